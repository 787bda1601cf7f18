"""The in-place float32 kernels the updates are written with, and the per-thread scratch
they use: ``Optimizer.step`` walks a slice in cache-sized pieces of ``PIECE`` elements."""

from __future__ import annotations

import threading

import numpy as np

F32 = np.dtype(np.float32)

# Elements per piece that ``Optimizer.step`` updates at a time (as the codecs' pieces). An
# update makes several passes over each piece (weights, gradient, one to three state arrays,
# temporaries), which then come from cache. 256K pieces were the fastest tried: much smaller
# ones pay Python's overhead per piece, whole arrays miss the cache, and plain numpy
# expressions also allocate full-size temporaries. Scratch: 4 MiB per thread.
PIECE = 1 << 18
TEMPORARIES = 4  # per-thread scratch arrays: three for the updates, one for grad_scale
_scratch = threading.local()


def workspace(length: int) -> list[np.ndarray]:
    """``TEMPORARIES`` float32 scratch arrays of ``length`` elements, this thread's own.

    Per thread because partitions may run as threads of one process (and Spark reuses
    Python workers), and an update must never share its temporaries with another one.
    """
    arrays = getattr(_scratch, "arrays", None)
    if arrays is None or arrays[0].shape[0] < length:
        arrays = [np.empty(max(length, PIECE), F32) for _ in range(TEMPORARIES)]
        _scratch.arrays = arrays
    return [a[:length] for a in arrays]


def add_weight_decay(
    w: np.ndarray, g: np.ndarray, weight_decay: float, tmp: np.ndarray
) -> np.ndarray:
    """The gradient with L2 weight decay: ``g + weight_decay * w`` in ``tmp``, or ``g``."""
    if weight_decay == 0.0:
        return g
    np.multiply(w, weight_decay, out=tmp)
    tmp += g
    return tmp


def ema(avg: np.ndarray, x: np.ndarray, beta: float, tmp: np.ndarray) -> None:
    """``avg = beta * avg + (1 - beta) * x`` in place; ``x`` may be ``tmp`` itself."""
    avg *= beta
    np.multiply(x, 1.0 - beta, out=tmp)
    avg += tmp


def momentum_update(buf: np.ndarray, x: np.ndarray, momentum: float) -> None:
    """``buf = momentum * buf + x`` in place (PyTorch's buffer, dampening 0).

    From a zero buffer the first step gives ``buf = x`` exactly, as PyTorch's clone does.
    """
    buf *= momentum
    buf += x


def descend(w: np.ndarray, direction: np.ndarray, lr: float, tmp: np.ndarray) -> None:
    """``w -= lr * direction``; ``direction`` may be ``tmp`` itself."""
    np.multiply(direction, lr, out=tmp)
    w -= tmp
