"""Codecs that turn a float32 block (a slice of a parameter or gradient vector) into bytes.

Every encoded block is a fixed 64-byte header followed by a payload::

    offset  size  field
         0     2  magic b"AR"
         2     1  format version (2)
         3     1  codec id: the index of the codec's name in ``CODECS`` (append only)
         4     1  flags: bit 0 = stored_raw (lz4 codecs: compression did not pay)
         5     1  block kind (the store's ``BlockKind``; 0 when not given)
         6     2  reserved, zero
         8     8  length: float32 elements the block decodes to
        16     8  payload_size: bytes after the header
        24     8  count: a float64 the caller attaches (a gradient's sample count)
        32     4  source: the partition that made the block
        36     4  destination: the partition it is for (0xFFFFFFFF: every partition)
        40     4  part: which part of its slice
        44     4  reserved, zero
        48     8  version
        56     8  checksum: xxh3_64 over bytes 0..55 and the payload (0: not yet sealed)
        64        payload

The header names its block, so a reader checks that the block it got is the one it asked
for: a protocol slip (an answer for another block or version) is an error, never data.
Encoding first marks the version field of the buffer as being rewritten, so a reader that
reads a block in place (shared memory) can tell afterwards whether it was rewritten
meanwhile (``Codec.unchanged``).

All integers are little-endian; the payload is little-endian too (the host must be one,
as every x86 and ARM machine Spark runs on is). Every block carries its checksum (xxh3,
which releases the GIL); a reader verifies it wherever the bytes crossed a socket. A block
read in place never left this host's memory, so there the version check after use stands
in for the checksum's extra pass over the bytes.

The payload is a *stream* of ``length`` encoded values (``topk``: of those it keeps),
optionally lz4-compressed:

``raw``       float32 bytes. Exact; decodes to a zero-copy view of the block.
``lz4``       the float32 stream, adaptively lz4-compressed (see below). Exact.
``bf16``      bfloat16 with round-to-nearest-even: half the bytes, relative error <= 2**-8.
``fp16``      IEEE half: half the bytes, relative error <= 2**-11, but only |x| <= 65504.
``bf16-lz4``  bfloat16 byte-shuffled (all high bytes, then all low bytes: sign and exponent
              bytes compress well even where mantissas do not), then adaptive lz4.
``int8``      a float32 scale per part (its largest magnitude / 127, rounded up), then one
              int8 per value, round to nearest even: a quarter of the bytes (4 + length),
              each value off by at most scale / 2 = max|x| / 254 (up to float32 rounding).
              For links where bytes cost more than rounding; the trainer adds error
              feedback (what was rounded off is sent with the next step's gradient). A part
              holding NaN or Inf decodes to NaN everywhere (its scale is NaN).
``topk``      gradients only: the ceil(length / 100) values of largest magnitude, as u32
              indices (increasing), then their float32 values: 8 bytes per kept value, 2 %
              of raw's bytes; the others decode to zero. Only with error feedback
              (``put_gradients(residual=)``, which the trainer passes): what is not sent
              waits in the residual for a later step; without it 99 % of each step's
              gradient would be lost. Weights need a dense codec
              (``AllReduceParameter(codec=..., gradient_codec="topk")``). A part holding NaN
              or Inf decodes to NaN at its first ceil(length / 100) places.

Adaptive lz4. The stream is cut into independent 1 MiB chunks, each compressed with
``lz4.block`` (fast mode, acceleration 1) and kept raw where it does not shrink to 90 %.
If no chunk pays, the block is stored raw (``stored_raw``; for ``lz4`` this decodes
zero-copy like ``raw``). Why chunks: one ``lz4.block.compress`` of a whole 40 MB block
spends most of its time allocating and copying full-size output buffers, even on random
data; in 1 MiB chunks lz4 skips ahead quickly on incompressible input and the allocator
recycles the chunk buffers, so no sampling probe is needed (64 KiB or 4 MiB chunks, or a
probe per chunk, were no faster). Higher acceleration buys time with ratio; 1 is kept, as
bytes on the wire are what lz4 is chosen for.
Chunks also keep temporaries small and let a block that is half zeros, half noise
compress its zero half. A chunked payload ends with a table: one u32 stored size per
chunk (equal to the chunk's raw size when the chunk is stored raw) and the u32 chunk size.

Payloads never exceed the uncompressed stream, so ``max_encoded_size`` is exact for the
uncompressed codecs and a tight bound for the lz4 ones.

Numpy transforms run over cache-sized pieces (256K elements) with preallocated
temporaries: several times faster than whole-array expressions, and no full-size
temporaries. Nothing loops over elements in Python.
"""

from __future__ import annotations

import math
import mmap
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Union

import lz4.block
import ml_dtypes
import numpy as np
import xxhash

from allreduce_param.errors import (
    CodecOverflowError,
    ConfigurationError,
    CorruptBlockError,
    UsageError,
)

__all__ = [
    "CODECS",
    "HEADER_SIZE",
    "BlockHeader",
    "Codec",
    "get_codec",
    "parse_header",
]

BytesLike = Union[bytes, bytearray, memoryview]  # noqa: UP007 - a runtime alias, fine on 3.10

CODECS: tuple[str, ...] = ("raw", "lz4", "bf16", "fp16", "bf16-lz4", "int8", "topk")

MAGIC = b"AR"
FORMAT_VERSION = 2
_HEADER = struct.Struct("<2sBBBB2sQQdIIIIQQ")
HEADER_SIZE: int = _HEADER.size  # 64: a multiple of 8, so payload views stay aligned
_CHECKED_HEADER_BYTES = HEADER_SIZE - 8  # every header byte but the checksum
_FIELD = struct.Struct("<Q")  # one 8-byte header field, read or written alone:
_PAYLOAD_SIZE_OFFSET = 16
_VERSION_OFFSET = 48
_CHECKSUM_OFFSET = _CHECKED_HEADER_BYTES
_UNSEALED = 0  # the checksum field of a block encoded without one (see Codec.seal)
_REWRITING = 0xFFFFFFFFFFFFFFFF  # the version field while a buffer is being encoded into
_RESERVED = b"\0\0"

#: Which block a header names: (kind, source, destination, part, version).
BlockIds = tuple
_FLAG_STORED_RAW = 0x01

LZ4_CHUNK_BYTES = 1 << 20  # independent lz4 chunk size (a multiple of 4)
LZ4_MAX_RATIO = 0.9  # compressed data is kept only when at most this fraction of the raw size
LZ4_ACCELERATION = 1
_PIECE = 1 << 18  # elements per cache-sized numpy piece

_U8 = np.dtype(np.uint8)
_U16 = np.dtype("<u2")
_U32 = np.dtype("<u4")
_F32 = np.dtype("<f4")
_BF16 = np.dtype(ml_dtypes.bfloat16)

_F32_ABS_MASK = 0x7FFFFFFF
_F32_INF_BITS = 0x7F800000
_F16_ABS_MASK = 0x7FFF
_F16_INF_BITS = 0x7C00
_F16_QUIET_NAN = 0x7E00
_F32_FP16_OVERFLOW_BITS = 0x477FF000  # 65520: rounds to Inf in fp16 (the tie goes to even)
_F32_FP16_NORMAL_BITS = 0x38800000  # 2**-14, the smallest normal fp16
_F32_HALF_BITS = 0x3F000000  # 0.5
_F32_TO_F16_REBIAS_AND_HALF = (((15 - 127) << 23) + 0xFFF) % (1 << 32)
# the largest int8 scale whose 127 * scale stays finite in float32: one below float32 max / 127
_INT8_LARGEST_SCALE = np.nextafter(
    np.float32(np.finfo(np.float32).max) / np.float32(127), np.float32(0)
)


@dataclass(frozen=True)
class BlockHeader:
    """The parsed header of one encoded block."""

    codec: str
    length: int
    payload_size: int
    checksum: int
    count: float = 0.0
    stored_raw: bool = False
    ids: BlockIds = (0, 0, 0, 0, 0)  # kind, source, destination, part, version

    @property
    def encoded_size(self) -> int:
        """Bytes of the whole block, header included: what a reader must receive."""
        return HEADER_SIZE + self.payload_size


def parse_header(buf: BytesLike, what: str = "block") -> BlockHeader:
    """Parse and sanity-check the first ``HEADER_SIZE`` bytes of ``buf``.

    Checks the magic, the format version, that the codec id and flags are known, and that
    ``payload_size`` is no more than ``length`` elements can take with that codec, so a
    reader can bound its receive buffer from the header alone. It does not check the
    checksum (that needs the payload: ``Codec.decode`` does). Raises ``CorruptBlockError``
    whose message starts with ``what``.
    """
    if len(buf) < HEADER_SIZE:
        raise CorruptBlockError(
            f"{what}: truncated: {len(buf)} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    (
        magic,
        version,
        codec_id,
        flags,
        kind,
        reserved,
        length,
        payload_size,
        count,
        source,
        destination,
        part,
        reserved_too,
        block_version,
        checksum,
    ) = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptBlockError(
            f"{what}: bad magic {magic!r}, expected {MAGIC!r}: not an allreduce-param block, "
            "or the stream lost its framing"
        )
    if version != FORMAT_VERSION:
        raise CorruptBlockError(
            f"{what}: block format version {version}, this build reads version {FORMAT_VERSION}: "
            "do all executors run the same allreduce-param?"
        )
    if codec_id >= len(CODECS):
        known = ", ".join(f"{i}={n}" for i, n in enumerate(CODECS))
        raise CorruptBlockError(f"{what}: unknown codec id {codec_id} (known: {known})")
    codec = _REGISTRY[CODECS[codec_id]]
    if flags & ~_FLAG_STORED_RAW:
        raise CorruptBlockError(f"{what}: unknown header flags {flags:#04x}")
    stored_raw = bool(flags & _FLAG_STORED_RAW)
    if stored_raw and not codec.compressed:
        raise CorruptBlockError(
            f"{what}: stored_raw flag set on codec {codec.name!r}, which never compresses"
        )
    if reserved != _RESERVED or reserved_too:
        raise CorruptBlockError(
            f"{what}: reserved header bytes are {reserved!r}, {reserved_too}, not zero"
        )
    limit = codec.max_encoded_size(length) - HEADER_SIZE
    if payload_size > limit:
        raise CorruptBlockError(
            f"{what}: header says {payload_size} payload bytes, more than the {limit} that "
            f"{length} elements can take with codec {codec.name!r}"
        )
    return BlockHeader(
        codec.name,
        length,
        payload_size,
        checksum,
        count,
        stored_raw,
        (kind, source, destination, part, block_version),
    )


# --------------------------------------------------------------------------- value formats
#
# A format turns float32 values into the uncompressed stream and back. ``pack`` writes the
# whole stream into a uint8 array; ``unpack`` decodes the stream bytes [pos, pos+len(piece))
# into the float32 result and may be called piece by piece, in increasing ``pos`` (lz4
# chunks). ``view`` returns a zero-copy array when the stream already is float32.


class _Format:
    itemsize: int
    prefix = 0  # bytes the stream starts with before the values (a per-block scale)
    passthrough = False  # the stream is the float32 bytes themselves
    lossy = True  # decoding may give other values than were encoded

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


def _pieces(length: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of the cache-sized pieces of ``length`` elements."""
    for start in range(0, length, _PIECE):
        yield start, min(start + _PIECE, length)


class _Workspace(threading.local):
    """One thread's reusable cache-sized temporaries: a fresh array of this size costs page
    faults each time it is allocated, which can take longer than the numpy work on it."""

    def __init__(self) -> None:
        self.magnitude = np.empty(_PIECE, _F32)
        self.mask = np.empty(_PIECE, np.bool_)


_WORKSPACE = _Workspace()


def _to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    """bfloat16 of the float32 ``values`` into ``out`` (as wide, 16-bit), rounded to nearest
    even by ml_dtypes' C cast; a NaN becomes the quiet NaN of its sign, values beyond the
    largest bfloat16 become Inf, as in every bfloat16 implementation."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and overflow are meant, not warned
        np.copyto(out.view(_BF16), values, casting="unsafe")


class _Float32(_Format):
    itemsize = 4
    passthrough = True
    lossy = False

    def pack(self, values: np.ndarray, dst: np.ndarray) -> None:
        np.copyto(dst, values.view(_U8))

    def unpack(self, pos: int, piece: BytesLike, out: np.ndarray) -> None:
        src = np.frombuffer(piece, _U8)
        out.view(_U8)[pos : pos + src.size] = src

    def view(self, stream: memoryview, length: int) -> np.ndarray:
        result = np.frombuffer(stream, _F32, length)
        result.flags.writeable = False
        return result


class _BFloat16(_Format):
    itemsize = 2

    def pack(self, values: np.ndarray, dst: np.ndarray) -> None:
        _to_bf16(values, dst.view(_U16))

    def unpack(self, pos: int, piece: BytesLike, out: np.ndarray) -> None:
        src = np.frombuffer(piece, _BF16)
        np.copyto(out[pos // 2 : pos // 2 + src.size], src, casting="unsafe")


class _Float16(_Format):
    """IEEE half precision by bit arithmetic, bit-identical to numpy's ``astype(float16)``.

    numpy's float32<->float16 casts are scalar and branchy, and far slower still when many
    values are tiny; this vectorised form is several times faster either way. NaN encodes
    as the canonical quiet NaN (sign kept); Inf stays Inf.
    """

    itemsize = 2

    def pack(self, values: np.ndarray, dst: np.ndarray) -> None:
        bits = values.view(_U32)
        dst16 = dst.view(_U16)
        magnitude, result, small = np.empty((3, min(_PIECE, values.size)), _U32)
        for start, stop in _pieces(values.size):
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
                    np.add(a.view(_F32), np.float32(0.5), out=s.view(_F32))
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
        src = np.frombuffer(piece, _U16)
        first = pos // 2
        words = out.view(_U32)
        magnitude, sign = np.empty((2, min(_PIECE, src.size)), _U32)
        for start, stop in _pieces(src.size):
            k = stop - start
            r, m, s = words[first + start : first + stop], magnitude[:k], sign[:k]
            np.copyto(m, src[start:stop])
            np.left_shift(m, 16, out=s)
            s &= 0x80000000
            m &= _F16_ABS_MASK
            # fp16 bits moved into float32 position are the value times 2**-112, exactly
            # (subnormals included); scaling back is one exact multiply
            np.left_shift(m, 13, out=r)
            value = r.view(_F32)
            np.multiply(value, np.float32(2.0**112), out=value)
            if m.max() >= _F16_INF_BITS:
                r[m >= _F16_INF_BITS] |= _F32_INF_BITS
            r |= s


class _ShuffledBFloat16(_Format):
    """bfloat16 as two planes: every element's high byte (sign, exponent), then low bytes."""

    itemsize = 2

    def pack(self, values: np.ndarray, dst: np.ndarray) -> None:
        n = values.size
        high, low = dst[:n], dst[n:]
        rounded, shifted = np.empty((2, min(_PIECE, n)), _U16)
        for start, stop in _pieces(n):
            k = stop - start
            _to_bf16(values[start:stop], rounded[:k])
            np.copyto(low[start:stop], rounded[:k], casting="unsafe")  # keeps the low byte
            np.right_shift(rounded[:k], 8, out=shifted[:k])
            np.copyto(high[start:stop], shifted[:k], casting="unsafe")

    def unpack(self, pos: int, piece: BytesLike, out: np.ndarray) -> None:
        n = out.size
        src = np.frombuffer(piece, _U8)
        words = out.view(_U32)
        cut = max(0, min(src.size, n - pos))  # src[:cut] are high bytes, src[cut:] low bytes
        for start, stop in _pieces(cut):
            dst = words[pos + start : pos + stop]
            np.copyto(dst, src[start:stop])
            dst <<= 24
        low_first = pos + cut - n  # element index of src[cut]
        tmp = np.empty(min(_PIECE, src.size - cut), _U32)
        for start, stop in _pieces(src.size - cut):
            t = tmp[: stop - start]
            np.copyto(t, src[cut + start : cut + stop])
            t <<= 16
            words[low_first + start : low_first + stop] |= t


class _ScaledInt8(_Format):
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
        scale_bytes.view(_F32)[0] = scale
        if not scale > 0:  # zeros, or NaN for a block holding NaN or Inf
            codes[:] = 0
            return
        room = _WORKSPACE.magnitude
        for start, stop in _pieces(values.size):
            # dividing (not multiplying by 1 / scale) keeps |quotient| <= 127 exactly
            quotient = np.divide(values[start:stop], scale, out=room[: stop - start])
            np.rint(quotient, out=quotient)
            np.copyto(codes[start:stop], quotient, casting="unsafe")

    @classmethod
    def scale(cls, values: np.ndarray) -> np.float32:
        """The block's scale (see the class): NaN when ``values`` hold NaN or Inf."""
        highest = lowest = np.float32(0)
        for start, stop in _pieces(values.size):  # max and min of a piece while it is in cache
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
        stream = np.frombuffer(piece, _U8)
        if stream.size == 0:
            return
        scale = stream[:4].view(_F32)[0]
        codes = stream[4:].view(np.int8)
        for start, stop in _pieces(codes.size):
            # widen, then scale while the piece is in cache: faster than one mixed-type
            # multiply, which converts through numpy's small cast buffers
            result = out[start:stop]
            np.copyto(result, codes[start:stop])
            result *= scale


class _TopK(_Format):
    """The k = ceil(length / DENSITY) values of largest magnitude (ties: any of them), as
    k u32 indices, strictly increasing, then their k float32 values; the others decode to 0.

    Choosing them takes one pass over the part, not a partition of it (many times dearer).
    A threshold is taken from a strided sample of the magnitudes: if fewer than ``rank``
    sampled values are among the k largest, all k largest exceed the sample's rank-th
    largest. How many are among them is about binomial (mean ``expected``, the sample's
    share of k), so a rank four standard deviations above the mean misleads at most about
    one part in 10**4 (unless the layout beats with the stride), for some 60 % more
    candidates than k in a part of 2**19 values; a rank for 25 % more would mislead about
    one part in 30 there, each costing a partition of the whole part. The pass keeps the
    candidates, the values above the threshold, and only they are partitioned to keep k.
    Fewer than k candidates: values equal to the threshold (zeros, mostly) take the places
    left, and if even those are too few (a misleading sample), the whole part is
    partitioned. The kept are always k largest.

    A part holding NaN or Inf is written as NaN at its first k places, so it decodes to NaN
    there and the owner's check names it, never to finite garbage.

    The stream has no fixed size per value and is never lz4-chunked: ``unpack`` always gets
    the whole stream (``pos`` 0). It refuses indices out of range or not increasing.
    """

    DENSITY = 100  # one value kept per DENSITY, rounded up
    _STRIDE = 97  # every 97th magnitude is sampled: a prime, so as not to beat with layouts
    _SIGMAS = 4  # the threshold's rank above the expected one, in standard deviations
    _MAX_LENGTH = 1 << 32  # the indices are u32

    def kept(self, length: int) -> int:
        """k: how many of ``length`` values a block keeps."""
        return -(-length // self.DENSITY)

    def stream_size(self, length: int) -> int:
        return 8 * self.kept(length)

    def pack(self, values: np.ndarray, dst: np.ndarray) -> None:
        if values.size > self._MAX_LENGTH:
            raise CodecOverflowError(
                f"topk indexes a block with u32: {values.size} values are more than it can hold "
                f"({self._MAX_LENGTH}); split the vector into smaller blocks"
            )
        k = self.kept(values.size)
        indices, kept = dst[: 4 * k].view(_U32), dst[4 * k :].view(_F32)
        threshold = self._threshold(values, k)
        candidates, magnitudes, largest = self._above(values, threshold)
        if not np.isfinite(largest):  # NaN or Inf: NaN wherever the block decodes
            indices[:] = np.arange(k)
            kept[:] = np.nan
            return
        if candidates.size >= k:
            chosen = candidates[self._select(magnitudes, k)]
        else:
            chosen = self._with_ties(values, candidates, threshold, k)
        np.copyto(indices, chosen, casting="unsafe")
        kept[:] = values[chosen]

    def _threshold(self, values: np.ndarray, k: int) -> np.float32:
        """A sampled magnitude that somewhat more than k of ``values`` exceed (see the class)."""
        sample = np.abs(values[:: self._STRIDE])
        expected = k * sample.size / values.size  # sampled values among the k largest
        rank = min(sample.size, math.ceil(expected + self._SIGMAS * math.sqrt(expected)) + 1)
        # without the zeros: np.partition slows down many times on a sample of mostly equal
        # values, such as a sparse gradient's zeros
        sample = sample[sample > 0]
        if sample.size < rank:
            return np.float32(0)
        return np.partition(sample, sample.size - rank)[sample.size - rank]

    @staticmethod
    def _above(
        values: np.ndarray, threshold: np.float32
    ) -> tuple[np.ndarray, np.ndarray, np.float32]:
        """The indices of the values whose magnitude exceeds ``threshold`` (increasing), those
        magnitudes, and the largest magnitude (NaN if any is NaN): one pass, in cache."""
        work = _WORKSPACE
        found, magnitudes = [], []
        largest = np.float32(0)
        for start, stop in _pieces(values.size):
            magnitude = np.abs(values[start:stop], out=work.magnitude[: stop - start])
            largest = np.maximum(largest, magnitude.max())  # np.maximum keeps a NaN
            hits = np.flatnonzero(np.greater(magnitude, threshold, out=work.mask[: stop - start]))
            magnitudes.append(magnitude[hits])
            hits += start
            found.append(hits)
        return np.concatenate(found), np.concatenate(magnitudes), largest

    def _with_ties(
        self, values: np.ndarray, candidates: np.ndarray, threshold: np.float32, k: int
    ) -> np.ndarray:
        """The k largest where fewer than k exceed ``threshold``: all of those, and values
        equal to it for the places left, or, if these are too few, by a partition of all."""
        need = k - candidates.size
        if threshold == 0:  # every value not above it is a zero: the first ones will do
            ties = np.setdiff1d(np.arange(k), candidates, assume_unique=True)[:need]
        else:
            ties = np.flatnonzero(np.abs(values) == threshold)[:need]
        if ties.size < need:  # a misleading sample: the threshold is above the k-th largest
            return self._select(np.abs(values), k)
        chosen = np.concatenate((candidates, ties))
        chosen.sort()
        return chosen

    @staticmethod
    def _select(magnitude: np.ndarray, k: int) -> np.ndarray:
        """The positions of k largest of ``magnitude``, increasing: a partition finds the
        k-th largest, and a mask keeps what exceeds it and the first of its equals, in
        position order, so the positions need no sort."""
        kth = np.partition(magnitude, magnitude.size - k)[magnitude.size - k]
        keep = magnitude > kth
        keep[np.flatnonzero(magnitude == kth)[: k - np.count_nonzero(keep)]] = True
        return np.flatnonzero(keep)

    def unpack(self, pos: int, piece: BytesLike, out: np.ndarray) -> None:
        k = self.kept(out.size)
        indices = np.frombuffer(piece, _U32, k)
        kept = np.frombuffer(piece, _F32, k, 4 * k)
        if (indices[1:] <= indices[:-1]).any():
            place = int(np.argmax(indices[1:] <= indices[:-1])) + 1
            raise CorruptBlockError(
                f"the topk block's indices are not increasing: index {place} is {indices[place]}, "
                f"after {indices[place - 1]}"
            )
        if k and indices[-1] >= out.size:
            raise CorruptBlockError(
                f"the topk block's indices are out of range: {indices[-1]} in a block of {out.size} values"
            )
        out[:] = 0
        out[indices] = kept


# --------------------------------------------------------------------------- adaptive lz4


def _lz4_pack(src: memoryview, block: memoryview, in_place: bool) -> tuple[int, bool]:
    """Write ``src`` (the stream) adaptively lz4-compressed as the payload of ``block``.

    Returns ``(payload_size, stored_raw)``. Each chunk goes straight to its final place:
    holding the compressed chunks until the end, to decide on the whole block first, cost
    page faults on fresh memory. A chunk is kept compressed only when it shrinks
    to 90 % and saves at least the size of the chunk table, so a chunked payload is always
    smaller than the stream; when no chunk pays, the raw chunks written so far already are
    the whole stream, which is then the payload (``stored_raw``).

    With ``in_place``, ``src`` is ``block[HEADER_SIZE:HEADER_SIZE+len(src)]`` itself.
    That is safe: chunk i is written at or before its own raw position and ends before
    chunk i+1 starts, and slice assignment between memoryviews moves like ``memmove``.
    """
    nbytes = len(src)
    n_chunks = -(-nbytes // LZ4_CHUNK_BYTES)
    sizes = np.empty(n_chunks + 1, _U32)
    table_bytes = sizes.nbytes
    pos = HEADER_SIZE
    compressed_any = False
    for i in range(n_chunks):
        start = i * LZ4_CHUNK_BYTES
        raw = src[start : start + LZ4_CHUNK_BYTES]
        packed = lz4.block.compress(
            raw, mode="fast", acceleration=LZ4_ACCELERATION, store_size=False
        )
        pays = len(packed) <= LZ4_MAX_RATIO * len(raw) and len(raw) - len(packed) >= table_bytes
        data = packed if pays else raw
        compressed_any |= pays
        if not (in_place and pos == HEADER_SIZE + start and not pays):  # else already there
            block[pos : pos + len(data)] = data
        sizes[i] = len(data)
        pos += len(data)
    if not compressed_any:
        return nbytes, True
    sizes[-1] = LZ4_CHUNK_BYTES
    block[pos : pos + table_bytes] = sizes.view(_U8)
    return pos + table_bytes - HEADER_SIZE, False


def _lz4_unpack(
    payload: memoryview, nbytes: int, sink: Callable[[int, BytesLike], None], what: str
) -> None:
    """Decode a chunked payload into a stream of ``nbytes``, handing each chunk to ``sink``."""
    if len(payload) < 4:
        raise CorruptBlockError(f"{what}: lz4 payload of {len(payload)} bytes has no chunk table")
    (chunk,) = struct.unpack_from("<I", payload, len(payload) - 4)
    if chunk == 0 or chunk % 4:
        raise CorruptBlockError(f"{what}: lz4 chunk size {chunk} in the chunk table is not valid")
    n_chunks = -(-nbytes // chunk)
    table_at = len(payload) - 4 * (n_chunks + 1)
    if table_at < 0:
        raise CorruptBlockError(
            f"{what}: lz4 payload of {len(payload)} bytes cannot hold a table of {n_chunks} chunks"
        )
    sizes = np.frombuffer(payload, _U32, n_chunks, table_at).tolist()
    if sum(sizes) != table_at:
        raise CorruptBlockError(
            f"{what}: lz4 chunk sizes add up to {sum(sizes)} bytes, the payload holds {table_at}"
        )
    pos = 0
    for i, size in enumerate(sizes):
        raw_size = min(chunk, nbytes - i * chunk)
        data = payload[pos : pos + size]
        pos += size
        if size > raw_size:
            raise CorruptBlockError(
                f"{what}: lz4 chunk {i} stores {size} bytes, more than its {raw_size} raw bytes"
            )
        if size < raw_size:
            try:
                data = lz4.block.decompress(data, uncompressed_size=raw_size)
            except lz4.block.LZ4BlockError as exc:
                raise CorruptBlockError(
                    f"{what}: lz4 chunk {i} does not decompress: {exc}"
                ) from None
            if len(data) != raw_size:
                raise CorruptBlockError(
                    f"{what}: lz4 chunk {i} decompresses to {len(data)} bytes, expected {raw_size}"
                )
        sink(i * chunk, data)


# --------------------------------------------------------------------------- codecs


def _bytes_view(data: BytesLike) -> memoryview:
    """``data`` as a flat memoryview of bytes."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _checksum(block: memoryview, payload_size: int, payload: BytesLike | None = None) -> int:
    """xxh3_64 over the header (all but the checksum field) and the payload (``payload``
    when it lies apart from the header)."""
    digest = xxhash.xxh3_64(block[:_CHECKED_HEADER_BYTES])
    digest.update(block[HEADER_SIZE : HEADER_SIZE + payload_size] if payload is None else payload)
    return digest.intdigest()


def _check_values(values: np.ndarray) -> None:
    if (
        not isinstance(values, np.ndarray)
        or values.dtype != _F32
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


class Codec:
    """One way to encode a float32 block: a value format, optionally adaptively lz4-compressed.

    Instances are stateless and shared (``get_codec``); every method is thread-safe.
    """

    def __init__(self, name: str, fmt: _Format, compressed: bool) -> None:
        self.name = name
        self.codec_id = CODECS.index(name)
        self.compressed = compressed
        self._format = fmt

    def __repr__(self) -> str:
        return f"Codec({self.name!r})"

    @property
    def lossy(self) -> bool:
        """Whether decoding may give other values than were encoded (it rounds or drops)."""
        return self._format.lossy

    @property
    def sparse(self) -> bool:
        """Whether it keeps only some values: for gradients with error feedback, never weights."""
        return isinstance(self._format, _TopK)

    def max_encoded_size(self, length: int) -> int:
        """Upper bound of ``HEADER_SIZE`` + payload for ``length`` elements.

        Exact for the uncompressed codecs. The lz4 codecs never exceed their uncompressed
        stream (they fall back to storing it raw), so the bound is the same. ``encode``
        needs this much room in ``out``.
        """
        return HEADER_SIZE + self._format.stream_size(length)

    def encode(
        self,
        values: np.ndarray,
        count: float = 0.0,
        out: bytearray | mmap.mmap | memoryview | None = None,
        ids: BlockIds = (0, 0, 0, 0, 0),
        checksum: bool = True,
    ) -> memoryview:
        """Encode ``values`` with ``count`` into ``out``, as the block ``ids`` names ((kind,
        source, destination, part, version), written into the header); return a view of
        exactly the block.

        ``out`` is grown (never shrunk) to ``max_encoded_size(len(values))`` when too small
        and reused otherwise, so a caller that keeps one bytearray per block allocates
        nothing big in steady state. Growing fails while older views of ``out`` (such as
        the view an earlier ``encode`` returned) are alive: release them first. ``out`` may
        also be a writable ``mmap`` or a writable byte ``memoryview`` (shared memory, a piece
        of it), which cannot grow: it must be large enough. ``values`` is not referenced
        after the call. ``checksum=False`` leaves the checksum to ``seal``, for a block that
        may never leave this host's memory.
        """
        _check_values(values)
        length = values.size
        out = self._room(out, self.max_encoded_size(length))
        with memoryview(out) as block:
            _FIELD.pack_into(block, _VERSION_OFFSET, _REWRITING)  # in-place readers can tell
            try:
                payload_size, stored_raw = self._encode_payload(values, out, block)
            except CodecOverflowError as exc:
                raise exc.with_traceback(None) from None  # drop frames holding views of out
            flags = _FLAG_STORED_RAW if stored_raw else 0
            kind, source, destination, part, version = ids
            _HEADER.pack_into(
                block,
                0,
                MAGIC,
                FORMAT_VERSION,
                self.codec_id,
                flags,
                kind,
                _RESERVED,
                length,
                payload_size,
                float(count),
                source,
                destination,
                part,
                0,
                version,
                0,
            )
            if checksum:
                _FIELD.pack_into(block, _CHECKSUM_OFFSET, _checksum(block, payload_size))
        return memoryview(out)[: HEADER_SIZE + payload_size]

    def encode_header(
        self,
        length: int,
        count: float = 0.0,
        out: bytearray | memoryview | None = None,
        ids: BlockIds = (0, 0, 0, 0, 0),
    ) -> memoryview:
        """The header of a block whose payload, ``length`` float32 values, lies elsewhere
        (``publishes_in_place`` codecs only): published where it lies, it is not copied.
        Written into ``out`` (grown if a bytearray) as ``encode`` would write it, unsealed:
        ``seal(header, payload)`` before it leaves this host's memory."""
        if not self.publishes_in_place:
            raise UsageError(
                f"codec {self.name!r} encodes its values: only raw blocks can be published in place"
            )
        out = self._room(out, HEADER_SIZE)
        kind, source, destination, part, version = ids
        _HEADER.pack_into(
            out,
            0,
            MAGIC,
            FORMAT_VERSION,
            self.codec_id,
            0,
            kind,
            _RESERVED,
            length,
            self._format.stream_size(length),
            float(count),
            source,
            destination,
            part,
            0,
            version,
            _UNSEALED,
        )
        return memoryview(out)[:HEADER_SIZE]

    @property
    def publishes_in_place(self) -> bool:
        """Whether a block's payload is the float32 values as they are, so that a vector can
        be published where it lies with only a header written (``encode_header``)."""
        return self._format.passthrough and not self.compressed

    @staticmethod
    def _room(
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

    @staticmethod
    def seal(block: memoryview, payload: BytesLike | None = None) -> None:
        """Write the checksum of a block ``encode`` left without one (a no-op otherwise):
        before its bytes first leave this host's memory. ``payload``: where it lies, when
        apart from the header (``block`` is then the header alone). Sealing the same block
        from several threads at once is safe; each writes the same eight bytes. Bytes that
        are not a block are left as they are, for the reader's ``decode`` to name what is
        wrong with them."""
        if len(block) < HEADER_SIZE or bytes(block[:2]) != MAGIC:
            return
        (checksum,) = _FIELD.unpack_from(block, _CHECKSUM_OFFSET)
        if checksum == _UNSEALED:
            (payload_size,) = _FIELD.unpack_from(block, _PAYLOAD_SIZE_OFFSET)
            _FIELD.pack_into(block, _CHECKSUM_OFFSET, _checksum(block, payload_size, payload))

    def _encode_payload(
        self, values: np.ndarray, out: bytearray, block: memoryview
    ) -> tuple[int, bool]:
        """Write the payload after the header; ``block`` is a memoryview of ``out``.

        Numpy views are taken of ``out`` itself, never of ``block``, so that releasing
        ``block`` cannot fail on a view that an exception's traceback still holds.
        """
        nbytes = self._format.stream_size(values.size)
        if values.size == 0:
            return 0, self.compressed
        if self.compressed and self._format.passthrough:
            # compress straight from the caller's array: no copy unless stored raw
            return _lz4_pack(memoryview(values).cast("B"), block, in_place=False)
        self._format.pack(values, np.frombuffer(out, _U8, nbytes, HEADER_SIZE))
        if self.compressed:
            return _lz4_pack(block[HEADER_SIZE : HEADER_SIZE + nbytes], block, in_place=True)
        return nbytes, False

    def decode(
        self,
        block: BytesLike,
        length: int,
        scratch: np.ndarray | None = None,
        what: str = "block",
        expect: BlockIds | None = None,
        checksum: bool = True,
        payload: BytesLike | None = None,
    ) -> tuple[BlockHeader, np.ndarray]:
        """Validate one encoded block and decode it to ``length`` float32 values.

        Checks the header (``parse_header``), that it names the block ``expect`` names (when
        given), that it was encoded with this codec, that it holds ``length`` elements, that
        ``block`` holds exactly header and payload, and the checksum; any mismatch raises
        ``CorruptBlockError`` whose message starts with ``what`` and names the failed check.
        ``checksum=False`` skips the one pass over the bytes, for a block read in place
        that never left this host's memory (its reader asks ``unchanged`` after use).

        ``raw`` blocks and stored-raw ``lz4`` blocks decode to a read-only zero-copy view of
        ``block``; the others decode into ``scratch[:length]`` (a float32 array of at least
        ``length`` elements) when given, else into a new array. Use the result before
        reusing ``block`` or ``scratch``. ``payload``: where the payload lies when apart from
        the header (a block published in place); ``block`` is then the header alone.
        """
        header, payload = self._checked(block, length, what, expect, checksum, payload)
        nbytes = self._format.stream_size(length)
        uncompressed = not self.compressed or header.stored_raw
        if uncompressed:
            direct = self._format.view(payload, length)
            if direct is not None:
                return header, direct
        result = self._result(length, scratch)
        if uncompressed:
            try:
                self._format.unpack(0, payload, result)
            except (
                CorruptBlockError
            ) as exc:  # the format's own check of its stream (topk's indices)
                raise CorruptBlockError(f"{what}: {exc}") from None
        else:
            _lz4_unpack(
                payload, nbytes, lambda pos, piece: self._format.unpack(pos, piece, result), what
            )
        return header, result

    def verify(
        self, block: BytesLike, length: int, what: str = "block", expect: BlockIds | None = None
    ) -> BlockHeader:
        """Every check ``decode`` makes, the checksum included, without decoding: for a
        block passed on as it is (a leader relaying it to its host)."""
        return self._checked(block, length, what, expect, True, None)[0]

    def _checked(
        self,
        block: BytesLike,
        length: int,
        what: str,
        expect: BlockIds | None,
        checksum: bool,
        payload: BytesLike | None,
    ) -> tuple[BlockHeader, memoryview]:
        """The header and payload of a block that passed ``decode``'s checks."""
        view = _bytes_view(block)
        header = parse_header(view, what)
        if expect is not None and tuple(header.ids) != tuple(expect):
            kind, source, destination, part, version = header.ids
            raise CorruptBlockError(
                f"{what}: its header names another block (kind {kind}, from partition {source} to "
                f"{'all' if destination == 0xFFFFFFFF else f'partition {destination}'}, part {part}, version "
                f"{version}): a protocol slip; every partition must run the same allreduce-param"
            )
        if header.codec != self.name:
            raise CorruptBlockError(
                f"{what}: encoded with codec {header.codec!r} but decoded as {self.name!r}: "
                "do all partitions use the same codec?"
            )
        if header.length != length:
            raise CorruptBlockError(
                f"{what}: expected {length} elements, header says {header.length}"
            )
        if payload is None:
            payload = view[HEADER_SIZE:]
        elif len(view) != HEADER_SIZE:
            raise CorruptBlockError(
                f"{what}: a header of {len(view)} bytes, expected {HEADER_SIZE}"
            )
        else:
            payload = _bytes_view(payload)
        held = len(payload)
        if held != header.payload_size:
            problem = "truncated" if held < header.payload_size else "extra bytes"
            raise CorruptBlockError(
                f"{what}: header says {header.payload_size} payload bytes but the block holds "
                f"{held} ({problem})"
            )
        nbytes = self._format.stream_size(length)
        if (not self.compressed or header.stored_raw) and header.payload_size != nbytes:
            raise CorruptBlockError(
                f"{what}: uncompressed payload of {header.payload_size} bytes, "
                f"{length} elements need {nbytes}"
            )
        actual = _checksum(view, header.payload_size, payload) if checksum else header.checksum
        if actual != header.checksum:
            raise CorruptBlockError(
                f"{what}: checksum mismatch (header {header.checksum:#018x}, bytes hash to "
                f"{actual:#018x}): the block was damaged in memory or on the wire"
            )
        return header, payload

    @staticmethod
    def unchanged(block: BytesLike, header: BlockHeader) -> bool:
        """Whether ``block``, decoded earlier with ``header``, still holds that very block: a
        reader of a buffer in place (shared memory) asks after using what it decoded."""
        (version,) = _FIELD.unpack_from(memoryview(block), _VERSION_OFFSET)
        return version == header.ids[4]  # encode marks it first, and a key's versions only grow

    @staticmethod
    def _result(length: int, scratch: np.ndarray | None) -> np.ndarray:
        if scratch is None:
            return np.empty(length, _F32)
        if (
            not isinstance(scratch, np.ndarray)
            or scratch.dtype != _F32
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


_REGISTRY: dict[str, Codec] = {
    "raw": Codec("raw", _Float32(), compressed=False),
    "lz4": Codec("lz4", _Float32(), compressed=True),
    "bf16": Codec("bf16", _BFloat16(), compressed=False),
    "fp16": Codec("fp16", _Float16(), compressed=False),
    "bf16-lz4": Codec("bf16-lz4", _ShuffledBFloat16(), compressed=True),
    "int8": Codec("int8", _ScaledInt8(), compressed=False),
    "topk": Codec("topk", _TopK(), compressed=False),
}


def get_codec(name: str) -> Codec:
    """The shared ``Codec`` called ``name``; ``ConfigurationError`` listing ``CODECS`` otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"unknown codec {name!r}: choose one of {', '.join(CODECS)}"
        ) from None


def codec_names(codec: str, gradient_codec: str | None = None) -> tuple[str, str]:
    """The codecs for weights and for gradients, checked: ``(codec, gradient_codec or codec)``.

    A codec that keeps only some values (``topk``) can carry gradients, whose rounding
    error feedback gives back later, but not weights; asked for weights it is refused,
    with the pair to pass instead.
    """
    if get_codec(codec).sparse:
        raise ConfigurationError(
            f"codec={codec!r} keeps only some values: it is for gradients with error feedback, "
            f"not for weights; pass codec='int8' (or 'bf16', 'raw'), gradient_codec={codec!r}"
        )
    get_codec(gradient_codec or codec)
    return codec, gradient_codec or codec
