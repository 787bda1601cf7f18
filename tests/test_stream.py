"""stream_gradients: a gradient sent owner chunk by owner chunk while backward computes the rest.

N partitions as threads over real loopback sockets, as in test_parameter.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import raise_first, run_partitions

from allreduce_param import InputError, PeerLostError, UsageError
from allreduce_param.engine import AllReduceParameter
from allreduce_param.engine.blocks.store import BlockKey, BlockKind

LR = np.float32(0.125)
SIZE, PARTITIONS, STEPS = 1_100_003, 3, 3  # three parts per chunk


def pieces(size: int, seed: int) -> list[tuple[int, int]]:
    """``[0, size)`` cut at random places into ranges, in a random order."""
    rng = np.random.default_rng(seed)
    cuts = np.unique(np.r_[0, np.sort(rng.integers(1, size, 6)), size])
    ranges = list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))
    return [ranges[i] for i in rng.permutation(len(ranges))]


def steps(grads, counts, how: str, residuals: bool = False):
    """A body that runs ``STEPS`` BSP steps with the step's gradient (the partition's scaled by
    step + 1) put whole (``how="put"``), or streamed range by range in a random order, each
    range written just before it is reported (``"stream"``), or streamed with no range
    reported (``"silent"``); each step's mean and the final weights (and residual)."""

    def body(p):
        p.init(np.zeros(p.info.layout.size, np.float32))
        g = p.gradient_buffer()
        residual = np.zeros(p.info.layout.size, np.float32) if residuals else None
        means = []
        for step in range(STEPS):
            p.get_weights()
            value = grads[p.info.partition_id] * np.float32(step + 1)
            if how == "put":
                g[:] = value
                p.put_gradients(g, count=counts[p.info.partition_id], residual=residual)
            else:
                with p.stream_gradients(
                    g, count=counts[p.info.partition_id], residual=residual
                ) as stream:
                    for start, stop in pieces(
                        p.info.layout.size, seed=10 * step + p.info.partition_id
                    ):
                        g[start:stop] = value[start:stop]
                        if how == "stream":
                            stream.ready(start, stop)
            means.append(p.aggregate_gradient_partition().copy())
            p.weight_partition[:] -= LR * means[-1]
            p.send_weight_partition()
        return means, p.get_weights().copy(), residual

    return body


def make_grads(seed: int = 3):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SIZE).astype(np.float32) for _ in range(PARTITIONS)], [
        10.0,
        13.0,
        0.0,
    ]


@pytest.mark.parametrize(
    "codec, transport",
    [
        ("raw", {}),
        ("raw", {"shared_memory": False}),
        ("raw", {"unix_sockets": False}),
        ("lz4", {}),
        ("bf16", {}),
    ],
)
def test_a_streamed_gradient_gives_the_bits_a_put_gives(codec, transport):
    """Whatever order the ranges come in, with or without any reported, and with error
    feedback under a lossy codec: the same means, weights and residuals as put_gradients."""
    grads, counts = make_grads()
    lossy = codec == "bf16"

    def run(how):
        param = AllReduceParameter(PARTITIONS, SIZE, codec=codec, timeout=60, **transport)
        return raise_first(run_partitions(param, steps(grads, counts, how, residuals=lossy)))

    expected = run("put")
    for how in ("stream", "silent"):
        for (means, weights, residual), (want_means, want_weights, want_residual) in zip(
            run(how), expected
        ):
            assert all(np.array_equal(got, want) for got, want in zip(means, want_means))
            assert np.array_equal(weights, want_weights)
            if lossy:
                assert np.any(residual != 0) and np.array_equal(residual, want_residual)


def test_a_whole_chunk_is_published_before_the_stream_closes():
    """Once owner j's chunk is reported the block for j is in the store, while the rest of
    the gradient is not yet final; the owner's fetch of it is already under way."""
    size = 1000

    def body(p):
        p.init(np.zeros(size, np.float32))
        p.get_weights()
        g = p.gradient_buffer()
        g[:] = p.info.partition_id + 1
        peer = (p.info.partition_id + 1) % 2
        bounds = p.info.layout.bounds(peer)
        with p.stream_gradients(g, count=1.0) as stream:
            stream.ready(bounds.start, bounds.stop)
            # blocks until published: the stream is still open, so ready() published it
            version, block = p._peers.store.get(
                BlockKey(BlockKind.GRADIENT, p.info.partition_id, peer, 0), 0, 10.0
            )
            assert version == 0 and block is not None
            del block
            # the own chunk's fetch from the peer is running
            assert set(p._gradients._prefetched) == {peer}
        return p.aggregate_gradient_partition().copy()

    results = raise_first(
        # the blocks' path (through the host arena nothing leaves before the close)
        run_partitions(AllReduceParameter(2, size, "raw", timeout=30, host_arena=False), body)
    )
    assert all(np.array_equal(mean, np.full(500, 1.5, np.float32)) for mean in results)


@pytest.mark.parametrize(
    "misuse, error, fragment",
    [
        (
            lambda p, s: s.ready(-1, 5),
            InputError,
            "ready(-1, 5) lies outside the gradient vector of 100",
        ),
        (lambda p, s: s.ready(90, 101), InputError, "ready(90, 101) lies outside"),
        (
            lambda p, s: (s.ready(10, 20), s.ready(15, 30)),
            InputError,
            "ready(15, 30) overlaps ready(10, 20)",
        ),
        (
            lambda p, s: (s.ready(30, 40), s.ready(10, 20), s.ready(5, 12)),
            InputError,
            "ready(5, 12) overlaps ready(10, 20)",
        ),
        (
            lambda p, s: (s.ready(0, 10), s.ready(20, 30), s.ready(10, 21)),
            InputError,
            "ready(10, 21) overlaps ready(20, 30)",
        ),
        (
            lambda p, s: p.aggregate_gradient_partition(),
            UsageError,
            "gradient stream is still open",
        ),
        (
            lambda p, s: p.put_gradients(np.zeros(100)),
            UsageError,
            "put_gradients() on partition 0 came while",
        ),
        (
            lambda p, s: (s.close(), s.ready(0, 1)),
            UsageError,
            "ready(0, 1) came after the stream was closed",
        ),
    ],
)
def test_misuse_of_a_stream_is_refused_with_what_to_do(misuse, error, fragment):
    def body(p):
        p.init(np.zeros(100))
        p.get_weights()
        with p.stream_gradients(np.zeros(100, np.float32)) as stream:
            misuse(p, stream)

    results = run_partitions(AllReduceParameter(1, 100, "raw"), body)
    assert isinstance(results[0], error) and fragment in str(results[0]), results


def test_an_error_during_backward_fails_the_handle_and_reaches_the_peers():
    """A model that raises mid-stream leaves a half-published gradient: the handle takes no
    more calls, and the peer waiting for the missing chunk hears why rather than hang."""
    # both are past get_weights: the peer then waits on the chunk
    weights_read = threading.Barrier(2)

    def body(p):
        p.init(np.zeros(100))
        p.get_weights()
        weights_read.wait(30)
        g = p.gradient_buffer()
        try:
            with p.stream_gradients(g, count=1.0) as stream:
                if p.info.partition_id == 0:
                    stream.ready(0, 50)  # the own chunk; owner 1's never comes
                    raise RuntimeError("backward broke")
                stream.ready(0, 100)
        except RuntimeError:
            with pytest.raises(UsageError, match="failed in an earlier call .*backward broke"):
                p.aggregate_gradient_partition()
            raise
        return p.aggregate_gradient_partition()

    results = run_partitions(AllReduceParameter(2, 100, "raw", timeout=30), body)
    assert isinstance(results[0], RuntimeError)
    assert isinstance(results[1], PeerLostError) and "backward broke" in str(results[1]), results[1]


def test_the_publishing_thread_ends_with_the_handle():
    def publishers():
        return [t.name for t in threading.enumerate() if t.name.startswith("allreduce-publish")]

    grads, counts = make_grads()
    param = AllReduceParameter(PARTITIONS, SIZE, codec="lz4", timeout=60, host_arena=False)

    def body(p):
        steps(grads, counts, "stream")(p)
        return publishers()

    during = raise_first(run_partitions(param, body))
    assert any(during) and publishers() == []
