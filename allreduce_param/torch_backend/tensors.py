"""Tensors as the numpy arrays the engine's collectives take, and the results back.

A contiguous CPU tensor is viewed, not copied: the engine reads its bytes where they lie and
the result is written into it. A CUDA tensor goes through host memory: copied to the host on
the caller's thread when the collective is called (so that what the caller's stream wrote
is what is sent), into a pinned buffer where CUDA is present (``HostBuffers`` reuses them,
as pinning memory costs more than a copy), and copied back on the group's thread once the
result is there. Nothing here touches CUDA unless a tensor is on a CUDA device.

Supported dtypes: float16, bfloat16 (as ml_dtypes' bfloat16, the same bits), float32,
float64, int8, int16, int32, int64, uint8 and bool; a complex or sparse tensor, or one of
another dtype, is an ``InputError`` naming the call and the dtype.
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import torch

from allreduce_param.errors import InputError

#: What each supported torch dtype is to numpy (the engine's typed collectives).
NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}


def numpy_dtype(tensor: torch.Tensor, call: str) -> np.dtype:
    """The numpy dtype ``tensor``'s values travel as; an InputError naming ``call`` for a
    tensor the backend cannot carry."""
    if not isinstance(tensor, torch.Tensor):
        raise InputError(f"{call}: expected tensors, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise InputError(
            f"{call}: {tensor.layout} tensors are not supported by the allreduce_param "
            "backend; pass tensor.to_dense()"
        )
    dtype = NUMPY_DTYPES.get(tensor.dtype)
    if dtype is None:
        names = ", ".join(str(d).removeprefix("torch.") for d in NUMPY_DTYPES)
        raise InputError(
            f"{call}: tensors of dtype {tensor.dtype} are not supported by the allreduce_param "
            f"backend; use one of {names}"
        )
    return dtype


def common_dtype(tensors: list[torch.Tensor], call: str) -> np.dtype:
    """The one numpy dtype of ``tensors`` (all checked); an InputError if they differ."""
    if not tensors:
        raise InputError(f"{call}: expected at least one tensor, got none")
    dtypes = {numpy_dtype(tensor, call) for tensor in tensors}
    if len(dtypes) > 1:
        raise InputError(
            f"{call}: the tensors are of several dtypes ({', '.join(sorted(map(str, dtypes)))}); "
            "pass tensors of one dtype"
        )
    return dtypes.pop()


def cpu_view(tensor: torch.Tensor) -> np.ndarray | None:
    """A flat numpy view of a contiguous CPU tensor's values (None for any other tensor).
    Made with as few torch calls as will do (DDP asks for one per gradient bucket per
    step, on its backward's thread): ``numpy()`` itself, but for bfloat16, which numpy
    has not, viewed from its bytes."""
    if not tensor.is_cpu or not tensor.is_contiguous():
        return None
    if tensor.dtype == torch.bfloat16:
        return (
            tensor.detach().reshape(-1).view(torch.uint8).numpy().view(NUMPY_DTYPES[tensor.dtype])
        )
    return tensor.detach().numpy().reshape(-1)


class HostBuffers:
    """Host memory for tensors that are not contiguous CPU tensors, pinned where CUDA is
    present, reused by size: a buffer is the caller's from ``take`` until ``give_back``, so
    that two collectives in flight never share one."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of ``nbytes`` that nobody else holds."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        pin = torch.cuda.is_available()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Let ``buffer`` be taken again (keeping at most four of a size)."""
        with self._lock:
            free = self._free.setdefault(buffer.numel(), [])
            if len(free) < 4:
                free.append(buffer)


class FlatValues:
    """The values of several tensors of one dtype, flattened and concatenated, as one numpy
    array (``values``): a view of the tensor itself for one contiguous CPU tensor, else host
    memory filled on the caller's thread. ``write(result)`` puts a result of the same length
    back into the tensors; ``release()`` returns the host memory."""

    def __init__(self, tensors: list[torch.Tensor], dtype: np.dtype, buffers: HostBuffers):
        self.tensors = tensors
        self.dtype = dtype
        self._buffers = buffers
        self._host: torch.Tensor | None = None
        view = cpu_view(tensors[0]) if len(tensors) == 1 else None
        if view is not None:
            self.values = view
            return
        total = sum(tensor.numel() for tensor in tensors)
        self._host = buffers.take(total * dtype.itemsize)
        self.values = self._host.numpy().view(dtype)
        offset = 0
        for tensor in tensors:
            room = self._host[offset * dtype.itemsize : (offset + tensor.numel()) * dtype.itemsize]
            room.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            offset += tensor.numel()

    @property
    def size(self) -> int:
        """How many values, over all the tensors."""
        return self.values.size

    def write(self, result: np.ndarray) -> None:
        """Copy ``result`` (as long as ``values``) into the tensors, in order."""
        if self._host is None:
            if not np.shares_memory(result, self.values):
                np.copyto(self.values, result)
            return
        np.copyto(self.values, result)
        offset, itemsize = 0, self.dtype.itemsize
        for tensor in self.tensors:
            room = self._host[offset * itemsize : (offset + tensor.numel()) * itemsize]
            tensor.copy_(room.view(tensor.dtype).view(tensor.shape))
            offset += tensor.numel()

    def release(self) -> None:
        """Give the host memory back (after ``write``, or when the call failed)."""
        if self._host is not None:
            self._buffers.give_back(self._host)
            self._host = None


def as_tensor_values(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """``array`` (of ``like``'s numpy dtype, as many values) as a CPU tensor shaped as
    ``like``, sharing its memory."""
    return torch.from_numpy(array.view(np.uint8)).view(like.dtype).view(like.shape)
