"""What the engine and the models take as a vector, and the errors that name what was wrong."""

from __future__ import annotations

from typing import NamedTuple

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


class SparseGradient(NamedTuple):
    """A gradient that is zero outside ``indices``: what ``put_gradients`` takes, besides a
    dense vector, to sync only the elements a step touched (a wide sparse model's first
    layer: the rows of the columns its batch holds; see ``movement/touched.py``).

    ``indices``: strictly increasing element indices into the flat vector (any integer
    dtype); ``values``: the gradient there, one float per index. Every element not listed
    is +0.0, as in a dense gradient computed into zeros; list an element whose value is
    -0.0, or any other it holds, and the sum is the dense sync's, bit for bit.
    """

    indices: np.ndarray
    values: np.ndarray


class EncodedGradient(NamedTuple):
    """A gradient whose lossy codec ran elsewhere (the GPU that computed it:
    ``models.device_codecs``): what ``put_gradients`` takes, besides a dense vector, to
    publish only the bytes made there (``encoded_puts.py``).

    ``payload``: a 1-D contiguous uint8 array of ``info.gradient_put_plan.payload_bytes``,
    every part's stream of the plan one after the other, made as ``Codec.encode`` makes
    them from the values after adding the caller's error feedback residual (which the
    caller keeps up to date).
    """

    payload: np.ndarray


def sparse_gradient(gradient: SparseGradient, size: int, what: str) -> SparseGradient:
    """``gradient`` with int64 indices and contiguous float32 values, if its indices are
    strictly increasing, in ``0..size-1``, and as many as its values; ``InputError``
    naming ``what`` and the first index at fault otherwise."""
    indices, values = np.asarray(gradient.indices), np.asarray(gradient.values)
    if indices.ndim != 1 or values.ndim != 1 or indices.size != values.size:
        raise InputError(
            f"{what}: a SparseGradient needs 1-D indices and values of one length, got shapes "
            f"{indices.shape} and {values.shape}"
        )
    if indices.size and not np.issubdtype(indices.dtype, np.integer):
        raise InputError(f"{what}: SparseGradient indices must be integers, got {indices.dtype}")
    if values.size and not np.issubdtype(values.dtype, np.floating):
        raise InputError(
            f"{what}: SparseGradient values must be floating-point, got {values.dtype}; "
            "convert with .astype(np.float32)"
        )
    indices = indices.astype(np.int64, copy=False)
    steps = np.flatnonzero(indices[1:] <= indices[:-1])
    if steps.size:
        at = int(steps[0]) + 1
        raise InputError(
            f"{what}: SparseGradient indices must be strictly increasing (each element once): "
            f"index {int(indices[at])} at {at} follows {int(indices[at - 1])}; sort them and "
            "add up the duplicates"
        )
    if indices.size and (indices[0] < 0 or indices[-1] >= size):
        bad = 0 if indices[0] < 0 else indices.size - 1
        raise InputError(
            f"{what}: SparseGradient index {int(indices[bad])} (at {bad}) is out of range: the "
            f"vector has {size} elements, so an index must be in 0..{size - 1}"
        )
    return SparseGradient(indices, np.ascontiguousarray(values, dtype=np.float32))


def byte_payload(payload, nbytes: int, what: str, why: str) -> np.ndarray:
    """``payload``, if it is a 1-D contiguous uint8 array of ``nbytes`` bytes (encoded
    streams made elsewhere); ``InputError`` naming ``what`` and ``why`` that many otherwise."""
    if (
        not isinstance(payload, np.ndarray)
        or payload.dtype != np.uint8
        or payload.ndim != 1
        or not payload.flags.c_contiguous
        or payload.size != nbytes
    ):
        described = (
            f"dtype {payload.dtype}, shape {payload.shape}"
            if isinstance(payload, np.ndarray)
            else f"type {type(payload).__name__}"
        )
        raise InputError(
            f"{what}: the payload must be a 1-D contiguous uint8 array of {nbytes} bytes "
            f"({why}), got {described}"
        )
    return payload
