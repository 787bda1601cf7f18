"""Clipping by the global norm: each partition's squared norm, summed across partitions, gives
one scale for every slice."""

from __future__ import annotations

import math
import numbers

import numpy as np

from allreduce_param.errors import InputError
from allreduce_param.optim import kernels
from allreduce_param.optim.kernels import F32


def clip_scale(global_sq_norm: float, clip_norm: float | None) -> float:
    """The factor that brings the gradient's global L2 norm down to at most ``clip_norm``.

    ``min(1, clip_norm / (sqrt(global_sq_norm) + 1e-6))``, and 1.0 when ``clip_norm`` is
    None (PyTorch's ``clip_grad_norm_``). ``global_sq_norm`` is the sum over all partitions
    of ``squared_norm(gradient slice)``: one scalar allreduce. Multiply every slice by the
    result (or pass it as ``Optimizer.step(..., grad_scale=...)``). A NaN norm (a NaN in
    some gradient) gives NaN and an infinite one 0.0, as in PyTorch: non-finite gradients
    stay visible instead of being clipped into plausible numbers.
    """
    if clip_norm is None:
        return 1.0
    if isinstance(global_sq_norm, (bool, np.bool_)) or not isinstance(global_sq_norm, numbers.Real):
        raise InputError(f"global_sq_norm must be a number, got {global_sq_norm!r}")
    total = float(global_sq_norm)
    if math.isnan(total):
        return math.nan
    if total < 0.0:
        raise InputError(f"global_sq_norm is a sum of squares and must be >= 0, got {total!r}")
    scale = float(clip_norm) / (math.sqrt(total) + 1e-6)
    return scale if scale < 1.0 else 1.0


def squared_norm(x: np.ndarray) -> float:
    """``sum(x ** 2)`` of a float32 vector as a Python float, without temporaries.

    What each partition contributes to the global norm for ``clip_scale``. Accumulated per
    ``PIECE`` elements in float32 (BLAS dot) and across pieces in float64, which keeps the
    relative error near 1e-6 on any length; the trainer sums the partitions' values.
    """
    x = np.asarray(x)
    if x.dtype != F32 or x.ndim != 1:
        raise InputError(f"squared_norm expects a 1-D float32 vector, got {x.dtype} {x.shape}")
    total = 0.0
    for start in range(0, x.shape[0], kernels.PIECE):
        piece = x[start : start + kernels.PIECE]
        total += float(np.dot(piece, piece))
    return total


# ---------------------------------------------------------------- shared update pieces
# Every helper works on one piece: equal-length float32 arrays; ``tmp`` is a scratch array
# of that length. None allocates.
