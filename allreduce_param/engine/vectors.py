"""What the engine and the models take as a vector, and the errors that name what was wrong."""

from __future__ import annotations

import numpy as np

from allreduce_param.errors import InputError


def float32_vector(values, size: int | None, what: str) -> np.ndarray:
    """``values`` as a contiguous float32 vector, if it is a floating-point vector of ``size``
    elements (None: any but none); ``InputError`` naming ``what`` otherwise."""
    array = np.asarray(values)
    if array.ndim != 1 or (size is not None and array.size != size) or array.size == 0:
        expected = (
            f"a 1-D vector of {size} elements" if size is not None else "a non-empty 1-D vector"
        )
        raise InputError(f"{what}: expected {expected}, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.floating):
        raise InputError(
            f"{what}: expected floating-point values, got dtype {array.dtype}; "
            "convert with .astype(np.float32)"
        )
    return np.ascontiguousarray(array, dtype=np.float32)


def writable_output(out: np.ndarray, size: int, what: str) -> np.ndarray:
    """``out``, if it is an array the engine may write ``size`` float32 values into."""
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.float32
        or out.shape != (size,)
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        described = (
            f"dtype {out.dtype}, shape {out.shape}"
            if isinstance(out, np.ndarray)
            else f"a {type(out).__name__}"
        )
        raise InputError(
            f"{what}: expected a writeable contiguous float32 array of shape ({size},), "
            f"got {described}"
        )
    return out
