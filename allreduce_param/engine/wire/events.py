"""Many connections, few threads: one thread that waits on sockets and deadlines, and a
bounded pool that does the work they call for.

A connection waiting for its next bytes, or a call waiting for its deadline, holds no
thread here: the loop's thread selects on every watched socket at once and hands what is
due to the pool. The block server answers its peers this way (``server.AuthenticatedServer``
runs its accept loop and handshakes on the loop's thread), and so does a channel whose
fetches may wait long for a peer (``channels.Channel``, a background owner's): neither holds a
thread per peer.
"""

from __future__ import annotations

import collections
import heapq
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Timer:
    """A call ``EventLoop.call_at`` will make at a deadline, unless cancelled."""

    __slots__ = ("deadline", "call", "cancelled", "on_loop")

    def __init__(self, deadline: float, call: Callable[[], None], on_loop: bool) -> None:
        self.deadline, self.call, self.cancelled, self.on_loop = deadline, call, False, on_loop

    def cancel(self) -> None:
        """Do not make the call (it may be under way already)."""
        self.cancelled = True


class _Watched:
    """A socket watched once for its next bytes: ``on_readable`` then runs on the pool."""

    __slots__ = ("on_readable",)

    def __init__(self, on_readable: Callable[[], None]) -> None:
        self.on_readable = on_readable


class WorkPool:
    """At most ``size`` threads running the calls handed to ``submit``, in order; a thread is
    started only when every running one is busy, and each ends at ``close``.

    What a call does for one connection must not wait for another's: a bounded number of
    threads serves any number of connections only so.
    """

    def __init__(self, size: int, name: str) -> None:
        self._size, self._name = size, name
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._idle = 0  # threads waiting for a job
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._changed = threading.Condition()

    def submit(self, call: Callable[[], None]) -> bool:
        """Run ``call()`` on a pool thread soon; False (and nothing runs) once closed."""
        with self._changed:
            if self._closed:
                return False
            self._jobs.append(call)
            if len(self._jobs) > self._idle and len(self._threads) < self._size:
                thread = threading.Thread(target=self._work, daemon=True, name=self._name)
                self._threads.append(thread)
                thread.start()
            else:
                self._changed.notify()
            return True

    @property
    def threads(self) -> int:
        """How many threads the pool has started (at most its size)."""
        return len(self._threads)

    def _work(self) -> None:
        while True:
            with self._changed:
                while not self._jobs and not self._closed:
                    self._idle += 1
                    self._changed.wait()
                    self._idle -= 1
                if not self._jobs:
                    return
                call = self._jobs.popleft()
            try:
                call()
            except Exception:  # a bug in one call must not take a thread of the pool
                log.exception("a call on %s failed", self._name)

    def close(self, timeout: float) -> list[str]:
        """Take no more calls, let the threads finish those queued, and wait for each (at
        most ``timeout`` seconds each); the names of those still running."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout)
        return [thread.name for thread in threads if thread.is_alive()]


class EventLoop:
    """One thread (``loop_name``) selecting on sockets and keeping deadlines, and a pool of at
    most ``threads`` threads (``pool_name``; 0: none) for the work they call for. ``what``
    names the owner in the log. Stop it with ``stop`` and ``close``.

    Two kinds of calls: those the loop makes on its own thread (``register``, ``call_at``
    with ``on_loop``), which must return at once (accepting, a handshake's next bytes), and
    those it hands to the pool (``watch``, ``call_at``, ``submit``), which may take a while
    but must not wait for another connection. Every method may be called from any thread;
    a change of what is selected on takes effect before the loop's next wait.
    """

    def __init__(
        self,
        what: str,
        threads: int = 0,
        pool_name: str = "allreduce-pool",
        loop_name: str = "allreduce-loop",
    ) -> None:
        self._what = what
        self._pool = WorkPool(threads, pool_name) if threads else None
        self._lock = threading.Lock()
        self._changes: list[
            tuple[object, object]
        ] = []  # (socket, what to call; None: stop selecting on it)
        self._timers: list[tuple[float, int, Timer]] = []  # a heap, by deadline
        self._timer_count = 0  # a tie-breaker for the heap
        self._stopped = False
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        for end in (self._wake_read, self._wake_write):
            end.setblocking(False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, daemon=True, name=loop_name)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        """``stop`` was called: nothing more is selected on, timed or run."""
        return self._stopped

    @property
    def pool_threads(self) -> int:
        """How many threads the pool has started (0 without one)."""
        return 0 if self._pool is None else self._pool.threads

    def register(self, sock, on_ready: Callable[[], None]) -> bool:
        """Call ``on_ready()`` on the loop's thread whenever ``sock`` (anything with
        ``fileno()``) can be read without waiting (a listener: accepted), until
        ``unregister``. False once stopped."""
        return self._change(sock, on_ready)

    def watch(self, sock, on_readable: Callable[[], None]) -> bool:
        """Call ``on_readable()`` on a pool thread once ``sock`` has bytes to read, or has
        ended; once, then it is no longer watched (``unregister`` ends the watch before).
        False, and nothing is called, once stopped: the caller ends the connection."""
        return self._change(sock, _Watched(on_readable))

    def unregister(self, sock) -> None:
        """Stop selecting on ``sock`` (nothing happens if it is not): before it is closed, or
        when a watch is no longer wanted. A call already handed to the pool still runs."""
        self._change(sock, None)

    def call_at(self, deadline: float, call: Callable[[], None], on_loop: bool = False) -> Timer:
        """Call ``call()`` at ``deadline`` (``time.monotonic()``'s clock), on a pool thread or
        with ``on_loop`` on the loop's, unless the returned timer is cancelled first or the
        loop stops first."""
        timer = Timer(deadline, call, on_loop)
        with self._lock:
            if self._stopped:
                timer.cancelled = True
                return timer
            self._timer_count += 1
            heapq.heappush(self._timers, (deadline, self._timer_count, timer))
            first = self._timers[0][2] is timer
            if (
                len(self._timers) > 64 and self._timer_count % 64 == 0
            ):  # drop the cancelled now and then
                live = [entry for entry in self._timers if not entry[2].cancelled]
                if len(live) < len(self._timers) // 2:
                    heapq.heapify(live)
                    self._timers = live
        if first:
            self._wake()
        return timer

    def submit(self, call: Callable[[], None]) -> bool:
        """Run ``call()`` on a pool thread soon; False, and nothing runs, once closed."""
        return self._pool is not None and self._pool.submit(call)

    def stop(self, timeout: float) -> bool:
        """End the loop's thread (waiting at most ``timeout`` seconds): nothing more is
        selected on or timed. The pool still runs what it was handed (``close`` ends it).
        Whether the thread ended."""
        with self._lock:
            self._stopped = True
            self._changes.clear()
            self._timers.clear()
        self._wake()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, timeout: float) -> list[str]:
        """``stop``, then let the pool finish what it was handed and end its threads (at most
        ``timeout`` seconds each); the names of the threads still running."""
        late = [] if self.stop(timeout) else [self._thread.name]
        if self._pool is not None:
            late += self._pool.close(timeout)
        if not self._thread.is_alive():
            self._selector.close()
            self._wake_read.close()
            self._wake_write.close()
        return late

    def _change(self, sock, handler) -> bool:
        with self._lock:
            if self._stopped:
                return False
            self._changes.append((sock, handler))
        if threading.current_thread() is not self._thread:
            self._wake()
        return True

    def _wake(self) -> None:
        try:
            self._wake_write.send(b"x")
        except OSError:  # full (the loop is waking anyway), or closed
            pass

    def _run(self) -> None:
        try:
            while True:
                self._apply_changes()
                with self._lock:
                    if self._stopped:
                        return
                    wait = max(0.0, self._timers[0][0] - time.monotonic()) if self._timers else None
                for key, _ in self._selector.select(wait):
                    if key.data is None:
                        self._drain_wake()
                    elif isinstance(key.data, _Watched):
                        self._selector.unregister(key.fileobj)
                        self._pool.submit(key.data.on_readable)
                    else:
                        key.data()
                self._run_due_timers()
        except Exception:  # a bug here must not pass silently: nothing would be served any more
            log.exception("%s stopped its event loop", self._what)

    def _apply_changes(self) -> None:
        with self._lock:
            changes, self._changes = self._changes, []
        for sock, handler in changes:
            if handler is None:
                try:
                    self._selector.unregister(sock)
                except (KeyError, ValueError):  # not selected on (any more)
                    pass
                continue
            try:
                self._selector.register(sock, selectors.EVENT_READ, handler)
            except (ValueError, OSError) as error:  # closed meanwhile: a watcher's reader finds out
                log.debug("%s: cannot select on a socket (%s)", self._what, error)
                if isinstance(handler, _Watched):
                    self._pool.submit(handler.on_readable)
            except KeyError:  # registered twice: a bug, which must not stop the loop
                log.exception("%s: a socket was selected on twice", self._what)

    def _drain_wake(self) -> None:
        try:
            while self._wake_read.recv(4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass

    def _run_due_timers(self) -> None:
        due = []
        now = time.monotonic()
        with self._lock:
            while self._timers and self._timers[0][0] <= now:
                timer = heapq.heappop(self._timers)[2]
                if not timer.cancelled:
                    due.append(timer)
        for timer in due:
            if timer.on_loop:
                timer.call()
            elif self._pool is not None:
                self._pool.submit(timer.call)
