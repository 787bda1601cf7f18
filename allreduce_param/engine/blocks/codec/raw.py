"""The exact codecs' family: ``raw`` float32 values, and the adaptive lz4 compression that
``lz4`` (of raw values) and ``bf16-lz4`` (of shuffled bfloat16) put their streams through.

The chunk layout of an lz4 payload is in the header module's docstring (the format).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import lz4.block
import numpy as np

from allreduce_param.engine.blocks.codec.format import F32, U8, U32, ValueFormat
from allreduce_param.engine.blocks.codec.header import HEADER_SIZE, BytesLike
from allreduce_param.errors import CorruptBlockError

LZ4_CHUNK_BYTES = 1 << 20  # independent lz4 chunk size (a multiple of 4)
LZ4_MAX_RATIO = 0.9  # compressed data is kept only when at most this fraction of the raw size
LZ4_ACCELERATION = 1


class Float32(ValueFormat):
    """float32 values as they are: the stream is the values' own bytes."""

    itemsize = 4
    passthrough = True
    lossy = False

    def pack(self, values: np.ndarray, dst: np.ndarray) -> None:
        np.copyto(dst, values.view(U8))

    def unpack(self, pos: int, piece: BytesLike, out: np.ndarray) -> None:
        src = np.frombuffer(piece, U8)
        out.view(U8)[pos : pos + src.size] = src

    def view(self, stream: memoryview, length: int) -> np.ndarray:
        result = np.frombuffer(stream, F32, length)
        result.flags.writeable = False
        return result


def lz4_pack(src: memoryview, block: memoryview, in_place: bool) -> tuple[int, bool]:
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
    sizes = np.empty(n_chunks + 1, U32)
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
    block[pos : pos + table_bytes] = sizes.view(U8)
    return pos + table_bytes - HEADER_SIZE, False


def lz4_unpack(
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
    sizes = np.frombuffer(payload, U32, n_chunks, table_at).tolist()
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
