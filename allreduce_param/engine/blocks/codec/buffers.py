"""The caller's arrays and buffers a codec reads and writes: checked, and grown where they may
be, so that a mistake is named at the call rather than deep in numpy."""

from __future__ import annotations

import mmap

import numpy as np

from allreduce_param.engine.blocks.codec.format import F32
from allreduce_param.errors import ConfigurationError, UsageError


def check_values(values: np.ndarray) -> None:
    """Refuse what is not a 1-D C-contiguous float32 array, saying how to pass one."""
    if (
        not isinstance(values, np.ndarray)
        or values.dtype != F32
        or values.ndim != 1
        or not values.flags.c_contiguous
    ):
        described = (
            f"dtype {values.dtype}, shape {values.shape}, "
            f"{'C-contiguous' if values.flags.c_contiguous else 'not contiguous'}"
            if isinstance(values, np.ndarray)
            else f"type {type(values).__name__}"
        )
        raise ConfigurationError(
            f"a block must be a 1-D C-contiguous float32 numpy array, got {described}: "
            "pass np.ascontiguousarray(x, dtype=np.float32).ravel()"
        )


def room(
    out: bytearray | mmap.mmap | memoryview | None, need: int
) -> bytearray | mmap.mmap | memoryview:
    """``out`` if it can take ``need`` bytes (a bytearray grown to it), or a new bytearray."""
    if out is None:
        return bytearray(need)
    if isinstance(out, (mmap.mmap, memoryview)):
        if isinstance(out, memoryview) and (
            out.readonly or out.format != "B" or not out.c_contiguous
        ):
            raise ConfigurationError("out must be a writable, contiguous memoryview of bytes")
        if len(out) < need:
            raise UsageError(
                f"the {len(out)}-byte shared buffer cannot take a block of up to {need} bytes"
            )
    elif not isinstance(out, bytearray):
        raise ConfigurationError(
            f"out must be a bytearray, an mmap or a memoryview, got {type(out).__name__}"
        )
    elif len(out) < need:
        try:
            out += bytes(need - len(out))
        except BufferError:
            raise UsageError(
                f"cannot grow the {len(out)}-byte out buffer to {need} bytes while views "
                "of it are alive: release the memoryview of the previous block first"
            ) from None
    return out


def scratch_for(length: int, scratch: np.ndarray | None) -> np.ndarray:
    """Where ``decode`` writes ``length`` values: ``scratch[:length]``, checked, or a new array."""
    if scratch is None:
        return np.empty(length, F32)
    if (
        not isinstance(scratch, np.ndarray)
        or scratch.dtype != F32
        or scratch.ndim != 1
        or not scratch.flags.c_contiguous
        or not scratch.flags.writeable
        or scratch.size < length
    ):
        raise ConfigurationError(
            f"scratch must be a writable 1-D C-contiguous float32 array of at least {length} "
            f"elements, got {getattr(scratch, 'dtype', type(scratch).__name__)} "
            f"{getattr(scratch, 'shape', '')}"
        )
    return scratch[:length]
