"""The typed collectives (p.collectives.reduce_scatter, all_gather, broadcast) across N
partitions run as threads over real loopback sockets and shared memory: each dtype's bits
against numpy's in partition order, uneven slices, every root, mismatched calls."""

from __future__ import annotations

import functools
import gc
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


# ---- allreduce_typed: through the host arena on one host, blocks past it -----------------


def arena_mappings() -> int:
    """How many host arena mappings this process holds (its own: /proc/self/maps), once
    the views of closed handles are collected (a closed arena unmaps with its last view)."""
    gc.collect()
    with open("/proc/self/maps") as maps:
        return sum("allreduce-param-arena" in line for line in maps)


def test_allreduce_typed_through_the_host_arena_and_past_its_capacity():
    """Calls that fit the arena (64 bytes here) and calls larger than it (blocks), mixed,
    each dtype and op: numpy's bits in partition order on every partition, in place and into
    a new array; a mean's ``finish`` on each owner's slice. A handle whose calls went
    through its arena refuses init (its steps would go there too); across hosts (flat, no
    arena) the blocks' path gives the same."""
    calls = [
        (np.float64, "sum", 7),  # 56 bytes: the arena
        (np.int32, "product", 50),  # 200 bytes: blocks
        (ml_dtypes.bfloat16, "max", 31),
        (np.uint8, "sum", 64),
        (np.float32, "min", 1000),
    ]
    data = {call: vectors(call[0], 3, call[2], seed=i) for i, call in enumerate(calls)}

    def body(p):
        me, got = p.info.partition_id, []
        for call in calls * 2:  # twice: the arena's buffers are reused
            values = data[call][me].copy()
            if len(got) % 2:
                got.append(p.collectives.allreduce_typed(values, call[1], out=values))
            else:
                got.append(p.collectives.allreduce_typed(values, call[1]))
        half = p.collectives.allreduce_typed(
            np.full(5, me + 1.0), finish=lambda mine: mine / 2
        )  # 1 + 2 + 3, halved
        try:
            p.init(np.zeros(16, np.float32))
        except UsageError as error:
            return got, half, str(error)
        return got, half, None

    before = arena_mappings()
    one_host = raise_first(run_partitions(AllReduceParameter(3, 16, "raw", timeout=30), body))
    assert arena_mappings() <= before  # every partition unmapped the arena at its close
    two_hosts = raise_first(
        run_partitions(
            AllReduceParameter(3, 16, "raw", timeout=30, topology="flat"), body, hosts=[[0, 1], [2]]
        )
    )
    for results, refused in ((one_host, True), (two_hosts, False)):
        for got, half, init_error in results:
            for call, result in zip(calls * 2, got):
                assert result.dtype == np.dtype(call[0])
                assert result.tobytes() == in_order(data[call], call[1]).tobytes(), call
            assert half.tolist() == [3.0] * 5
            assert (init_error is not None) == refused, init_error
            if refused:
                assert "allreduce_typed calls went through its host arena" in init_error


def test_allreduce_typed_mismatches_in_the_arena_are_named_on_every_partition():
    """Another dtype, and a call past the arena's capacity against one within it: every
    partition's error names the other partition's call and its own, none waits."""
    for mine, fragment in [
        (np.zeros(6, np.int32), "partition 1 called it with 6 elements of int32, op 'sum'"),
        (np.zeros(40, np.float32), "partition 1 called it with 40 elements of float32"),
    ]:

        def body(p, mine=mine):
            values = np.zeros(6, np.float32) if p.info.partition_id == 0 else mine
            return p.collectives.allreduce_typed(values)

        before = arena_mappings()
        results = run_partitions(AllReduceParameter(2, 16, "raw", timeout=20), body)
        assert all(isinstance(r, CollectiveMismatchError) for r in results), results
        first = str(results[0])
        del results  # their tracebacks hold the closed handles, so their views of the arena
        assert arena_mappings() <= before  # unmapped after the failure too
        assert fragment in first, first
        assert "this partition with 6 elements of float32" in first


def vanish_in_allreduce(param, addresses, partition_id, results) -> None:
    """Both partitions allreduce once; then partition 1's process ends at once, as a killed
    worker's does, while partition 0 allreduces again."""
    import os

    from allreduce_param.engine import StaticRendezvous

    try:
        with param.connect(StaticRendezvous(partition_id, addresses)) as p:
            p.collectives.allreduce_typed(np.ones(8, np.float32))
            if partition_id == 1:
                os._exit(1)
            p.collectives.allreduce_typed(np.ones(8, np.float32))
        results.put((partition_id, "finished"))
    except BaseException as error:
        results.put((partition_id, f"{type(error).__name__}: {error}"))


@pytest.mark.slow
def test_allreduce_typed_names_a_peer_process_that_dies_in_the_arena():
    """Partition 0 waits in the arena for partition 1's values; partition 1's process is
    gone: its pidfd ends the wait at once (the timeout is 60 s), naming it."""
    import multiprocessing

    from test_processes import free_loopback_ports

    addresses = [("127.0.0.1", port) for port in free_loopback_ports(2)]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    param = AllReduceParameter(2, 16, "raw", timeout=60)
    processes = [
        context.Process(target=vanish_in_allreduce, args=(param, addresses, i, results))
        for i in range(2)
    ]
    for process in processes:
        process.start()
    try:
        partition_id, outcome = results.get(timeout=50)
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    assert partition_id == 0 and outcome.startswith("PeerLostError: partition 1 at 127.0.0.1")
    assert "exited while partition 0 waited" in outcome and "shared memory" in outcome
