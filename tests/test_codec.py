"""Tests of allreduce_param.engine.blocks.codec: round trips, rounding, adaptivity, corruption, buffers."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from allreduce_param.engine.blocks.codec import (
    CODECS,
    HEADER_SIZE,
    LZ4_CHUNK_BYTES,
    BlockHeader,
    Codec,
    get_codec,
    parse_header,
)
from allreduce_param.errors import (
    CodecOverflowError,
    ConfigurationError,
    CorruptBlockError,
    UsageError,
)

LENGTHS = (0, 1, 7, 1_000_003)
EXACT = ("raw", "lz4")
BF16 = ("bf16", "bf16-lz4")


def make(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """Test data of one kind: what gradients and weights look like, plus edge cases."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if kind == "zeros":
        x[:] = 0
    elif kind == "sparse":  # ReLU-like gradient: 90 % zeros
        x[rng.random(n) < 0.9] = 0
    elif kind == "large":  # large magnitudes, still inside fp16's range
        x *= 2e4
        np.clip(x, -65000, 65000, out=x)
    elif kind == "huge":  # float32 magnitudes far beyond fp16
        x *= 1e30
    elif kind == "tiny":  # fp16 subnormals and below
        x *= 1e-6
    elif kind == "nonfinite":
        x[::5] = np.nan
        x[1::7] = np.inf
        x[2::11] = -np.inf
    return x


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def reference_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 by picking the nearer neighbour in float64; ties to even.

    Deliberately unlike the codec's carry trick: both candidates are formed and compared.
    For finite inputs only.
    """
    b = bits(x)
    low = b & np.uint32(0xFFFF0000)  # truncated towards zero
    exponent = ((b >> 23) & 0xFF).astype(np.int64)
    step = np.ldexp(1.0, np.maximum(exponent, 1) - 127 - 7)  # bf16 spacing at this exponent
    low_val = np.abs(low.view(np.float32).astype(np.float64))
    distance_low = np.abs(x.astype(np.float64)) - low_val
    distance_high = low_val + step - np.abs(x.astype(np.float64))
    even = ((low >> 16) & 1) == 0
    up = (distance_high < distance_low) | ((distance_high == distance_low) & ~even)
    return ((low >> 16) + up).astype(np.uint16)


def reseal(block: bytearray) -> bytearray:
    """Recompute the checksum after a deliberate change, so later checks are reached."""
    digest = xxhash.xxh3_64(bytes(block[: HEADER_SIZE - 8]))
    digest.update(bytes(block[HEADER_SIZE:]))
    struct.pack_into("<Q", block, HEADER_SIZE - 8, digest.intdigest())
    return block


def encoded(name: str, x: np.ndarray, count: float = 0.0) -> bytearray:
    return bytearray(get_codec(name).encode(x, count=count))


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", ["normal", "zeros", "sparse", "large", "huge", "nonfinite"])
@pytest.mark.parametrize("name", EXACT)
def test_lossless_codecs_are_bit_exact(name, kind, n):
    x = make(kind, n)
    block = get_codec(name).encode(x, count=2.0)
    assert len(block) <= get_codec(name).max_encoded_size(n)
    header, y = get_codec(name).decode(bytes(block), n)
    assert header.codec == name and header.length == n and header.count == 2.0
    assert y.dtype == np.float32 and y.shape == (n,)
    assert np.array_equal(bits(y), bits(x))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", ["normal", "zeros", "sparse", "large", "huge", "tiny"])
@pytest.mark.parametrize("name", BF16)
def test_bf16_matches_round_to_nearest_even_reference(name, kind, n):
    x = make(kind, n)
    block = get_codec(name).encode(x)
    assert len(block) <= get_codec(name).max_encoded_size(n)
    _, y = get_codec(name).decode(bytes(block), n)
    assert y.shape == (n,)
    assert np.array_equal(bits(y) >> 16, reference_bf16(x))
    assert not (bits(y) & 0xFFFF).any()
    normal = np.abs(x) >= np.float32(2.0**-126)
    assert np.all(np.abs(y[normal] - x[normal]) <= 2.0**-8 * np.abs(x[normal]))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", ["normal", "zeros", "sparse", "large", "tiny", "nonfinite"])
def test_fp16_matches_numpy_and_its_error_bound(kind, n):
    x = make(kind, n)
    block = get_codec("fp16").encode(x)
    assert len(block) == HEADER_SIZE + 2 * n
    _, y = get_codec("fp16").decode(bytes(block), n)
    expected = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(np.isnan(y), np.isnan(x))
    finite_or_inf = ~np.isnan(x)
    assert np.array_equal(bits(y[finite_or_inf]), bits(expected[finite_or_inf]))
    normal = np.isfinite(x) & (np.abs(x) >= 2.0**-14)
    assert np.all(np.abs(y[normal] - x[normal]) <= 2.0**-11 * np.abs(x[normal]))
    sub = np.abs(x) < 2.0**-14
    assert np.all(np.abs(y[sub] - x[sub]) <= 2.0**-25)


def test_fp16_is_bit_identical_to_numpy_over_random_bit_patterns():
    rng = np.random.default_rng(1)
    patterns = rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32)
    x = patterns.view(np.float32)
    x = x[~np.isnan(x) & ~((np.abs(x) >= 65520) & np.isfinite(x))]
    # every fp16 value, the midpoints between neighbours, and one float32 ulp either side
    halves = np.arange(0x7C01, dtype=np.uint16).view(np.float16).astype(np.float64)
    mids = ((halves[:-1] + halves[1:]) / 2).astype(np.float32)
    edges = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf)])
    x = np.concatenate([x, edges, -edges, halves[:-1].astype(np.float32)])
    x = x[np.abs(x) < 65520]
    _, y = get_codec("fp16").decode(get_codec("fp16").encode(x), x.size)
    assert np.array_equal(bits(y), bits(x.astype(np.float16).astype(np.float32)))


def test_fp16_decode_covers_every_half_bit_pattern():
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    block = bytearray(get_codec("fp16").encode(np.zeros(65536, np.float32)))
    block[HEADER_SIZE:] = every.tobytes()
    _, y = get_codec("fp16").decode(reseal(block), 65536)
    expected = every.view(np.float16).astype(np.float32)
    assert np.array_equal(np.isnan(y), np.isnan(expected))
    keep = ~np.isnan(expected)
    assert np.array_equal(bits(y[keep]), bits(expected[keep]))


# --------------------------------------------------------------------------- bf16 rounding


@pytest.mark.parametrize("name", BF16)
def test_bf16_known_roundings(name):
    cases = {
        1 + 2.0**-8: 1.0,  # exact tie, 1.0 is even
        1 + 3 * 2.0**-8: 1 + 2.0**-6,  # exact tie, rounds up to the even neighbour
        1 + 2.0**-8 + 2.0**-20: 1 + 2.0**-7,  # just above the tie
        1 + 2.0**-8 - 2.0**-20: 1.0,  # just below it
        -(1 + 2.0**-8): -1.0,
        -(1 + 3 * 2.0**-8): -(1 + 2.0**-6),
        3.0: 3.0,
        2.0**-130: 2.0**-130,  # float32 subnormal that bf16 holds exactly
        float(np.finfo(np.float32).max): np.inf,  # beyond bf16's largest finite value
    }
    x = np.array(list(cases), dtype=np.float32)
    _, y = get_codec(name).decode(get_codec(name).encode(x), x.size)
    assert y.tolist() == list(cases.values())


@pytest.mark.parametrize("name", BF16)
def test_bf16_keeps_nan_nan_and_inf_inf(name):
    patterns = np.array(
        [
            0x7F800001,  # NaN with only the lowest payload bit: naive rounding gives Inf
            0x7F808000,  # NaN whose low half rounds up into the exponent
            0x7FFFFFFF,  # NaN that carries into the sign bit naively
            0xFFFFFFFF,  # -NaN that wraps to +0 naively
            0xFF800001,
            0x7FC00000,  # the canonical quiet NaN
            0x7F800000,  # +Inf
            0xFF800000,  # -Inf
            0x80000000,  # -0.0
        ],
        dtype=np.uint32,
    )
    x = patterns.view(np.float32)
    _, y = get_codec(name).decode(get_codec(name).encode(x), x.size)
    assert np.isnan(y[:6]).all()
    assert np.signbit(y[[3, 4]]).all() and not np.signbit(y[[0, 1, 2, 5]]).any()
    assert y[6] == np.inf and y[7] == -np.inf
    assert bits(y[8:]).tolist() == [0x80000000]


def bf16_by_carry(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float32 ``x`` by the carry formula, every input class included.

    (bits + 0x7FFF + lowest kept bit) >> 16 rounds to nearest even, carrying into the
    exponent (and to Inf past bfloat16's largest value); a NaN becomes the quiet NaN of its
    sign. A second, independent statement of what the codec's encode must give, bit for bit.
    """
    wide = bits(x).astype(np.uint64)  # no wrap-around for -NaN patterns
    result = ((wide + 0x7FFF + ((wide >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    result[nan] = np.where(np.signbit(x[nan]), 0xFFC0, 0x7FC0)
    return result


@pytest.mark.parametrize("name", BF16)
def test_bf16_encode_is_bit_identical_to_the_carry_formula_over_every_input_class(name):
    """Random bit patterns (NaNs, Infs, subnormals, normals of every exponent), exact ties
    with even and odd kept bits, subnormals, and the values around the overflow to Inf."""
    rng = np.random.default_rng(7)
    patterns = rng.integers(0, 2**32, 1_000_003, dtype=np.uint64).astype(np.uint32)
    kept = rng.integers(0, 2**16, 20_000, dtype=np.uint64).astype(np.uint32) << 16
    ties = kept | 0x8000  # exactly halfway: even kept bits stay, odd ones round up
    near_ties = np.concatenate([kept | 0x7FFF, kept | 0x8001])
    subnormals = rng.integers(1, 0x800000, 20_000, dtype=np.uint64).astype(np.uint32)
    specials = np.array(
        [
            0x7F7F7FFF,
            0x7F7F8000,
            0x7F7FFFFF,
            0x7F800000,
            0x7F800001,
            0x7FC00000,
            0x7FFFFFFF,
            0x00008000,
            0x00018000,
            0x0000FFFF,
            0x80000000,
            0x00000000,
        ],
        np.uint32,
    )
    every = np.concatenate(
        [
            patterns,
            ties,
            near_ties,
            subnormals,
            subnormals | 0x80000000,
            specials,
            specials | 0x80000000,
        ]
    )
    x = every.view(np.float32)
    block = get_codec(name).encode(x)
    _, y = get_codec(name).decode(block, x.size)
    assert np.array_equal(bits(y) >> 16, bf16_by_carry(x))
    if name == "bf16":  # the stream itself holds the same codes
        assert np.array_equal(
            np.frombuffer(block, np.uint16, x.size, HEADER_SIZE), bf16_by_carry(x)
        )


@pytest.mark.parametrize("name", BF16)
def test_bf16_decode_covers_every_bfloat16_bit_pattern(name):
    """Decoding is the code moved into float32's high half, NaN payloads included."""
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    values = (every.astype(np.uint32) << 16).view(np.float32)
    scratch = np.full(65536, -1.0, np.float32)
    with np.errstate(invalid="ignore"):
        block = get_codec(name).encode(values)
    if name == "bf16":  # NaN payloads survive only when the stream is written by hand
        block = bytearray(block)
        block[HEADER_SIZE:] = every.tobytes()
        block = reseal(block)
    _, y = get_codec(name).decode(block, 65536, scratch=scratch)
    assert np.shares_memory(y, scratch)
    expected = every.astype(np.uint32) << 16
    if name == "bf16-lz4":  # encoded through the codec: NaNs became the quiet NaN of their sign
        expected = bf16_by_carry(values).astype(np.uint32) << 16
    assert np.array_equal(bits(y), expected)


# --------------------------------------------------------------------------- fp16 overflow


def test_fp16_overflow_names_index_and_value():
    x = make("normal", 100_000)
    x[70_123] = 70_000.0
    x[80_000] = 1e9
    with pytest.raises(CodecOverflowError, match=r"index 70123") as info:
        get_codec("fp16").encode(x)
    assert "70000.0" in str(info.value) and "bf16" in str(info.value)


@pytest.mark.parametrize(
    "value, ok",
    [(65504.0, True), (65519.0, True), (65520.0, False), (-65520.0, False), (-1e30, False)],
)
def test_fp16_overflow_boundary(value, ok):
    x = np.array([1.0, value], dtype=np.float32)
    if ok:
        _, y = get_codec("fp16").decode(get_codec("fp16").encode(x), 2)
        assert y[1] == 65504.0
    else:
        with pytest.raises(CodecOverflowError, match="index 1"):
            get_codec("fp16").encode(x)


def test_fp16_passes_nan_and_inf_through():
    x = np.array([np.nan, np.inf, -np.inf, -np.nan, 1.5], dtype=np.float32)
    _, y = get_codec("fp16").decode(get_codec("fp16").encode(x), 5)
    assert np.isnan(y[0]) and np.isnan(y[3]) and y[1] == np.inf and y[2] == -np.inf
    assert y[4] == 1.5


def test_fp16_overflow_leaves_out_buffer_growable():
    out = bytearray(10)
    x = np.array([1e6], dtype=np.float32)
    with pytest.raises(CodecOverflowError):
        get_codec("fp16").encode(x, out=out)
    block = get_codec("fp16").encode(np.ones(1000, np.float32), out=out)  # grows `out`
    assert block.obj is out and len(out) == get_codec("fp16").max_encoded_size(1000)


# --------------------------------------------------------------------------- lz4 adaptivity


@pytest.mark.parametrize("name", ["lz4", "bf16-lz4"])
def test_lz4_compresses_zeros_and_sparse_data(name):
    n = 1_000_003
    zeros = get_codec(name).decode(encoded(name, make("zeros", n)), n)[0]
    sparse = get_codec(name).decode(encoded(name, make("sparse", n)), n)[0]
    assert not zeros.stored_raw and zeros.payload_size < 0.01 * 4 * n
    assert not sparse.stored_raw and sparse.payload_size < 0.3 * 4 * n


def test_lz4_stores_random_data_raw_and_decodes_zero_copy():
    n = 1_000_003
    x = make("normal", n)
    block = encoded("lz4", x)
    header, y = get_codec("lz4").decode(block, n)
    assert header.stored_raw and header.payload_size == 4 * n
    assert np.shares_memory(y, np.frombuffer(block, np.uint8))
    assert np.array_equal(bits(y), bits(x))


@pytest.mark.parametrize("name", ["lz4", "bf16-lz4"])
@pytest.mark.parametrize("n", [3_000_001, 2 * LZ4_CHUNK_BYTES + 10])
def test_lz4_mixed_block_compresses_the_compressible_chunks(name, n):
    """First half zeros, second half noise: chunks of noise are kept raw, the rest shrink."""
    x = make("normal", n)
    x[: n // 2] = 0
    block = encoded(name, x)
    header, y = get_codec(name).decode(block, n)
    stream = n * (4 if name == "lz4" else 2)
    assert not header.stored_raw
    assert header.payload_size < 0.8 * stream
    if name == "lz4":
        assert header.payload_size > 0.45 * stream  # the noise half is stored, not lost
        assert np.array_equal(bits(y), bits(x))
    else:
        assert np.array_equal(bits(y) >> 16, reference_bf16(x))


def test_bf16_lz4_is_smaller_than_bf16_on_gradient_like_data():
    x = make("normal", 1_000_003) * np.float32(1e-3)
    assert len(encoded("bf16-lz4", x)) < 0.9 * len(encoded("bf16", x))


def test_lz4_encode_copies_values():
    x = make("sparse", 100_000)
    original = x.copy()
    block = encoded("lz4", x)
    x[:] = 7.0
    _, y = get_codec("lz4").decode(block, x.size)
    assert np.array_equal(bits(y), bits(original))


# --------------------------------------------------------------------------- corruption

WHAT = "gradient block from partition 2 to 0, version 7"


def corrupt(block: bytes, match: str, length: int = 1000, name: str = "raw") -> str:
    with pytest.raises(CorruptBlockError, match=match) as info:
        get_codec(name).decode(block, length, what=WHAT)
    assert str(info.value).startswith(WHAT + ": ")
    return str(info.value)


@pytest.mark.parametrize("name", CODECS)
def test_flipped_payload_byte_fails_checksum(name):
    block = encoded(name, make("sparse", 1000))
    block[-1] ^= 0x01
    corrupt(bytes(block), "checksum mismatch", name=name)


def test_a_block_read_in_place_skips_only_the_checksum():
    """checksum=False (a block that never left shared memory) skips the pass over the bytes,
    and nothing else: a header naming another block still fails."""
    values = make("normal", 1000)
    block = encoded("raw", values)
    block[-1] ^= 0x01
    _, decoded = get_codec("raw").decode(bytes(block), 1000, what=WHAT, checksum=False)
    assert np.array_equal(decoded[:-1], values[:-1]) and decoded[-1] != values[-1]
    with pytest.raises(CorruptBlockError, match="expected 999 elements"):
        get_codec("raw").decode(bytes(block), 999, what=WHAT, checksum=False)


@pytest.mark.parametrize("name", CODECS)
def test_a_block_encoded_unsealed_needs_its_seal_to_cross_a_socket(name):
    """encode(checksum=False) leaves the checksum to seal(): unsealed, a reader that checks
    refuses it; sealed (twice is harmless), it decodes to the same values."""
    values = make("normal", 1000)
    codec = get_codec(name)
    block = codec.encode(values, out=bytearray(), checksum=False)
    corrupt(bytes(block), "checksum mismatch", name=name)
    Codec.seal(block)
    Codec.seal(block)
    assert bytes(block) == bytes(codec.encode(values, out=bytearray()))
    Codec.seal(memoryview(b"not a block"))  # left alone, for decode to name


@pytest.mark.parametrize("name", CODECS)
def test_flipped_count_fails_checksum(name):
    block = encoded(name, make("normal", 1000), count=32.0)
    block[24 + 3] ^= 0x10
    corrupt(bytes(block), "checksum mismatch", name=name)


def test_flipped_length_byte_names_both_lengths():
    block = encoded("raw", make("normal", 1000))
    block[8] ^= 0x01  # 1000 -> 1001 elements
    corrupt(bytes(block), "expected 1000 elements, header says 1001")


def test_length_that_cannot_hold_payload_is_caught_by_header_check():
    block = encoded("raw", make("normal", 1000))
    block[9] ^= 0x03  # 1000 = 0x3E8 -> 0x0E8 = 232 elements
    corrupt(bytes(block), "more than the 928")


def test_codec_id_byte():
    block = encoded("raw", make("normal", 1000))
    block[3] = CODECS.index("lz4")
    corrupt(bytes(block), "encoded with codec 'lz4' but decoded as 'raw'")
    block[3] = CODECS.index("bf16")  # a half-size codec cannot have 4000 payload bytes
    corrupt(bytes(block), "more than the 2000 that 1000 elements can take with codec 'bf16'")
    block[3] = 9
    corrupt(bytes(block), "unknown codec id 9")


def test_decode_with_the_wrong_codec():
    block = encoded("lz4", make("sparse", 1000))
    corrupt(bytes(block), "encoded with codec 'lz4' but decoded as 'bf16'", name="bf16")


def test_wrong_expected_length():
    block = encoded("bf16", make("normal", 1000))
    corrupt(bytes(block), "expected 999 elements, header says 1000", length=999, name="bf16")


@pytest.mark.parametrize("name", CODECS)
def test_truncated_and_appended_blocks(name):
    block = bytes(encoded(name, make("sparse", 1000)))
    message = corrupt(block[:-3], "truncated", name=name)
    assert "header says" in message
    corrupt(block + b"\0\0", r"extra bytes", name=name)
    corrupt(block[: HEADER_SIZE - 1], f"shorter than the {HEADER_SIZE}-byte header", name=name)
    corrupt(b"", "truncated: 0 bytes", name=name)


def test_wrong_magic_version_flags_and_reserved():
    good = encoded("raw", make("normal", 1000))
    for offset, value, match in [
        (0, ord("X"), "bad magic"),
        (2, 9, "format version 9"),
        (4, 0x80, "unknown header flags"),
        (4, 0x01, "stored_raw flag set on codec 'raw'"),
        (6, 1, "reserved header bytes"),
    ]:
        block = bytearray(good)
        block[offset] = value
        corrupt(bytes(block), match)


def test_parse_header_bounds_payload_size_by_length():
    block = encoded("bf16", make("normal", 1000))
    struct.pack_into("<Q", block, 16, 2001)
    with pytest.raises(CorruptBlockError, match="2001 payload bytes, more than the 2000"):
        parse_header(block, what=WHAT)
    block += b"\0"
    corrupt(bytes(reseal(block)), "more than the 2000", name="bf16")


def test_uncompressed_payload_of_wrong_size():
    block = encoded("lz4", make("normal", 1000))  # stored raw: 4000 bytes
    struct.pack_into("<Q", block, 16, 3996)
    corrupt(bytes(reseal(block[:-4])), "uncompressed payload of 3996 bytes", name="lz4")


@pytest.mark.parametrize("name", ["lz4", "bf16-lz4"])
def test_damaged_lz4_chunks_with_a_valid_checksum(name):
    good = encoded(name, make("sparse", 300_000))
    assert not parse_header(good).stored_raw
    table_end = len(good) - 4
    block = bytearray(good)  # chunk table no longer adds up
    struct.pack_into("<I", block, table_end - 4, 5)
    corrupt(bytes(reseal(block)), "chunk sizes add up", length=300_000, name=name)
    block = bytearray(good)  # chunk size of zero
    struct.pack_into("<I", block, table_end, 0)
    corrupt(bytes(reseal(block)), "chunk size 0", length=300_000, name=name)
    block = bytearray(good)  # garbage inside compressed data
    block[HEADER_SIZE : HEADER_SIZE + 64] = b"\xff" * 64
    corrupt(bytes(reseal(block)), "lz4 chunk 0", length=300_000, name=name)


# --------------------------------------------------------------------------- buffers


@pytest.mark.parametrize("name", CODECS)
def test_encode_reuses_out_without_reallocating(name):
    codec = get_codec(name)
    n = 100_000
    out = bytearray(codec.max_encoded_size(n) + 123)
    size, ident = len(out), id(out)
    for seed in range(3):
        x = make("sparse", n, seed)
        block = codec.encode(x, count=float(seed), out=out)
        assert block.obj is out and id(out) == ident and len(out) == size
        header, y = codec.decode(block, n)
        assert header.count == float(seed)
        if name in EXACT:
            assert np.array_equal(bits(y), bits(x))
        del y
        block.release()


def test_encode_grows_small_out_and_refuses_while_a_view_is_alive():
    out = bytearray(8)
    x = make("normal", 1000)
    block = get_codec("raw").encode(x, out=out)
    assert block.obj is out and len(out) == get_codec("raw").max_encoded_size(1000)
    with pytest.raises(UsageError, match="release the memoryview"):
        get_codec("raw").encode(make("normal", 2000), out=out)
    block.release()
    block = get_codec("raw").encode(make("normal", 2000), out=out)
    assert block.obj is out and len(block) == HEADER_SIZE + 8000


def test_raw_decode_is_a_read_only_zero_copy_view():
    x = make("normal", 1000)
    block = encoded("raw", x)
    _, y = get_codec("raw").decode(block, 1000)
    assert np.shares_memory(y, np.frombuffer(block, np.uint8))
    assert not y.flags.writeable
    with pytest.raises(ValueError):
        y[0] = 1.0


def test_decode_from_a_slice_of_a_larger_receive_buffer():
    x = make("normal", 1000)
    block = encoded("raw", x)
    buffer = bytearray(3) + block + bytearray(5)  # unaligned, with trailing bytes
    view = memoryview(buffer)[3 : 3 + len(block)]
    _, y = get_codec("raw").decode(view, 1000)
    assert np.shares_memory(y, np.frombuffer(buffer, np.uint8))
    assert np.array_equal(bits(y), bits(x))


@pytest.mark.parametrize("name", ["bf16", "fp16", "bf16-lz4", "lz4"])
def test_decode_into_scratch(name):
    x = make("sparse", 1000)
    scratch = np.full(1500, -1.0, dtype=np.float32)
    _, y = get_codec(name).decode(encoded(name, x), 1000, scratch=scratch)
    assert y.shape == (1000,) and np.shares_memory(y, scratch)
    assert np.all(scratch[1000:] == -1.0)
    assert np.allclose(y, x, rtol=2.0**-8, atol=0)


@pytest.mark.parametrize(
    "scratch",
    [np.empty(999, np.float32), np.empty(1000, np.float64), np.empty((10, 100), np.float32)],
)
def test_bad_scratch_is_a_configuration_error(scratch):
    block = encoded("bf16", make("normal", 1000))
    with pytest.raises(ConfigurationError, match="scratch must be"):
        get_codec("bf16").decode(block, 1000, scratch=scratch)


@pytest.mark.parametrize(
    "values, match",
    [
        (np.zeros(10, np.float64), "dtype float64"),
        (np.zeros((2, 5), np.float32), r"shape \(2, 5\)"),
        (np.zeros(20, np.float32)[::2], "not contiguous"),
        ([1.0, 2.0], "type list"),
    ],
)
def test_encode_rejects_values_that_are_not_flat_float32(values, match):
    with pytest.raises(ConfigurationError, match=match):
        get_codec("raw").encode(values)


def test_count_round_trips_and_defaults_to_zero():
    block = encoded("bf16-lz4", make("sparse", 1000), count=12345.5)
    assert parse_header(block).count == 12345.5
    assert get_codec("bf16-lz4").decode(block, 1000)[0].count == 12345.5
    assert parse_header(encoded("raw", make("normal", 3))).count == 0.0


def test_header_fields():
    block = encoded("fp16", make("normal", 1000), count=4.0)
    header = parse_header(block)
    assert isinstance(header, BlockHeader)
    assert (header.codec, header.length, header.payload_size, header.count) == (
        "fp16",
        1000,
        2000,
        4.0,
    )
    assert header.encoded_size == len(block) == HEADER_SIZE + 2000
    assert not header.stored_raw
    with pytest.raises(AttributeError):
        header.length = 3  # frozen


def test_get_codec():
    assert [get_codec(name).name for name in CODECS] == list(CODECS)
    with pytest.raises(ConfigurationError, match="raw, lz4, bf16, fp16, bf16-lz4, int8"):
        get_codec("zstd")


@pytest.mark.parametrize("name", CODECS)
def test_max_encoded_size(name):
    codec = get_codec(name)
    per, prefix = (4, 0) if name in EXACT else (1, 4) if name == "int8" else (2, 0)
    if name == "topk":  # 8 bytes for each of the ceil(1000 / 100) kept
        per, prefix = 0, 8 * 10
    assert codec.max_encoded_size(0) == HEADER_SIZE
    assert codec.max_encoded_size(1000) == HEADER_SIZE + prefix + per * 1000
    for kind in ("normal", "zeros", "nonfinite"):
        assert len(codec.encode(make(kind, 5000))) <= codec.max_encoded_size(5000)


def test_codecs_are_safe_to_share_between_threads():
    """The parameter fetches and encodes blocks on a thread pool with one shared codec."""
    from concurrent.futures import ThreadPoolExecutor

    def round_trip(seed: int) -> bool:
        name = CODECS[seed % len(CODECS)]
        x = make("sparse" if seed % 2 else "normal", 300_001, seed)
        out = bytearray()
        scratch = np.empty(300_001, np.float32)
        for _ in range(3):
            block = get_codec(name).encode(x, count=float(seed), out=out)
            header, y = get_codec(name).decode(block, x.size, scratch=scratch)
            expected = reference_bf16(x) if name in BF16 else None
            ok = header.count == seed and (
                np.array_equal(bits(y) >> 16, expected)
                if expected is not None
                else np.abs(y - x).max() <= np.abs(x).max() / 254 * (1 + 1e-5)
                if name == "int8"
                else np.array_equal(y, topk_reference(x))
                if name == "topk"
                else np.allclose(y, x, rtol=2.0**-11, atol=2.0**-24)
            )
            del y
            block.release()
            if not ok:
                return False
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(round_trip, range(12)))


def test_a_header_names_its_block_and_a_read_of_another_block_is_refused():
    codec = get_codec("raw")
    values = make("normal", 100)
    block = codec.encode(values, count=3.0, ids=(2, 1, 0, 4, 9))
    header, decoded = codec.decode(block, 100, expect=(2, 1, 0, 4, 9))
    assert header.ids == (2, 1, 0, 4, 9) and np.array_equal(decoded, values)
    with pytest.raises(
        CorruptBlockError,
        match=r"gradient v8: its header names another block \(kind 2, from "
        r"partition 1 to partition 0, part 4, version 9\): a protocol slip",
    ):
        codec.decode(block, 100, what="gradient v8", expect=(2, 1, 0, 4, 8))


def test_a_buffer_read_in_place_tells_whether_it_was_rewritten():
    codec = get_codec("raw")
    out = bytearray()
    block = codec.encode(make("normal", 100), out=out, ids=(1, 0, 0xFFFFFFFF, 0, 5))
    header, _ = codec.decode(block, 100)
    assert codec.unchanged(out, header)
    del block
    # the owner's next version
    codec.encode(make("normal", 100), out=out, ids=(1, 0, 0xFFFFFFFF, 0, 6))
    assert not codec.unchanged(out, header)
    again, _ = codec.decode(memoryview(out)[: HEADER_SIZE + 400], 100)
    rewriting = bytearray(out)
    struct.pack_into("<Q", rewriting, 48, 0xFFFFFFFFFFFFFFFF)  # an encode that has begun
    assert codec.unchanged(out, again) and not codec.unchanged(rewriting, again)


# ---- int8: a scale per block ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["normal", "sparse", "zeros"])
@pytest.mark.parametrize("n", [1, 7, 1000, 300_001])
def test_int8_is_off_by_at_most_half_a_step(kind, n):
    x = make(kind, n)
    header, y = get_codec("int8").decode(get_codec("int8").encode(x), n)
    step = np.abs(x).max() / 127
    assert header.codec == "int8" and header.payload_size == 4 + n
    assert np.abs(y - x).max() <= step / 2 * (1 + 1e-5)
    if step:
        assert np.abs(y).max() == pytest.approx(np.abs(x).max(), rel=1e-6)  # the largest is exact


def test_int8_codes_span_minus_to_plus_127_and_ties_go_to_even():
    x = np.array([-254.0, 254.0, 1.0, 3.0, -1.0, 0.0], np.float32)  # a step of 2: 1 and 3 are ties
    block = get_codec("int8").encode(x)
    codes = np.frombuffer(block, np.int8, 6, HEADER_SIZE + 4)
    assert codes.tolist() == [-127, 127, 0, 2, 0, 0]
    assert np.frombuffer(block, np.float32, 1, HEADER_SIZE)[0] == 2.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_int8_block_with_nan_or_inf_decodes_to_nan_everywhere(bad):
    x = np.array([1.0, bad, 2.0, 0.0], np.float32)
    _, y = get_codec("int8").decode(get_codec("int8").encode(x), 4)
    assert np.isnan(y).all()


def test_int8_is_lossy_and_the_exact_codecs_are_not():
    assert {name: get_codec(name).lossy for name in CODECS} == {
        "raw": False,
        "lz4": False,
        "bf16": True,
        "fp16": True,
        "bf16-lz4": True,
        "int8": True,
        "topk": True,
    }
    assert [name for name in CODECS if get_codec(name).sparse] == ["topk"]
    assert [name for name in CODECS if get_codec(name).publishes_in_place] == ["raw"]


def test_a_header_without_its_payload_is_refused_and_raw_alone_publishes_in_place():
    raw = get_codec("raw")
    values = make("normal", 100)
    header = raw.encode_header(100, count=3.0, ids=(2, 0, 1, 0, 7))
    Codec.seal(header, values)
    got, y = raw.decode(header, 100, expect=(2, 0, 1, 0, 7), payload=values)
    assert got.count == 3.0 and np.array_equal(y, values)
    with pytest.raises(CorruptBlockError, match="truncated"):
        raw.decode(header, 100, payload=values[:99])
    with pytest.raises(CorruptBlockError, match="checksum mismatch"):
        raw.decode(header, 100, payload=values * 2)
    with pytest.raises(UsageError, match="only raw blocks can be published in place"):
        get_codec("lz4").encode_header(100)


def test_int8_truncated_block_is_refused():
    block = get_codec("int8").encode(make("normal", 100))
    with pytest.raises(
        CorruptBlockError,
        match=r"header says 104 payload bytes but the block holds 103 \(truncated\)",
    ):
        get_codec("int8").decode(block[:-1], 100)


INT8_MAGNITUDES = [1e-45, 1e-42, 1e-40, 1e-38, 1e-37, 1e-30, 1e-3, 1.0, 1e3, 1e30, 3e38]


def int8_parts(block: bytes | bytearray | memoryview, n: int) -> tuple[np.float32, np.ndarray]:
    """The scale and the codes of an int8 block."""
    return (
        np.frombuffer(block, np.float32, 1, HEADER_SIZE)[0],
        np.frombuffer(block, np.int8, n, HEADER_SIZE + 4),
    )


@pytest.mark.parametrize("magnitude", INT8_MAGNITUDES)
# none a multiple of 8; 262_145 spans two pieces
@pytest.mark.parametrize("n", [1, 13, 1001, 262_145])
def test_int8_bound_holds_at_every_magnitude(magnitude, n):
    """Off by at most largest / 254 (plus float32 rounding) from float32 subnormals, where the
    scale is coarse, up to float32's largest values. The extremes are the codes -127 and 127
    wherever the scale is a normal float32 (it is rounded up: a subnormal one can be far above
    largest / 127, and the extremes' codes then fall short of 127 to keep the bound)."""
    rng = np.random.default_rng(n)
    x = (rng.uniform(-1, 1, n) * magnitude).astype(np.float32)
    x[rng.integers(n)] = -np.float32(magnitude)
    largest = float(np.abs(x).max())
    block = get_codec("int8").encode(x)
    scale, codes = int8_parts(block, n)
    _, y = get_codec("int8").decode(block, n)
    # float32 slack: the quotient and the decoding product are each rounded (2**-24 of up to
    # largest each), a subnormal product by up to 2**-150
    assert np.abs(y.astype(np.float64) - x).max() <= largest / 254 + largest * 2.0**-22 + 2.0**-149
    assert codes.min() >= -127 and codes.max() <= 127
    if scale >= np.finfo(np.float32).tiny:
        extremes = x[np.abs(x) == largest]
        assert codes[np.abs(x) == largest].tolist() == [127 if v > 0 else -127 for v in extremes]
    # rounded up
    assert float(scale) * 127 >= largest > float(np.nextafter(scale, np.float32(0))) * 127


def test_int8_block_holding_float32_largest_value_decodes_finite():
    top = np.finfo(np.float32).max
    x = np.array([top, -top, 1e38, 0.0], np.float32)
    block = get_codec("int8").encode(x)
    scale, codes = int8_parts(block, 4)
    _, y = get_codec("int8").decode(block, 4)
    with np.errstate(over="ignore"):  # the next scale up would overflow: this one is the cap
        assert np.isfinite(y).all() and np.isinf(
            np.float32(127) * np.nextafter(scale, np.float32(np.inf))
        )
    assert codes.tolist()[:2] == [127, -127]
    assert np.abs(y.astype(np.float64) - x).max() <= float(top) / 254 * (1 + 1e-5)


@pytest.mark.parametrize("value", [-3.5, 1e-30, 1e20, 0.0, -0.0])
def test_int8_single_value(value):
    x = np.array([value], np.float32)
    block = get_codec("int8").encode(x)
    scale, codes = int8_parts(block, 1)
    _, y = get_codec("int8").decode(block, 1)
    assert len(block) == HEADER_SIZE + 5
    if value == 0:
        assert scale == 0 and codes.tolist() == [0] and y.tolist() == [0.0]
    else:
        assert codes.tolist() == [127 if value > 0 else -127]
        assert y[0] == pytest.approx(value, rel=1e-6)


def test_int8_block_of_zeros_has_scale_zero_and_decodes_to_zeros():
    x = np.zeros(1001, np.float32)
    x[::3] = -0.0
    block = get_codec("int8").encode(x)
    scale, codes = int8_parts(block, 1001)
    _, y = get_codec("int8").decode(block, 1001)
    assert scale == 0 and not codes.any() and not y.any()


@pytest.mark.parametrize("where", [0, 262_143, 262_144, -1])  # first and last of each piece
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_int8_nan_or_inf_anywhere_in_a_long_block_makes_a_nan_scale(where, bad):
    x = make("normal", 300_001)
    x[where] = bad
    block = get_codec("int8").encode(x)
    scale, codes = int8_parts(block, x.size)
    _, y = get_codec("int8").decode(block, x.size, scratch=np.empty(x.size, np.float32))
    assert np.isnan(scale) and not codes.any() and np.isnan(y).all()


def test_int8_residual_of_an_unsealed_block_read_unchecked():
    """Error feedback: the engine encodes without a checksum and decodes it back unchecked to
    learn what was rounded off; the residual is what the bound allows, and decoding writes
    into the caller's scratch."""
    x = make("sparse", 100_001)
    codec = get_codec("int8")
    assert codec.lossy
    block = codec.encode(x, out=bytearray(), checksum=False)
    scratch = np.full(100_010, 7.0, np.float32)
    _, y = codec.decode(block, x.size, scratch=scratch, checksum=False)
    residual = x - y
    assert np.shares_memory(y, scratch) and (scratch[x.size :] == 7.0).all()
    assert np.abs(residual).max() <= np.abs(x).max() / 254 * (1 + 1e-5)
    # unsealed: not for a socket
    corrupt(bytes(block), "checksum mismatch", length=x.size, name="int8")


def test_int8_codec_id_is_appended_and_round_trips_through_the_header():
    assert CODECS[:5] == ("raw", "lz4", "bf16", "fp16", "bf16-lz4")  # ids are append-only
    block = encoded("int8", make("normal", 100), count=3.0)
    assert block[3] == CODECS.index("int8") == 5
    header = parse_header(block)
    assert (header.codec, header.length, header.payload_size, header.count, header.stored_raw) == (
        "int8",
        100,
        104,
        3.0,
        False,
    )
    assert get_codec("int8").max_encoded_size(100) == header.encoded_size == len(block)


def test_int8_malformed_blocks_name_what_is_wrong():
    good = encoded("int8", make("normal", 100))
    corrupt(bytes(good), "encoded with codec 'int8' but decoded as 'bf16'", length=100, name="bf16")
    fp16 = encoded("fp16", make("normal", 100))  # 200 payload bytes cannot be 100 int8 values
    fp16[3] = CODECS.index("int8")
    corrupt(
        bytes(reseal(fp16)),
        "200 payload bytes, more than the 104 that 100 elements can take with codec 'int8'",
        length=100,
        name="int8",
    )
    short = bytearray(good[:-1])  # a consistent header, one value missing
    struct.pack_into("<Q", short, 16, 103)
    corrupt(
        bytes(reseal(short)),
        "uncompressed payload of 103 bytes, 100 elements need 104",
        length=100,
        name="int8",
    )
    corrupt(
        bytes(good[: HEADER_SIZE + 4]),
        r"header says 104 payload bytes but the block holds 4 \(truncated\)",
        length=100,
        name="int8",
    )
    flipped = bytearray(good)
    flipped[HEADER_SIZE] ^= 0x40  # the scale
    corrupt(bytes(flipped), "checksum mismatch", length=100, name="int8")
    corrupt(bytes(good), "expected 99 elements, header says 100", length=99, name="int8")


# ---- topk: the 1 % of largest magnitude, for gradients with error feedback -------------

# ties at the edge of the k largest: "zeros" (all tie), "ties" (seven levels: the edge's
# level holds thousands), "rounded" (a few values per level among the candidates)
TOPK_KINDS = ["normal", "sparse", "zeros", "ties", "rounded", "huge", "tiny"]


def topk_data(kind: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "ties":
        return rng.integers(-3, 4, n).astype(np.float32)
    if kind == "rounded":
        return np.round(rng.standard_normal(n) * 100).astype(np.float32)
    return make(kind, n, seed)


def topk_parts(block: bytes | bytearray | memoryview, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The indices and the values of a topk block of n values."""
    k = -(-n // 100)
    return (
        np.frombuffer(block, np.uint32, k, HEADER_SIZE),
        np.frombuffer(block, np.float32, k, HEADER_SIZE + 4 * k),
    )


def topk_reference(x: np.ndarray) -> np.ndarray:
    """What topk must decode to: the ceil(n / 100) values of largest magnitude (by a full
    argpartition, so ties may pick others: callers use data without ties at the edge), zeros
    elsewhere."""
    k = -(-x.size // 100)
    keep = np.argpartition(np.abs(x), x.size - k)[x.size - k :]
    out = np.zeros_like(x)
    out[keep] = x[keep]
    return out


def assert_top_k(x: np.ndarray, block: bytes | bytearray | memoryview) -> None:
    """The block keeps k = ceil(n / 100) values of x, strictly increasing indices, their exact
    float32 values, and decodes to them there and to zero elsewhere. Which k are the largest
    is not unique where magnitudes tie, so what is compared with a full argpartition is the
    magnitudes kept, not the indices."""
    n, k = x.size, -(-x.size // 100)
    indices, kept = topk_parts(block, n)
    assert (np.diff(indices.astype(np.int64)) > 0).all()
    assert np.array_equal(bits(kept), bits(x[indices]))
    largest = np.argpartition(np.abs(x), n - k)[n - k :]
    assert np.array_equal(np.sort(np.abs(kept)), np.sort(np.abs(x[largest])))
    _, y = get_codec("topk").decode(block, n)
    others = np.ones(n, bool)
    others[indices] = False
    assert np.array_equal(bits(y[indices]), bits(kept)) and not bits(y[others]).any()


@pytest.mark.parametrize("n", [1, 7, 99, 100, 101, 7919, 262_145, 1 << 19])  # 262_145: two pieces
@pytest.mark.parametrize("kind", TOPK_KINDS)
def test_topk_keeps_exactly_the_largest_magnitudes(kind, n):
    x = topk_data(kind, n, seed=n)
    assert_top_k(x, encoded("topk", x))


@pytest.mark.parametrize("n, k", [(0, 0), (1, 1), (99, 1), (100, 1), (101, 2), (1 << 19, 5243)])
def test_topk_keeps_ceil_n_over_100_values_at_8_bytes_each(n, k):
    codec = get_codec("topk")
    block = encoded("topk", make("normal", n))
    assert len(block) == codec.max_encoded_size(n) == HEADER_SIZE + 8 * k
    header, y = codec.decode(block, n)
    assert header.payload_size == 8 * k and y.shape == (n,)


def test_topk_residual_is_what_was_not_sent():
    """Error feedback as the engine does it: encode unsealed, decode what was sent into its
    scratch unchecked, subtract. The residual is zero where a value was sent and the whole
    value elsewhere, so nothing is lost, only sent later."""
    codec = get_codec("topk")
    x = make("normal", 300_001)
    block = codec.encode(x, out=bytearray(), checksum=False)
    scratch = np.full(300_010, 7.0, np.float32)
    _, sent = codec.decode(block, x.size, scratch=scratch, checksum=False)
    residual = x - sent
    indices, _ = topk_parts(block, x.size)
    others = np.ones(x.size, bool)
    others[indices] = False
    assert np.shares_memory(sent, scratch) and (scratch[x.size :] == 7.0).all()
    assert not residual[indices].any()
    assert np.array_equal(bits(residual[others]), bits(x[others]))


def test_topk_is_exact_where_the_sample_misleads_high(monkeypatch):
    """Large values exactly where the strided sample looks (every 97th), small ones elsewhere:
    the sampled threshold lies above the k-th largest, fewer than k exceed it, and the whole
    part is partitioned (the spy sees it) to keep the k largest all the same."""
    n = 1 << 19
    x = make("normal", n) * np.float32(1e-3)
    x[::97] = 10 + make("normal", x[::97].size, seed=1)
    codec_format = type(get_codec("topk")._format)
    select, sizes = codec_format._select, []
    monkeypatch.setattr(
        codec_format, "_select", staticmethod(lambda m, k: sizes.append(m.size) or select(m, k))
    )
    assert_top_k(x, encoded("topk", x))
    assert sizes == [n]


def test_topk_is_exact_where_the_sample_misleads_low():
    """Large values only where the strided sample never looks: the sampled threshold is zero,
    far more than k exceed it, and the k largest of them are kept."""
    x = np.full(100_000, 1e-3, np.float32)
    x[::97] = 0.0  # what the sample sees: nothing
    spots = np.arange(5, 100_000, 97)[:1000]
    x[spots] = np.linspace(1.0, 2.0, spots.size, dtype=np.float32)
    block = encoded("topk", x)
    assert_top_k(x, block)
    assert np.array_equal(topk_parts(block, x.size)[0], spots)


def test_topk_with_many_ties_keeps_k_of_the_largest():
    x = np.zeros(10_000, np.float32)
    x[:300] = 5.0  # 300 tie for 100 places
    _, y = get_codec("topk").decode(encoded("topk", x), x.size)
    assert (y == 5.0).sum() == 100 and (y[300:] == 0).all()


def lowest_index_top_k(x: np.ndarray) -> np.ndarray:
    """The indices topk keeps: the k largest magnitudes, ties at the k-th going to the lowest
    indices (a stable sort by descending magnitude), in increasing order."""
    k = -(-x.size // 100)
    return np.sort(np.argsort(-np.abs(x), kind="stable")[:k])


def sample_misleads_high_with_ties() -> np.ndarray:
    """Where the strided sample looks (every 97th) a 10, elsewhere ones: fewer than k exceed
    the sampled threshold, and the ones tie at the k-th magnitude."""
    x = np.ones(1 << 19, np.float32)
    x[::97] = 10.0
    return x


@pytest.mark.parametrize(
    "x",
    [
        *(
            topk_data(kind, n, seed=n)
            for kind in ("zeros", "ties", "rounded", "sparse")
            for n in (7, 7919, 262_145)
        ),
        np.array([0.0, -0.0, 0.0, -1.0, 1.0, -1.0], np.float32),  # -0.0 ties with 0.0
        sample_misleads_high_with_ties(),
    ],
)
def test_topk_ties_at_the_kth_magnitude_keep_the_lowest_indices(x):
    """Whichever path chooses (a partition of the candidates, ties at the sampled threshold,
    zeros, or a partition of the whole part), the tied values kept are those of the lowest
    indices: the choice depends on the values only, and the device codec matches it."""
    indices, _ = topk_parts(encoded("topk", x), x.size)
    assert np.array_equal(indices, lowest_index_top_k(x))


# sampled or not; first and last piece
@pytest.mark.parametrize("where", [0, 1, 97, 262_143, 262_144, -1])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_topk_part_with_nan_or_inf_decodes_to_nan(where, bad):
    x = make("normal", 300_001)
    x[where] = bad
    _, y = get_codec("topk").decode(encoded("topk", x), x.size)
    assert np.isnan(y).any()


@pytest.mark.parametrize(
    "x",
    [
        np.array([np.nan], np.float32),
        np.array([-np.inf, 1.0], np.float32),
        make("nonfinite", 1000),
        np.full(1000, np.inf, np.float32),
    ],
)
def test_topk_part_of_nan_or_inf_only_or_mostly_decodes_to_nan(x):
    _, y = get_codec("topk").decode(encoded("topk", x), x.size)
    assert np.isnan(y).any()


@pytest.mark.parametrize(
    "tamper, match",
    [
        (
            "out of range",
            r"the topk block's indices are out of range: 1000 in a block of 1000 values",
        ),
        ("repeated", r"the topk block's indices are not increasing: index 4 is (\d+), after \1"),
        ("swapped", r"the topk block's indices are not increasing: index 5 is"),
        (
            "wrapped",
            r"not increasing: index 3 is 0, after 4294967295",
        ),  # a u32 difference would wrap around
    ],
)
def test_topk_block_with_bad_indices_is_refused(tamper, match):
    block = encoded("topk", make("normal", 1000))
    indices = np.frombuffer(block, np.uint32, 10, HEADER_SIZE)
    if tamper == "out of range":
        indices[9] = 1000
    elif tamper == "repeated":
        indices[4] = indices[3]
    elif tamper == "swapped":
        indices[4], indices[5] = indices[5], indices[4]
    else:
        indices[2], indices[3] = 0xFFFFFFFF, 0
    del indices
    corrupt(bytes(reseal(block)), match, name="topk")
    with pytest.raises(
        CorruptBlockError, match="the topk block's indices"
    ):  # read in place, unchecked too
        get_codec("topk").decode(bytes(block), 1000, checksum=False)


def test_topk_refuses_a_block_longer_than_its_u32_indices_reach(monkeypatch):
    monkeypatch.setattr(type(get_codec("topk")._format), "_MAX_LENGTH", 1000)
    out = bytearray()
    with pytest.raises(CodecOverflowError, match="topk indexes a block with u32: 1001 values"):
        get_codec("topk").encode(make("normal", 1001), out=out)
    block = get_codec("topk").encode(make("normal", 1000), out=out)  # `out` is still growable
    assert len(block) == HEADER_SIZE + 80


def test_topk_codec_id_is_appended_and_it_is_lossy():
    assert CODECS[:6] == ("raw", "lz4", "bf16", "fp16", "bf16-lz4", "int8")  # ids are append-only
    block = encoded("topk", make("normal", 1000), count=3.0)
    assert block[3] == CODECS.index("topk") == 6
    assert parse_header(block).codec == "topk"
    assert get_codec("topk").lossy and get_codec("topk").sparse
    assert not get_codec("raw").lossy and not get_codec("lz4").lossy
