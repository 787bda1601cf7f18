"""The frame around every block's payload, whatever its codec: written, sealed, checked.

A block is the 64-byte header (``header.py``) and a payload a codec wrote. Here is what
happens to that frame alone: a buffer made room in and marked as being rewritten before
its payload is written (``framed``), the checksum written later for a block that was
encoded without one (``seal``), a block's frame checked against what its reader asked
for (``checked``), and whether a block read in place still holds what was decoded
(``unchanged``). ``codecs.Codec`` supplies the payloads and the codec's sizes.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

from allreduce_param.engine.blocks.codec.buffers import room
from allreduce_param.engine.blocks.codec.header import (
    CHECKSUM_OFFSET,
    FIELD,
    FLAG_STORED_RAW,
    HEADER_SIZE,
    MAGIC,
    PAYLOAD_SIZE_OFFSET,
    REWRITING,
    UNSEALED,
    VERSION_OFFSET,
    BlockHeader,
    BlockIds,
    BytesLike,
    bytes_view,
    checksum_of,
    write_header,
)
from allreduce_param.errors import CodecOverflowError, CorruptBlockError

Out = bytearray | mmap.mmap | memoryview


def framed(
    codec_id: int,
    max_size: int,
    length: int,
    count: float,
    out: Out | None,
    ids: BlockIds,
    checksum: bool,
    write_payload: Callable[[Out, memoryview], tuple[int, bool]],
) -> memoryview:
    """A block of codec ``codec_id``: ``out`` made room in (``max_size`` bytes), marked as
    being rewritten, the payload written after the header by ``write_payload(out, block)``
    (its size, and whether it is stored raw), then the header and, with ``checksum``, the
    checksum; a view of exactly the block."""
    out = room(out, max_size)
    with memoryview(out) as block:
        FIELD.pack_into(block, VERSION_OFFSET, REWRITING)  # in-place readers can tell
        try:
            payload_size, stored_raw = write_payload(out, block)
        except CodecOverflowError as exc:
            raise exc.with_traceback(None) from None  # drop frames holding views of out
        flags = FLAG_STORED_RAW if stored_raw else 0
        write_header(block, codec_id, flags, length, payload_size, count, ids)
        if checksum:
            FIELD.pack_into(block, CHECKSUM_OFFSET, checksum_of(block, payload_size))
    return memoryview(out)[: HEADER_SIZE + payload_size]


def seal(block: memoryview, payload: BytesLike | None = None) -> None:
    """Write the checksum of a block encoded without one (a no-op otherwise): before its
    bytes first leave this host's memory. ``payload``: where it lies, when apart from the
    header (``block`` is then the header alone). Sealing the same block from several
    threads at once is safe; each writes the same eight bytes. Bytes that are not a block
    are left as they are, for the reader's ``decode`` to name what is wrong with them."""
    if len(block) < HEADER_SIZE or bytes(block[:2]) != MAGIC:
        return
    (checksum,) = FIELD.unpack_from(block, CHECKSUM_OFFSET)
    if checksum == UNSEALED:
        (payload_size,) = FIELD.unpack_from(block, PAYLOAD_SIZE_OFFSET)
        FIELD.pack_into(block, CHECKSUM_OFFSET, checksum_of(block, payload_size, payload))


def checked(
    view: memoryview,
    header: BlockHeader,
    codec: str,
    uncompressed_size: int | None,
    length: int,
    what: str,
    expect: BlockIds | None,
    checksum: bool,
    payload: BytesLike | None,
) -> memoryview:
    """The payload of block ``view`` (its parsed ``header``) once its frame passed every
    check a decode makes: that it names the block ``expect`` names (when given), was
    encoded with ``codec``, holds ``length`` elements and exactly its payload (where that
    is stored uncompressed, ``uncompressed_size`` bytes; None: it may be compressed), and,
    with ``checksum``, its checksum. ``payload``: where it lies when apart from the header.
    Raises ``CorruptBlockError`` whose message starts with ``what``."""
    if expect is not None and tuple(header.ids) != tuple(expect):
        kind, source, destination, part, version = header.ids
        raise CorruptBlockError(
            f"{what}: its header names another block (kind {kind}, from partition {source} to "
            f"{'all' if destination == 0xFFFFFFFF else f'partition {destination}'}, part {part}, version "
            f"{version}): a protocol slip; every partition must run the same allreduce-param"
        )
    if header.codec != codec:
        raise CorruptBlockError(
            f"{what}: encoded with codec {header.codec!r} but decoded as {codec!r}: "
            "do all partitions use the same codec?"
        )
    if header.length != length:
        raise CorruptBlockError(f"{what}: expected {length} elements, header says {header.length}")
    if payload is None:
        payload = view[HEADER_SIZE:]
    elif len(view) != HEADER_SIZE:
        raise CorruptBlockError(f"{what}: a header of {len(view)} bytes, expected {HEADER_SIZE}")
    else:
        payload = bytes_view(payload)
    held = len(payload)
    if held != header.payload_size:
        problem = "truncated" if held < header.payload_size else "extra bytes"
        raise CorruptBlockError(
            f"{what}: header says {header.payload_size} payload bytes but the block holds "
            f"{held} ({problem})"
        )
    if uncompressed_size is not None and header.payload_size != uncompressed_size:
        raise CorruptBlockError(
            f"{what}: uncompressed payload of {header.payload_size} bytes, "
            f"{length} elements need {uncompressed_size}"
        )
    actual = checksum_of(view, header.payload_size, payload) if checksum else header.checksum
    if actual != header.checksum:
        raise CorruptBlockError(
            f"{what}: checksum mismatch (header {header.checksum:#018x}, bytes hash to "
            f"{actual:#018x}): the block was damaged in memory or on the wire"
        )
    return payload


def unchanged(block: BytesLike, header: BlockHeader) -> bool:
    """Whether ``block``, decoded earlier with ``header``, still holds that very block: a
    reader of a buffer in place (shared memory) asks after using what it decoded."""
    (version,) = FIELD.unpack_from(memoryview(block), VERSION_OFFSET)
    return version == header.ids[4]  # encode marks it first, and a key's versions only grow
