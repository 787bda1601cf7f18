"""The 16-bit float codecs' formats: ``bf16``, ``fp16``, and ``bf16-lz4``'s shuffled bfloat16."""

from __future__ import annotations

import numpy as np

from allreduce_param.engine.blocks.codec.format import (
    BF16,
    F32,
    PIECE,
    U8,
    U16,
    U32,
    ValueFormat,
    pieces,
)
from allreduce_param.engine.blocks.codec.header import BytesLike
from allreduce_param.errors import CodecOverflowError

_F32_ABS_MASK = 0x7FFFFFFF
_F32_INF_BITS = 0x7F800000
_F16_ABS_MASK = 0x7FFF
_F16_INF_BITS = 0x7C00
_F16_QUIET_NAN = 0x7E00
_F32_FP16_OVERFLOW_BITS = 0x477FF000  # 65520: rounds to Inf in fp16 (the tie goes to even)
_F32_FP16_NORMAL_BITS = 0x38800000  # 2**-14, the smallest normal fp16
_F32_HALF_BITS = 0x3F000000  # 0.5
_F32_TO_F16_REBIAS_AND_HALF = (((15 - 127) << 23) + 0xFFF) % (1 << 32)


def to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    """bfloat16 of the float32 ``values`` into ``out`` (as wide, 16-bit), rounded to nearest
    even by ml_dtypes' C cast; a NaN becomes the quiet NaN of its sign, values beyond the
    largest bfloat16 become Inf, as in every bfloat16 implementation."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and overflow are meant, not warned
        np.copyto(out.view(BF16), values, casting="unsafe")


class BFloat16(ValueFormat):
    """bfloat16, rounded to nearest even: float32's range in half the bytes."""

    itemsize = 2

    def pack(self, values: np.ndarray, dst: np.ndarray) -> None:
        to_bf16(values, dst.view(U16))

    def unpack(self, pos: int, piece: BytesLike, out: np.ndarray) -> None:
        src = np.frombuffer(piece, BF16)
        np.copyto(out[pos // 2 : pos // 2 + src.size], src, casting="unsafe")


class Float16(ValueFormat):
    """IEEE half precision by bit arithmetic, bit-identical to numpy's ``astype(float16)``.

    numpy's float32<->float16 casts are scalar and branchy, and far slower still when many
    values are tiny; this vectorised form is several times faster either way. NaN encodes
    as the canonical quiet NaN (sign kept); Inf stays Inf.
    """

    itemsize = 2

    def pack(self, values: np.ndarray, dst: np.ndarray) -> None:
        bits = values.view(U32)
        dst16 = dst.view(U16)
        magnitude, result, small = np.empty((3, min(PIECE, values.size)), U32)
        for start, stop in pieces(values.size):
            k = stop - start
            b, a, t, s = bits[start:stop], magnitude[:k], result[:k], small[:k]
            np.bitwise_and(b, _F32_ABS_MASK, out=a)
            largest = a.max()
            if largest >= _F32_FP16_OVERFLOW_BITS:
                self._check_overflow(values, start, a)
            # normal fp16 range: rebias the exponent, round the 13 dropped bits to even
            np.right_shift(a, 13, out=t)
            t &= 1
            t += _F32_TO_F16_REBIAS_AND_HALF
            t += a
            t >>= 13
            if largest >= _F32_INF_BITS:
                t[a >= _F32_INF_BITS] = _F16_INF_BITS
                t[a > _F32_INF_BITS] = _F16_QUIET_NAN
            if a.min() < _F32_FP16_NORMAL_BITS:
                # below 2**-14 (zeros, subnormals): adding 0.5 makes the FPU round to a
                # multiple of 2**-24, the fp16 subnormal step; the low bits are the result
                with np.errstate(invalid="ignore"):  # signalling NaNs; masked out below
                    np.add(a.view(F32), np.float32(0.5), out=s.view(F32))
                s -= _F32_HALF_BITS
                s ^= t  # blend: t ^= (s ^ t) & mask, mask = all ones where a is small
                a -= _F32_FP16_NORMAL_BITS  # negative (top bit set) exactly where small
                signed = a.view(np.int32)
                np.right_shift(signed, 31, out=signed)  # arithmetic shift: all ones or zero
                s &= a
                t ^= s
            np.right_shift(b, 16, out=a)
            a &= 0x8000
            t |= a
            np.copyto(dst16[start:stop], t, casting="unsafe")

    @staticmethod
    def _check_overflow(values: np.ndarray, start: int, magnitude: np.ndarray) -> None:
        """Raise for the first finite value of the piece that fp16 rounds to Inf."""
        overflow = (magnitude >= _F32_FP16_OVERFLOW_BITS) & (magnitude < _F32_INF_BITS)
        if overflow.any():
            bad = start + int(overflow.argmax())
            raise CodecOverflowError(
                f"fp16 cannot hold the value {float(values[bad])!r} at index {bad} of the block "
                "(largest finite fp16 is 65504): use codec 'bf16' (float32's range at the same "
                "size) or scale the values down"
            )

    def unpack(self, pos: int, piece: BytesLike, out: np.ndarray) -> None:
        src = np.frombuffer(piece, U16)
        first = pos // 2
        words = out.view(U32)
        magnitude, sign = np.empty((2, min(PIECE, src.size)), U32)
        for start, stop in pieces(src.size):
            k = stop - start
            r, m, s = words[first + start : first + stop], magnitude[:k], sign[:k]
            np.copyto(m, src[start:stop])
            np.left_shift(m, 16, out=s)
            s &= 0x80000000
            m &= _F16_ABS_MASK
            # fp16 bits moved into float32 position are the value times 2**-112, exactly
            # (subnormals included); scaling back is one exact multiply
            np.left_shift(m, 13, out=r)
            value = r.view(F32)
            np.multiply(value, np.float32(2.0**112), out=value)
            if m.max() >= _F16_INF_BITS:
                r[m >= _F16_INF_BITS] |= _F32_INF_BITS
            r |= s


class ShuffledBFloat16(ValueFormat):
    """bfloat16 as two planes: every element's high byte (sign, exponent), then low bytes."""

    itemsize = 2

    def pack(self, values: np.ndarray, dst: np.ndarray) -> None:
        n = values.size
        high, low = dst[:n], dst[n:]
        rounded, shifted = np.empty((2, min(PIECE, n)), U16)
        for start, stop in pieces(n):
            k = stop - start
            to_bf16(values[start:stop], rounded[:k])
            np.copyto(low[start:stop], rounded[:k], casting="unsafe")  # keeps the low byte
            np.right_shift(rounded[:k], 8, out=shifted[:k])
            np.copyto(high[start:stop], shifted[:k], casting="unsafe")

    def unpack(self, pos: int, piece: BytesLike, out: np.ndarray) -> None:
        n = out.size
        src = np.frombuffer(piece, U8)
        words = out.view(U32)
        cut = max(0, min(src.size, n - pos))  # src[:cut] are high bytes, src[cut:] low bytes
        for start, stop in pieces(cut):
            dst = words[pos + start : pos + stop]
            np.copyto(dst, src[start:stop])
            dst <<= 24
        low_first = pos + cut - n  # element index of src[cut]
        tmp = np.empty(min(PIECE, src.size - cut), U32)
        for start, stop in pieces(src.size - cut):
            t = tmp[: stop - start]
            np.copyto(t, src[cut + start : cut + stop])
            t <<= 16
            words[low_first + start : low_first + stop] |= t
