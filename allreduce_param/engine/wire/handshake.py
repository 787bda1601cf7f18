"""How a connection proves the shared secret, both ways, before anything else crosses it.

Handshake (little-endian). Server: ``MAGIC`` + 16-byte nonce. Client: magic, parameter id,
own partition id, 16-byte nonce, HMAC-SHA256(secret, "client" + both nonces + ids).
Server: one status byte, then its own HMAC(secret, "server" + ...) so the client knows it
talks to a holder of the secret too. A connection that fails it reads and writes nothing
more. Both ends then share a session key, HMAC(secret, "session" + both nonces + ids),
fresh for every connection (the messages are tagged with it).

With ``NetworkSettings.encrypt`` a TCP connection is encrypted after the handshake
(``sealing.py``, its keys from the session key). Whether it is counts as one of the ids:
the MACs and the session key of a sealed connection cover ``sealing.CIPHER_NAME`` too, so
an end that encrypts and one that does not never agree; the server, seeing that the
client's MAC holds for the other choice, refuses it with its own status
(``HELLO_OTHER_SEALING``), and the client's error names the setting.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from typing import NamedTuple

from allreduce_param.engine.wire.sealing import CIPHER_NAME, SealedConnection
from allreduce_param.engine.wire.settings import ENCRYPT_SETTINGS
from allreduce_param.engine.wire.sockets import recv_exactly
from allreduce_param.errors import AuthenticationError, ConfigurationError, ProtocolError

MAGIC = b"ARP1"
NONCE_SIZE = 16
MAC_SIZE = 32
# magic, param, partition, nonce, mac
_CLIENT_HELLO = struct.Struct(f"<4sII{NONCE_SIZE}s{MAC_SIZE}s")
HELLO_OK = 0
HELLO_REFUSED = 4
#: The client proved the secret, but for the other choice of encryption (no block response
#: status has this value).
HELLO_OTHER_SEALING = 6


def mac(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``role`` and ``parts`` under ``secret``: every tag of the protocol."""
    return hmac.new(secret, role + b"".join(parts), hashlib.sha256).digest()


def seals(sock, encrypt: bool) -> bool:
    """Whether a connection is encrypted (``sealing.py``): with ``encrypt`` on, one that can
    leave the host (TCP); a Unix socket never."""
    return bool(encrypt) and sock.family != socket.AF_UNIX


def _ids(param_id: int, partition_id: int, sealed: bool) -> bytes:
    """What the handshake's MACs and the session key bind besides the nonces: the parameter,
    the client's partition, and whether the connection is encrypted (and how)."""
    return struct.pack("<II", param_id, partition_id) + (CIPHER_NAME if sealed else b"")


def client_handshake(
    sock: socket.socket,
    secret: bytes,
    param_id: int,
    partition_id: int,
    server_text: str,
    refused: str,
    encrypt: bool = False,
) -> bytes:
    """Prove the secret to the server on ``sock`` and check its proof; the session key.

    With ``encrypt``, a TCP connection (``seals``) is agreed to be encrypted: the caller
    wraps it in a ``sealing.SealedConnection`` with the key. AuthenticationError (with
    ``refused`` when the server refused us), ConfigurationError when the server knows the
    secret but does not make the same choice about encryption, ProtocolError when the other
    end is no allreduce-param server; OSError and EOFError as the socket gives."""
    greeting = bytearray(len(MAGIC) + NONCE_SIZE)
    recv_exactly(sock, memoryview(greeting))
    if greeting[: len(MAGIC)] != MAGIC:
        raise ProtocolError(f"{server_text} is not an allreduce-param server")
    server_nonce = bytes(greeting[len(MAGIC) :])
    client_nonce = os.urandom(NONCE_SIZE)
    sealed = seals(sock, encrypt)
    ids = _ids(param_id, partition_id, sealed)
    sock.sendall(
        _CLIENT_HELLO.pack(
            MAGIC,
            param_id,
            partition_id,
            client_nonce,
            mac(secret, b"client", server_nonce, client_nonce, ids),
        )
    )
    status = bytearray(1)
    recv_exactly(sock, memoryview(status))
    if status[0] == HELLO_OTHER_SEALING:
        raise ConfigurationError(
            f"{server_text} refused this connection: this end {'encrypts' if sealed else 'does not encrypt'} it and "
            f"that server {'does not' if sealed else 'does'}. Both ends must make the same choice: "
            f"{ENCRYPT_SETTINGS}; every task must use the one AllReduceParameter made on the driver"
        )
    if status[0] != HELLO_OK:
        raise AuthenticationError(f"{server_text} refused this connection: {refused}")
    proof = bytearray(MAC_SIZE)
    recv_exactly(sock, memoryview(proof))
    if not hmac.compare_digest(
        bytes(proof), mac(secret, b"server", client_nonce, server_nonce, ids)
    ):
        raise AuthenticationError(f"{server_text} could not prove the secret")
    return mac(secret, b"session", server_nonce, client_nonce, ids)


class Proven(NamedTuple):
    """A connection that proved the secret: the socket (a ``sealing.SealedConnection``
    around it when both agreed to encrypt it: ``sealed``), the client's partition, where it
    came from (for messages), and the session key both ends now share."""

    sock: socket.socket | SealedConnection
    partition: int
    peer_text: str
    session_key: bytes
    sealed: bool = False


def seal_proven(proven: Proven) -> Proven:
    """A server's proven connection as its serving code uses it: the socket wrapped in a
    ``SealedConnection`` when the handshake agreed to encrypt it, else as it is."""
    if not proven.sealed:
        return proven
    return proven._replace(
        sock=SealedConnection(
            proven.sock, proven.session_key, client=False, peer_text=proven.peer_text
        )
    )


class HelloChecked(NamedTuple):
    """What the server makes of a client's hello (``check_hello``): the client's partition
    (None: refused), why it was refused, the answer to send, the session key, and whether
    the connection is encrypted."""

    partition: int | None
    reason: str
    answer: bytes
    session_key: bytes
    sealed: bool


def check_hello(
    hello: bytes,
    sock: socket.socket,
    nonce: bytes,
    secret: bytes,
    param_id: int,
    partition_num: int,
    encrypt: bool,
) -> HelloChecked:
    """The server's half: check the client's ``hello`` (``_CLIENT_HELLO.size`` bytes, read
    from ``sock`` after this server sent ``nonce``) against ``secret``, the parameter id and
    the partitions ``0..partition_num-1``, and with ``encrypt``, that the client agrees to
    encrypt a TCP connection."""
    magic, asked_id, partition, client_nonce, client_mac = _CLIENT_HELLO.unpack(hello)
    sealed = seals(sock, encrypt)
    ids = _ids(asked_id, partition, sealed)
    expected = mac(secret, b"client", nonce, client_nonce, ids)
    if magic != MAGIC:
        reason = f"bad magic {bytes(magic)!r}, not an allreduce-param client"
    elif not hmac.compare_digest(client_mac, expected):
        if sock.family != socket.AF_UNIX and hmac.compare_digest(
            client_mac,
            mac(
                secret,
                b"client",
                nonce,
                client_nonce,
                _ids(asked_id, partition, not sealed),
            ),
        ):
            reason = (
                f"it proved the secret but {'does not encrypt' if sealed else 'encrypts'} its traffic, "
                f"and this server {'does' if sealed else 'does not'}: {ENCRYPT_SETTINGS}"
            )
            return HelloChecked(None, reason, bytes([HELLO_OTHER_SEALING]), b"", False)
        reason = "it could not prove the secret"
    elif asked_id != param_id:
        reason = f"it asked for parameter {asked_id}, this server serves parameter {param_id}"
    elif not 0 <= partition < partition_num:
        reason = f"partition {partition} is outside 0..{partition_num - 1}"
    else:
        proof = mac(secret, b"server", client_nonce, nonce, ids)
        return HelloChecked(
            partition,
            "",
            bytes([HELLO_OK]) + proof,
            mac(secret, b"session", nonce, client_nonce, ids),
            sealed,
        )
    return HelloChecked(None, reason, bytes([HELLO_REFUSED]), b"", False)
