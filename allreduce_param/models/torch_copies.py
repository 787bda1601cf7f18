"""Each thread's copy of a ``TorchModel``'s module, on the device this process runs it on.

``torch.func.functional_call`` swaps a module's parameters while it runs, so every thread
(sub-batches run on threads) uses its own copy of the module; in train mode a copy's
BatchNorm updates its own running statistics, and the rows it trained on are counted, so
that the copies' buffers can be merged weighted by them. The device is chosen at the first
call, in the process that runs the module (``models.devices.choose_device``): a copy
unpickled in an executor chooses its own.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

from allreduce_param.models.devices import CudaInfo, choose_device, task_gpus
from allreduce_param.models.torch_state import require_torch
from allreduce_param.models.transfers import Staging


def _where() -> tuple:
    """``(the Spark task's resources or None, whether this is a Spark driver)``; from the
    Spark layer, imported only when a device is chosen."""
    from allreduce_param.spark.gpus import on_spark_driver, task_resources

    resources = task_resources()
    return resources, resources is None and on_spark_driver()


class ModuleCopy:
    """One thread's copy of the module (on the model's device), how many rows it has trained
    on (whose buffer updates it holds), and on a GPU its pinned host buffers."""

    __slots__ = ("module", "rows", "staging")

    def __init__(self, module: Any, staging: Staging | None) -> None:
        self.module, self.rows, self.staging = module, 0, staging


class ThreadCopies:
    """The copies of ``module`` that this process's threads run, on the device ``request``
    (``TorchModel``'s ``device``) chooses; ``size``: the flat vector's length (a GPU
    copy's pinned buffers hold it). Pickles as the module and the request alone."""

    def __init__(self, module: Any, request: str, size: int) -> None:
        self.module, self.request, self.size = module, request, size
        self._reset()

    def _reset(self) -> None:
        self._per_thread = threading.local()
        self._copies: list[ModuleCopy] = []  # every thread's, to merge their buffers
        self._lock = threading.Lock()
        #: the ``torch.device`` chosen, None until the first call in this process
        self.chosen = None

    def __getstate__(self) -> dict:
        # copies and the device stay where they were made: an executor chooses its own
        return {"module": self.module, "request": self.request, "size": self.size}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    @property
    def device(self):
        """The ``torch.device`` this process runs the module on, chosen at the first call (a
        ConfigurationError says why a GPU is unusable)."""
        if self.chosen is None:
            torch = require_torch()
            with self._lock:
                if self.chosen is None:
                    resources, driver = _where()
                    chosen = choose_device(
                        self.request, task_gpus(resources), CudaInfo.of_torch(torch), driver
                    )
                    self.chosen = torch.device(chosen)
        return self.chosen

    def own(self) -> ModuleCopy:
        """This thread's copy of the module, on the device (made at its first call)."""
        own = getattr(self._per_thread, "copy", None)
        if own is None:
            device = self.device
            module = copy.deepcopy(self.module).to(device)
            staging = Staging(require_torch(), device, self.size) if device.type == "cuda" else None
            own = self._per_thread.copy = ModuleCopy(module, staging)
            with self._lock:
                self._copies.append(own)
        return own

    def trained(self) -> list[tuple[Any, int]]:
        """``(module, rows)`` of every copy that has trained on rows."""
        with self._lock:
            return [(own.module, own.rows) for own in self._copies if own.rows]

    def clear(self) -> None:
        """Drop every copy: the threads copy the module again at their next call (after its
        buffers were set)."""
        with self._lock:
            self._per_thread, self._copies = threading.local(), []
