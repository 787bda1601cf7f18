"""The block client: one partition's connection to one peer's ``BlockServer``."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
from typing import NamedTuple

from allreduce_param.engine.blocks.store import BlockKey, BlockKind, SplitBlock
from allreduce_param.engine.wire.blocks.protocol import (
    FLAG_NEWEST,
    MAX_ADDRESS_TEXT,
    MAX_ERROR_TEXT,
    OP_ADDRESS,
    OP_ARENA,
    OP_DONE,
    OP_GET,
    OP_GET_SHARED,
    REQUEST,
    RESPONSE,
    STATUS_CLOSING,
    STATUS_OK,
    STATUS_SHARED,
    STATUS_STALE,
    STATUS_TIMEOUT,
)
from allreduce_param.engine.wire.blocks.shared_answers import SharedAnswers
from allreduce_param.engine.wire.handshake import MAGIC, client_handshake, seals
from allreduce_param.engine.wire.sealing import SealedConnection
from allreduce_param.engine.wire.settings import DEFAULT_CONNECT_TIMEOUT
from allreduce_param.engine.wire.sockets import recv_exactly, tune, unix_sockets_available
from allreduce_param.errors import (
    AllReduceError,
    FetchTimeoutError,
    PeerLostError,
    ProtocolError,
    StaleVersionError,
    StoreClosedError,
    peer_lost,
)

log = logging.getLogger(__name__)


class AnswerDue(NamedTuple):
    """A get sent (``PeerClient.request``): its answer's first bytes make ``conn`` readable,
    by ``deadline`` (``time.monotonic()``'s clock) or never."""

    client: PeerClient
    conn: object
    deadline: float


class PeerClient:
    """One authenticated connection to one peer's ``BlockServer``, used by one thread at a time.

    Connects on first use: to the peer's ``local_name`` Unix socket when given (a peer on
    this host), else, or when that fails, over TCP (encrypted with ``encrypt``). Errors name
    the peer, the block and the version; any error on the connection closes it, and the
    next use connects anew.
    """

    def __init__(
        self,
        address: tuple[str, int],
        secret: bytes,
        param_id: int,
        partition_id: int,
        peer_partition: int,
        timeout: float,
        local_name: str | None = None,
        handshake_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        encrypt: bool = False,
    ) -> None:
        self.address = address
        self._encrypt = encrypt
        self._handshake_timeout = handshake_timeout
        self.local_name = local_name if unix_sockets_available() else None
        self.peer_partition = peer_partition
        self._secret = secret
        self._param_id = param_id
        self._partition_id = partition_id
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.RLock()
        self._asked: tuple | None = None  # (key, version, shared, newest) of the get sent last
        self._shared = SharedAnswers()  # blocks the peer answers with in shared memory
        self._aborted = False  # this partition is shutting down: no new connection

    @property
    def connected(self) -> bool:
        """Whether a connection to the peer is open now (one is made at the first use)."""
        return self._sock is not None

    @property
    def _peer_text(self) -> str:
        return f"partition {self.peer_partition} at {self.address[0]}:{self.address[1]}"

    def _lost(self, what: str, detail: str, said: str = "") -> PeerLostError:
        """The one wording of 'this peer is gone', naming the peer, the block and the cause.

        ``said`` is the reason the peer gave as it failed, when it could give one.
        """
        return peer_lost(f"{self._peer_text} {detail} while we fetched {what}", said)

    def _open(self) -> socket.socket:
        if self.local_name:
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            local.settimeout(self._handshake_timeout)
            try:
                local.connect("\0" + self.local_name)
                return local
            except OSError as error:  # another network namespace, or gone: TCP will tell
                local.close()
                log.debug("no local socket for %s (%s), using TCP", self._peer_text, error)
        return socket.create_connection(self.address, timeout=self._handshake_timeout)

    def _connect(self, what: str) -> socket.socket | SealedConnection:
        if self._aborted:
            raise StoreClosedError(
                f"this partition is shutting down: no new connection to {self._peer_text} "
                f"for {what}"
            )
        try:
            sock = self._open()
        except OSError as error:
            raise self._lost(what, f"cannot be reached ({error})") from error
        try:
            tune(sock)
            key = client_handshake(
                sock,
                self._secret,
                self._param_id,
                self._partition_id,
                self._peer_text,
                "the secrets differ. Every partition must use the same AllReduceParameter "
                "object, made on the driver",
                encrypt=self._encrypt,
            )
            sock.settimeout(None)
            return (
                SealedConnection(sock, key, client=True, peer_text=self._peer_text)
                if seals(sock, self._encrypt)
                else sock
            )
        except AllReduceError:
            sock.close()
            raise
        except TimeoutError as error:
            sock.close()
            raise FetchTimeoutError(
                f"{self._peer_text} did not finish the handshake within "
                f"{self._handshake_timeout:g} s while we fetched {what}"
            ) from error
        except (OSError, EOFError) as error:
            sock.close()
            raise self._lost(
                what, f"dropped the connection during the handshake ({error})"
            ) from error

    def fetch(
        self,
        key: BlockKey,
        version: int,
        max_size: int,
        into: memoryview | None,
        shared: bool = False,
        newest: bool = False,
    ) -> tuple[int, memoryview | SplitBlock]:
        """Fetch ``version`` of block ``key`` (with ``newest``: the newest version at or above
        it), waiting on the peer up to the timeout; ``(version served, block)``.

        The block lands at the start of ``into`` (at least ``max_size`` bytes, the most such
        a block can be; a longer one is a protocol error; None: a new buffer) and the
        returned view covers exactly its bytes. With ``shared``, a peer on this host that
        keeps the block in shared memory answers with where it lies, and a ``SplitBlock``
        of views reads it there, in place: the peer keeps it as it is until this client
        asks for the same block again.
        """
        with self._lock:
            self.request(key, version, shared, newest)
            return self.answer(max_size, into)

    def request(
        self, key: BlockKey, version: int, shared: bool = False, newest: bool = False
    ) -> AnswerDue:
        """The first half of ``fetch`` (the same arguments): send the get, and say where and
        until when its answer comes, for a caller that waits for it without a thread. Then
        ``answer`` reads it (or ``give_up`` ends the wait); nothing else uses the client
        meanwhile."""
        what = key.describe(version)
        with self._lock, self._failing(what):
            sock = self._sock or self._connect(what)
            self._sock = sock
            # The server gives up waiting at the timeout and says so; the socket waits longer
            # so that the server's answer, not a bare socket timeout, reaches the user.
            sock.settimeout(self._timeout + self._handshake_timeout)
            shared = shared and sock.family == socket.AF_UNIX
            op = (OP_GET_SHARED if shared else OP_GET) | (FLAG_NEWEST if newest else 0)
            sock.sendall(
                REQUEST.pack(
                    MAGIC,
                    op,
                    key.kind,
                    key.source,
                    key.destination,
                    key.part,
                    version,
                    int(self._timeout * 1000),
                )
            )
            self._asked = (key, version, shared, newest)
            return AnswerDue(self, sock, time.monotonic() + self._timeout + self._handshake_timeout)

    def answer(self, max_size: int, into: memoryview | None) -> tuple[int, memoryview | SplitBlock]:
        """The second half of ``fetch``: read the answer to the get ``request`` sent, as
        ``fetch`` says."""
        key, version, shared, newest = self._asked
        what = key.describe(version)
        with self._lock, self._failing(what):
            sock = self._sock
            if sock is None:  # cut meanwhile (aborted)
                raise self._lost(what, "was cut off by this partition")
            status, length, served = self._shared.receive_head(sock, shared)
            if status not in (STATUS_OK, STATUS_SHARED):
                raise self._answer_error(status, length, sock, what)
            if length > max_size:
                raise ProtocolError(
                    f"{self._peer_text} sent {length} bytes for {what}; such a block has at "
                    f"most {max_size}"
                )
            if served < version or (served != version and not newest):
                raise ProtocolError(f"{self._peer_text} answered {what} with version {served}")
            if status == STATUS_SHARED:
                return served, self._shared.place(sock, length, what, self._peer_text)
            view = (into if into is not None else memoryview(bytearray(length)))[:length]
            recv_exactly(sock, view)
            return served, view

    def give_up(self) -> FetchTimeoutError:
        """End the wait for the answer to the get ``request`` sent, past its deadline: the
        connection is closed (the answer may still come), the error says what was late."""
        key, version, _, _ = self._asked
        with self._lock:
            self._drop()
        return self._late(key.describe(version))

    def _late(self, what: str) -> FetchTimeoutError:
        return FetchTimeoutError(
            f"{self._peer_text} did not answer for {what} within "
            f"{self._timeout + self._handshake_timeout:g} s"
        )

    @contextlib.contextmanager
    def _failing(self, what: str):
        """Any error on the connection closes it (but a peer's clean 'not in time' or 'no
        longer kept'), and a socket's error becomes the engine's, naming the peer."""
        try:
            yield
        except (
            FetchTimeoutError,
            StaleVersionError,
        ):  # the peer said so cleanly: the connection stays
            raise
        except AllReduceError:
            self._drop()
            raise
        except TimeoutError as error:
            self._drop()
            raise self._late(what) from error
        except (OSError, EOFError) as error:
            self._drop()
            if getattr(error, "errno", None) == errno.ENOMEM:  # ours, not the peer's
                raise self._out_of_memory(what, error) from error
            raise self._lost(what, f"closed the connection ({error})") from error

    def _out_of_memory(self, what: str, error: OSError) -> MemoryError:
        """This process, not the peer, could not get memory (ENOMEM) for ``what``: most
        often mapping the peer's shared memory under a limit on the address space."""
        return MemoryError(
            f"this partition ran out of memory ({error}) while it fetched {what}: it maps the "
            "shared memory its peers on this host publish blocks in, and a limit on its address "
            "space counts the mappings (under Spark, spark.executor.pyspark.memory sets one on "
            "each Python worker): raise that limit or leave it unset"
        )

    def _answer_error(
        self, status: int, length: int, sock: socket.socket, what: str
    ) -> AllReduceError:
        """The error a non-OK answer stands for, its text read off the connection."""
        if length > MAX_ERROR_TEXT:
            raise ProtocolError(
                f"{self._peer_text} sent an error text of {length} bytes for {what}"
            )
        text = bytearray(length)
        recv_exactly(sock, memoryview(text))
        reason = text.decode("utf-8", "replace")
        if status == STATUS_TIMEOUT:
            return FetchTimeoutError(
                f"{self._peer_text} did not publish {what} in time: {reason}. The peer is stuck or "
                "much slower; raise AllReduceParameter(timeout=...) if its steps are this slow"
            )
        if status == STATUS_CLOSING:
            return self._lost(what, "shut down", said=reason)
        if status == STATUS_STALE:
            return StaleVersionError(f"{self._peer_text} no longer has {what}: {reason}")
        return ProtocolError(f"{self._peer_text} answered {what} with unknown status {status}")

    def ask_address(self) -> list:
        """The peer's advertised address (``BlockServer.advertised_address``, as a list),
        asked over a connection of its own that the peer then ends: for a meeting that
        gave only ``(host, port)``. The client holds no connection afterwards."""
        what = "its address"
        with self._lock:
            if self._sock is not None:
                raise ProtocolError(f"asked {self._peer_text} for {what} on a connection in use")
            try:
                with self._failing(what):
                    sock = self._sock = self._connect(what)
                    sock.settimeout(self._handshake_timeout)
                    sock.sendall(REQUEST.pack(MAGIC, OP_ADDRESS, BlockKind.WEIGHT, 0, 0, 0, 0, 0))
                    head = bytearray(RESPONSE.size)
                    recv_exactly(sock, memoryview(head))
                    status, length, _ = RESPONSE.unpack(head)
                    if status != STATUS_OK or length > MAX_ADDRESS_TEXT:
                        raise ProtocolError(
                            f"{self._peer_text} answered the question of {what} with status "
                            f"{status} and {length} bytes"
                        )
                    text = bytearray(length)
                    recv_exactly(sock, memoryview(text))
                try:
                    address = json.loads(bytes(text))
                except ValueError as error:
                    raise ProtocolError(
                        f"{self._peer_text} answered the question of {what} with no JSON: {error}"
                    ) from error
                if not isinstance(address, list):
                    raise ProtocolError(
                        f"{self._peer_text} answered the question of {what} with {address!r}"
                    )
                return address
            finally:
                self._drop()

    def ask_arena(self, max_fds: int) -> tuple[bytes, list[int]]:
        """The host arena's description and descriptors (at most ``max_fds``), asked of
        this host's leader over its Unix socket on a connection of its own, which the
        leader then ends (``OP_ARENA``). The caller owns the descriptors."""
        what = "the host arena"
        if not self.local_name:
            raise ProtocolError(f"asked {self._peer_text} for {what} without a Unix socket")
        with self._lock:
            if self._sock is not None:
                raise ProtocolError(f"asked {self._peer_text} for {what} on a connection in use")
            fds: list[int] = []
            try:
                with self._failing(what):
                    sock = self._sock = self._connect(what)
                    if not isinstance(sock, socket.socket) or sock.family != socket.AF_UNIX:
                        raise ProtocolError(f"{self._peer_text} is not reached over a Unix socket")
                    sock.settimeout(self._handshake_timeout)
                    sock.sendall(REQUEST.pack(MAGIC, OP_ARENA, BlockKind.WEIGHT, 0, 0, 0, 0, 0))
                    first, fds, _, _ = socket.recv_fds(
                        sock, RESPONSE.size + MAX_ADDRESS_TEXT, max_fds
                    )
                    if len(first) < RESPONSE.size:
                        head = bytearray(RESPONSE.size)
                        head[: len(first)] = first
                        recv_exactly(sock, memoryview(head)[len(first) :])
                        first = bytes(head)
                    status, length, _ = RESPONSE.unpack(first[: RESPONSE.size])
                    if status != STATUS_OK:
                        raise self._answer_error(
                            status, length, _Prefixed(first[RESPONSE.size :], sock), what
                        )
                    if length > MAX_ADDRESS_TEXT:
                        raise ProtocolError(
                            f"{self._peer_text} answered {what} with {length} bytes"
                        )
                    text = bytearray(length)
                    got = first[RESPONSE.size : RESPONSE.size + length]
                    text[: len(got)] = got
                    recv_exactly(sock, memoryview(text)[len(got) :])
                return bytes(text), fds
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            finally:
                self._drop()

    def done(self) -> None:
        """Tell the peer this partition will fetch nothing more from it (closing handshake)."""
        what = "nothing more (saying we are done)"
        with self._lock:
            sock = self._sock or self._connect(what)
            self._sock = sock
            try:
                sock.sendall(REQUEST.pack(MAGIC, OP_DONE, BlockKind.WEIGHT, 0, 0, 0, 0, 0))
            except OSError as error:
                self._drop()
                raise self._lost(what, f"closed the connection ({error})") from error

    def abort(self) -> None:
        """Cut the connection at once, waking a fetch blocked on it, and open none after
        (for shutting down)."""
        self._aborted = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _drop(self) -> None:
        self._shared.connection_ended()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Close the connection, if any, and unmap the peer's shared segments."""
        with self._lock:
            self._drop()
            self._shared.close()


class _Prefixed:
    """A socket to read an error text from whose first bytes came already (with descriptors)."""

    def __init__(self, first: bytes, sock: socket.socket) -> None:
        self._first = first
        self._sock = sock

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        if self._first:
            size = min(len(self._first), nbytes or len(buffer))
            buffer[:size] = self._first[:size]
            self._first = self._first[size:]
            return size
        return self._sock.recv_into(buffer, nbytes)
