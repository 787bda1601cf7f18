"""EngineWork: the ``torch.distributed`` Work an ``AllReduceProcessGroup`` call returns, over
the future the group's thread resolves when the call has run."""

from __future__ import annotations

import torch
import torch.distributed as dist


class EngineWork(dist.Work):
    """The Work of one queued call: ``wait()`` blocks until the group's thread has run it and
    raises its error, if it failed; ``get_future()`` is the future DDP's comm hooks chain on.
    (torch's ``_create_work_from_future`` would not do: its ``wait()`` swallows the error.)"""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout=None) -> bool:
        """Wait for the call (the engine's own timeout bounds it); raise its error."""
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        """The call's future: its result (the tensors), or its error."""
        return self._future

    def is_completed(self) -> bool:
        """Whether the call has run (done or failed)."""
        return self._future.done()

    def is_success(self) -> bool:
        """Whether the call has run and did not fail."""
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True
