"""The block client: one partition's connection to one peer's ``BlockServer``.

How it connects is ``dialing.py``'s, how its errors are worded ``client_errors.py``'s, and
the one-off questions (the peer's address, the host arena) ``questions.py``'s.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time
from typing import NamedTuple

from allreduce_param.engine.blocks.store import BlockKey, BlockKind, SplitBlock
from allreduce_param.engine.wire.blocks.client_errors import (
    answer_error,
    late,
    lost,
    out_of_memory,
)
from allreduce_param.engine.wire.blocks.dialing import Dialer
from allreduce_param.engine.wire.blocks.protocol import (
    FLAG_NEWEST,
    OP_DONE,
    OP_GET,
    OP_GET_SHARED,
    REQUEST,
    STATUS_OK,
    STATUS_SHARED,
)
from allreduce_param.engine.wire.blocks.questions import (
    parse_address_answer,
    read_address,
    read_arena,
)
from allreduce_param.engine.wire.blocks.shared_answers import SharedAnswers
from allreduce_param.engine.wire.handshake import MAGIC
from allreduce_param.engine.wire.sealing import SealedConnection
from allreduce_param.engine.wire.settings import DEFAULT_CONNECT_TIMEOUT
from allreduce_param.engine.wire.sockets import recv_exactly, unix_sockets_available
from allreduce_param.errors import (
    AllReduceError,
    FetchTimeoutError,
    PeerLostError,
    ProtocolError,
    StaleVersionError,
    StoreClosedError,
)


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
        self._handshake_timeout = handshake_timeout
        self.local_name = local_name if unix_sockets_available() else None
        self.peer_partition = peer_partition
        self._timeout = timeout
        self._dialer = Dialer(
            address,
            self.local_name,
            secret,
            param_id,
            partition_id,
            self._peer_text,
            handshake_timeout,
            encrypt,
        )
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
        """``client_errors.lost``: this peer is gone (``said``: the reason it gave)."""
        return lost(self._peer_text, what, detail, said)

    def _connect(self, what: str) -> socket.socket | SealedConnection:
        if self._aborted:
            raise StoreClosedError(
                f"this partition is shutting down: no new connection to {self._peer_text} "
                f"for {what}"
            )
        return self._dialer.connect(what)

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
            # so that the server's answer, not a bare socket timeout, reaches the user. Set
            # only when it differs: each settimeout is two fcntl calls that let go of the GIL.
            patience = self._timeout + self._handshake_timeout
            if sock.gettimeout() != patience:
                sock.settimeout(patience)
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
                raise answer_error(self._peer_text, status, length, sock, what)
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
        return late(self._peer_text, what, self._timeout + self._handshake_timeout)

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
                raise out_of_memory(what, error) from error
            raise self._lost(what, f"closed the connection ({error})") from error

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
                    text = read_address(sock, self._peer_text, what)
                return parse_address_answer(text, self._peer_text, what)
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
            try:
                with self._failing(what):
                    sock = self._sock = self._connect(what)
                    if not isinstance(sock, socket.socket) or sock.family != socket.AF_UNIX:
                        raise ProtocolError(f"{self._peer_text} is not reached over a Unix socket")
                    sock.settimeout(self._handshake_timeout)
                    return read_arena(sock, max_fds, self._peer_text, what)
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
