"""The wire between partitions: a block server, a peer client, and how they prove the secret.

Each partition runs one ``BlockServer`` over its ``BlockStore`` and one ``PeerClient`` per
peer. A client pulls blocks: it names a block and a version, and the server answers when
that version is in its store (or with an error once the wait times out).

Wire format (little-endian):

* Handshake. Server: ``HELLO`` magic + 16-byte nonce. Client: magic, parameter id, own
  partition id, 16-byte nonce, HMAC-SHA256(secret, "client" + both nonces + ids). Server:
  one status byte, then its own HMAC(secret, "server" + ...) so the client knows it talks to
  a holder of the secret too. A connection that fails this reads and writes nothing.
* Request: op, block kind, source, destination, part, version, timeout in ms (fixed size).
  The op's ``FLAG_NEWEST`` bit asks for the newest version at or above ``version``.
* Response: status, length, the version served; then ``length`` bytes (the encoded block,
  or an error text). A peer on this host that asked for shared answers gets, for a block
  in shared memory, where its header and its payload lie instead (segment ids, offsets,
  the header's length; with the descriptor of a segment it has not been passed yet): the
  two may lie apart, when a vector was published where it lies (``store.SplitBlock``).

Every length is checked against what the block can be before a byte of it is read; a
malformed frame closes that connection with a logged reason, never the server.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import sys
import threading
import time
from typing import Callable, NamedTuple

from .codec import HEADER_SIZE, Codec
from .errors import (
    AllReduceError,
    AuthenticationError,
    FetchTimeoutError,
    PeerLostError,
    ProtocolError,
    StaleVersionError,
    StoreClosedError,
)
from .shm import SharedArenas, SharedMappings
from .store import BlockKey, BlockKind, BlockStore, SplitBlock

log = logging.getLogger(__name__)

MAGIC = b"ARP1"
NONCE_SIZE = 16
MAC_SIZE = 32
_CLIENT_HELLO = struct.Struct(f"<4sII{NONCE_SIZE}s{MAC_SIZE}s")  # magic, param, partition, nonce, mac
_REQUEST = struct.Struct("<4sBBIIIQI")  # magic, op, kind, source, destination, part, version, timeout ms
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
STATUS_REFUSED = 4
STATUS_SHARED = 5  # the block lies in shared segments: where follows (and, once each, their fds)

#: After STATUS_SHARED: the header's segment id, offset and length, the payload's segment id
#: and offset (the payload's length is the response's length less the header's).
_SHARED_PLACE = struct.Struct("<QQQQQ")

MAX_ERROR_TEXT = 64 * 1024
HANDSHAKE_TIMEOUT = 10.0
#: Connections that may be in their handshake at once; one more pushes out the oldest.
MAX_UNPROVEN = 64
#: How long accepting pauses after accept() failed (e.g. out of file descriptors).
ACCEPT_PAUSE = 0.2
#: How long closing waits for each server thread before it names the late ones in the log.
CLOSE_TIMEOUT = 10.0


def _mac(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, role + b"".join(parts), hashlib.sha256).digest()


def secret_fingerprint(secret: bytes, param_id: int) -> str:
    """A short tag of a parameter's secret and id that partitions exchange at the meeting,
    so that partitions of different parameters learn it there, all of them, before any
    connects (one that connects first would see the other close). It reveals nothing that
    proves the secret: the handshake's MACs cover fresh nonces."""
    return _mac(secret, b"fingerprint", str(param_id).encode())[:12].hex()


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


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``EOFError`` if the peer closes first."""
    received = 0
    total = view.nbytes
    while received < total:
        got = sock.recv_into(view[received:], total - received)
        if got == 0:
            raise EOFError(f"connection closed after {received} of {total} bytes")
        received += got


def cut(connections) -> None:
    """Shut every socket down both ways, so a thread blocked reading one wakes with its end;
    one already gone is left alone."""
    for conn in connections:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _tune(sock: socket.socket) -> None:
    # Small request frames must not wait for Nagle. Socket buffer sizes are left to the
    # kernel's own sizing, which did no worse than fixed ones (docs/DESIGN.md, figures).
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def unix_sockets_available() -> bool:
    """Whether this platform has abstract Unix sockets (Linux): the same-host fast path."""
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


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


class _Unproven:
    """A connection in its handshake: what it has sent so far, and until when it may try."""

    __slots__ = ("sock", "peer_text", "nonce", "hello", "deadline")

    def __init__(self, sock: socket.socket, peer_text: str, nonce: bytes, deadline: float) -> None:
        self.sock, self.peer_text, self.nonce, self.deadline = sock, peer_text, nonce, deadline
        self.hello = bytearray()


class BlockServer:
    """Serves one partition's ``BlockStore`` to the peers that prove the secret.

    Binds ``host`` (the task's own address, never every interface) on ``port`` (0: any free
    one) and, with ``unix``, also an abstract Unix socket named ``local_name``, which peers
    on the same host use instead (faster than loopback TCP).

    One thread accepts and runs every handshake at once, each connection a small state in
    a selector: a connection that has not proven the secret costs no thread, gets
    ``HANDSHAKE_TIMEOUT`` seconds, and at most ``MAX_UNPROVEN`` wait at a time (a new one
    pushes out the oldest), so a flood of idle or garbage connections neither exhausts the
    process nor keeps peers out; an error from ``accept`` (out of file descriptors) pauses
    accepting briefly and never ends it. A peer that proves the secret gets a thread of
    its own, so that a get waiting for a version never holds up the others. A partition id
    is taken from a connection only once it has proven the secret. ``on_done(partition)``
    is called when a proven peer says it is done, or its connection ends. A get waits for
    a version at most ``max_wait`` seconds, whatever the request asks.
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
    ) -> None:
        self.store = store
        self._max_wait = max_wait
        self._secret = secret
        self._param_id = param_id
        self._partition_id = partition_id
        self._partition_num = partition_num
        self._on_done = on_done or (lambda partition: None)
        # where the owner's blocks lie in shared memory, if they do
        self._shared = shared
        backlog = max(16, 2 * partition_num)
        self._listeners = [socket.create_server((host, port), backlog=backlog)]
        self.address: tuple[str, int] = self._listeners[0].getsockname()[:2]
        self.local_name: str | None = None
        if unix and unix_sockets_available():
            name = f"allreduce-param-{os.getpid()}-{os.urandom(8).hex()}"
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                local.bind("\0" + name)  # abstract: no file to clean up
                local.listen(backlog)
            except OSError:
                local.close()
                self._listeners[0].close()
                raise
            self._listeners.append(local)
            self.local_name = name
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._unproven: dict[socket.socket, _Unproven] = {}  # oldest first
        self._paused_until = 0.0  # accept() failed: try again from then on
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        for listener in self._listeners:
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ, "listener")
        self._acceptor = threading.Thread(target=self._admit, daemon=True, name=f"allreduce-accept-{partition_id}")
        self._acceptor.start()

    @property
    def advertised_address(self) -> tuple:
        """What peers need to reach this server and to know it serves their parameter:
        ``(host, port, fingerprint, local_name, local_scope)`` (``parse_address`` reads it;
        the last two None without a Unix socket)."""
        return (*self.address, secret_fingerprint(self._secret, self._param_id), self.local_name,
                local_scope() if self.local_name else None)

    # ---- admitting: accept and handshake, on one thread -----------------------------------

    def _admit(self) -> None:
        try:
            while not self._closed:
                now = time.monotonic()
                deadlines = [pending.deadline for pending in self._unproven.values()]
                if self._paused_until:
                    deadlines.append(self._paused_until)
                wait = max(0.0, min(deadlines) - now) if deadlines else None
                for key, _ in self._selector.select(wait):
                    if key.data is None:
                        self._wake_read.recv(64)
                    elif key.data == "listener":
                        self._accept(key.fileobj)
                    else:
                        self._read_hello(key.data)
                now = time.monotonic()
                for pending in [p for p in self._unproven.values() if p.deadline <= now]:
                    self._drop(pending, f"no handshake within {HANDSHAKE_TIMEOUT:g} s")
                if self._paused_until and now >= self._paused_until:
                    self._paused_until = 0.0
                    for listener in self._listeners:
                        self._selector.register(listener, selectors.EVENT_READ, "listener")
        except Exception:  # a bug here must not pass silently: the server would stop admitting
            log.exception("partition %d: the block server stopped admitting connections", self._partition_id)
        finally:
            for pending in list(self._unproven.values()):
                self._drop(pending, "shutting down")

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, peer = listener.accept()
        except BlockingIOError:
            return
        except OSError as error:  # out of file descriptors, buffers...: pause, never give up
            if self._closed:
                return
            log.warning("partition %d: accept failed (%s); pausing new connections briefly",
                        self._partition_id, error)
            self._paused_until = time.monotonic() + ACCEPT_PAUSE
            for other in self._listeners:
                self._selector.unregister(other)
            return
        if len(self._unproven) >= MAX_UNPROVEN:
            oldest = next(iter(self._unproven.values()))
            self._drop(oldest, f"more than {MAX_UNPROVEN} connections in their handshake")
        peer_text = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and peer else "a local socket"
        nonce = os.urandom(NONCE_SIZE)
        try:
            conn.setblocking(False)
            _tune(conn)
            if conn.send(MAGIC + nonce) != len(MAGIC) + NONCE_SIZE:  # a fresh socket takes 20 bytes
                raise OSError("the greeting did not fit the socket buffer")
        except OSError as error:
            log.debug("connection from %s ended at once: %s", peer_text, error)
            conn.close()
            return
        pending = _Unproven(conn, peer_text, nonce, time.monotonic() + HANDSHAKE_TIMEOUT)
        self._unproven[conn] = pending
        self._selector.register(conn, selectors.EVENT_READ, pending)

    def _read_hello(self, pending: _Unproven) -> None:
        try:
            chunk = pending.sock.recv(_CLIENT_HELLO.size - len(pending.hello))
        except BlockingIOError:
            return
        except OSError as error:
            self._drop(pending, str(error), quiet=True)
            return
        if not chunk:
            self._drop(pending, "closed during the handshake", quiet=True)
            return
        pending.hello += chunk
        if len(pending.hello) < _CLIENT_HELLO.size:
            return
        self._selector.unregister(pending.sock)
        del self._unproven[pending.sock]
        partition, reason, answer = self._check_hello(pending)
        conn = pending.sock
        if partition is None:  # said here first: the refused client hears it next
            log.warning("refused connection from %s: %s", pending.peer_text, reason)
        try:
            conn.setblocking(True)
            conn.settimeout(HANDSHAKE_TIMEOUT)
            conn.sendall(answer)
            conn.settimeout(None)
        except OSError as error:
            if partition is not None:
                log.debug("connection from %s ended in its handshake: %s", pending.peer_text, error)
            partition = None
        if partition is None:
            conn.close()
            return
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._connections.add(conn)
            self._threads = {thread for thread in self._threads if thread.is_alive()}  # the ended ones need no join
            thread = threading.Thread(target=self._serve, args=(conn, partition, pending.peer_text), daemon=True,
                                      name=f"allreduce-serve-{self._partition_id}")
            self._threads.add(thread)
        thread.start()

    def _check_hello(self, pending: _Unproven) -> tuple[int | None, str, bytes]:
        """(the client's partition or None, why it was refused, the answer to send)."""
        magic, param_id, partition, client_nonce, mac = _CLIENT_HELLO.unpack(pending.hello)
        ids = struct.pack("<II", param_id, partition)
        expected = _mac(self._secret, b"client", pending.nonce, client_nonce, ids)
        if magic != MAGIC:
            reason = f"bad magic {bytes(magic)!r}, not an allreduce-param client"
        elif not hmac.compare_digest(mac, expected):
            reason = "it could not prove the parameter's secret"
        elif param_id != self._param_id:
            reason = f"it asked for parameter {param_id}, this server serves parameter {self._param_id}"
        elif not 0 <= partition < self._partition_num:
            reason = f"partition {partition} is outside 0..{self._partition_num - 1}"
        else:
            return partition, "", bytes([STATUS_OK]) + _mac(self._secret, b"server", client_nonce, pending.nonce, ids)
        return None, reason, bytes([STATUS_REFUSED])

    def _drop(self, pending: _Unproven, reason: str, quiet: bool = False) -> None:
        """Close a connection that never proved the secret."""
        if self._unproven.pop(pending.sock, None) is not None:
            self._selector.unregister(pending.sock)
        (log.debug if quiet else log.info)("dropped an unproven connection from %s: %s", pending.peer_text, reason)
        pending.sock.close()

    # ---- serving a proven peer, on a thread of its own -----------------------------------

    def _serve(self, conn: socket.socket, client_partition: int, peer_text: str) -> None:
        try:
            self._answer_requests(conn, client_partition, peer_text)
        except (OSError, EOFError) as error:
            if not self._closed:
                log.debug("connection from %s ended: %s", peer_text, error)
        finally:
            self.store.release(conn)
            # A peer whose connection ends fetches nothing more: as good as its "done".
            self._on_done(client_partition)
            with self._lock:
                self._connections.discard(conn)
            conn.close()  # the thread stays listed until it has ended, so close() joins it

    def _answer_requests(self, conn: socket.socket, client_partition: int, peer_text: str) -> None:
        request = bytearray(_REQUEST.size)
        view = memoryview(request)
        fds_passed: set[int] = set()  # segments whose descriptor this peer already has
        local = conn.family == socket.AF_UNIX
        while True:
            try:
                _recv_exactly(conn, view)
            except EOFError:
                return
            magic, op, kind, source, destination, part, version, timeout_ms = _REQUEST.unpack(request)
            newest, op = bool(op & FLAG_NEWEST), op & ~FLAG_NEWEST
            if magic != MAGIC or op not in _OPS or kind not in BlockKind.NAMES:
                log.warning(
                    "closed connection from partition %d at %s: malformed request frame %s",
                    client_partition, peer_text, bytes(request[:16]).hex(),
                )
                return
            if op == OP_DONE:
                self._on_done(client_partition)
                continue
            key = BlockKey(kind, source, destination, part)
            try:
                version, block = self.store.get(key, version, min(timeout_ms / 1000.0, self._max_wait),
                                                newest=newest, reader=conn)
            except FetchTimeoutError as error:
                self._send_error(conn, STATUS_TIMEOUT, str(error))
            except StaleVersionError as error:
                self._send_error(conn, STATUS_STALE, str(error))
            except StoreClosedError as error:
                self._send_error(conn, STATUS_CLOSING, str(error))
                return
            else:
                header, payload = block if isinstance(block, SplitBlock) else (block[:HEADER_SIZE],
                                                                               block[HEADER_SIZE:])
                places = [self._shared.locate(header), self._shared.locate(payload)] \
                    if op == OP_GET_SHARED and local and self._shared else [None]
                if None in places:
                    Codec.seal(header, payload)  # its bytes leave this host's memory: they need their checksum
                    conn.sendall(_RESPONSE.pack(STATUS_OK, block.nbytes, version) + header)
                    conn.sendall(payload)
                    continue
                (header_segment, header_offset), (payload_segment, payload_offset) = places
                answer = _RESPONSE.pack(STATUS_SHARED, block.nbytes, version) + _SHARED_PLACE.pack(
                    header_segment.id, header_offset, header.nbytes, payload_segment.id, payload_offset)
                new = {segment.id: segment.fd for segment, _ in places if segment.id not in fds_passed}
                if new:  # the descriptors ride with the answer, once per connection
                    socket.send_fds(conn, [answer], list(new.values()))
                    fds_passed.update(new)
                else:
                    conn.sendall(answer)

    @staticmethod
    def _send_error(conn: socket.socket, status: int, text: str) -> None:
        data = text.encode("utf-8")[:MAX_ERROR_TEXT]
        conn.sendall(_RESPONSE.pack(status, len(data), 0) + data)

    def close(self) -> None:
        """Stop accepting, close the store, cut every connection, and wait for the threads.

        Closing the store first ends the gets that wait in it, so no thread outlives this;
        each wait for a thread is bounded, and one that overruns is named in the log.
        """
        self.store.close()
        with self._lock:
            self._closed = True
            connections = list(self._connections)
            threads = list(self._threads)
        try:
            self._wake_write.send(b"x")
        except OSError:
            pass
        self._acceptor.join(CLOSE_TIMEOUT)
        for listener in self._listeners:
            listener.close()
        cut(connections)
        for thread in threads:
            thread.join(CLOSE_TIMEOUT)
        late = [thread.name for thread in [self._acceptor, *threads] if thread.is_alive()]
        if late:
            log.warning("partition %d: %d server threads still running %g s after close: %s",
                        self._partition_id, len(late), CLOSE_TIMEOUT, late)
        self._selector.close()
        self._wake_read.close()
        self._wake_write.close()


class PeerClient:
    """One authenticated connection to one peer's ``BlockServer``, used by one thread at a time.

    Connects on first use: to the peer's ``local_name`` Unix socket when given (a peer on
    this host), else, or when that fails, over TCP. Errors name the peer, the block and the
    version; any error on the connection closes it, and the next use connects anew.
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
    ) -> None:
        self.address = address
        self.local_name = local_name if unix_sockets_available() else None
        self.peer_partition = peer_partition
        self._secret = secret
        self._param_id = param_id
        self._partition_id = partition_id
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._mappings = SharedMappings()
        self._pending_fds: list[int] = []  # descriptors that came with a response head
        self._passed_here: set[int] = set()  # segments whose descriptor this connection brought
        self._aborted = False  # this partition is shutting down: no new connection

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
        return PeerLostError(f"{text}, without a word: its task failed or its executor was lost, "
                             "often killed for using too much memory (see that executor's log; raise "
                             "spark.executor.memory or spark.executor.memoryOverhead)")

    def _open(self) -> socket.socket:
        if self.local_name:
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            local.settimeout(HANDSHAKE_TIMEOUT)
            try:
                local.connect("\0" + self.local_name)
                return local
            except OSError as error:  # another network namespace, or gone: TCP will tell
                local.close()
                log.debug("no local socket for %s (%s), using TCP", self._peer_text, error)
        return socket.create_connection(self.address, timeout=HANDSHAKE_TIMEOUT)

    def _connect(self, what: str) -> socket.socket:
        if self._aborted:
            raise StoreClosedError(f"this partition is shutting down: no new connection to {self._peer_text} "
                                   f"for {what}")
        try:
            sock = self._open()
        except OSError as error:
            raise self._lost(what, f"cannot be reached ({error})") from error
        try:
            _tune(sock)
            greeting = bytearray(len(MAGIC) + NONCE_SIZE)
            _recv_exactly(sock, memoryview(greeting))
            if greeting[: len(MAGIC)] != MAGIC:
                raise ProtocolError(f"{self._peer_text} is not an allreduce-param block server")
            server_nonce = bytes(greeting[len(MAGIC):])
            client_nonce = os.urandom(NONCE_SIZE)
            ids = struct.pack("<II", self._param_id, self._partition_id)
            mac = _mac(self._secret, b"client", server_nonce, client_nonce, ids)
            sock.sendall(_CLIENT_HELLO.pack(MAGIC, self._param_id, self._partition_id, client_nonce, mac))
            status = bytearray(1)
            _recv_exactly(sock, memoryview(status))
            if status[0] != STATUS_OK:
                raise AuthenticationError(
                    f"{self._peer_text} refused this connection: the secrets differ. Every "
                    "partition must use the same AllReduceParameter object, made on the driver"
                )
            proof = bytearray(MAC_SIZE)
            _recv_exactly(sock, memoryview(proof))
            if not hmac.compare_digest(bytes(proof), _mac(self._secret, b"server", client_nonce, server_nonce, ids)):
                raise AuthenticationError(f"{self._peer_text} could not prove the parameter's secret")
            sock.settimeout(None)
            return sock
        except AllReduceError:
            sock.close()
            raise
        except socket.timeout as error:
            sock.close()
            raise FetchTimeoutError(f"{self._peer_text} did not finish the handshake within "
                                    f"{HANDSHAKE_TIMEOUT:g} s while we fetched {what}") from error
        except (OSError, EOFError) as error:
            sock.close()
            raise self._lost(what, f"dropped the connection during the handshake ({error})") from error

    def fetch(self, key: BlockKey, version: int, max_size: int, into: memoryview | None,
              shared: bool = False, newest: bool = False) -> tuple[int, memoryview | SplitBlock]:
        """Fetch ``version`` of block ``key`` (with ``newest``: the newest version at or above
        it), waiting on the peer up to the timeout; ``(version served, block)``.

        The block lands at the start of ``into`` (at least ``max_size`` bytes, the most such
        a block can be; a longer one is a protocol error; None: a new buffer) and the
        returned view covers exactly its bytes. With ``shared``, a peer on this host that
        keeps the block in shared memory answers with where it lies, and a ``SplitBlock``
        of views reads it there, in place: the peer keeps it as it is until this client
        asks for the same block again.
        """
        what = key.describe(version)
        keep_connection = False
        with self._lock:
            sock = self._sock or self._connect(what)
            self._sock = sock
            try:
                # The server gives up waiting at the timeout and says so; the socket waits longer
                # so that the server's answer, not a bare socket timeout, reaches the user.
                sock.settimeout(self._timeout + HANDSHAKE_TIMEOUT)
                shared = shared and sock.family == socket.AF_UNIX
                op = (OP_GET_SHARED if shared else OP_GET) | (FLAG_NEWEST if newest else 0)
                sock.sendall(_REQUEST.pack(MAGIC, op, key.kind, key.source, key.destination, key.part,
                                           version, int(self._timeout * 1000)))
                status, length, served = self._receive_head(sock, shared)
                if status not in (STATUS_OK, STATUS_SHARED):
                    error = self._answer_error(status, length, sock, what)
                    # a peer that waited in vain or no longer keeps a version says so cleanly
                    keep_connection = status in (STATUS_TIMEOUT, STATUS_STALE)
                    raise error
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
                _recv_exactly(sock, view)
                return served, view
            except AllReduceError:
                if not keep_connection:
                    self._drop()
                raise
            except socket.timeout as error:
                self._drop()
                raise FetchTimeoutError(
                    f"{self._peer_text} did not answer for {what} within "
                    f"{self._timeout + HANDSHAKE_TIMEOUT:g} s"
                ) from error
            except (OSError, EOFError) as error:
                self._drop()
                raise self._lost(what, f"closed the connection ({error})") from error

    def _receive_head(self, sock: socket.socket, shared: bool) -> tuple[int, int, int]:
        """The response's status, length and version. A shared answer may carry a descriptor with its
        first bytes, so those are read with recvmsg and the descriptor kept for the segment."""
        head = bytearray(_RESPONSE.size)
        if not shared:
            _recv_exactly(sock, memoryview(head))
            return _RESPONSE.unpack_from(head)
        data, fds, _, _ = socket.recv_fds(sock, _RESPONSE.size, 2)
        self._pending_fds = list(fds)
        if not data:
            raise EOFError("connection closed before the response")
        head[:len(data)] = data
        _recv_exactly(sock, memoryview(head)[len(data):_RESPONSE.size])
        return _RESPONSE.unpack_from(head)

    def _shared_view(self, sock: socket.socket, length: int, what: str) -> SplitBlock:
        """After a shared answer: views of where the block's header and payload lie (the
        descriptors of segments not seen before came with the answer's first bytes)."""
        tail = bytearray(_SHARED_PLACE.size)
        _recv_exactly(sock, memoryview(tail))
        header_segment, header_offset, header_length, payload_segment, payload_offset = _SHARED_PLACE.unpack(tail)
        fds, self._pending_fds = self._pending_fds, []
        # the server passes each segment's descriptor once per connection, the header's first
        fresh = [segment for segment in dict.fromkeys((header_segment, payload_segment))
                 if segment not in self._passed_here]
        if len(fds) != len(fresh):
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"{self._peer_text} passed {len(fds)} descriptors with {what}, which lies in "
                                f"shared segments {fresh} not passed on this connection yet")
        for segment, fd in zip(fresh, fds):
            self._passed_here.add(segment)
            if segment in self._mappings:  # mapped from an earlier connection
                os.close(fd)
            else:
                self._mappings.add(segment, fd)
        if header_length > length:
            raise ProtocolError(f"{self._peer_text} said {what} has a {header_length}-byte header "
                                f"in a {length}-byte block")
        views = []
        for segment, offset, size in ((header_segment, header_offset, header_length),
                                      (payload_segment, payload_offset, length - header_length)):
            view = self._mappings.view(segment, offset, size)
            if view is None:
                raise ProtocolError(f"{self._peer_text} placed part of {what} at bytes {offset}..{offset + size} "
                                    f"of shared segment {segment}, which is not that long")
            views.append(view)
        return SplitBlock(*views)

    def _answer_error(self, status: int, length: int, sock: socket.socket, what: str) -> AllReduceError:
        """The error a non-OK answer stands for, its text read off the connection."""
        if length > MAX_ERROR_TEXT:
            raise ProtocolError(f"{self._peer_text} sent an error text of {length} bytes for {what}")
        text = bytearray(length)
        _recv_exactly(sock, memoryview(text))
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
