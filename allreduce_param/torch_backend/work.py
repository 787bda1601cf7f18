"""EngineWork, the ``torch.distributed`` Work an ``AllReduceProcessGroup`` call returns, and
CallThread, the group's one thread, which runs the calls in order and resolves each Work's
future."""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class EngineWork(dist.Work):
    """The Work of one queued call: ``wait()`` blocks until the group's thread has run it and
    raises its error, if it failed; ``get_future()`` is the future DDP's comm hooks chain on.
    (torch's ``_create_work_from_future`` would not do: its ``wait()`` swallows the error.)"""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future
        self._ended = threading.Event()
        self._error: BaseException | None = None

    def finish(self, result) -> None:
        """End the call with ``result`` (what the future gives)."""
        try:
            self._future.set_result(result)
        finally:
            self._ended.set()

    def fail(self, error: BaseException) -> None:
        """End the call with ``error``: ``wait()`` raises it; the future gets a copy.

        Two objects, and ``wait()`` never goes through the future, because the future keeps
        its error in C++, out of the garbage collector's sight: an error raised in Python
        gathers the frames it passes through (the caller's, holding this Work, the group and
        its shared memory), and if the future held it, that cycle would keep them all for as
        long as the process runs.
        """
        self._error = error
        try:
            copy = type(error)(*error.args)
            copy.__dict__.update(error.__dict__)  # notes, and what an error class keeps
        except Exception:  # an error class whose arguments are not its args
            copy = RuntimeError(f"{type(error).__name__}: {error}")
        try:
            self._future.set_exception(copy)
        finally:
            self._ended.set()

    def wait(self, timeout=None) -> bool:
        """Wait for the call (the engine's own timeout bounds it); raise its error."""
        self._ended.wait()
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """The call's future: its result (the tensors), or its error."""
        return self._future

    def is_completed(self) -> bool:
        """Whether the call has run (done or failed)."""
        return self._ended.is_set()

    def is_success(self) -> bool:
        """Whether the call has run and did not fail."""
        return self._ended.is_set() and self._error is None


class CallThread:
    """One thread running the calls ``put`` queues, one at a time, in the order queued: the
    caller (DDP's backward, a training loop) goes on while a call moves. Each call's
    ``work`` ends with ``result`` once ``run()`` returns, or with its error (with a note naming the
    call, from ``note``: a format string of one ``{}``); ``done()`` runs after either.
    ``close()`` stops the thread, as does dropping the object unclosed.

    A bare queue and thread, not a ``ThreadPoolExecutor``: queuing costs the caller one put
    under one uncontended lock, no executor future or work item per call (DDP queues a call
    per gradient bucket per step, from inside backward). The thread waits on the queue, with no periodic
    wake-up, so an idle group takes no CPU from the training it runs beside.

    A call ``put`` with ``here`` runs on the caller's thread instead when nothing is queued
    or running and ``here()`` says so: a call the caller would only hand over and wait for
    (its peers already wait in it) then costs no wake-up of this thread and none of the
    caller's back. Calls stay in one order: queuing and running here take one lock."""

    def __init__(self, name: str, note: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._note = note
        self._order = threading.Lock()
        self._queued = 0  # calls put on the queue, counted by the callers (under the lock)
        self._ended = [0]  # of those, the calls the thread has finished, counted by it
        self._thread = threading.Thread(
            target=_serve, args=(self._calls, note, self._ended), name=name, daemon=True
        )
        self._thread.start()
        # a group dropped without close(): its thread ends too (it holds nothing of the group)
        weakref.finalize(self, self._calls.put, None)

    def put(
        self,
        call: str,
        run: Callable[[], None],
        work: EngineWork,
        result,
        done: Callable[[], None] | None,
        here: Callable[[], bool] | None = None,
    ) -> None:
        """Queue ``run`` after every call queued before it; or, given ``here``, run it now
        on this thread where nothing is queued or running and ``here()`` is true."""
        with self._order:
            if here is not None and self._queued == self._ended[0] and here():
                _run_call(call, run, work, result, done, self._note)
                return
            self._queued += 1
            self._calls.put((call, run, work, result, done))

    def close(self) -> None:
        """Run the calls queued so far, then stop the thread (waiting for it)."""
        self._calls.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()


def _serve(calls: queue.SimpleQueue, note: str, ended: list[int]) -> None:
    """A ``CallThread``'s loop, until it takes ``None``; ``ended[0]`` counts the calls it
    has finished. Nothing of a call is kept once it has run (its closure holds the group and
    so the engine's handle and its mappings)."""
    while (item := calls.get()) is not None:
        _run_call(*item, note)
        item = None
        ended[0] += 1


def _run_call(call: str, run, work: EngineWork, result, done, note: str) -> None:
    """Run one call and end its Work: with ``result``, or with its error (noted, via
    ``note``); then ``done()``."""
    try:
        run()
    except BaseException as error:
        if hasattr(error, "add_note"):  # Python 3.11 on
            error.add_note(note.format(call))
        # without this frame, which holds the Work while it runs
        _safely(work.fail, error.with_traceback(error.__traceback__.tb_next))
    else:
        _safely(work.finish, result)
    finally:
        if done is not None:
            _safely(done)


def _safely(finish: Callable, *args) -> None:
    """End a call's Work, or give its host memory back: an error there (of a callback
    chained on the future, which torch may raise here) is logged, never the end of the
    thread every later call waits on."""
    try:
        finish(*args)
    except Exception:
        log.exception("finishing a process group call failed")
