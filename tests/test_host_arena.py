"""The host arena (``AllReduceParameter(host_arena=True)``): one host's BSP step through one
shared segment. The same bits as the blocks' path, across threads and spawned processes;
the read-only view; and every way a wait ends: a peer's failure, its process's death, the
timeout, this partition's own abort."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading

import numpy as np
import pytest
from conftest import run_partitions
from test_processes import free_loopback_ports, lost_peer_outcome

from allreduce_param import FetchTimeoutError, PeerLostError
from allreduce_param.engine import (
    AllReduceParameter,
    NonFiniteGradientError,
    StaticRendezvous,
    Strategy,
)
from allreduce_param.engine.blocks.arena import HostArena
from allreduce_param.engine.blocks.arena_signals import GRADIENT, WEIGHT
from allreduce_param.engine.movement.peers import PART_LENGTH
from allreduce_param.engine.movement.sums import SUM_PIECE
from allreduce_param.errors import ProtocolError, StoreClosedError, UsageError

STEPS = 3


def steps(p, size: int, lent: bool, stream: bool = False) -> list[np.ndarray]:
    """A few BSP steps whose gradients depend on the weights and the partition; every
    ``get_weights`` as read (copied)."""
    rng = np.random.default_rng(p.info.partition_id)
    p.init(np.linspace(-1, 1, size, dtype=np.float32))
    seen = []
    for _ in range(STEPS):
        w = p.get_weights()
        seen.append(w.copy())
        g = p.gradient_buffer() if lent else np.empty(size, np.float32)
        np.multiply(rng.standard_normal(size, dtype=np.float32), w, out=g)
        if stream:
            with p.stream_gradients(g, count=1.0 + p.info.partition_id) as s:
                s.ready(0, size)
        else:
            p.put_gradients(g, count=1.0 + p.info.partition_id)
        p.weight_partition[:] -= np.float32(0.1) * p.aggregate_gradient_partition()
        p.send_weight_partition()
    seen.append(p.get_weights().copy())
    return seen


def both_ways(n: int, size: int, codec: str = "raw", **body) -> tuple[list, list]:
    """``steps`` through the arena and through blocks, one partition per thread."""
    runs = []
    for arena in (True, False):
        param = AllReduceParameter(n, size, codec, host_arena=arena, timeout=30)
        results = run_partitions(
            param, lambda p: (p.info.host_arena, steps(p, size, **body)), timeout=60
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        assert all(used == arena for used, _ in results)
        runs.append([seen for _, seen in results])
    return runs[0], runs[1]


def assert_same_bits(first: list, second: list) -> None:
    for mine, theirs in zip(first, second, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize(
    "n, size, lent, codec",
    [
        (2, 1_000, True, "raw"),
        (3, 2 * PART_LENGTH * 3 + 5, True, "raw"),  # several parts per slice
        (3, 1_001, False, "lz4"),  # the caller's own vector, copied in; a lossless codec
        (3, 2 * PART_LENGTH * 3 + 5, False, "raw"),  # the own chunk summed where it lies
    ],
)
@pytest.mark.slow
def test_the_arena_gives_the_blocks_bits(n, size, lent, codec):
    """Every partition reads the same weights, bit for bit, as through blocks: the owners
    sum the same chunks in the same order."""
    arena, blocks = both_ways(n, size, codec, lent=lent)
    assert_same_bits(arena, blocks)
    assert_same_bits(arena, [arena[0]] * n)


def test_a_streamed_gradient_goes_through_the_arena_with_the_same_bits():
    arena, blocks = both_ways(2, 5_000, lent=True, stream=True)
    assert_same_bits(arena, blocks)


def spawned(param, addresses, partition_id, results) -> None:
    try:
        with param.connect(StaticRendezvous(partition_id, addresses)) as p:
            results.put((partition_id, p.info.host_arena, steps(p, param.size, lent=True)))
    except BaseException as error:  # reported to the test, which fails on it
        results.put((partition_id, None, f"{type(error).__name__}: {error}"))


def run_spawned(param, target, partitions: int) -> list:
    addresses = [("127.0.0.1", port) for port in free_loopback_ports(partitions)]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=target, args=(param, addresses, i, results))
        for i in range(partitions)
    ]
    for process in processes:
        process.start()
    try:
        return sorted((results.get(timeout=120) for _ in processes), key=lambda got: got[0])
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_plain_processes_share_the_arena_with_the_blocks_bits(n):
    """Spawned processes map the arena partition 0 made (its descriptor passed over the
    Unix socket) and end with the bits threads get through blocks."""
    size = 40_001
    got = run_spawned(AllReduceParameter(n, size, "raw", host_arena=True, timeout=60), spawned, n)
    _, blocks = both_ways(n, size, lent=True)
    for partition_id, used, seen in got:
        assert used is True, seen
        assert_same_bits([seen], [blocks[partition_id]])


def test_get_weights_is_a_read_only_view_until_the_next_put_and_out_copies():
    size = 1_000

    def body(p):
        p.init(np.ones(size, np.float32))
        view = p.get_weights()
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 2.0
        kept = p.get_weights(out=np.empty(size, np.float32))
        before = view.copy()
        p.put_gradients(np.ones(size, np.float32), count=1.0)
        p.weight_partition[:] -= p.aggregate_gradient_partition()
        p.send_weight_partition()
        after = p.get_weights()
        return view, before, kept, after

    results = run_partitions(AllReduceParameter(2, size, "raw", host_arena=True), body)
    for view, before, kept, after in results:
        assert np.array_equal(kept, before) and np.array_equal(before, np.ones(size))
        # the view is the host's one vector: the owners updated it in place after the put
        assert np.array_equal(after, np.zeros(size)) and np.shares_memory(view, after)
        assert np.array_equal(view, after)
        assert np.array_equal(kept, np.ones(size))  # the copy stayed


def test_other_strategies_and_lossy_codecs_keep_the_blocks():
    for param in (
        AllReduceParameter(2, 100, "raw", host_arena=True, strategy=Strategy("ssp", staleness=1)),
        AllReduceParameter(2, 100, "bf16", host_arena=True),
        AllReduceParameter(2, 100, "raw", host_arena=True, shared_memory=False),
    ):
        assert run_partitions(param, lambda p: p.info.host_arena) == [False, False]


@pytest.mark.parametrize("lent", [True, False])
def test_a_nan_names_its_partition_through_the_arena(lent):
    """Also in the own chunk of a vector of the caller's, which is summed where it lies."""

    def body(p):
        p.init(np.zeros(10, np.float32))
        p.get_weights()
        g = p.gradient_buffer() if lent else np.empty(10, np.float32)
        g[:] = np.nan if p.info.partition_id == 1 else 1.0
        p.put_gradients(g)
        p.aggregate_gradient_partition()

    results = run_partitions(AllReduceParameter(2, 10, "raw", host_arena=True), body)
    for error in results:
        assert isinstance(error, NonFiniteGradientError) and "partition 1" in str(error)


def test_a_failing_peer_ends_the_wait_with_its_reason():
    """Partition 1 raises after its put: partition 0, waiting for its weights in the arena,
    hears its reason at once (its timeout is far off)."""

    def body(p):
        p.init(np.zeros(10, np.float32))
        p.get_weights()
        p.put_gradients(np.ones(10, np.float32))
        if p.info.partition_id == 1:
            raise RuntimeError("boom in partition 1")
        p.aggregate_gradient_partition()
        p.send_weight_partition()
        p.get_weights()

    results = run_partitions(AllReduceParameter(2, 10, "raw", host_arena=True, timeout=60), body)
    assert isinstance(results[1], RuntimeError)
    assert isinstance(results[0], PeerLostError), results[0]
    assert "partition 1 at 127.0.0.1" in str(results[0])
    assert "shut down" in str(results[0]) and "boom in partition 1" in str(results[0])


def test_a_silent_peer_is_a_timeout_naming_it():
    stop = threading.Event()

    def body(p):
        p.init(np.zeros(10, np.float32))
        if p.info.partition_id == 1:
            stop.wait(30)  # until partition 0 has given up
            return None
        try:
            p.get_weights()
            p.put_gradients(np.ones(10, np.float32))
            p.aggregate_gradient_partition()
        finally:
            stop.set()

    results = run_partitions(AllReduceParameter(2, 10, "raw", host_arena=True, timeout=0.5), body)
    assert isinstance(results[0], FetchTimeoutError), results[0]
    assert "partition 1 at 127.0.0.1" in str(
        results[0]
    ) and "gradient block from partition 1 to partition 0, version 0" in str(results[0])


def test_a_peer_shut_down_mid_wait_ends_the_wait():
    """A peer shut down from another thread (as a task kill's cleanup does) while this
    partition waits for it in the arena: the wait ends, naming it."""
    waiting = threading.Event()

    def body(p):
        p.init(np.zeros(10, np.float32))
        if p.info.partition_id == 1:
            waiting.wait(30)
            p._peers.shutdown()
            return "shut down"
        p.get_weights()
        p.put_gradients(np.ones(10, np.float32))
        waiting.set()  # whether before or in the wait below, it ends with partition 1 named
        p.aggregate_gradient_partition()  # partition 1's gradient never comes

    results = run_partitions(AllReduceParameter(2, 10, "raw", host_arena=True, timeout=60), body)
    assert results[1] == "shut down"
    assert isinstance(results[0], PeerLostError), results[0]
    assert "partition 1 at 127.0.0.1" in str(results[0])
    assert "it said: partition 1 was shut down" in str(results[0])


@pytest.fixture
def two_mappings():
    """Partition 0's new arena and partition 1's mapping of it, in this process."""
    first = HostArena.create(2, 10, 0, timeout=60)
    text, fds = first.offer()
    second = HostArena.attach(text, [os.dup(fd) for fd in fds], 1, timeout=60)
    yield first, second
    second.close()
    first.close()


def test_an_arena_wait_ends_on_our_abort_a_peer_s_close_and_calls_out_of_step(two_mappings):
    first, second = two_mappings
    second.publish(GRADIENT, 5, count=1.0)
    with pytest.raises(
        ProtocolError,
        match="partition 1 published the gradient block from partition 1 to partition 0, "
        "version 5 while partition 0 waits for version 3: .* out of step",
    ):
        first.wait(GRADIENT, 3)
    second.end(None)
    with pytest.raises(PeerLostError, match="partition 1 closed its handle .* no more calls"):
        first.wait(WEIGHT, 0)
    first.end("partition 0 failed: boom")
    with pytest.raises(StoreClosedError, match="partition 0 is shutting down"):
        first.wait(WEIGHT, 0)
    assert second.ended(0) and first.ended(1)


def test_a_peer_that_publishes_its_last_version_and_closes_at_once_is_not_lost(two_mappings):
    """The race a wait must survive: it found partition 1 missing, then partition 1 made the
    version whole and closed before the wait looked at its state. Its version is there: not
    a PeerLostError (a fit's last step failed so once in CI)."""
    first, second = two_mappings
    second.publish(WEIGHT, 0)
    second.end(None)
    first.signals._check([1], WEIGHT, 0)  # what the wait does with the partition it found missing
    first.wait(WEIGHT, 0, partitions=[1])
    with pytest.raises(PeerLostError, match="partition 1 closed its handle .* no more calls"):
        first.wait(WEIGHT, 1, partitions=[1])


def test_an_arena_of_another_parameter_is_refused():
    arena = HostArena.create(2, 10, 0, timeout=60)
    try:
        _, fds = arena.offer()
        text = b'{"partitions": 2, "size": 11}'
        with pytest.raises(ProtocolError, match="2 partitions of 10 floats, not 2 of 11"):
            HostArena.attach(text, [os.dup(fd) for fd in fds], 1, timeout=60)
        with pytest.raises(ProtocolError, match="description"):
            HostArena.attach(b"not json", [os.dup(fd) for fd in fds], 1, timeout=60)
    finally:
        arena.close()


@pytest.mark.slow
def test_a_peer_process_that_dies_mid_wait_is_named_at_once():
    """Partition 0 waits in the arena for partition 1's gradient; partition 1's process
    ends: its pidfd wakes the wait, long before the 60 s timeout."""
    param = AllReduceParameter(2, 1000, "raw", host_arena=True, timeout=60)
    partition_id, outcome = lost_peer_outcome(param)
    assert partition_id == 0 and outcome.startswith("PeerLostError: partition 1 at 127.0.0.1"), (
        outcome
    )
    assert (
        "exited while partition 0 waited for the gradient block from partition 1 to partition 0, "
        "version 0 in the host's shared memory" in outcome
    )
    assert "without a word" in outcome
    assert (
        "spark.executor.pyspark.memory where it is set, else spark.executor.memoryOverhead"
        in outcome
    )


def test_the_arena_leaves_no_descriptor_or_mapping_behind():
    """Spark reuses Python workers: what a connect maps and opens (the segment, the
    doorbells), its end closes, on a clean close and after a failure alike."""

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def arena_maps() -> int:
        with open("/proc/self/maps") as maps:
            return sum("allreduce-param-arena" in line for line in maps)

    def clean(p):
        steps(p, 1000, lent=True)

    def failing(p):
        p.init(np.zeros(1000, np.float32))
        p.get_weights()
        raise RuntimeError("boom")

    param = AllReduceParameter(2, 1000, "raw", host_arena=True, timeout=30)
    run_partitions(param, clean)  # warm: the pools' threads and imports
    gc.collect()
    before = open_fds()
    for body in (clean, failing, clean):
        results = run_partitions(param, body)
        assert all(r is None or isinstance(r, RuntimeError) for r in results), results
    # a mapping (and the descriptor Python's mmap keeps with it) lives while a view of it
    # does (the handles' slices, the weights handed out): the handles are garbage by now
    gc.collect()
    assert open_fds() == before
    assert arena_maps() == 0


def map_under_a_limit(results) -> None:
    """Partition 0's arena of 10M floats, mapped again under an address-space limit with
    no room for it (as spark.executor.pyspark.memory sets one)."""
    import resource

    arena = HostArena.create(2, 10_000_000, 0, timeout=30)
    text, fds = arena.offer()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    used = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (used + (16 << 20), hard))
    try:
        HostArena.attach(text, [os.dup(fd) for fd in fds], 1, timeout=30)
        results.put("mapped")
    except BaseException as error:
        results.put(f"{type(error).__name__}: {error}")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.slow
def test_no_memory_to_map_the_arena_is_a_memory_error_naming_the_limit():
    context = multiprocessing.get_context("spawn")  # the limit stays in a process of its own
    results = context.Queue()
    process = context.Process(target=map_under_a_limit, args=(results,))
    process.start()
    try:
        outcome = results.get(timeout=120)
    finally:
        process.join(60)
    assert outcome.startswith(
        "MemoryError: partition 1 ran out of memory ([Errno 12] Cannot allocate memory) while "
        "it mapped its host's shared arena"
    ), outcome
    assert "spark.executor.pyspark.memory" in outcome


def test_our_own_shutdown_from_another_thread_ends_our_wait():
    """A shutdown of this partition from another thread (a task kill's cleanup) while it
    waits in the arena: the wait ends with this partition's own shutting down (or, had the
    shutdown come first, the call is refused), never a hang or a closed descriptor's error."""
    handles = {}
    about_to_wait = threading.Event()

    def body(p):
        p.init(np.zeros(10, np.float32))
        handles[p.info.partition_id] = p
        if p.info.partition_id == 1:
            about_to_wait.wait(30)
            handles[0]._peers.shutdown()  # partition 0's, from this thread
            return "shut partition 0 down"
        p.get_weights()
        p.put_gradients(np.ones(10, np.float32))
        about_to_wait.set()
        p.aggregate_gradient_partition()  # partition 1's gradient never comes

    results = run_partitions(AllReduceParameter(2, 10, "raw", host_arena=True, timeout=60), body)
    assert results[1] == "shut partition 0 down"
    assert isinstance(results[0], (StoreClosedError, UsageError)), results[0]
    assert "partition 0 is shutting down" in str(results[0]) or "closed" in str(results[0])


@pytest.mark.parametrize("own_vector", [False, True])
def test_a_nan_beyond_the_first_summed_piece_is_named_with_its_index(own_vector):
    """The owner sums, checks and divides a part a cache-sized piece at a time
    (``sums.SUM_PIECE``); a NaN in a later piece of a later part names its partition and
    its index in the full vector."""
    size = 2 * PART_LENGTH + 3 * SUM_PIECE  # partition 1's slice: two parts, several pieces
    bad = size // 2 + PART_LENGTH + SUM_PIECE + 7

    def body(p):
        p.init(np.zeros(size, np.float32))
        p.get_weights()
        g = np.empty(size, np.float32) if own_vector else p.gradient_buffer()
        g[:] = 1.0
        if p.info.partition_id == 0:
            g[bad] = np.nan
        p.put_gradients(g)
        try:
            p.aggregate_gradient_partition()
        except NonFiniteGradientError as error:
            return str(error)
        return None

    results = run_partitions(AllReduceParameter(2, size, "raw", host_arena=True), body)
    assert results[0] is None
    assert f"the gradient of partition 0 for step 0 holds NaN/Inf (first at index {bad}" in str(
        results[1]
    )
