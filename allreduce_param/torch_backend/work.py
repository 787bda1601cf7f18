"""EngineWork: the ``torch.distributed`` Work an ``AllReduceProcessGroup`` call returns, over
the future the group's thread resolves when the call has run."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist


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
        self._future.set_result(result)
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
        self._future.set_exception(copy)
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
