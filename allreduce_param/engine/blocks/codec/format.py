"""What every value format shares: the base class and cache-sized numpy pieces.

A format turns float32 values into the uncompressed stream and back. ``pack`` writes the
whole stream into a uint8 array; ``unpack`` decodes the stream bytes [pos, pos+len(piece))
into the float32 result and may be called piece by piece, in increasing ``pos`` (lz4
chunks). ``view`` returns a zero-copy array when the stream already is float32.

Numpy transforms run over cache-sized pieces (``PIECE`` elements) with preallocated
temporaries: several times faster than whole-array expressions, and no full-size
temporaries. Nothing loops over elements in Python.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import ml_dtypes
import numpy as np

from allreduce_param.engine.blocks.codec.header import BytesLike

PIECE = 1 << 18  # elements per cache-sized numpy piece

U8 = np.dtype(np.uint8)
U16 = np.dtype("<u2")
U32 = np.dtype("<u4")
F32 = np.dtype("<f4")
BF16 = np.dtype(ml_dtypes.bfloat16)


class ValueFormat:
    """How a codec writes float32 values as its stream (see the module); one instance per
    codec, stateless, so shared by every thread."""

    itemsize: int
    prefix = 0  # bytes the stream starts with before the values (a per-block scale)
    passthrough = False  # the stream is the float32 bytes themselves
    lossy = True  # decoding may give other values than were encoded
    sparse = False  # only some values are kept: for gradients with error feedback

    def stream_size(self, length: int) -> int:
        """Bytes of the uncompressed stream of ``length`` values (none for none)."""
        return self.prefix + self.itemsize * length if length else 0

    def pack(self, values: np.ndarray, dst: np.ndarray) -> None:
        raise NotImplementedError

    def unpack(self, pos: int, piece: BytesLike, out: np.ndarray) -> None:
        raise NotImplementedError

    def view(self, stream: memoryview, length: int) -> np.ndarray | None:
        """A zero-copy read-only float32 view of the stream, for ``passthrough`` formats."""
        return None


def pieces(length: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of the cache-sized pieces of ``length`` elements."""
    for start in range(0, length, PIECE):
        yield start, min(start + PIECE, length)


class Workspace(threading.local):
    """One thread's reusable cache-sized temporaries: a fresh array of this size costs page
    faults each time it is allocated, which can take longer than the numpy work on it."""

    def __init__(self) -> None:
        self.magnitude = np.empty(PIECE, F32)
        self.mask = np.empty(PIECE, np.bool_)


WORKSPACE = Workspace()
