"""Encryption in transit: one connection's bytes sealed in authenticated records.

When a parameter (or the fit) encrypts (``NetworkSettings.encrypt``: on by itself where the
driver's Spark encrypts its own traffic, ``spark.network.crypto.enabled`` or
``spark.ssl.enabled``), every connection that can leave the host, i.e. TCP, is wrapped in
a ``SealedConnection`` right after the handshake: the block connections between
partitions and the tasks' connections to the driver's message server. Unix sockets and
shared memory never leave the host's kernel and stay as they are.

Why this and not TLS: the standard library's ``ssl`` needs certificates (TLS-PSK only from
Python 3.13), and the engine already has what a key needs: the handshake (``handshake.py``)
proves the per-fit secret both ways over fresh nonces of both ends and gives each
connection a session key of its own. So each connection's keys are derived from that
session key, one per direction (HMAC-SHA256 as the expansion step of HKDF: the session
key is already a uniformly random HMAC output), and the records are AES-256-GCM from the
``cryptography`` package (AES-NI, several GB/s per core; it releases the GIL, so fetch
threads overlap as with plain sockets).

A record: the plaintext's length (u32, 1..``RECORD_SIZE``), then the ciphertext and the
16-byte tag. The length is the associated data, and the nonce is the record's number in
its direction (a counter from 0: never reused, as a connection's keys are its own).
So a record that was changed, replayed, reordered, dropped, cut short in its length, or
sent back the other way fails its tag: ``AuthenticationError``, and the caller closes
that connection (never the server). A connection that ends between records reads as an
end (0 bytes), one that ends inside a record as ``EOFError``, as an unsealed socket's
would: a peer that dies mid-block is a lost peer either way. Each ``sendall`` of at most
``RECORD_SIZE`` bytes is one record; a longer one is cut into records of that size, so a
receiver holds at most one record's ciphertext at a time.

``SealedConnection`` offers what the block and message code use of a socket, and nothing
else on purpose (no ``__getattr__``): a call it does not have fails loudly instead of
going out unsealed.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from typing import Any

from allreduce_param.errors import AuthenticationError, ConfigurationError, ProtocolError

#: The most plaintext bytes in one record: large enough that the per-record cost vanishes,
#: small enough that a receiver's buffer stays small and sender and receiver overlap.
RECORD_SIZE = 256 * 1024
TAG_SIZE = 16
_HEAD = struct.Struct("<I")  # the record's plaintext length
_NONCE = struct.Struct("<Q4x")  # 12 bytes: the record's number in its direction
#: The handshake's name for a sealed connection: the MACs and the session key cover it
#: (handshake.py), so both ends agree to seal a connection or neither accepts it.
CIPHER_NAME = b"aes-256-gcm/records-1"
_DIRECTIONS = (b"client to server", b"server to client")

INSTALL_HINT = (
    "encrypting the engine's traffic needs the package 'cryptography' (pip install 'cryptography>=41') "
    "on the driver and on every executor"
)


def cipher_class() -> tuple[Any, type[Exception]]:
    """AES-GCM of the ``cryptography`` package and the error of a record that fails its tag;
    ConfigurationError, saying what to install, when the package is missing."""
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as error:
        raise ConfigurationError(
            f"{INSTALL_HINT}, or turn encryption off (encrypt=False, the Spark setting "
            f"spark.allreduce.encrypt=false): {error}"
        ) from None
    return AESGCM, InvalidTag


def direction_keys(session_key: bytes) -> tuple[bytes, bytes]:
    """The two 32-byte keys of a connection, ``(client to server, server to client)``,
    from the session key its handshake gave both ends."""
    return tuple(
        hmac.new(
            session_key,
            b"allreduce-param seal " + CIPHER_NAME + b" " + direction + b"\x01",
            hashlib.sha256,
        ).digest()
        for direction in _DIRECTIONS
    )


class SealedConnection:
    """A connected socket whose bytes travel as AES-256-GCM records (see the module).

    ``session_key``: the handshake's; ``client``: which end this is (each direction has
    its own key, so a record sent back fails); ``peer_text`` names the other end in
    errors. Sends may come from one thread while another receives; each direction is
    used by one thread at a time (as the callers do with sockets). A receive that times
    out keeps what it had read of a record, so a later one goes on from there.
    """

    def __init__(
        self, sock: socket.socket, session_key: bytes, *, client: bool, peer_text: str = "the peer"
    ) -> None:
        aead, self._invalid_tag = cipher_class()
        outgoing, incoming = direction_keys(session_key)
        if not client:
            outgoing, incoming = incoming, outgoing
        self._sock = sock
        self._peer_text = peer_text
        self._seal = aead(outgoing)
        self._open = aead(incoming)
        # cryptography >= 45; else a copy per record
        self._in_place = hasattr(self._seal, "encrypt_into")
        self._sent = 0  # records sent: the next one's nonce
        self._received = 0  # records opened
        # buffers grow to the largest record seen, so that a connection of small blocks stays small
        self._out = bytearray()
        self._head = bytearray(_HEAD.size)
        self._head_got = 0  # of the next record's length
        self._body = bytearray()
        self._body_got = 0  # of its ciphertext and tag
        self._plain = bytearray()
        self._left = memoryview(b"")  # opened bytes not yet handed out

    # ---- the socket's own, passed through ---------------------------------------------------

    @property
    def family(self) -> int:
        return self._sock.family

    def fileno(self) -> int:
        return self._sock.fileno()

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._sock.gettimeout()

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()

    @property
    def buffered(self) -> int:
        """Opened bytes not handed out yet: readable although the socket may not be."""
        return len(self._left)

    # ---- sending ------------------------------------------------------------------------------

    def sendall(self, data: Any) -> None:
        """Send ``data`` (any bytes-like object) as one record, or records of ``RECORD_SIZE``."""
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, RECORD_SIZE):
            self._send_record(view[start : start + RECORD_SIZE])

    def _send_record(self, plain: memoryview) -> None:
        size = plain.nbytes
        head = _HEAD.pack(size)
        nonce = _NONCE.pack(self._sent)
        self._sent += 1
        if self._in_place:
            if len(self._out) < _HEAD.size + size + TAG_SIZE:
                self._out = bytearray(_HEAD.size + size + TAG_SIZE)
            out = memoryview(self._out)
            out[: _HEAD.size] = head
            self._seal.encrypt_into(
                nonce, plain, head, out[_HEAD.size : _HEAD.size + size + TAG_SIZE]
            )
            self._sock.sendall(out[: _HEAD.size + size + TAG_SIZE])
        else:
            self._sock.sendall(head + self._seal.encrypt(nonce, bytes(plain), head))

    # ---- receiving ----------------------------------------------------------------------------

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        """Fill up to ``nbytes`` (0: all) of ``buffer`` with opened bytes, at most one record's;
        0 when the connection ended between records. AuthenticationError for a record that
        fails its tag, ProtocolError for an impossible length, EOFError for an end inside a
        record."""
        view = memoryview(buffer).cast("B")
        wanted = nbytes or view.nbytes
        if not self._left:
            size = self._next_record()
            if size is None:
                return 0
            if wanted >= size:  # the caller takes the whole record: open it straight into place
                self._open_into(size, view[:size])
                return size
            if len(self._plain) < size:
                self._plain = bytearray(size)
            self._open_into(size, memoryview(self._plain)[:size])
            self._left = memoryview(self._plain)[:size]
        taken = min(wanted, len(self._left))
        view[:taken] = self._left[:taken]
        self._left = self._left[taken:]
        return taken

    def _next_record(self) -> int | None:
        """Read the next record whole (its plaintext's length); None at an end between records."""
        head = memoryview(self._head)
        while self._head_got < _HEAD.size:
            got = self._sock.recv_into(head[self._head_got :])
            if got == 0:
                if self._head_got == 0:
                    return None
                raise EOFError(
                    f"{self._peer_text} closed the connection inside an encrypted record's length"
                )
            self._head_got += got
        (size,) = _HEAD.unpack(self._head)
        if not 0 < size <= RECORD_SIZE:
            raise ProtocolError(
                f"{self._peer_text} sent an encrypted record of {size} bytes (1 to {RECORD_SIZE} "
                "may come): not a record of this connection; it is closed"
            )
        total = size + TAG_SIZE
        if len(self._body) < total:
            self._body = bytearray(total)
        body = memoryview(self._body)
        while self._body_got < total:
            got = self._sock.recv_into(body[self._body_got : total])
            if got == 0:
                raise EOFError(
                    f"{self._peer_text} closed the connection inside an encrypted record "
                    f"({self._body_got} of {total} bytes)"
                )
            self._body_got += got
        self._head_got = self._body_got = 0
        return size

    def _open_into(self, size: int, into: memoryview) -> None:
        """Authenticate and decrypt the record just read into ``into`` (``size`` bytes)."""
        nonce = _NONCE.pack(self._received)
        head = bytes(self._head)
        sealed = memoryview(self._body)[: size + TAG_SIZE]
        try:
            if self._in_place:
                self._open.decrypt_into(nonce, sealed, head, into)
            else:
                into[:] = self._open.decrypt(nonce, bytes(sealed), head)
        except self._invalid_tag:
            raise AuthenticationError(
                f"encrypted record {self._received} from {self._peer_text} failed its authentication: it was "
                "changed, replayed, reordered or cut on the way, or is not of this connection; the connection "
                "is closed"
            ) from None
        self._received += 1
