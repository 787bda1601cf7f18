"""A channel: one thread's way to the peers (its connections, fetch threads and landing
buffers), and how a fetch runs on it.

A fetch is written once (``fetches.Fetcher._fetch_parts``) as a generator of the gets it needs,
a block from a peer (``PeerGet``) or from the own store (``StoreGet``), each of which may
wait until the block is published. A channel runs it either through, on one of its
threads, waiting where it waits (``run_through``: the worker's fetches, which wait only
for blocks their peers publish without waiting for this partition), or, with
``idle_waits``, holding no thread while it waits: the request is sent, and one loop
thread (``events.EventLoop``) watches the answer's socket, the store's waiter and the
deadline, and hands the fetch back to the pool when it is due (a background owner's
fetches, which may wait on any producer for as long as the strategy lets it lag).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Generator, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from allreduce_param.engine.blocks.store import Block, BlockKey, BlockStore
from allreduce_param.engine.blocks.waiters import Waiter
from allreduce_param.engine.wire.blocks import PeerClient
from allreduce_param.engine.wire.events import EventLoop
from allreduce_param.engine.wire.server import CLOSE_TIMEOUT
from allreduce_param.errors import StoreClosedError

log = logging.getLogger(__name__)


class PeerGet(NamedTuple):
    """A fetch's step: a block from a peer (``PeerClient.fetch``'s arguments)."""

    client: PeerClient
    key: BlockKey
    version: int
    max_size: int
    into: memoryview | None
    shared: bool
    newest: bool

    def now(self) -> tuple[int, Block]:
        return self.client.fetch(
            self.key, self.version, self.max_size, self.into, self.shared, self.newest
        )


class StoreGet(NamedTuple):
    """A fetch's step: a block of the own store (``BlockStore.get``'s arguments)."""

    store: BlockStore
    key: BlockKey
    version: int
    timeout: float
    newest: bool
    reader: Hashable | None

    def now(self) -> tuple[int, Block]:
        return self.store.get(
            self.key, self.version, self.timeout, newest=self.newest, reader=self.reader
        )


#: A fetch's steps: a generator that yields each get it needs (which may wait for the block
#: to be published) and is sent its ``(version, block)``, or has the get's error raised
#: where it yielded; it resolves its futures itself. A channel runs it (``Channel.start``).
FetchSteps = Generator[PeerGet | StoreGet, tuple, None]


def run_through(steps: FetchSteps) -> None:
    """Run a fetch's steps on this thread, waiting where they wait."""
    result, error = None, None
    while True:
        try:
            get = steps.send(result) if error is None else steps.throw(error)
        except StopIteration:
            return
        try:
            result, error = get.now(), None
        except BaseException as failure:  # the steps' to handle, where they asked
            result, error = None, failure


class Channel:
    """One thread's way to the peers: its own connections, fetch threads and landing buffers.

    The worker and a background owner each fetch through their own channel, so that an
    owner waiting for a slow partition's gradient never holds up the worker's reads. A
    fetched block stays valid (in a receive buffer, a scratch array, or a peer's shared
    memory) until the channel fetches the same source's next one.

    A fetch (``start``) runs on one of ``threads`` threads. With ``idle_waits`` it holds
    none while it waits for a peer to publish: one thread (an ``events.EventLoop``) watches
    every fetch's socket and deadline and hands it back to the pool when its answer comes.
    So a few threads serve fetches that each wait on a different peer for as long as the
    strategy makes them (a background owner's, for gradients as they come): no fetch
    queues behind another's wait.
    """

    def __init__(
        self,
        clients: dict[int, PeerClient],
        threads: int,
        name: str,
        role: str = "fetch",
        idle_waits: bool = False,
    ) -> None:
        self.clients = clients
        self.role = role
        self._loop = (
            EventLoop(name, threads, pool_name=name, loop_name=f"{name}-waits")
            if idle_waits and threads
            else None
        )
        self.pool = (
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
            if threads and self._loop is None
            else None
        )
        self.reader = object()  # who reads the own store through this channel (for its holds)
        self.aborted = False  # abort() was called: a fetch failing now says nothing of the peer
        self._receive: dict[Hashable, bytearray] = {}
        self._scratch: dict[Hashable, np.ndarray] = {}

    def start(self, steps: FetchSteps) -> None:
        """Run one fetch's ``steps`` on the channel's threads; with ``idle_waits``, the
        loop waits where they wait, else the thread."""
        if self._loop is None:
            self.pool.submit(run_through, steps)
        else:
            fetch = _IdleFetch(self._loop, steps)
            if not self._loop.submit(fetch.step):  # closing: each get fails at once
                fetch.step()

    def receive_buffer(self, landing: Hashable, nbytes: int) -> memoryview:
        """Where the blocks of ``landing`` (a source, or a source and destination) land:
        reused, replaced by a larger one when too small."""
        buffer = self._receive.get(landing)
        if buffer is None or len(buffer) < nbytes:
            buffer = self._receive[landing] = bytearray(nbytes)
        return memoryview(buffer)

    def scratch(self, landing: Hashable, length: int) -> np.ndarray:
        """Float32 room to decode the lossy blocks of ``landing`` into, reused across fetches."""
        scratch = self._scratch.get(landing)
        if scratch is None or scratch.size < length:
            scratch = self._scratch[landing] = np.empty(length, dtype=np.float32)
        return scratch

    def abort(self) -> None:
        """Wake every fetch that waits on a peer; no new connection is made."""
        self.aborted = True
        for client in self.clients.values():
            client.abort()

    def close(self) -> None:
        """Stop the fetch threads (after ``abort`` wakes any that wait) and the connections."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self._loop is not None:
            late = self._loop.close(CLOSE_TIMEOUT)
            if late:
                log.warning(
                    "%s channel: threads still running %g s after close: %s",
                    self.role,
                    CLOSE_TIMEOUT,
                    late,
                )
        for client in self.clients.values():
            client.close()


class _Once:
    """The first of several wake-ups of one wait: ``claim()`` is True once."""

    __slots__ = ("_lock", "_claimed")

    def __init__(self) -> None:
        self._lock, self._claimed = threading.Lock(), False

    def claim(self) -> bool:
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed


class _IdleFetch:
    """One fetch on a channel with idle waits: its steps run on the loop's pool, and where
    a get would wait, the loop waits for it (a socket's answer or the store's version, each
    until its deadline), holding no thread.

    A peer's get is sent, and its answer read, without the client's lock held in between:
    the channel's fetches must never share a client at once (a background owner's do not:
    one request per source at a time).
    """

    def __init__(self, loop: EventLoop, steps: FetchSteps) -> None:
        self._loop, self._steps = loop, steps

    def step(self, result: tuple | None = None, error: BaseException | None = None) -> None:
        """Give the steps their last get's ``result`` (or raise its ``error`` there), and
        start waiting for their next get."""
        try:
            get = self._steps.send(result) if error is None else self._steps.throw(error)
        except StopIteration:
            return
        if isinstance(get, PeerGet):
            self._await_answer(get)
        else:
            self._await_store(get, time.monotonic() + get.timeout)

    def _then(self, call: Callable[[], tuple]) -> None:
        """Go on with what ``call()`` returns, or the error it raises."""
        try:
            result = call()
        except BaseException as error:
            self.step(error=error)
        else:
            self.step(result)

    def _await_answer(self, get: PeerGet) -> None:
        try:
            due = get.client.request(get.key, get.version, get.shared, get.newest)
        except BaseException as error:
            self.step(error=error)
            return
        once = _Once()

        def answered() -> None:  # on a pool thread
            if once.claim():
                timer.cancel()
                self._then(functools.partial(get.client.answer, get.max_size, get.into))

        def late() -> None:
            if once.claim():
                self._loop.unregister(due.conn)
                self.step(error=due.client.give_up())

        timer = self._loop.call_at(due.deadline, late)
        if not self._loop.watch(due.conn, answered) and once.claim():  # closing
            timer.cancel()
            self.step(error=StoreClosedError("this partition's fetches are closing"))

    def _await_store(self, get: StoreGet, deadline: float) -> None:
        once = _Once()
        timer = None

        def ready() -> None:  # on the thread that put the version, or closed the store: hand over
            if once.claim():
                if timer is not None:
                    timer.cancel()
                if not self._loop.submit(functools.partial(self._await_store, get, deadline)):
                    self._await_store(get, deadline)  # the pool is closing: its get ends it

        try:
            got = get.store.get_or_notify(
                get.key, get.version, ready, newest=get.newest, reader=get.reader
            )
        except BaseException as error:
            self.step(error=error)
            return
        if not isinstance(got, Waiter):
            self.step(got)
            return

        def late() -> None:
            error = got.expire(get.timeout)
            if error is not None and once.claim():
                self.step(error=error)

        timer = self._loop.call_at(deadline, late)
