"""The engine's authenticated server: listens, admits the connections that prove the secret,
and serves them with a few threads.

Two servers use this: each partition's block server (``blocks.BlockServer``) and the
driver's message server (``messages.MessageServer``). Both listen where
``NetworkSettings`` says and admit only connections that prove a shared secret in the
handshake (``handshake.py``), on one accept loop. Each then serves every proven connection
with a few threads (``AuthenticatedServer``: the loop watches the idle connections, a
small pool answers), however many connect.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from allreduce_param.engine.wire.events import EventLoop, Timer
from allreduce_param.engine.wire.handshake import (
    _CLIENT_HELLO,
    MAGIC,
    NONCE_SIZE,
    Proven,
    check_hello,
    seal_proven,
)
from allreduce_param.engine.wire.settings import (
    DEFAULT_CONNECT_TIMEOUT,
    ENVIRONMENT,
    SPARK_SETTINGS,
    check_address,
)
from allreduce_param.engine.wire.sockets import cut, tune, unix_sockets_available
from allreduce_param.errors import NetworkError

log = logging.getLogger(__name__)

#: Connections that may be in their handshake at once, at least; one more pushes out the
#: oldest. A server of N partitions allows 2N (``unproven_limit``): every peer's channels
#: may connect at the same moment.
MAX_UNPROVEN = 64
#: How long accepting pauses after accept() failed (e.g. out of file descriptors).
ACCEPT_PAUSE = 0.2
#: How long closing waits for each server thread before it names the late ones in the log.
CLOSE_TIMEOUT = 10.0

# a port another process holds, or one this user may not take
_TAKEN = (errno.EADDRINUSE, errno.EACCES)


def unproven_limit(partition_num: int) -> int:
    """How many connections a server of ``partition_num`` partitions lets be in their
    handshake at once: enough for every peer's worker and owner channels to connect at the
    same moment, and never fewer than ``MAX_UNPROVEN``."""
    return max(MAX_UNPROVEN, 2 * partition_num)


def listen(
    host: str, ports: tuple[int, int] | None, backlog: int, what: str, port: int = 0
) -> socket.socket:
    """A TCP listener on ``host``: at ``port`` when it is not 0 (an address a fixed address
    list gave), else at a free port of ``ports`` (None: any free one), tried from a random
    one on so that servers on one host rarely collide.

    NetworkError, naming ``what`` and what to change: free the port or give another (a
    given ``port``), widen the range (every port of ``ports`` taken), or set a bind
    address of this host (any other failure)."""
    if port:
        candidates = [port]
    elif ports is None:
        candidates = [0]
    else:
        candidates = list(range(ports[0], ports[1] + 1))
        start = int.from_bytes(os.urandom(2), "little") % len(candidates)
        candidates = candidates[start:] + candidates[:start]
    last_error: OSError | None = None
    for candidate in candidates:
        try:
            return socket.create_server((host, candidate), backlog=backlog)
        except OSError as error:
            last_error = error
            if error.errno not in _TAKEN:
                break
    if port:
        raise NetworkError(
            f"{what} cannot listen on {host}:{port} ({last_error}): that address was given for it "
            "(a fixed address list); free the port or give another"
        ) from last_error
    if ports is not None and last_error.errno in _TAKEN:
        raise NetworkError(
            f"{what} found no free port in {ports[0]}-{ports[1]} on {host} (all {len(candidates)} taken): widen "
            f"the range (port_range, or the Spark setting {SPARK_SETTINGS['port_range']}), allowing at least one "
            "port per task on each executor plus one for the driver, or free ports there"
        ) from last_error
    raise NetworkError(
        f"{what} cannot listen on {host}{'' if ports is None else f' in ports {ports[0]}-{ports[1]}'} "
        f"({last_error}): is {host} an address of this host? Set bind_address (the Spark setting "
        f"{SPARK_SETTINGS['bind_address']}, or {ENVIRONMENT['bind_address']} on that host) to one of its "
        "addresses"
    ) from last_error


class _Unproven:
    """A connection in its handshake: what it has sent so far, and the timer that drops it
    when it has not proven the secret in time."""

    __slots__ = ("sock", "peer_text", "nonce", "hello", "timer")

    def __init__(self, sock: socket.socket, peer_text: str, nonce: bytes) -> None:
        self.sock, self.peer_text, self.nonce = sock, peer_text, nonce
        self.hello = bytearray()
        self.timer: Timer | None = None


class AuthenticatedServer:
    """Listens, admits the connections that prove ``secret`` for ``param_id`` (from a
    partition in ``0..partition_num-1``), and runs ``serve(proven)`` for each. Close it when
    done.

    ``serve(proven)`` runs on one of at most ``pool`` threads and must return soon; the
    connection is then the caller's. It asks this server to ``watch`` it (the accept loop
    selects on it and calls back on a pool thread once it has bytes to read), to ``call_at``
    a deadline, or to ``submit`` work, and says ``discard`` when it has closed it. So a
    server with many idle or waiting connections holds ``pool`` threads (and the loop's),
    not one each.

    Listens on ``bind`` at a port of ``ports`` (None: any free one; ``port``, when not 0,
    exactly there) and, with ``unix``, also on an abstract Unix socket (``local_name``),
    which peers on the same host use instead. ``advertise`` is the address the others are
    told (``address`` is what was bound).

    One thread accepts and runs every handshake at once, each connection a small state in
    a selector: a connection that has not proven the secret costs no thread, gets
    ``timeout`` seconds, and at most ``MAX_UNPROVEN`` wait at a time (a new one pushes out
    the oldest), so a flood of idle or garbage connections neither exhausts the process
    nor keeps peers out; an error from ``accept`` (out of file descriptors) pauses
    accepting briefly and never ends it. A partition id is taken from a connection only
    once it has proven the secret. The bound on connections in their handshake grows with
    ``partition_num`` (``unproven_limit``), so all peers connecting at once are admitted.
    With ``encrypt``, a TCP connection must agree to be encrypted (``Proven.sealed``); one
    that proves the secret for the other choice is refused with ``HELLO_OTHER_SEALING``.
    """

    def __init__(
        self,
        secret: bytes,
        param_id: int,
        partition_num: int,
        serve: Callable[[Proven], None],
        *,
        bind: str,
        what: str,
        port: int = 0,
        ports: tuple[int, int] | None = None,
        advertise: str | None = None,
        unix: bool = False,
        timeout: float = DEFAULT_CONNECT_TIMEOUT,
        pool: int,
        encrypt: bool = False,
        thread_name: str = "allreduce-serve",
        accept_thread_name: str = "allreduce-accept",
    ) -> None:
        self._secret = secret
        self._param_id = param_id
        self._partition_num = partition_num
        self._serve = serve
        self._what = what
        self._timeout = timeout
        self._encrypt = encrypt
        self._max_unproven = unproven_limit(partition_num)
        # whoever chose it: never every interface
        check_address(bind, f"{what}'s bind address", bind=True)
        # every peer may connect at once; the kernel caps the backlog at net.core.somaxconn
        # (4096 on Linux since 5.4, 128 before): past that, a SYN waits for the client's retry
        backlog = max(16, 2 * partition_num)
        listener = listen(bind, ports, backlog, what, port)
        self._listeners = [listener]
        self.address: tuple[str, int] = listener.getsockname()[:2]
        self.advertised_host = advertise or self.address[0]
        self.local_name: str | None = None
        if unix and unix_sockets_available():
            name = f"allreduce-param-{os.getpid()}-{os.urandom(8).hex()}"
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                local.bind("\0" + name)  # abstract: no file to clean up
                local.listen(backlog)
            except OSError:
                local.close()
                listener.close()
                raise
            self._listeners.append(local)
            self.local_name = name
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False
        self._unproven: dict[socket.socket, _Unproven] = {}  # oldest first
        self._loop = EventLoop(
            what, threads=pool, pool_name=thread_name, loop_name=accept_thread_name
        )
        for each in self._listeners:
            each.setblocking(False)
            self._loop.register(each, functools.partial(self._accept, each))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pool_threads(self) -> int:
        """How many threads the pool has started (0 without one)."""
        return self._loop.pool_threads

    # ---- for a pooled server: watching, deadlines, work ------------------------------------

    def watch(self, conn, on_readable: Callable[[], None]) -> bool:
        """Call ``on_readable()`` on a pool thread once ``conn`` (a proven connection, or the
        object made from it: anything with ``fileno()``) has bytes to read, or has ended;
        once, then it is no longer watched. False, and nothing is called, once the server
        is closing: the caller ends the connection."""
        return not self._closed and self._loop.watch(conn, on_readable)

    def call_at(self, deadline: float, call: Callable[[], None]) -> Timer:
        """Call ``call()`` on a pool thread at ``deadline`` (``time.monotonic()``'s clock),
        unless the returned timer is cancelled first, or the server closes first."""
        return self._loop.call_at(deadline, call)

    def submit(self, call: Callable[[], None]) -> bool:
        """Run ``call()`` on a pool thread soon; False, and nothing runs, once closing."""
        return self._loop.submit(call)

    def discard(self, sock: socket.socket) -> None:
        """A pooled connection's owner closed it: closing the server no longer cuts it."""
        with self._lock:
            self._connections.discard(sock)

    # ---- admitting: accept and handshake, on the loop's thread ---------------------------

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, peer = listener.accept()
        except BlockingIOError:
            return
        except OSError as error:  # out of file descriptors, buffers...: pause, never give up
            if self._closed:
                return
            log.warning(
                "%s: accept failed (%s); pausing new connections briefly", self._what, error
            )
            for other in self._listeners:
                self._loop.unregister(other)
            self._loop.call_at(
                time.monotonic() + ACCEPT_PAUSE, self._resume_accepting, on_loop=True
            )
            return
        if len(self._unproven) >= self._max_unproven:
            oldest = next(iter(self._unproven.values()))
            self._drop(oldest, f"more than {self._max_unproven} connections in their handshake")
        peer_text = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and peer else "a local socket"
        nonce = os.urandom(NONCE_SIZE)
        try:
            conn.setblocking(False)
            tune(conn)
            if conn.send(MAGIC + nonce) != len(MAGIC) + NONCE_SIZE:  # a fresh socket takes 20 bytes
                raise OSError("the greeting did not fit the socket buffer")
        except OSError as error:
            log.debug("connection from %s ended at once: %s", peer_text, error)
            conn.close()
            return
        pending = _Unproven(conn, peer_text, nonce)
        self._unproven[conn] = pending
        pending.timer = self._loop.call_at(
            time.monotonic() + self._timeout,
            functools.partial(self._drop, pending, f"no handshake within {self._timeout:g} s"),
            on_loop=True,
        )
        self._loop.register(conn, functools.partial(self._read_hello, pending))

    def _resume_accepting(self) -> None:
        for listener in self._listeners:
            self._loop.register(listener, functools.partial(self._accept, listener))

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
        self._forget(pending)
        partition, reason, answer, session_key, sealed = check_hello(
            bytes(pending.hello),
            pending.sock,
            pending.nonce,
            self._secret,
            self._param_id,
            self._partition_num,
            self._encrypt,
        )
        conn = pending.sock
        if partition is None:  # said here first: the refused client hears it next
            log.warning("%s refused connection from %s: %s", self._what, pending.peer_text, reason)
        try:
            conn.setblocking(True)
            conn.settimeout(self._timeout)
            conn.sendall(answer)
            conn.settimeout(None)
        except OSError as error:
            if partition is not None:
                log.debug("connection from %s ended in its handshake: %s", pending.peer_text, error)
            partition = None
        if partition is None:
            conn.close()
            return
        # from here the connection is what serve gets: the frames travel in sealed records if agreed
        proven = seal_proven(Proven(conn, partition, pending.peer_text, session_key, sealed))
        with self._lock:
            if self._closed:
                proven.sock.close()
                return
            self._connections.add(proven.sock)
        if not self._loop.submit(functools.partial(self._serve, proven)):
            self.discard(proven.sock)
            proven.sock.close()

    def _drop(self, pending: _Unproven, reason: str, quiet: bool = False) -> None:
        """Close a connection that never proved the secret."""
        self._forget(pending)
        (log.debug if quiet else log.info)(
            "dropped an unproven connection from %s: %s", pending.peer_text, reason
        )
        pending.sock.close()

    def _forget(self, pending: _Unproven) -> None:
        """The connection's handshake is over: its bytes and deadline are no longer watched."""
        if self._unproven.pop(pending.sock, None) is not None:
            pending.timer.cancel()
            self._loop.unregister(pending.sock)

    def close(self) -> None:
        """Stop accepting and watching, cut every connection, and wait for the threads (each
        wait bounded; one that overruns is named in the log): the pool's threads first finish
        the calls already handed to them. Connections still open are cut, not closed: their
        owner closes them."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        stopped = self._loop.stop(CLOSE_TIMEOUT)
        if stopped:  # else the loop's thread still has them: it is named below
            for pending in list(self._unproven.values()):
                self._drop(pending, "shutting down")
        for listener in self._listeners:
            listener.close()
        cut(connections)
        late = self._loop.close(CLOSE_TIMEOUT)
        if late:
            log.warning(
                "%s: %d threads still running %g s after close: %s",
                self._what,
                len(late),
                CLOSE_TIMEOUT,
                late,
            )
