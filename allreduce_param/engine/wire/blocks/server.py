"""The block server: one partition's ``BlockStore`` served to the peers that prove the secret.

What it reads from and writes to each peer's connection (the frames) is ``serving.py``'s.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable

from allreduce_param.engine.blocks.shm import SharedArenas
from allreduce_param.engine.blocks.store import BlockStore
from allreduce_param.engine.blocks.waiters import Waiter
from allreduce_param.engine.wire.blocks.addresses import local_scope, secret_fingerprint
from allreduce_param.engine.wire.blocks.protocol import (
    MAX_ERROR_TEXT,
    OP_ADDRESS,
    OP_ARENA,
    OP_DONE,
    STATUS_CLOSING,
    STATUS_OK,
    STATUS_STALE,
    STATUS_TIMEOUT,
)
from allreduce_param.engine.wire.blocks.serving import (
    ServedPeer,
    read_request,
    send_block,
    send_frame,
)
from allreduce_param.engine.wire.handshake import Proven
from allreduce_param.engine.wire.server import AuthenticatedServer
from allreduce_param.engine.wire.settings import DEFAULT_CONNECT_TIMEOUT
from allreduce_param.errors import AllReduceError, StaleVersionError, StoreClosedError

log = logging.getLogger(__name__)

#: The threads a block server answers with, however many peers it serves.
SERVE_THREADS = 8


class BlockServer:
    """Serves one partition's ``BlockStore`` to the peers that prove the secret.

    Listens on ``host`` (the task's own address, never every interface unless told) at
    ``port`` or, when that is 0, a free port of ``ports`` (None: any), and with ``unix``
    also on an abstract Unix socket (``local_name``), which peers on the same host use
    instead (faster than loopback TCP); ``advertise`` is the address peers are told
    (default: ``host``). Admission is ``wire.server.AuthenticatedServer``'s: a handshake within
    ``handshake_timeout`` seconds. ``on_done(partition)`` is called when a proven peer says
    it is done, or its connection ends. A get waits for a version at most ``max_wait``
    seconds, whatever the request asks. With ``encrypt``, connections over TCP are
    encrypted (``sealing.py``). ``arena()``: the host arena's description and descriptors
    (``HostArena.offer``), what a same-host peer's ``OP_ARENA`` is answered with.

    However many peers it serves, it holds ``threads`` threads (and the accept thread): the
    accept loop watches the idle connections, a pool thread reads a request and answers it,
    and a get for a version not published yet holds no thread while it waits: the store
    calls back when the version comes (or it closes), the accept loop at the deadline.
    Answers are sent from the pool threads, each slice of a block (``serving.SEND_SLICE``)
    within the handshake timeout, so a reader that stops reading holds one thread for that
    long at most, never the others: sending whole blocks blocking keeps a connection wrapper
    (made by ``wire.server.AuthenticatedServer`` as it hands a proven connection over) free
    to frame each send as it likes, and a shared-memory answer's descriptors in the same
    call as its bytes.
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
        arena: Callable[[], tuple[bytes, list[int]]] | None = None,
    ) -> None:
        self.store = store
        # the host arena's description and descriptors, for OP_ARENA (a host's leader)
        self._arena = arena
        self._max_wait = max_wait
        self._secret = secret
        self._param_id = param_id
        self._partition_id = partition_id
        self._on_done = on_done or (lambda partition: None)
        self._io_timeout = handshake_timeout
        # where the owner's blocks lie in shared memory, if they do
        self._shared = shared
        self._lock = threading.Lock()
        self._peers: set[ServedPeer] = set()
        # the accept loop runs from inside AuthenticatedServer's constructor: a peer quick
        # enough is proven before ``_server`` is assigned, and its serving waits for this
        self._started = threading.Event()
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
        self._started.set()
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
        peer = ServedPeer(proven)
        if not self._started.wait(self._io_timeout):  # the constructor failed after accepting
            peer.conn.close()
            return
        # a request comes whole; an answer's slice is taken in time
        peer.conn.settimeout(self._io_timeout)
        with self._lock:
            self._peers.add(peer)
        self._await_request(peer)

    def _await_request(self, peer: ServedPeer) -> None:
        if not self._server.watch(peer.conn, functools.partial(self._read_request, peer)):
            self._end(peer)  # closing

    def _read_request(self, peer: ServedPeer) -> None:
        try:
            op, key, version, newest, timeout_ms = read_request(peer.conn)
        except EOFError:
            self._end(peer)
            return
        except OSError as error:
            self._lost(peer, error)
            return
        except AllReduceError as error:  # malformed, or a sealed record failing its check
            log.warning(
                "closed connection from partition %d at %s: %s",
                peer.partition,
                peer.peer_text,
                error,
            )
            self._end(peer)
            return
        if op == OP_ADDRESS:
            self._send_address(peer)
            return
        if op == OP_ARENA:
            self._send_arena(peer)
            return
        if op == OP_DONE:
            self._on_done(peer.partition)
            self._await_request(peer)
            return
        wait = min(timeout_ms / 1000.0, self._max_wait)
        peer.request = (key, version, newest, op, wait)
        peer.deadline = time.monotonic() + wait
        self._answer(peer)

    def _answer(self, peer: ServedPeer) -> None:
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
            send_block(peer, op, *got, self._shared)
        except StaleVersionError as error:
            self._send_error(peer, STATUS_STALE, str(error))
        except StoreClosedError as error:  # this partition stops: the peer hears why, then the end
            self._send_error(peer, STATUS_CLOSING, str(error), last=True)
        except OSError as error:
            self._lost(peer, error)
        else:
            self._await_request(peer)

    def _version_ready(self, peer: ServedPeer) -> None:
        """The store's call: the awaited version was put, or the store closed. On the thread
        that did that, so the answer goes to the pool."""
        self._server.submit(functools.partial(self._answer, peer))  # closing: close() ends the peer

    def _expire(self, peer: ServedPeer, waiter: Waiter, wait: float) -> None:
        """The get's deadline passed: answer TIMEOUT, unless its version came first."""
        error = waiter.expire(wait)
        if error is None:
            return
        peer.timer = None
        self._send_error(peer, STATUS_TIMEOUT, str(error))

    def _send_address(self, peer: ServedPeer) -> None:
        """Answer "where can I reach you" with the advertised address, then end the
        connection: it was made for that alone, so its end says nothing of the peer's fetches."""
        data = json.dumps(list(self.advertised_address)).encode()
        peer.only_asked_address = True
        try:
            send_frame(peer.conn, STATUS_OK, data)
        except OSError as error:
            self._lost(peer, error)
            return
        self._end(peer)

    def _send_arena(self, peer: ServedPeer) -> None:
        """Answer "map the host arena" with its description and, riding with it, its
        descriptors; then end the connection, as ``_send_address`` does. Refused (with the
        reason) over TCP, or where this partition keeps no arena."""
        peer.only_asked_address = True
        if not peer.local or self._arena is None:
            self._send_error(
                peer,
                STATUS_CLOSING,
                f"partition {self._partition_id} keeps no host arena for a peer "
                + ("on another host" if not peer.local else "(it is not its host's leader)"),
                last=True,
            )
            return
        try:
            data, fds = self._arena()
            send_frame(peer.conn, STATUS_OK, data, fds)
        except (OSError, AllReduceError) as error:
            self._lost(peer, error)
            return
        self._end(peer)

    def _send_error(self, peer: ServedPeer, status: int, text: str, last: bool = False) -> None:
        """Answer with ``status`` and ``text``, then await the next request; with ``last``,
        end the connection instead."""
        data = text.encode("utf-8")[:MAX_ERROR_TEXT]
        try:
            send_frame(peer.conn, status, data)
        except OSError as error:
            self._lost(peer, error)
            return
        if last:
            self._end(peer)
        else:
            self._await_request(peer)

    def _lost(self, peer: ServedPeer, error: BaseException) -> None:
        if not self._server.closed:
            log.debug("connection from %s ended: %s", peer.peer_text, error)
        self._end(peer)

    def _end(self, peer: ServedPeer) -> None:
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
            if not peer.only_asked_address:
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
