"""The ``int8`` codec's format: one float32 scale per part, then an int8 per value."""

from __future__ import annotations

import numpy as np

from allreduce_param.engine.blocks.codec.format import F32, U8, WORKSPACE, ValueFormat, pieces
from allreduce_param.engine.blocks.codec.header import BytesLike

# the largest int8 scale whose 127 * scale stays finite in float32: one below float32 max / 127
_INT8_LARGEST_SCALE = np.nextafter(
    np.float32(np.finfo(np.float32).max) / np.float32(127), np.float32(0)
)


class ScaledInt8(ValueFormat):
    """One float32 scale per block, then each value as the int8 nearest to value / scale.

    The scale is the block's largest magnitude / 127, rounded up to float32, so no
    value / scale exceeds 127 and the codes lie in [-127, 127] without a clipping pass;
    the block's extremes become -127 and +127. Rounding is to nearest, ties to even
    (``np.rint``); a value decodes to code * scale, off by at most scale / 2, which is
    largest / 254 up to float32 rounding. Rounding the scale up, rather than to nearest,
    keeps that bound where the scale is a coarse float32 subnormal (blocks whose largest
    magnitude is below 127 * 2**-126, about 1.5e-36); there the extremes' codes may fall
    short of 127. Dividing by the scale, rather than multiplying by 127 / largest, cannot
    overflow for such tiny blocks. The scale is capped below the one whose 127 * scale
    overflows, so a block holding float32's largest value still decodes to finite values.
    A block of zeros has scale 0.

    A block holding NaN or Inf has no finite scale: it is written with a NaN scale and
    zero codes, so it decodes to NaN everywhere and the owner's NaN check names it, never
    to finite garbage. (The engine refuses non-finite values before encoding unless told
    to allow them.)

    The stream has a prefix, so it is never cut into lz4 chunks: ``unpack`` always gets
    the whole stream (``pos`` 0).
    """

    itemsize = 1
    prefix = 4
    _LEVELS = 127

    def pack(self, values: np.ndarray, dst: np.ndarray) -> None:
        scale_bytes, codes = dst[:4], dst[4:].view(np.int8)
        scale = self.scale(values)
        scale_bytes.view(F32)[0] = scale
        if not scale > 0:  # zeros, or NaN for a block holding NaN or Inf
            codes[:] = 0
            return
        room = WORKSPACE.magnitude
        for start, stop in pieces(values.size):
            # dividing (not multiplying by 1 / scale) keeps |quotient| <= 127 exactly
            quotient = np.divide(values[start:stop], scale, out=room[: stop - start])
            np.rint(quotient, out=quotient)
            np.copyto(codes[start:stop], quotient, casting="unsafe")

    @classmethod
    def scale(cls, values: np.ndarray) -> np.float32:
        """The block's scale (see the class): NaN when ``values`` hold NaN or Inf."""
        highest = lowest = np.float32(0)
        for start, stop in pieces(values.size):  # max and min of a piece while it is in cache
            piece = values[start:stop]
            highest = np.maximum(highest, piece.max())  # np.maximum keeps a NaN, max() would not
            lowest = np.minimum(lowest, piece.min())
        largest = float(np.maximum(highest, -lowest))
        if not np.isfinite(largest):
            return np.float32(np.nan)
        scale = np.float32(largest / cls._LEVELS)  # to nearest: may be just below
        if float(scale) * cls._LEVELS < largest:  # exact in float64 (24-bit times 7-bit)
            scale = np.nextafter(scale, np.float32(np.inf))
        return min(scale, _INT8_LARGEST_SCALE)

    def unpack(self, pos: int, piece: BytesLike, out: np.ndarray) -> None:
        stream = np.frombuffer(piece, U8)
        if stream.size == 0:
            return
        scale = stream[:4].view(F32)[0]
        codes = stream[4:].view(np.int8)
        for start, stop in pieces(codes.size):
            # widen, then scale while the piece is in cache: faster than one mixed-type
            # multiply, which converts through numpy's small cast buffers
            result = out[start:stop]
            np.copyto(result, codes[start:stop])
            result *= scale
