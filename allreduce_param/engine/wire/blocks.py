"""The wire between partitions: a block server, a peer client, and how they prove the secret.

Each partition runs one ``BlockServer`` over its ``BlockStore`` and one ``PeerClient`` per
peer. A client pulls blocks: it names a block and a version, and the server answers when
that version is in its store (or with an error once the wait times out).

Wire format (little-endian):

* Handshake: ``handshake.py``'s (each side proves the parameter's secret over fresh nonces);
  the client's ids are the parameter id and its own partition. With ``encrypt``, a TCP
  connection is a ``sealing.SealedConnection`` from then on: the frames below travel in
  encrypted records; Unix sockets and shared memory stay as they are.
* Request: op, block kind, source, destination, part, version, timeout in ms (fixed size).
  The op's ``FLAG_NEWEST`` bit asks for the newest version at or above ``version``.
* Response: status, length, the version served; then ``length`` bytes (the encoded block,
  or an error text). A peer on this host that asked for shared answers gets, for a block
  in shared memory, where its header and its payload lie instead (segment ids, offsets,
  the header's length; with the descriptor of a segment it has not been passed yet): the
  two may lie apart, when a vector was published where it lies (``store.SplitBlock``).

Every length is checked against what the block can be before a byte of it is read; a
malformed frame closes that connection with a logged reason, never the server. A client
sends one request at a time on a connection and reads its answer before the next.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from allreduce_param.engine.blocks.codec import HEADER_SIZE, Codec
from allreduce_param.engine.blocks.shm import SharedArenas, SharedMappings
from allreduce_param.engine.blocks.store import BlockKey, BlockKind, BlockStore, SplitBlock, Waiter
from allreduce_param.engine.wire.handshake import (
    HELLO_REFUSED,
    MAGIC,
    Proven,
    client_handshake,
    mac,
    seals,
)
from allreduce_param.engine.wire.sealing import SealedConnection
from allreduce_param.engine.wire.server import AuthenticatedServer
from allreduce_param.engine.wire.settings import DEFAULT_CONNECT_TIMEOUT
from allreduce_param.engine.wire.sockets import recv_exactly, tune, unix_sockets_available
from allreduce_param.errors import (
    AllReduceError,
    FetchTimeoutError,
    PeerLostError,
    ProtocolError,
    StaleVersionError,
    StoreClosedError,
)

log = logging.getLogger(__name__)

_REQUEST = struct.Struct(
    "<4sBBIIIQI"
)  # magic, op, kind, source, destination, part, version, timeout ms
_RESPONSE = struct.Struct("<BQQ")  # status, length, version served

OP_GET = 1
OP_DONE = 2  # "I have fetched everything I need from you": the closing handshake
OP_GET_SHARED = 3  # as GET, but a block in shared memory is answered with where it lies
FLAG_NEWEST = 0x10  # with a get: the newest version at or above the one asked for
_OPS = (OP_GET, OP_DONE, OP_GET_SHARED)

STATUS_OK = 0
STATUS_TIMEOUT = 1
STATUS_STALE = 2
STATUS_CLOSING = 3
STATUS_REFUSED = (
    HELLO_REFUSED  # the handshake's refusal (handshake.py): one status byte, nothing after
)
STATUS_SHARED = 5  # the block lies in shared segments: where follows (and, once each, their fds)

#: After STATUS_SHARED: the header's segment id, offset and length, the payload's segment id
#: and offset (the payload's length is the response's length less the header's).
_SHARED_PLACE = struct.Struct("<QQQQQ")

MAX_ERROR_TEXT = 64 * 1024

#: The threads a block server answers with, however many peers it serves.
SERVE_THREADS = 8
#: A block leaves in slices of at most this many bytes, each within the connect timeout: a
#: reader that takes nothing for that long is taken for gone, and its connection closed.
SEND_SLICE = 1 << 20


def secret_fingerprint(secret: bytes, param_id: int) -> str:
    """A short tag of a parameter's secret and id that partitions exchange at the meeting,
    so that partitions of different parameters learn it there, all of them, before any
    connects (one that connects first would see the other close). It reveals nothing that
    proves the secret: the handshake's MACs cover fresh nonces."""
    return mac(secret, b"fingerprint", str(param_id).encode())[:12].hex()


class PeerAddress(NamedTuple):
    """A partition's server as the meeting gives it: ``host``, ``port``, and where the
    server said so, its secret's ``fingerprint`` and its abstract Unix socket
    (``local_name``, for peers of the same ``local_scope``)."""

    host: str
    port: int
    fingerprint: str | None = None
    local_name: str | None = None
    scope: str | None = None


def parse_address(address) -> PeerAddress:
    """An exchanged address: ``advertised_address``'s five fields, or a bare ``(host, port)``
    (a fixed list, ``StaticRendezvous``)."""
    return PeerAddress(*address)


@functools.lru_cache(maxsize=1)
def local_scope() -> str:
    """Which abstract Unix sockets this process can reach: its machine (the kernel's boot id)
    and network namespace. Peers with the same scope meet over Unix sockets and shared
    memory, whatever host names or addresses Spark gave them; others over TCP."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return f"{socket.gethostname()}/unknown"


class _Peer:
    """A proven peer's connection, as the block server keeps it between its requests."""

    __slots__ = (
        "conn",
        "partition",
        "peer_text",
        "local",
        "fds_passed",
        "request",
        "deadline",
        "timer",
        "ended",
    )

    def __init__(self, proven: Proven) -> None:
        self.conn = (
            proven.sock
        )  # what requests are read from and answers written to (sealed, if agreed)
        self.partition = proven.partition
        self.peer_text = proven.peer_text
        self.local = self.conn.family == socket.AF_UNIX
        self.fds_passed: set[int] = set()  # segments whose descriptor this peer already has
        self.request: tuple | None = (
            None  # (key, version, newest, op, wait) of the get being answered
        )
        self.deadline = 0.0  # when that get stops waiting
        self.timer = None  # the server's timer for that deadline
        self.ended = False


class BlockServer:
    """Serves one partition's ``BlockStore`` to the peers that prove the secret.

    Listens on ``host`` (the task's own address, never every interface unless told) at
    ``port`` or, when that is 0, a free port of ``ports`` (None: any), and with ``unix``
    also on an abstract Unix socket (``local_name``), which peers on the same host use
    instead (faster than loopback TCP); ``advertise`` is the address peers are told
    (default: ``host``). Admission is ``server.AuthenticatedServer``'s: a handshake within
    ``handshake_timeout`` seconds. ``on_done(partition)`` is called when a proven peer says
    it is done, or its connection ends. A get waits for a version at most ``max_wait``
    seconds, whatever the request asks. With ``encrypt``, connections over TCP are
    encrypted (``sealing.py``).

    However many peers it serves, it holds ``threads`` threads (and the accept thread): the
    accept loop watches the idle connections, a pool thread reads a request and answers it,
    and a get for a version not published yet holds no thread while it waits: the store
    calls back when the version comes (or it closes), the accept loop at the deadline.
    Answers are sent from the pool threads, each slice of a block (``SEND_SLICE``) within the
    handshake timeout, so a reader that stops reading holds one thread for that long at
    most, never the others: sending whole blocks blocking keeps a connection wrapper (made
    by ``server.AuthenticatedServer`` as it hands a proven connection over) free to frame
    each send as it likes, and a shared-memory answer's descriptors in the same call as
    its bytes.
    """

    def __init__(
        self,
        store: BlockStore,
        secret: bytes,
        param_id: int,
        partition_id: int,
        host: str,
        port: int = 0,
        partition_num: int = 1,
        on_done: Callable[[int], None] | None = None,
        unix: bool = False,
        shared: SharedArenas | None = None,
        max_wait: float = 3600.0,
        *,
        ports: tuple[int, int] | None = None,
        advertise: str | None = None,
        handshake_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        threads: int = SERVE_THREADS,
        encrypt: bool = False,
    ) -> None:
        self.store = store
        self._max_wait = max_wait
        self._secret = secret
        self._param_id = param_id
        self._partition_id = partition_id
        self._on_done = on_done or (lambda partition: None)
        self._io_timeout = handshake_timeout
        # where the owner's blocks lie in shared memory, if they do
        self._shared = shared
        self._lock = threading.Lock()
        self._peers: set[_Peer] = set()
        self._server = AuthenticatedServer(
            secret,
            param_id,
            partition_num,
            self._serve,
            bind=host,
            port=port,
            ports=ports,
            advertise=advertise,
            unix=unix,
            timeout=handshake_timeout,
            what=f"partition {partition_id}'s block server",
            pool=threads,
            encrypt=encrypt,
            thread_name=f"allreduce-serve-{partition_id}",
            accept_thread_name=f"allreduce-accept-{partition_id}",
        )
        self.address: tuple[str, int] = self._server.address
        self.local_name = self._server.local_name

    @property
    def advertised_address(self) -> tuple:
        """What peers need to reach this server and to know it serves their parameter:
        ``(host, port, fingerprint, local_name, local_scope)`` (``parse_address`` reads it;
        the last two None without a Unix socket)."""
        return (
            self._server.advertised_host,
            self.address[1],
            secret_fingerprint(self._secret, self._param_id),
            self.local_name,
            local_scope() if self.local_name else None,
        )

    @property
    def threads(self) -> int:
        """How many threads answer (started so far; at most ``threads``)."""
        return self._server.pool_threads

    # ---- serving the proven peers, a request at a time, on the pool's threads -------------

    def _serve(self, proven: Proven) -> None:
        """A peer proved the secret: every request is read from its connection (sealed, if
        agreed) and every answer written to it."""
        peer = _Peer(proven)
        peer.conn.settimeout(
            self._io_timeout
        )  # a request comes whole; an answer's slice is taken in time
        with self._lock:
            self._peers.add(peer)
        self._await_request(peer)

    def _await_request(self, peer: _Peer) -> None:
        if not self._server.watch(peer.conn, functools.partial(self._read_request, peer)):
            self._end(peer)  # closing

    def _read_request(self, peer: _Peer) -> None:
        request = bytearray(_REQUEST.size)
        try:
            recv_exactly(peer.conn, memoryview(request))
        except EOFError:
            self._end(peer)
            return
        except OSError as error:
            self._lost(peer, error)
            return
        except AllReduceError as error:  # an encrypted record that failed its tag or its length
            log.warning(
                "closed connection from partition %d at %s: %s",
                peer.partition,
                peer.peer_text,
                error,
            )
            self._end(peer)
            return
        magic, op, kind, source, destination, part, version, timeout_ms = _REQUEST.unpack(request)
        newest, op = bool(op & FLAG_NEWEST), op & ~FLAG_NEWEST
        if magic != MAGIC or op not in _OPS or kind not in BlockKind.NAMES:
            log.warning(
                "closed connection from partition %d at %s: malformed request frame %s",
                peer.partition,
                peer.peer_text,
                bytes(request[:16]).hex(),
            )
            self._end(peer)
            return
        if op == OP_DONE:
            self._on_done(peer.partition)
            self._await_request(peer)
            return
        wait = min(timeout_ms / 1000.0, self._max_wait)
        peer.request = (BlockKey(kind, source, destination, part), version, newest, op, wait)
        peer.deadline = time.monotonic() + wait
        self._answer(peer)

    def _answer(self, peer: _Peer) -> None:
        """Answer the peer's get if its version is there (or can never come); else leave a
        waiter with the store and a timer for its deadline, and return."""
        key, version, newest, op, wait = peer.request
        if peer.timer is not None:
            peer.timer.cancel()
            peer.timer = None
        try:
            got = self.store.get_or_notify(
                key,
                version,
                functools.partial(self._version_ready, peer),
                newest=newest,
                reader=peer,
            )
            if isinstance(got, Waiter):
                timer = self._server.call_at(
                    peer.deadline, functools.partial(self._expire, peer, got, wait)
                )
                peer.timer = timer
                if got.fired:  # answered meanwhile, or about to be
                    timer.cancel()
                return
            self._send_block(peer, op, *got)
        except StaleVersionError as error:
            self._send_error(peer, STATUS_STALE, str(error))
        except StoreClosedError as error:  # this partition stops: the peer hears why, then the end
            self._send_error(peer, STATUS_CLOSING, str(error), last=True)
        except OSError as error:
            self._lost(peer, error)
        else:
            self._await_request(peer)

    def _version_ready(self, peer: _Peer) -> None:
        """The store's call: the awaited version was put, or the store closed. On the thread
        that did that, so the answer goes to the pool."""
        self._server.submit(functools.partial(self._answer, peer))  # closing: close() ends the peer

    def _expire(self, peer: _Peer, waiter: Waiter, wait: float) -> None:
        """The get's deadline passed: answer TIMEOUT, unless its version came first."""
        error = waiter.expire(wait)
        if error is None:
            return
        peer.timer = None
        self._send_error(peer, STATUS_TIMEOUT, str(error))

    def _send_block(self, peer: _Peer, op: int, version: int, block) -> None:
        conn = peer.conn
        header, payload = (
            block if isinstance(block, SplitBlock) else (block[:HEADER_SIZE], block[HEADER_SIZE:])
        )
        places = (
            [self._shared.locate(header), self._shared.locate(payload)]
            if op == OP_GET_SHARED and peer.local and self._shared
            else [None]
        )
        if None in places:
            Codec.seal(
                header, payload
            )  # its bytes leave this host's memory: they need their checksum
            conn.sendall(_RESPONSE.pack(STATUS_OK, block.nbytes, version) + header)
            for start in range(0, payload.nbytes, SEND_SLICE):
                conn.sendall(payload[start : start + SEND_SLICE])
            return
        (header_segment, header_offset), (payload_segment, payload_offset) = places
        answer = _RESPONSE.pack(STATUS_SHARED, block.nbytes, version) + _SHARED_PLACE.pack(
            header_segment.id, header_offset, header.nbytes, payload_segment.id, payload_offset
        )
        new = {segment.id: segment.fd for segment, _ in places if segment.id not in peer.fds_passed}
        if new:  # the descriptors ride with the answer, once per connection
            socket.send_fds(conn, [answer], list(new.values()))
            peer.fds_passed.update(new)
        else:
            conn.sendall(answer)

    def _send_error(self, peer: _Peer, status: int, text: str, last: bool = False) -> None:
        """Answer with ``status`` and ``text``, then await the next request; with ``last``,
        end the connection instead."""
        data = text.encode("utf-8")[:MAX_ERROR_TEXT]
        try:
            peer.conn.sendall(_RESPONSE.pack(status, len(data), 0) + data)
        except OSError as error:
            self._lost(peer, error)
            return
        if last:
            self._end(peer)
        else:
            self._await_request(peer)

    def _lost(self, peer: _Peer, error: BaseException) -> None:
        if not self._server.closed:
            log.debug("connection from %s ended: %s", peer.peer_text, error)
        self._end(peer)

    def _end(self, peer: _Peer) -> None:
        """The peer's connection is done: its holds go, and as it fetches nothing more, it
        counts as done; then it is closed. Once."""
        with self._lock:
            if peer.ended:
                return
            peer.ended = True
            self._peers.discard(peer)
        if peer.timer is not None:
            peer.timer.cancel()
        try:
            self.store.release(peer)
            # A peer whose connection ends fetches nothing more: as good as its "done".
            self._on_done(peer.partition)
        finally:
            self._server.discard(peer.conn)
            peer.conn.close()

    def close(self) -> None:
        """Stop accepting, close the store, cut every connection, and wait for the threads.

        Closing the store first answers every get that waits in it (with the reason), so no
        thread outlives this; the connections that were idle are ended here.
        """
        self.store.close()
        self._server.close()
        with self._lock:
            left = list(self._peers)
        for peer in left:
            self._end(peer)


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
        self._mappings = SharedMappings()
        self._pending_fds: list[int] = []  # descriptors that came with a response head
        self._passed_here: set[int] = set()  # segments whose descriptor this connection brought
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
        text = f"{self._peer_text} {detail} while we fetched {what}"
        if said:
            return PeerLostError(f"{text}; it said: {said}")
        return PeerLostError(
            f"{text}, without a word: its task failed or its executor was lost, "
            "often killed for using too much memory (see that executor's log; raise "
            "spark.executor.memory or spark.executor.memoryOverhead)"
        )

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
                _REQUEST.pack(
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
            status, length, served = self._receive_head(sock, shared)
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
                return served, self._shared_view(sock, length, what)
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
            raise self._lost(what, f"closed the connection ({error})") from error

    def _receive_head(self, sock: socket.socket, shared: bool) -> tuple[int, int, int]:
        """The response's status, length and version. A shared answer may carry a descriptor with its
        first bytes, so those are read with recvmsg and the descriptor kept for the segment."""
        head = bytearray(_RESPONSE.size)
        if not shared:
            recv_exactly(sock, memoryview(head))
            return _RESPONSE.unpack_from(head)
        data, fds, _, _ = socket.recv_fds(sock, _RESPONSE.size, 2)
        self._pending_fds = list(fds)
        if not data:
            raise EOFError("connection closed before the response")
        head[: len(data)] = data
        recv_exactly(sock, memoryview(head)[len(data) : _RESPONSE.size])
        return _RESPONSE.unpack_from(head)

    def _shared_view(self, sock: socket.socket, length: int, what: str) -> SplitBlock:
        """After a shared answer: views of where the block's header and payload lie (the
        descriptors of segments not seen before came with the answer's first bytes)."""
        tail = bytearray(_SHARED_PLACE.size)
        recv_exactly(sock, memoryview(tail))
        header_segment, header_offset, header_length, payload_segment, payload_offset = (
            _SHARED_PLACE.unpack(tail)
        )
        fds, self._pending_fds = self._pending_fds, []
        # the server passes each segment's descriptor once per connection, the header's first
        fresh = [
            segment
            for segment in dict.fromkeys((header_segment, payload_segment))
            if segment not in self._passed_here
        ]
        if len(fds) != len(fresh):
            for fd in fds:
                os.close(fd)
            raise ProtocolError(
                f"{self._peer_text} passed {len(fds)} descriptors with {what}, which lies in "
                f"shared segments {fresh} not passed on this connection yet"
            )
        for segment, fd in zip(fresh, fds):
            self._passed_here.add(segment)
            if segment in self._mappings:  # mapped from an earlier connection
                os.close(fd)
            else:
                self._mappings.add(segment, fd)
        if header_length > length:
            raise ProtocolError(
                f"{self._peer_text} said {what} has a {header_length}-byte header "
                f"in a {length}-byte block"
            )
        views = []
        for segment, offset, size in (
            (header_segment, header_offset, header_length),
            (payload_segment, payload_offset, length - header_length),
        ):
            view = self._mappings.view(segment, offset, size)
            if view is None:
                raise ProtocolError(
                    f"{self._peer_text} placed part of {what} at bytes {offset}..{offset + size} "
                    f"of shared segment {segment}, which is not that long"
                )
            views.append(view)
        return SplitBlock(*views)

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

    def done(self) -> None:
        """Tell the peer this partition will fetch nothing more from it (closing handshake)."""
        what = "nothing more (saying we are done)"
        with self._lock:
            sock = self._sock or self._connect(what)
            self._sock = sock
            try:
                sock.sendall(_REQUEST.pack(MAGIC, OP_DONE, BlockKind.WEIGHT, 0, 0, 0, 0, 0))
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
        for fd in self._pending_fds:
            os.close(fd)
        self._pending_fds = []
        self._passed_here = set()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Close the connection, if any, and unmap the peer's shared segments."""
        with self._lock:
            self._drop()
            self._mappings.close()
