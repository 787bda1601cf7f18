"""The format of an encoded block, for every codec, and its header.

Every encoded block (a float32 slice of a parameter or gradient vector, as bytes) is a
fixed 64-byte header followed by a payload::

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

import struct
from dataclasses import dataclass
from typing import Union

import xxhash

BytesLike = Union[bytes, bytearray, memoryview]  # noqa: UP007 - a runtime alias, fine on 3.10

#: The codecs' names; a header names its codec by the index here, so names are only appended.
CODECS: tuple[str, ...] = ("raw", "lz4", "bf16", "fp16", "bf16-lz4", "int8", "topk")

MAGIC = b"AR"
FORMAT_VERSION = 2
HEADER = struct.Struct("<2sBBBB2sQQdIIIIQQ")
HEADER_SIZE: int = HEADER.size  # 64: a multiple of 8, so payload views stay aligned
CHECKED_HEADER_BYTES = HEADER_SIZE - 8  # every header byte but the checksum
FIELD = struct.Struct("<Q")  # one 8-byte header field, read or written alone:
PAYLOAD_SIZE_OFFSET = 16
VERSION_OFFSET = 48
CHECKSUM_OFFSET = CHECKED_HEADER_BYTES
UNSEALED = 0  # the checksum field of a block encoded without one (see Codec.seal)
REWRITING = 0xFFFFFFFFFFFFFFFF  # the version field while a buffer is being encoded into
RESERVED = b"\0\0"

#: Which block a header names: (kind, source, destination, part, version).
BlockIds = tuple
FLAG_STORED_RAW = 0x01


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


def write_header(
    out: BytesLike,
    codec_id: int,
    flags: int,
    length: int,
    payload_size: int,
    count: float,
    ids: BlockIds,
    checksum: int = UNSEALED,
) -> None:
    """Write a block's header into the first ``HEADER_SIZE`` bytes of ``out``."""
    kind, source, destination, part, version = ids
    HEADER.pack_into(
        out,
        0,
        MAGIC,
        FORMAT_VERSION,
        codec_id,
        flags,
        kind,
        RESERVED,
        length,
        payload_size,
        float(count),
        source,
        destination,
        part,
        0,
        version,
        checksum,
    )


def bytes_view(data: BytesLike) -> memoryview:
    """``data`` as a flat memoryview of bytes."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def checksum_of(block: memoryview, payload_size: int, payload: BytesLike | None = None) -> int:
    """xxh3_64 over the header (all but the checksum field) and the payload (``payload``
    when it lies apart from the header)."""
    digest = xxhash.xxh3_64(block[:CHECKED_HEADER_BYTES])
    digest.update(block[HEADER_SIZE : HEADER_SIZE + payload_size] if payload is None else payload)
    return digest.intdigest()
