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
  or an error text).

Every length is checked against what the block can be before a byte of it is read; a
malformed frame closes that connection with a logged reason, never the server.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import sys
import threading
from typing import Callable

from .errors import (
    AllReduceError,
    AuthenticationError,
    FetchTimeoutError,
    PeerLostError,
    ProtocolError,
    StaleVersionError,
    StoreClosedError,
)
from .shm import SharedMappings, SharedSegment
from .store import BlockKey, BlockKind, BlockStore

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
STATUS_SHARED = 5  # the block lies in a shared segment: its id follows (and, once, its fd)

_SEGMENT = struct.Struct("<Q")  # a shared segment's id, after a STATUS_SHARED response

MAX_ERROR_TEXT = 64 * 1024
HANDSHAKE_TIMEOUT = 10.0


def _mac(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, role + b"".join(parts), hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``EOFError`` if the peer closes first."""
    received = 0
    total = view.nbytes
    while received < total:
        got = sock.recv_into(view[received:], total - received)
        if got == 0:
            raise EOFError(f"connection closed after {received} of {total} bytes")
        received += got


def _tune(sock: socket.socket) -> None:
    # Small request frames must not wait for Nagle. The kernel's own buffer sizing measured
    # at least as fast here as fixed 1-16 MiB buffers, so those are left alone.
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def unix_sockets_available() -> bool:
    """Whether this platform has abstract Unix sockets (Linux): the same-host fast path."""
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


class BlockServer:
    """Serves one partition's ``BlockStore`` to the peers that prove the secret.

    Binds ``host`` (the task's own address, never every interface) on ``port`` (0: any free
    one) and, with ``unix``, also an abstract Unix socket named ``local_name``, which peers on
    the same host use instead: on this 2-core machine it moves 20 MB each way in 4.6 ms
    where loopback TCP takes 7.2 ms. It runs one thread per connection, so that a get
    waiting for a version never holds up the others. ``on_done(partition)`` is called when
    a peer says it is done.
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
        shared: dict[int, SharedSegment] | None = None,
        on_refused: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self._secret = secret
        self._param_id = param_id
        self._partition_id = partition_id
        self._partition_num = partition_num
        self._on_done = on_done or (lambda partition: None)
        self._on_refused = on_refused or (lambda partition: None)
        # shared segments by id() of their mmap, filled in by the owner as it makes them
        self._shared = shared if shared is not None else {}
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
        self._acceptors = [
            threading.Thread(target=self._accept_loop, args=(listener,), daemon=True,
                             name=f"allreduce-accept-{partition_id}")
            for listener in self._listeners
        ]
        for acceptor in self._acceptors:
            acceptor.start()

    @property
    def advertised_address(self) -> tuple:
        """What peers need to reach this server: ``(host, port)``, plus ``local_name`` if any."""
        return (*self.address, self.local_name) if self.local_name else tuple(self.address)

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return  # the listener was closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
                thread = threading.Thread(
                    target=self._serve, args=(conn, peer), daemon=True,
                    name=f"allreduce-serve-{self._partition_id}",
                )
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket, peer) -> None:
        peer_text = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a local socket"
        client_partition = None
        try:
            _tune(conn)
            client_partition = self._handshake(conn, peer_text)
            if client_partition is not None:
                self._answer_requests(conn, client_partition, peer_text)
        except (OSError, EOFError) as error:
            if not self._closed:
                log.debug("connection from %s ended: %s", peer_text, error)
        finally:
            self.store.release(conn)
            if client_partition is not None:
                # A peer whose connection ends fetches nothing more: as good as its "done".
                self._on_done(client_partition)
            with self._lock:
                self._connections.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _handshake(self, conn: socket.socket, peer_text: str) -> int | None:
        """Check that the client knows the secret; its partition id, or None if it does not."""
        conn.settimeout(HANDSHAKE_TIMEOUT)
        server_nonce = os.urandom(NONCE_SIZE)
        conn.sendall(MAGIC + server_nonce)
        hello = bytearray(_CLIENT_HELLO.size)
        _recv_exactly(conn, memoryview(hello))
        magic, param_id, partition, client_nonce, mac = _CLIENT_HELLO.unpack(hello)
        ids = struct.pack("<II", param_id, partition)
        expected = _mac(self._secret, b"client", server_nonce, client_nonce, ids)
        if magic != MAGIC:
            reason = f"bad magic {bytes(magic)!r}, not an allreduce-param client"
        elif not hmac.compare_digest(mac, expected):
            reason = "it could not prove the parameter's secret"
        elif param_id != self._param_id:
            reason = f"it asked for parameter {param_id}, this server serves parameter {self._param_id}"
        elif not 0 <= partition < self._partition_num:
            reason = f"partition {partition} is outside 0..{self._partition_num - 1}"
        else:
            conn.sendall(bytes([STATUS_OK]) + _mac(self._secret, b"server", client_nonce, server_nonce, ids))
            conn.settimeout(None)
            return partition
        log.warning("refused connection from %s: %s", peer_text, reason)
        conn.sendall(bytes([STATUS_REFUSED]))
        if 0 <= partition < self._partition_num:
            self._on_refused(partition)  # unproven, so it may only shorten a failure's linger
        return None

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
                version, block = self.store.get(key, version, timeout_ms / 1000.0, newest=newest, reader=conn)
            except FetchTimeoutError as error:
                self._send_error(conn, STATUS_TIMEOUT, str(error))
            except StaleVersionError as error:
                self._send_error(conn, STATUS_STALE, str(error))
            except StoreClosedError as error:
                self._send_error(conn, STATUS_CLOSING, str(error))
                return
            else:
                segment = self._shared.get(id(block.obj)) if op == OP_GET_SHARED and local else None
                if segment is None:
                    conn.sendall(_RESPONSE.pack(STATUS_OK, block.nbytes, version))
                    conn.sendall(block)
                    continue
                answer = _RESPONSE.pack(STATUS_SHARED, block.nbytes, version) + _SEGMENT.pack(segment.id)
                if segment.id in fds_passed:
                    conn.sendall(answer)
                else:  # the descriptor rides with the answer, once per connection
                    socket.send_fds(conn, [answer], [segment.fd])
                    fds_passed.add(segment.id)

    @staticmethod
    def _send_error(conn: socket.socket, status: int, text: str) -> None:
        data = text.encode("utf-8")[:MAX_ERROR_TEXT]
        conn.sendall(_RESPONSE.pack(status, len(data), 0) + data)

    def close(self) -> None:
        """Stop accepting, close the store, cut every connection, and wait for the threads.

        Closing the store first ends the gets that wait in it, so no thread outlives this.
        """
        self.store.close()
        with self._lock:
            self._closed = True
            connections = list(self._connections)
            threads = list(self._threads)
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for acceptor in self._acceptors:
            acceptor.join()
        for thread in threads:
            thread.join()


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
              shared: bool = False, newest: bool = False) -> tuple[int, memoryview]:
        """Fetch ``version`` of block ``key`` (with ``newest``: the newest version at or above
        it), waiting on the peer up to the timeout; ``(version served, block)``.

        The block lands at the start of ``into`` (at least ``max_size`` bytes, the most such
        a block can be; a longer one is a protocol error; None: a new buffer) and the
        returned view covers exactly its bytes. With ``shared``, a peer on this host that
        keeps the block in shared memory answers with where it lies, and the view reads
        it there, in place: the peer keeps that buffer as it is until this client asks for
        the same block again.
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
        head = bytearray(_RESPONSE.size + _SEGMENT.size)
        if not shared:
            _recv_exactly(sock, memoryview(head)[:_RESPONSE.size])
            return _RESPONSE.unpack_from(head)
        data, fds, _, _ = socket.recv_fds(sock, _RESPONSE.size, 1)
        self._pending_fds = list(fds)
        if not data:
            raise EOFError("connection closed before the response")
        head[:len(data)] = data
        _recv_exactly(sock, memoryview(head)[len(data):_RESPONSE.size])
        return _RESPONSE.unpack_from(head)

    def _shared_view(self, sock: socket.socket, length: int, what: str) -> memoryview:
        """After a shared answer: the segment id (and, the first time, its descriptor)."""
        tail = bytearray(_SEGMENT.size)
        _recv_exactly(sock, memoryview(tail))
        (segment_id,) = _SEGMENT.unpack(tail)
        fds, self._pending_fds = self._pending_fds, []
        for fd in fds:
            if segment_id in self._mappings:
                os.close(fd)
            else:
                self._mappings.add(segment_id, fd)
        if segment_id not in self._mappings:
            raise ProtocolError(f"{self._peer_text} pointed at shared segment {segment_id} for {what} "
                                "without ever passing it")
        return self._mappings.view(segment_id, length)

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
        """Cut the connection at once, waking a fetch blocked on it (for shutting down on errors)."""
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
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Close the connection, if any, and unmap the peer's shared segments."""
        with self._lock:
            self._drop()
            self._mappings.close()
