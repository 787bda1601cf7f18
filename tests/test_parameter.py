"""AllReduceParameter across N partitions run as threads over real loopback sockets."""

from __future__ import annotations

import functools
import re
import threading

import numpy as np
import pytest
from conftest import raise_first, run_partitions

from allreduce_param import (
    ConfigurationError,
    FetchTimeoutError,
    InputError,
    PeerLostError,
    UsageError,
)
from allreduce_param.engine import CODECS, AllReduceParameter, NonFiniteGradientError
from allreduce_param.engine.movement.fetches import INLINE_LENGTH

LR = np.float32(0.125)


def make_data(size: int, partitions: int, seed: int = 0, counts=None):
    """Start weights, per-partition gradient sums and counts, all float32."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(partitions)]
    counts = counts or [float(10 + 3 * i) for i in range(partitions)]
    return weights, grads, counts


def reference_step(weights, grads, counts):
    """What one BSP step must give: the exact mean gradient and the updated weights."""
    mean = functools.reduce(np.add, grads) / np.float32(sum(counts))
    return mean, weights - LR * mean


def one_step(weights, grads, counts):
    def body(p):
        p.init(weights)
        before = p.get_weights().copy()
        p.put_gradients(grads[p.info.partition_id], count=counts[p.info.partition_id])
        gradient = p.aggregate_gradient_partition().copy()
        p.weight_partition[:] -= LR * gradient
        p.send_weight_partition()
        return before, gradient, p.get_weights()

    return body


@pytest.mark.parametrize("partitions", [2, 3, 4])
@pytest.mark.parametrize("size_name", ["one", "partitions-1", "prime", "millions"])
def test_raw_step_is_exact_and_identical_everywhere(partitions, size_name):
    size = {"one": 1, "partitions-1": max(1, partitions - 1), "prime": 7919, "millions": 2_000_003}[
        size_name
    ]
    weights, grads, counts = make_data(size, partitions, seed=size)
    param = AllReduceParameter(partitions, size, codec="raw", timeout=30)
    results = raise_first(run_partitions(param, one_step(weights, grads, counts)))
    mean, updated = reference_step(weights, grads, counts)
    layout = param.layout
    for partition_id, (before, gradient, after) in enumerate(results):
        assert np.array_equal(before, weights)
        assert np.array_equal(gradient, mean[layout.bounds(partition_id)])
        assert np.array_equal(after, updated)


# topk: gradients only
@pytest.mark.parametrize("codec", [c for c in CODECS if c not in ("raw", "topk")])
def test_every_codec_within_its_bound_and_identical_everywhere(codec):
    size, partitions = 50_021, 3
    weights, grads, counts = make_data(size, partitions, seed=7)
    param = AllReduceParameter(partitions, size, codec=codec, timeout=30)
    results = raise_first(run_partitions(param, one_step(weights, grads, counts)))
    mean, updated = reference_step(weights, grads, counts)
    # each of the N chunks and the published weights are rounded once by the codec
    gradient = np.concatenate([r[1] for r in results])
    if (
        codec == "int8"
    ):  # off by at most half a step, the step being a part's largest magnitude / 127
        bound = sum(np.abs(g).max() for g in grads) / 254 / sum(counts)
        assert np.all(np.abs(gradient - mean) <= 1.01 * bound)
        assert np.all(
            np.abs(results[0][2] - updated)
            <= np.abs(updated).max() / 254 * 1.01 + LR * 1.01 * bound
        )
    else:
        relative = {"lz4": 0.0, "bf16": 2.0**-8, "bf16-lz4": 2.0**-8, "fp16": 2.0**-11}[codec]
        bound = (
            relative * (functools.reduce(np.add, [np.abs(g) for g in grads]) / sum(counts)) + 1e-30
        )
        assert np.all(np.abs(gradient - mean) <= 1.01 * bound)
        assert np.all(
            np.abs(results[0][2] - updated)
            <= relative * np.abs(updated) + LR * 1.01 * bound + 1e-30
        )
    for _, _, after in results[1:]:
        assert np.array_equal(after.view(np.uint32), results[0][2].view(np.uint32))
    if codec == "lz4":
        assert np.array_equal(results[0][2], updated)


def test_uneven_counts_and_an_empty_partition_give_the_exact_mean():
    size, partitions = 1001, 3
    rng = np.random.default_rng(3)
    samples = [rng.standard_normal((n, size)).astype(np.float32) for n in (5, 0, 17)]
    grads = [
        s.sum(axis=0, dtype=np.float32) if len(s) else np.zeros(size, np.float32) for s in samples
    ]
    counts = [float(len(s)) for s in samples]
    weights = np.zeros(size, np.float32)
    results = raise_first(
        run_partitions(
            AllReduceParameter(partitions, size, "raw"), one_step(weights, grads, counts)
        )
    )
    mean = functools.reduce(np.add, grads) / np.float32(22)
    assert np.array_equal(np.concatenate([r[1] for r in results]), mean)
    exact = np.concatenate(samples).astype(np.float64).mean(axis=0)
    assert np.allclose(mean, exact, rtol=1e-5, atol=1e-6)


def test_avg_divides_by_the_given_number():
    weights, grads, counts = make_data(100, 2)

    def body(p):
        p.init(weights)
        p.put_gradients(grads[p.info.partition_id], count=counts[p.info.partition_id])
        return p.aggregate_gradient_partition(avg=2).copy()

    results = raise_first(run_partitions(AllReduceParameter(2, 100, "raw"), body))
    assert np.array_equal(np.concatenate(results), (grads[0] + grads[1]) / np.float32(2))


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_allreduce_any_length(op):
    partitions = 3
    rng = np.random.default_rng(11)
    vectors = {
        length: [rng.standard_normal(length).astype(np.float32) for _ in range(partitions)]
        for length in (1, 2, 5, 10_007)
    }

    def body(p):
        return {
            length: p.collectives.allreduce(vs[p.info.partition_id], op=op)
            for length, vs in vectors.items()
        }

    results = raise_first(run_partitions(AllReduceParameter(partitions, 10, "raw"), body))
    for length, vs in vectors.items():
        expected = functools.reduce(np.add, vs)
        if op == "mean":
            expected = expected / np.float32(partitions)
        for result in results:
            assert np.array_equal(result[length], expected)


def test_many_steps_keep_only_the_versions_needed():
    size, partitions, steps = 4099, 3, 25
    weights, grads, counts = make_data(size, partitions)

    def body(p):
        p.init(weights)
        held = []
        for _ in range(steps):
            p.get_weights()
            p.put_gradients(grads[p.info.partition_id], count=counts[p.info.partition_id])
            p.weight_partition[:] -= LR * p.aggregate_gradient_partition()
            p.send_weight_partition()
            held.append(p._peers.store.nbytes)
        return p.get_weights(), held

    results = raise_first(run_partitions(AllReduceParameter(partitions, size, "raw"), body))
    mean, _ = reference_step(weights, grads, counts)
    expected = weights.copy()
    for _ in range(steps):
        expected = expected - LR * mean
    for final, held in results:
        assert np.array_equal(final, expected)
        # one weight slice and N gradient chunks, one version each: no growth over the steps
        assert held[-1] == held[0]


# ---- bad input -------------------------------------------------------------------------


def expect_error(param, body, error_type, *fragments):
    results = run_partitions(param, body)
    errors = [r for r in results if isinstance(r, error_type)]
    assert errors, f"expected {error_type.__name__}, got {results!r}"
    for fragment in fragments:
        assert fragment in str(errors[0]), f"{fragment!r} not in {errors[0]}"
    return results


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (np.zeros(99, np.float32), "expected a 1-D vector of 100 elements, got shape (99,)"),
        (np.zeros((10, 10), np.float32), "got shape (10, 10)"),
        (np.zeros(100, np.int64), "expected floating-point values, got dtype int64"),
    ],
)
def test_wrong_vectors_are_refused(bad, fragment):
    def body(p):
        p.init(bad)

    expect_error(
        AllReduceParameter(1, 100, "raw"),
        body,
        InputError,
        "init(weights) on partition 0",
        fragment,
    )


def test_float64_vectors_are_taken_as_float32():
    weights = np.linspace(-1, 1, 100)

    def body(p):
        p.init(weights)
        return p.get_weights()

    (result,) = raise_first(run_partitions(AllReduceParameter(1, 100, "raw"), body))
    assert result.dtype == np.float32 and np.array_equal(result, weights.astype(np.float32))


def test_nan_gradient_names_partition_and_step():
    weights, grads, counts = make_data(1000, 2)
    poisoned = grads[1].copy()
    poisoned[777] = np.nan  # in owner 1's chunk (500..999): the index must count from 0

    def body(p):
        p.init(weights)
        for step in range(2):
            p.put_gradients(
                poisoned if (p.info.partition_id, step) == (1, 1) else grads[p.info.partition_id]
            )
            p.aggregate_gradient_partition()
            p.send_weight_partition()
            p.get_weights()

    results = expect_error(
        AllReduceParameter(2, 1000, "raw", timeout=20),
        body,
        NonFiniteGradientError,
        "partition 1 for step 1",
        "index 777",
        "allow_nonfinite=True",
    )
    # the healthy partition is not left hanging: it fails as its peer went away
    assert isinstance(results[0], PeerLostError)


def test_nan_gradient_passes_when_allowed():
    grads = [np.ones(10, np.float32), np.full(10, np.inf, np.float32)]

    def body(p):
        p.init(np.zeros(10))
        p.put_gradients(grads[p.info.partition_id])
        return p.aggregate_gradient_partition().copy()

    results = raise_first(
        run_partitions(AllReduceParameter(2, 10, "raw", allow_nonfinite=True), body)
    )
    assert np.all(np.isinf(np.concatenate(results)))


@pytest.mark.parametrize(
    "calls, fragment",
    [
        (["get_weights"], "get_weights() on partition 0 came before init(weights)"),
        (
            ["send_weight_partition"],
            "send_weight_partition() on partition 0 came before init(weights)",
        ),
        (
            ["init", "aggregate"],
            "aggregate_gradient_partition() on partition 0 came before put_gradients()",
        ),
        (["init", "put", "put"], "put_gradients() was called twice on partition 0"),
        (["init", "init"], "init() was called twice on partition 0"),
        (
            ["init", "send_weight_partition", "send_weight_partition"],
            "send_weight_partition() was called twice on partition 0 with no aggregate_gradient_partition()",
        ),
    ],
)
def test_calls_out_of_order_are_refused(calls, fragment):
    def body(p):
        for call in calls:
            {
                "get_weights": p.get_weights,
                "send_weight_partition": p.send_weight_partition,
                "init": lambda: p.init(np.zeros(8)),
                "put": lambda: p.put_gradients(np.zeros(8)),
                "aggregate": p.aggregate_gradient_partition,
            }[call]()

    expect_error(AllReduceParameter(1, 8, "raw"), body, UsageError, fragment)


def test_all_counts_zero_is_refused():
    def body(p):
        p.init(np.zeros(8))
        p.put_gradients(np.zeros(8), count=0)
        p.aggregate_gradient_partition()

    expect_error(AllReduceParameter(2, 8, "raw"), body, InputError, "every partition put count=0")


def test_settings_are_checked_on_the_driver():
    with pytest.raises(ConfigurationError, match="unknown codec|'zstd'"):
        AllReduceParameter(2, 10, codec="zstd")
    with pytest.raises(ConfigurationError, match="size must be a positive"):
        AllReduceParameter(2, 0)
    with pytest.raises(ConfigurationError, match="partition_num must be a positive"):
        AllReduceParameter(0, 10)
    for threads in (0, True, 2.5):
        with pytest.raises(
            ConfigurationError,
            match=f"fetch_threads must be a positive whole number, got {threads}",
        ):
            AllReduceParameter(2, 10, fetch_threads=threads)


def test_partition_count_mismatch_says_what_to_change():
    from allreduce_param.engine import LocalRendezvous

    with pytest.raises(
        ConfigurationError, match="made for 3 partitions but this stage has 2 tasks"
    ):
        AllReduceParameter(3, 10).connect(LocalRendezvous(2).member(0))


# ---- faults ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("unix_sockets", [True, False])
def test_a_silent_peer_times_out_naming_peer_block_and_version(unix_sockets):
    released = threading.Event()

    def body(p):
        p.init(np.zeros(10))
        if p.info.partition_id == 1:
            released.wait(60)  # alive but silent: never publishes version 1
            return "never sent version 1"
        try:
            p.send_weight_partition()
            p.get_weights()
        finally:
            released.set()

    results = run_partitions(
        AllReduceParameter(2, 10, "raw", timeout=1.5, unix_sockets=unix_sockets), body
    )
    error = results[0]
    assert isinstance(error, FetchTimeoutError), results
    assert "partition 1 at 127.0.0.1:" in str(error)
    assert "weight block from partition 1 to all, version 1" in str(error)


@pytest.mark.parametrize("unix_sockets", [True, False])
def test_a_peer_that_dies_mid_step_fails_the_others_promptly(unix_sockets):
    def body(p):
        p.init(np.zeros(1000))
        p.get_weights()
        if p.info.partition_id == 2:
            raise RuntimeError("partition 2 crashed")
        p.put_gradients(np.ones(1000))
        return p.aggregate_gradient_partition()

    # a long timeout: the survivors must notice the lost peer, not wait it out
    results = run_partitions(
        AllReduceParameter(3, 1000, "raw", timeout=600, unix_sockets=unix_sockets), body, timeout=60
    )
    assert str(results[2]) == "partition 2 crashed"
    survivors = results[:2]
    assert all(isinstance(error, PeerLostError) for error in survivors), results
    # the crashed partition keeps answering with its reason until its peers hang up, so
    # every survivor names the root cause, first hand or relayed by the other survivor
    for error in survivors:
        assert re.search(
            r"while we fetched (weight|gradient) block from partition \d+ .*; it said: "
            r"partition \d failed: .*partition 2 failed: RuntimeError: partition 2 crashed$",
            str(error),
        ) or str(error).endswith(
            "it said: partition 2 failed: RuntimeError: partition 2 crashed"
        ), str(error)


@pytest.mark.parametrize("unix_sockets", [True, False])
@pytest.mark.parametrize("failing", [(0, 1, 2), (1,)])
def test_partitions_failing_before_any_fetch_do_not_wait_out_the_linger(
    failing, unix_sockets, caplog
):
    """Partitions that fail before fetching anything (a task's fit refused as it is set up)
    have no connection to hang up: each tells its peers it fetches nothing more, so no
    partition, failed or told of the failure, waits ``failure_linger`` for a goodbye that
    never comes (the engine logs it where it gives up waiting)."""

    def body(p):
        if p.info.partition_id in failing:
            raise RuntimeError(f"partition {p.info.partition_id} refused its fit")
        p.init(np.zeros(12))
        p.get_weights()

    param = AllReduceParameter(
        3, 12, "raw", timeout=600, unix_sockets=unix_sockets, host_arena=False
    )
    with caplog.at_level("WARNING", logger="allreduce_param"):
        results = run_partitions(param, body, timeout=60)
    for partition, result in enumerate(results):
        if partition in failing:
            assert str(result) == f"partition {partition} refused its fit"
        else:
            assert isinstance(result, PeerLostError), results
            assert "it said: partition 1 failed: RuntimeError: partition 1 refused" in str(result)
    assert not [r.message for r in caplog.records if "to say they were done" in r.message]


def test_a_partition_that_finishes_first_serves_until_its_peers_are_done():
    closing = threading.Event()

    def body(p):
        p.init(np.arange(10.0))
        if p.info.partition_id == 0:
            p.weight_partition[:] += 1
            p.send_weight_partition()
            closing.set()  # leaves the with-block: close() must wait for partition 1
            return None
        p.send_weight_partition()
        closing.wait(30)
        return p.get_weights()

    results = raise_first(run_partitions(AllReduceParameter(2, 10, "raw", timeout=30), body))
    assert np.array_equal(
        results[1], np.arange(10.0, dtype=np.float32) + np.r_[np.ones(5), np.zeros(5)]
    )


def ours() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("allreduce-"))


def test_no_thread_outlives_the_handle_on_any_path():
    assert ours() == []

    def fine(p):
        p.init(np.zeros(100))
        p.get_weights()
        return ours()

    def failing(p):
        p.init(np.zeros(100))
        if p.info.partition_id == 0:
            raise RuntimeError("stop")
        p.put_gradients(np.zeros(100))
        p.aggregate_gradient_partition()

    during = raise_first(run_partitions(AllReduceParameter(3, 100, "raw"), fine))
    assert all(any(name.startswith("allreduce-accept") for name in names) for names in during)
    assert ours() == []
    run_partitions(AllReduceParameter(3, 100, "raw", timeout=30), failing)
    assert ours() == []


def test_exact_allreduce_keeps_counts_whole_under_a_lossy_codec():
    def body(p):
        counts = np.array([4095.0, 1797.0, 16_000_001.0, 2.0**51 + p.info.partition_id])
        return (
            p.collectives.allreduce_exact(counts),
            p.collectives.allreduce_exact(counts * 2),
            p.collectives.allreduce(counts.astype(np.float32)),
        )

    for exact, again, rounded in raise_first(
        run_partitions(AllReduceParameter(3, 10, codec="bf16"), body)
    ):
        assert exact.dtype == np.float64
        assert exact.tolist() == [3 * 4095.0, 3 * 1797.0, 48_000_003.0, 3 * 2.0**51 + 3]
        assert again.tolist() == (2 * exact).tolist()  # a second call reads its own version
        assert rounded[0] != 3 * 4095.0  # what the fit's own codec would have made of it


def test_exact_allreduce_refuses_what_is_not_a_vector():
    def body(p):
        p.collectives.allreduce_exact(np.zeros((2, 2)))

    expect_error(
        AllReduceParameter(1, 10),
        body,
        InputError,
        "allreduce_exact(values) on partition 0: expected a non-empty 1-D vector, got shape (2, 2)",
    )


def test_close_then_an_error_surfaces_the_error_and_closes_once():
    def body(p):
        p.init(np.zeros(10))
        p.close()
        raise ValueError("the user's own error")

    results = run_partitions(AllReduceParameter(2, 10, "raw"), body)
    assert [str(r) for r in results] == ["the user's own error"] * 2
    assert ours() == []


def test_a_handle_that_failed_partway_takes_no_more_calls():
    size = 1000

    def body(p):
        p.init(np.zeros(size))
        p.get_weights()
        bad = np.zeros(size, np.float32)
        bad[0] = np.nan  # in partition 0's chunk: its owner finds it as it sums
        p.put_gradients(bad if p.info.partition_id == 1 else np.ones(size, np.float32))
        if p.info.partition_id == 0:
            with pytest.raises(
                NonFiniteGradientError, match="the gradient of partition 1 for step 0 .* index 0"
            ):
                p.aggregate_gradient_partition()
            with pytest.raises(
                UsageError,
                match=r"get_weights\(\) on partition 0: this handle failed in an earlier "
                r"call \(NonFiniteGradientError: .*\); .* connect again",
            ):
                p.get_weights()
            return "refused"
        p.aggregate_gradient_partition()  # its own chunk is finite: the step is half done
        return "stepped"

    assert run_partitions(AllReduceParameter(2, size, "raw", timeout=30), body) == [
        "refused",
        "stepped",
    ]


def test_descriptors_and_buffers_do_not_grow_with_the_model():
    """A 100x larger vector takes no more shared-memory descriptors, and under BSP each block
    part has one buffer (every reader is done with a version before the next is made)."""
    from allreduce_param.engine.blocks.store import BlockKey, BlockKind

    def body(p):
        grads = np.full(p.info.layout.size, 1.0, np.float32)
        p.init(np.zeros(p.info.layout.size))
        for _ in range(3):
            p.get_weights()
            p.put_gradients(grads)
            p.weight_partition[:] -= p.aggregate_gradient_partition()
            p.send_weight_partition()
        buffers = {
            p._peers.store.buffer_count(BlockKey(kind, p.info.partition_id, destination, 0))
            for kind, destination in (
                (BlockKind.WEIGHT, 0xFFFFFFFF),
                (BlockKind.GRADIENT, 1 - p.info.partition_id),
            )
        }
        return p._peers.shared.count, buffers

    for size in (100_000, 10_000_000):
        param = AllReduceParameter(2, size, "raw", timeout=60, host_arena=False)  # blocks
        results = raise_first(run_partitions(param, body))
        assert all(segments == 1 and buffers == {1} for segments, buffers in results), (
            size,
            results,
        )


def test_get_weights_without_out_refills_one_array():
    """The README's ``w = p.get_weights()`` costs no new 40 MB a step: the handle fills one
    array again, and the values are each step's weights."""

    def body(p):
        p.init(np.zeros(p.info.layout.size, np.float32))
        first = p.get_weights()
        seen = []
        for _ in range(3):
            w = p.get_weights()
            seen.append((w is first, float(w[0])))
            p.put_gradients(np.ones(p.info.layout.size, np.float32))
            p.weight_partition[:] -= p.aggregate_gradient_partition()
            p.send_weight_partition()
        return seen

    # through blocks (the host arena hands out a view instead: tests/test_host_arena.py)
    param = AllReduceParameter(2, 1000, "raw", timeout=60, host_arena=False)
    for seen in raise_first(run_partitions(param, body)):
        assert seen == [(True, 0.0), (True, -1.0), (True, -2.0)]


@pytest.mark.parametrize(
    "peer_scope, family", [(None, "AF_UNIX"), ("another-machine/1", "AF_INET")]
)
def test_peers_meet_by_scope_not_by_host_name(peer_scope, family):
    """Spark may name a task's host "localhost" while its server reports 127.0.0.1: peers of
    one machine and network namespace still meet over Unix sockets and shared memory; a peer
    that says it is elsewhere is reached over TCP."""
    from allreduce_param.engine import LocalRendezvous
    from allreduce_param.engine.movement.rendezvous import Rendezvous

    group = LocalRendezvous(2)

    class NamedHost(Rendezvous):
        def __init__(self, partition_id):
            self.partition_id, self.partition_num = partition_id, 2
            self._member = group.member(partition_id)

        def bind_address(self):
            return "localhost", 0

        def exchange(self, address):
            if peer_scope is not None and self.partition_id == 1:
                address = (*address[:4], peer_scope)
            return self._member.exchange(address)

    param = AllReduceParameter(2, 10_000, "raw", timeout=30, host_arena=False)  # blocks
    families = [None, None]

    def partition(i):
        with param.connect(NamedHost(i)) as p:
            p.init(np.zeros(10_000, np.float32))
            p.get_weights()
            families[i] = {client._sock.family.name for client in p._peers.peers.values()}

    threads = [threading.Thread(target=partition, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert families[0] == {family}, families


def test_error_feedback_keeps_what_the_codec_rounds_off():
    # 1 + 2**-10 is 1.0 in bf16: without feedback every step loses 2**-10 per partition
    gradient = np.full(8, 1.0 + 2.0**-10, np.float32)
    steps = 64

    def body(p, feedback):
        p.init(np.zeros(8))
        residual = np.zeros(8, np.float32) if feedback else None
        total = np.zeros(p.info.slice_length, np.float64)
        for _ in range(steps):
            p.get_weights()
            p.put_gradients(gradient, count=1, residual=residual)
            total += p.aggregate_gradient_partition(avg=1)
            p.send_weight_partition()
        return total

    exact = steps * 2 * (1.0 + 2.0**-10)
    for feedback, worst in ((False, 0.1), (True, 2 * 2.0**-7)):
        results = raise_first(
            run_partitions(AllReduceParameter(2, 8, "bf16"), lambda p, f=feedback: body(p, f))
        )
        error = np.abs(np.concatenate(results) - exact).max()
        assert (error <= worst) if feedback else (error >= worst), (feedback, error)


def test_a_residual_of_the_wrong_shape_is_refused():
    def body(p):
        p.init(np.zeros(10))
        p.put_gradients(np.ones(10), residual=np.zeros(9, np.float32))

    expect_error(
        AllReduceParameter(1, 10, "bf16"),
        body,
        InputError,
        "put_gradients(residual=) on partition 0: expected a writeable contiguous float32 array "
        "of shape (10,), got dtype float32, shape (9,)",
    )


def in_place_steps(grads, counts, steps: int = 3):
    """A body that computes each step's gradient into ``gradient_buffer()`` (step ``s``
    scales the partition's gradient by ``s + 1``); each step's mean and weights, and what
    the store kept of the last gradient chunk published for the next partition."""

    def body(p):
        from allreduce_param.engine.blocks.store import BlockKey, BlockKind

        p.init(np.zeros(p.info.layout.size, np.float32))
        g = p.gradient_buffer()
        assert (
            g is p.gradient_buffer() and g.dtype == np.float32 and g.shape == (p.info.layout.size,)
        )
        seen = []
        for step in range(steps):
            p.get_weights()
            np.multiply(grads[p.info.partition_id], np.float32(step + 1), out=g)
            p.put_gradients(g, count=counts[p.info.partition_id])
            peer = (p.info.partition_id + 1) % p.info.partition_num
            _, kept = p._peers.store.get(
                BlockKey(BlockKind.GRADIENT, p.info.partition_id, peer, 0), step, 1.0
            )
            mean = p.aggregate_gradient_partition().copy()
            p.weight_partition[:] -= LR * mean
            p.send_weight_partition()
            seen.append((mean, kept))
        return seen, p.get_weights().copy()

    return body


@pytest.mark.parametrize("transport", [dict(), dict(shared_memory=False), dict(unix_sockets=False)])
def test_a_gradient_in_the_engines_buffer_is_published_where_it_lies_and_exact(transport):
    """``put_gradients(p.gradient_buffer())`` copies nothing (the store keeps a view of the
    buffer itself), over shared memory, Unix sockets and TCP, and the steps stay exact."""
    size, partitions = 1_100_003, 3  # three parts per chunk
    _, grads, counts = make_data(size, partitions, seed=5)
    param = AllReduceParameter(
        partitions, size, codec="raw", timeout=60, host_arena=False, **transport
    )
    results = raise_first(run_partitions(param, in_place_steps(grads, counts)))
    weights = np.zeros(size, np.float32)
    for step in range(3):
        mean, weights = reference_step(weights, [g * np.float32(step + 1) for g in grads], counts)
        for partition_id, (seen, _final) in enumerate(results):
            got, kept = seen[step]
            assert np.array_equal(got, mean[param.layout.bounds(partition_id)])
            assert type(kept).__name__ == "SplitBlock", "the gradient was copied into the store"
    for _seen, final in results:
        assert np.array_equal(final, weights)


@pytest.mark.parametrize("codec, strategy", [("bf16", None), ("raw", "asp")])
def test_the_engines_gradient_buffer_is_copied_where_it_cannot_be_published_in_place(
    codec, strategy
):
    """A lossy codec encodes, and a background owner reads gradients while the next is
    computed: there the buffer is copied at put, like any vector, and stays writable."""
    from allreduce_param.engine import Strategy

    def body(p):
        p.init(np.zeros(p.info.layout.size, np.float32))
        g = p.gradient_buffer()
        means = []  # every mean gradient an update applied
        if strategy:
            p.background.serve_updates(
                lambda gradient, weights, step: means.append(gradient.copy()), steps=2
            )
        for _ in range(2):
            p.get_weights()
            g[:] = 1.0
            p.put_gradients(g, count=1.0)
            g[:] = -1.0  # the put took a copy: this must not reach anyone
            if not strategy:
                means.append(p.aggregate_gradient_partition().copy())
                p.send_weight_partition()
        if strategy:
            p.background.finish_updates()
        return means

    param = AllReduceParameter(
        2, 1000, codec=codec, timeout=60, strategy=Strategy(strategy) if strategy else None
    )
    for means in raise_first(run_partitions(param, body)):
        assert means and all(np.array_equal(mean, np.ones(500, np.float32)) for mean in means)


def test_the_engines_gradient_buffer_is_read_only_while_peers_read_it():
    """After a put in place peers read the buffer until the next ``get_weights``: writing
    it meanwhile is refused, not silently sent half-changed."""

    def body(p):
        p.init(np.zeros(p.info.layout.size, np.float32))
        g = p.gradient_buffer()
        p.get_weights()
        g[:] = 1.0
        p.put_gradients(g)
        with pytest.raises(ValueError, match="read-only"):
            g[0] = 2.0
        p.weight_partition[:] -= p.aggregate_gradient_partition()
        p.send_weight_partition()
        with pytest.raises(ValueError, match="read-only"):
            g[0] = 2.0
        p.get_weights()
        g[0] = 2.0  # every peer has summed it
        return float(g[0])

    assert raise_first(
        run_partitions(AllReduceParameter(2, 100, codec="raw", timeout=60), body)
    ) == [2.0, 2.0]


def test_topk_gradients_with_error_feedback_lose_nothing_over_the_steps():
    """``gradient_codec="topk"`` sends 1 % of each gradient; what it holds back waits in each
    partition's residual, so what the owners summed plus what is still held is every
    gradient put, and the weights travel whole through their own codec."""
    size, steps = 20_000, 6
    _, grads, counts = make_data(size, 2, seed=11)

    def body(p):
        p.init(np.zeros(size, np.float32))
        residual = np.zeros(size, np.float32)
        summed = np.zeros(p.info.slice_length, np.float64)
        for _ in range(steps):
            p.get_weights()
            p.put_gradients(
                grads[p.info.partition_id], count=counts[p.info.partition_id], residual=residual
            )
            mean = p.aggregate_gradient_partition()
            # 1 % from each partition
            assert np.count_nonzero(mean) <= 2 * -(-p.info.slice_length // 100)
            summed += mean.astype(np.float64) * sum(counts)
            p.weight_partition[:] -= mean
            p.send_weight_partition()
        return summed, residual, p.get_weights().copy(), p.weight_partition.copy()

    param = AllReduceParameter(2, size, codec="raw", gradient_codec="topk", timeout=60)
    assert "gradient_codec='topk'" in repr(param)
    results = raise_first(run_partitions(param, body))
    put = steps * (grads[0].astype(np.float64) + grads[1])
    held = results[0][1].astype(np.float64) + results[1][1]
    for partition_id, (summed, _, weights, own) in enumerate(results):
        bounds = param.layout.bounds(partition_id)
        np.testing.assert_allclose(summed + held[bounds], put[bounds], rtol=1e-5, atol=1e-4)
        # raw weights: every partition sees the owner's bits
        assert np.array_equal(weights[bounds], own)


def test_a_sparse_codec_cannot_carry_weights():
    with pytest.raises(ConfigurationError, match="gradient_codec='topk'"):
        AllReduceParameter(2, 100, codec="topk")


def test_partitions_of_different_parameters_all_learn_it_at_the_meeting():
    """Each partition made its own AllReduceParameter (the mistake of making it inside the
    task): every one of them fails at connect with the same clear message, whichever of them
    would have connected first."""
    from allreduce_param.engine import AuthenticationError, LocalRendezvous

    group = LocalRendezvous(3)
    errors: list = [None] * 3

    def partition(i):
        own = AllReduceParameter(3, 100, "raw", timeout=30)  # a secret of its own
        try:
            with own.connect(group.member(i)) as p:
                p.init(np.zeros(100, np.float32))
        except AuthenticationError as error:
            errors[i] = str(error)

    threads = [threading.Thread(target=partition, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for i, error in enumerate(errors):
        others = [peer for peer in range(3) if peer != i]
        assert error == (
            f"partition {i} met partitions {others} with another AllReduceParameter: the secrets "
            "differ. Every partition must use the same AllReduceParameter object, made on the driver "
            "(make it before the barrier stage; the tasks get it in their closure)"
        )


def engine_threads(partition_id: int) -> dict[str, int]:
    names = [thread.name for thread in threading.enumerate()]
    return {
        # a pool's thread: the prefix, _, its number
        kind: sum(
            name == f"allreduce-{kind}-{partition_id}"
            or name.startswith(f"allreduce-{kind}-{partition_id}_")
            for name in names
        )
        for kind in ("serve", "fetch", "accept")
    }


@pytest.mark.slow
@pytest.mark.parametrize("put", ["put_gradients", "stream_gradients"])
def test_many_more_partitions_than_fetch_threads_sync_exactly_with_bounded_threads(put):
    """24 partitions with 2 fetch threads each: a partition's fetches of versions not yet
    published queue behind each other, and every step is still exact; no partition holds
    more threads than the bounds, whatever N."""
    from allreduce_param.engine.wire.blocks import SERVE_THREADS

    partitions, steps = 24, 3
    size = partitions * 40 + 7
    weights, grads, counts = make_data(size, partitions, seed=24)
    param = AllReduceParameter(
        partitions, size, codec="raw", timeout=60, fetch_threads=2, host_arena=False
    )

    def body(p):
        p.init(weights)
        seen = []
        for _ in range(steps):
            p.get_weights()
            if put == "put_gradients":
                p.put_gradients(grads[p.info.partition_id], count=counts[p.info.partition_id])
            else:
                with p.stream_gradients(
                    grads[p.info.partition_id], count=counts[p.info.partition_id]
                ) as stream:
                    stream.ready(0, size)
            p.weight_partition[:] -= LR * p.aggregate_gradient_partition()
            p.send_weight_partition()
            seen.append(engine_threads(p.info.partition_id))
        return p.get_weights().copy(), seen

    results = raise_first(run_partitions(param, body))
    expected = weights
    for _ in range(steps):
        _, expected = reference_step(expected, grads, counts)
    for after, seen in results:
        assert np.array_equal(after, expected)
        for threads in seen:
            assert (
                threads["accept"] == 1
                and 1 <= threads["serve"] <= SERVE_THREADS
                and threads["fetch"] <= 2
            )
    assert ours() == []


@pytest.mark.slow
def test_a_background_owner_with_more_partitions_than_fetch_threads_applies_every_gradient():
    """ssp over 12 partitions with one fetch thread each: the workers' reads queue, the
    owners (waiting idle, on one thread too) take every gradient once, and all end with the same weights."""
    from allreduce_param.engine import Strategy

    partitions, steps = 12, 4
    size = partitions * 10
    weights, grads, counts = make_data(size, partitions, seed=12)
    param = AllReduceParameter(
        partitions,
        size,
        codec="raw",
        timeout=60,
        fetch_threads=1,
        strategy=Strategy("ssp", staleness=1),
    )

    assert_owners_take_every_gradient(param, weights, grads, counts, steps)


def assert_owners_take_every_gradient(param, weights, grads, counts, steps, partition_0_waits=None):
    """Each partition puts ``steps`` gradients, its background owner updating its slice;
    with ``partition_0_waits`` (a barrier), partition 0 starts putting only once every other
    has put all of its own. Every partition must end with the same weights, every row of
    every step applied once."""

    def body(p):
        p.init(weights)
        p.background.serve_updates(
            lambda gradient, weight, step: weight.__isub__(LR * gradient), steps
        )
        if partition_0_waits is not None and p.info.partition_id == 0:
            partition_0_waits.wait(timeout=30)
        for _ in range(steps):
            p.get_weights()
            p.put_gradients(grads[p.info.partition_id], count=counts[p.info.partition_id])
        if partition_0_waits is not None and p.info.partition_id != 0:
            partition_0_waits.wait(timeout=30)
        p.background.finish_updates()
        return p.get_weights().copy(), sum(update.count for update in p.background.updates)

    results = raise_first(run_partitions(param, body))
    assert all(np.array_equal(after, results[0][0]) for after, _ in results)
    # every row of every step, once
    assert all(applied == steps * sum(counts) for _, applied in results)
    assert ours() == []


@pytest.mark.parametrize("strategy", ["asp", "ssp"])
def test_a_background_owner_on_one_thread_takes_a_ready_gradient_while_another_source_is_behind(
    strategy,
):
    """A background owner with one fetch thread and a source that holds its first gradient
    back until another source has put all of its own: the owner must take the ready ones
    meanwhile. A fetch that held the thread while it waited for the late source would keep
    the others' queued, and the other source, whose next gradient waits until its last one
    was read, could never finish: every partition would time out."""
    from allreduce_param.engine import Strategy

    partitions, steps = 3, 4
    size = partitions * 8
    weights, grads, counts = make_data(size, partitions, seed=3)
    rule = Strategy("asp") if strategy == "asp" else Strategy("ssp", staleness=steps)
    param = AllReduceParameter(
        partitions, size, codec="raw", timeout=20, fetch_threads=1, strategy=rule
    )
    # the late partition 0 waits for the others' last puts
    others_done = threading.Barrier(partitions)
    assert_owners_take_every_gradient(
        param, weights, grads, counts, steps, partition_0_waits=others_done
    )


@pytest.mark.parametrize("slice_length, pool_used", [(1000, False), (INLINE_LENGTH + 1, True)])
def test_with_one_peer_a_small_block_is_fetched_on_the_callers_thread(slice_length, pool_used):
    """A small vector's sync is mostly hand-offs between threads: where the caller waits for
    every block next (get_weights, aggregate), the last peer's small one-part blocks are
    fetched on its own thread, so with one peer the worker's fetch pool starts no thread.
    Larger blocks stay on the pool, the caller copying or summing what it has meanwhile.
    The same bits either way."""
    size = 2 * slice_length
    weights, grads, counts = make_data(size, 2, seed=slice_length)
    step = one_step(weights, grads, counts)

    def body(p):
        return step(p), len(p._peers.worker.pool._threads)

    param = AllReduceParameter(2, size, "raw", timeout=30, host_arena=False)  # blocks
    results = raise_first(run_partitions(param, body))
    mean, updated = reference_step(weights, grads, counts)
    for partition_id, ((before, gradient, after), threads) in enumerate(results):
        assert np.array_equal(before, weights)
        assert np.array_equal(gradient, mean[param.layout.bounds(partition_id)])
        assert np.array_equal(after, updated)
        assert (threads > 0) == pool_used
