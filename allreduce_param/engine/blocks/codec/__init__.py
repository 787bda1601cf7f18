"""Codecs that turn a float32 block (a slice of a parameter or gradient vector) into bytes.

The block format (a 64-byte header and a payload) is specified in ``header``; ``Codec`` and
the registry of codecs by name are in ``codecs``; each codec family's value format has a
module of its own: ``raw`` (and the adaptive lz4 of ``lz4`` and ``bf16-lz4``), ``float16s``
(``bf16``, ``fp16``, ``bf16-lz4``), ``int8`` and ``topk``.
"""

from allreduce_param.engine.blocks.codec.codecs import (
    Codec,
    codec_names,
    get_codec,
    parse_header,
)
from allreduce_param.engine.blocks.codec.header import (
    CODECS,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    BlockHeader,
    BlockIds,
    BytesLike,
)
from allreduce_param.engine.blocks.codec.raw import (
    LZ4_ACCELERATION,
    LZ4_CHUNK_BYTES,
    LZ4_MAX_RATIO,
)

__all__ = [
    "CODECS",
    "HEADER_SIZE",
    "BlockHeader",
    "Codec",
    "get_codec",
    "parse_header",
    # also importable from here, as they always were
    "FORMAT_VERSION",
    "LZ4_ACCELERATION",
    "LZ4_CHUNK_BYTES",
    "LZ4_MAX_RATIO",
    "MAGIC",
    "BlockIds",
    "BytesLike",
    "codec_names",
]
