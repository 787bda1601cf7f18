"""The typed collectives (p.collectives.reduce_scatter, all_gather, broadcast) across N
partitions run as threads over real loopback sockets and shared memory: each dtype's bits
against numpy's in partition order, uneven slices, every root, mismatched calls."""

from __future__ import annotations

import functools
import re

import ml_dtypes
import numpy as np
import pytest
from conftest import raise_first, run_partitions

from allreduce_param.engine import (
    AllReduceParameter,
    CollectiveMismatchError,
    InputError,
    SliceLayout,
    UsageError,
)

OPS = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum}


def vectors(dtype, partitions: int, size: int, seed: int = 0) -> list[np.ndarray]:
    """One vector per partition: wide-ranged values of ``dtype`` (integers near their
    limits, so that sums and products overflow and wrap)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return [rng.integers(0, 2, size).astype(bool) for _ in range(partitions)]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return [
            rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
            for _ in range(partitions)
        ]
    return [(rng.standard_normal(size) * 1000).astype(dtype) for _ in range(partitions)]


def in_order(vs: list[np.ndarray], op: str) -> np.ndarray:
    """numpy's combination in partition order, in the dtype."""
    with np.errstate(over="ignore"):
        return functools.reduce(lambda a, b: OPS[op](a, b), vs)


DTYPES = [
    np.float64,
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    bool,
]


def test_reduce_scatter_and_all_gather_give_numpys_bits_for_every_dtype_and_op():
    partitions = 3
    cases = [
        (dtype, op, size)
        for dtype in DTYPES
        for op in OPS
        for size in ((7, 2) if dtype in (np.float64, np.int8) else (7,))
    ]  # uneven slices; fewer elements than partitions
    inputs = {case: vectors(case[0], partitions, case[2], seed=i) for i, case in enumerate(cases)}

    def body(p):
        me = p.info.partition_id
        out = {}
        for (dtype, op, size), vs in inputs.items():
            mine = p.collectives.reduce_scatter(vs[me], op=op)
            layout = SliceLayout(size, partitions)
            out[dtype, op, size] = (mine, p.collectives.all_gather(mine, layout))
        return out

    results = raise_first(run_partitions(AllReduceParameter(partitions, 8, "bf16"), body))
    for (dtype, op, size), vs in inputs.items():
        expected = in_order(vs, op)
        layout = SliceLayout(size, partitions)
        for me, result in enumerate(results):
            mine, whole = result[dtype, op, size]
            assert mine.dtype == whole.dtype == expected.dtype
            assert mine.tobytes() == expected[layout.bounds(me)].tobytes(), (dtype, op, size)
            assert whole.tobytes() == expected.tobytes(), (dtype, op, size)


def test_float64_sums_keep_float64_and_ints_wrap():
    big = np.array([2.0**53, 1.0, 1e-300, -(2.0**60)], np.float64)
    ints = np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min, 5], np.int64)

    def body(p):
        # gathered into arrays of the caller's: unpadded (4 float64 over 2), padded (3 int64)
        summed, wrapped = np.full(4, np.nan), np.zeros(3, np.int64)
        returned = (
            p.collectives.all_gather(p.collectives.reduce_scatter(big), SliceLayout(4, 2), summed),
            p.collectives.all_gather(
                p.collectives.reduce_scatter(ints), SliceLayout(3, 2), out=wrapped
            ),
        )
        assert returned[0] is summed and returned[1] is wrapped
        return summed, wrapped

    for summed, wrapped in raise_first(run_partitions(AllReduceParameter(2, 8), body)):
        assert summed.tolist() == [2.0**54, 2.0, 2e-300, -(2.0**61)]
        assert wrapped.tolist() == [-2, 0, 10]  # int64 overflow wraps, as numpy's does


def test_a_layout_given_and_a_large_vector_in_several_parts():
    partitions, size = 2, (1 << 19) + 5  # the float64 chunks span several blocks' parts
    vs = vectors(np.float64, partitions, size, seed=3)
    layout = SliceLayout(size, partitions)

    def body(p):
        return p.collectives.reduce_scatter(vs[p.info.partition_id], "sum", layout)

    results = raise_first(run_partitions(AllReduceParameter(partitions, 8), body))
    expected = in_order(vs, "sum")
    assert np.concatenate(results).tobytes() == expected.tobytes()


def test_broadcast_from_every_root():
    partitions = 3
    data = {
        (dtype, root): vectors(dtype, partitions, 5, seed=root)
        for dtype in (np.float64, np.int8, ml_dtypes.bfloat16)
        for root in range(partitions)
    }

    def body(p):
        return {
            key: p.collectives.broadcast(vs[p.info.partition_id], key[1])
            for key, vs in data.items()
        }

    for result in raise_first(run_partitions(AllReduceParameter(partitions, 8), body)):
        for (dtype, root), vs in data.items():
            assert result[dtype, root].tobytes() == vs[root].tobytes()
            assert result[dtype, root].dtype == np.dtype(dtype)


@pytest.mark.parametrize(
    "mine, fragment",
    [
        # whichever partition finds the mismatch first names both calls
        (np.zeros(6, np.int32), "6 elements of int32, op 'sum'"),
        (np.zeros(6, np.float64), "same length and dtype|6 elements of float64"),
    ],
)
def test_mismatched_calls_are_a_clear_error(mine, fragment):
    def body(p):
        values = np.zeros(6, np.float32) if p.info.partition_id == 0 else mine
        return p.collectives.reduce_scatter(values)

    results = run_partitions(AllReduceParameter(2, 8, timeout=20), body)
    errors = [r for r in results if isinstance(r, CollectiveMismatchError)]
    assert errors, results
    assert any(re.search(fragment, str(error)) for error in errors), errors


def test_bad_arguments_are_refused_before_anything_moves():
    def body(p):
        calls = [
            lambda: p.collectives.reduce_scatter(np.zeros(4, np.complex64)),
            lambda: p.collectives.reduce_scatter(np.zeros(4), op="mean"),
            lambda: p.collectives.reduce_scatter(np.zeros((2, 2))),
            lambda: p.collectives.all_gather(np.zeros(3), SliceLayout(4, 1)),
            lambda: p.collectives.broadcast(np.zeros(3), root=1),
            lambda: p.collectives.all_gather(np.zeros(3), SliceLayout(3, 1), np.zeros(3, np.int8)),
        ]
        messages = []
        for call in calls:
            with pytest.raises(InputError) as caught:
                call()
            messages.append(str(caught.value))
        # refused calls leave the handle usable
        messages.append(p.collectives.broadcast(np.arange(3), root=0).tolist())
        return messages

    (messages,) = raise_first(run_partitions(AllReduceParameter(1, 8), body))
    assert "dtype complex64 is not carried" in messages[0]
    assert "op must be one of 'sum', 'product', 'min', 'max'" in messages[1]
    assert "expected a non-empty 1-D array, got shape (2, 2)" in messages[2]
    assert "pass values[layout.bounds(0)]" in messages[3]
    assert "root must be a partition, 0..0" in messages[4]
    assert "out must be a writeable contiguous 1-D array of float64 with 3 elements" in messages[5]
    assert messages[6] == [0, 1, 2]


def test_hierarchical_handles_refuse_them():
    def body(p):
        with pytest.raises(UsageError, match="hierarchical"):
            p.collectives.reduce_scatter(np.zeros(4))
        return p.info.hierarchical

    results = raise_first(
        run_partitions(
            AllReduceParameter(4, 8, topology="hierarchical"), body, hosts=[[0, 1], [2, 3]]
        )
    )
    assert results == [True] * 4
