"""``Codec``, one way to encode a block (a value format, optionally lz4-compressed, behind
the block header), and the registry of them by name: ``get_codec``, ``codec_names``, and
``parse_header``, whose checks need the codec a header names.

Instances are stateless and shared; the format each uses lives in its family's module
(``raw``, ``float16s``, ``int8``, ``topk``), the layout in ``header``, and what is done to
the frame around a payload (written, sealed, checked) in ``framing``.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np

from allreduce_param.engine.blocks.codec.buffers import check_values, room, scratch_for
from allreduce_param.engine.blocks.codec.float16s import BFloat16, Float16, ShuffledBFloat16
from allreduce_param.engine.blocks.codec.format import U8, ValueFormat
from allreduce_param.engine.blocks.codec.framing import Out, checked, framed, seal, unchanged
from allreduce_param.engine.blocks.codec.header import (
    CODECS,
    FLAG_STORED_RAW,
    FORMAT_VERSION,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    RESERVED,
    BlockHeader,
    BlockIds,
    BytesLike,
    bytes_view,
    write_header,
)
from allreduce_param.engine.blocks.codec.int8 import ScaledInt8
from allreduce_param.engine.blocks.codec.raw import Float32, lz4_pack, lz4_unpack
from allreduce_param.engine.blocks.codec.topk import TopK
from allreduce_param.errors import (
    ConfigurationError,
    CorruptBlockError,
    UsageError,
)


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
    ) = HEADER.unpack_from(buf, 0)
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
    if flags & ~FLAG_STORED_RAW:
        raise CorruptBlockError(f"{what}: unknown header flags {flags:#04x}")
    stored_raw = bool(flags & FLAG_STORED_RAW)
    if stored_raw and not codec.compressed:
        raise CorruptBlockError(
            f"{what}: stored_raw flag set on codec {codec.name!r}, which never compresses"
        )
    if reserved != RESERVED or reserved_too:
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


class Codec:
    """One way to encode a float32 block: a value format, optionally adaptively lz4-compressed.

    Instances are stateless and shared (``get_codec``); every method is thread-safe.
    """

    def __init__(self, name: str, fmt: ValueFormat, compressed: bool) -> None:
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
        return self._format.sparse

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
        check_values(values)
        return self._framed(
            values.size,
            count,
            out,
            ids,
            checksum,
            lambda target, block: self._encode_payload(values, target, block),
        )

    def _framed(
        self,
        length: int,
        count: float,
        out: Out | None,
        ids: BlockIds,
        checksum: bool,
        write: Callable[[Out, memoryview], tuple[int, bool]],
    ) -> memoryview:
        """The block ``encode`` and ``encode_stream`` make (``framing.framed``): ``write``
        writes the payload after the header."""
        max_size = self.max_encoded_size(length)
        return framed(self.codec_id, max_size, length, count, out, ids, checksum, write)

    def stream_size(self, length: int) -> int:
        """Bytes of the uncompressed stream (the value format's bytes, before any lz4) of
        ``length`` values: what ``encode_stream`` takes."""
        return self._format.stream_size(length)

    @property
    def takes_streams(self) -> bool:
        """Whether ``encode_stream`` takes a stream made elsewhere: the lossy codecs, whose
        value format can be computed where the values lie (on a GPU) and only its bytes
        brought here."""
        return self.lossy

    def encode_stream(
        self,
        stream: BytesLike,
        length: int,
        count: float = 0.0,
        out: bytearray | mmap.mmap | memoryview | None = None,
        ids: BlockIds = (0, 0, 0, 0, 0),
        checksum: bool = True,
    ) -> memoryview:
        """``encode`` for a block whose uncompressed stream (``stream_size(length)`` bytes of
        the value format, as ``encode`` would have made from the values) was made elsewhere:
        the header is written around it, the lz4 codecs compress it here. The same block as
        ``encode`` of the values it was made from; ``out``, ``ids``, ``checksum`` as there.
        Lossy codecs only (``takes_streams``): a lossless one has nothing to compute."""
        if not self.takes_streams:
            raise UsageError(
                f"codec {self.name!r} is lossless: it takes float32 values (encode), not a "
                "stream made elsewhere; only the lossy codecs (bf16, fp16, bf16-lz4, int8, "
                "topk) take streams"
            )
        view = bytes_view(stream)
        nbytes = self._format.stream_size(length)
        if len(view) != nbytes:
            raise UsageError(
                f"codec {self.name!r}: a stream of {length} values is {nbytes} bytes, got "
                f"{len(view)}"
            )

        def write_payload(_, block: memoryview) -> tuple[int, bool]:
            block[HEADER_SIZE : HEADER_SIZE + nbytes] = view
            if self.compressed and nbytes:
                return lz4_pack(block[HEADER_SIZE : HEADER_SIZE + nbytes], block, in_place=True)
            return nbytes, self.compressed

        return self._framed(length, count, out, ids, checksum, write_payload)

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
        out = room(out, HEADER_SIZE)
        write_header(out, self.codec_id, 0, length, self._format.stream_size(length), count, ids)
        return memoryview(out)[:HEADER_SIZE]

    @property
    def publishes_in_place(self) -> bool:
        """Whether a block's payload is the float32 values as they are, so that a vector can
        be published where it lies with only a header written (``encode_header``)."""
        return self._format.passthrough and not self.compressed

    #: ``framing.seal``: a block encoded without its checksum gets it
    seal = staticmethod(seal)

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
            return lz4_pack(memoryview(values).cast("B"), block, in_place=False)
        self._format.pack(values, np.frombuffer(out, U8, nbytes, HEADER_SIZE))
        if self.compressed:
            return lz4_pack(block[HEADER_SIZE : HEADER_SIZE + nbytes], block, in_place=True)
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
        result = scratch_for(length, scratch)
        if uncompressed:
            try:
                self._format.unpack(0, payload, result)
            except (
                CorruptBlockError
            ) as exc:  # the format's own check of its stream (topk's indices)
                raise CorruptBlockError(f"{what}: {exc}") from None
        else:
            lz4_unpack(
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
        view = bytes_view(block)
        header = parse_header(view, what)
        stored_raw = not self.compressed or header.stored_raw
        size = self._format.stream_size(length) if stored_raw else None
        payload = checked(view, header, self.name, size, length, what, expect, checksum, payload)
        return header, payload

    #: ``framing.unchanged``: whether a block read in place still holds what was decoded
    unchanged = staticmethod(unchanged)


_REGISTRY: dict[str, Codec] = {
    "raw": Codec("raw", Float32(), compressed=False),
    "lz4": Codec("lz4", Float32(), compressed=True),
    "bf16": Codec("bf16", BFloat16(), compressed=False),
    "fp16": Codec("fp16", Float16(), compressed=False),
    "bf16-lz4": Codec("bf16-lz4", ShuffledBFloat16(), compressed=True),
    "int8": Codec("int8", ScaledInt8(), compressed=False),
    "topk": Codec("topk", TopK(), compressed=False),
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
