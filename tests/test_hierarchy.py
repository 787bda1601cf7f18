"""Hierarchical sync: hosts sum within themselves, their leaders exchange; same bits as flat.

Partitions run as threads (``run_partitions(hosts=...)``): the meeting places them on
hosts, so those of one host meet over Unix sockets and shared memory and the others over
TCP on 127.0.0.1. ``test_sim_hosts`` runs the same across real network namespaces.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import raise_first, run_partitions

from allreduce_param import ConfigurationError, PeerLostError
from allreduce_param.engine import AllReduceParameter, NonFiniteGradientError, Strategy
from allreduce_param.engine.layout import HostLayout
from allreduce_param.engine.movement.peers import PART_LENGTH

LR = np.float32(0.25)
STEPS = 3


def reference(weights, grads, counts, hosts, steps=STEPS):
    """Every step's weights as the documented order gives them: on each host in partition
    order, then the host sums in host order; divided by the summed counts."""
    order = HostLayout(
        [next(h for h, members in enumerate(hosts) if p in members) for p in range(len(grads))]
    ).hosts
    history, weights = [], weights.copy()
    for step in range(steps):
        history.append(weights.copy())
        host_sums = []
        for members in order:
            total = grads[members[0]] * np.float32(step + 1)
            for p in members[1:]:
                total = total + grads[p] * np.float32(step + 1)
            host_sums.append(total)
        summed = host_sums[0]
        for more in host_sums[1:]:
            summed = summed + more
        count = sum(sum(counts[p] for p in members) for members in order)
        weights = weights - LR * (summed / np.float32(count))
    history.append(weights)
    return history


def make(size, partitions, seed=0):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(partitions)]
    counts = [float(2 + 3 * p) for p in range(partitions)]
    return weights, grads, counts


def steps(weights, grads, counts, stream=False, in_place=False):
    def body(p):
        p.init(weights)
        seen = []
        for step in range(STEPS):
            seen.append(p.get_weights().copy())
            gradient = p.gradient_buffer() if in_place else np.empty_like(grads[0])
            np.multiply(grads[p.info.partition_id], np.float32(step + 1), out=gradient)
            if stream:
                with p.stream_gradients(gradient, count=counts[p.info.partition_id]) as flow:
                    flow.ready(0, gradient.size)
            else:
                p.put_gradients(gradient, count=counts[p.info.partition_id])
            p.weight_partition[:] -= LR * p.aggregate_gradient_partition()
            p.send_weight_partition()
        seen.append(p.get_weights().copy())
        return seen, p.info.hierarchical, p.info.connections, p.info.remote_peers

    return body


LAYOUTS = {
    "2x2": [[0, 1], [2, 3]],
    "interleaved": [[0, 2, 4], [1, 3], [5]],
    "one alone first": [[0], [1, 2, 3], [4, 5]],
}


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["raw", "lz4"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hierarchical_is_the_documented_sum_bit_for_bit_and_so_is_flat(layout, codec):
    hosts = LAYOUTS[layout]
    partitions = sum(map(len, hosts))
    size = 2 * PART_LENGTH + 7919  # several parts per slice for 2x2, one for 6 partitions
    weights, grads, counts = make(size, partitions, seed=len(layout))
    expected = reference(weights, grads, counts, hosts)
    for topology in ("auto", "flat"):
        param = AllReduceParameter(partitions, size, codec=codec, timeout=60, topology=topology)
        results = raise_first(run_partitions(param, steps(weights, grads, counts), hosts=hosts))
        for p, (seen, hierarchical, _, _) in enumerate(results):
            assert hierarchical == (topology == "auto"), (topology, p)
            for step, (got, want) in enumerate(zip(seen, expected)):
                assert np.array_equal(got, want), f"{topology}, partition {p}, step {step}"


@pytest.mark.parametrize("host_arena", [False, True])
def test_each_partition_connects_only_to_its_host_and_leaders_to_leaders(host_arena):
    hosts = LAYOUTS["interleaved"]
    weights, grads, counts = make(1000, 6)
    param = AllReduceParameter(6, 1000, codec="raw", timeout=30, host_arena=host_arena)
    results = raise_first(run_partitions(param, steps(weights, grads, counts), hosts=hosts))
    if host_arena:  # a host's gradients and weights are in its arena: only host sums are fetched
        expected_fetch = {0: [1, 5], 2: [0], 4: [0], 1: [0, 5], 3: [1], 5: [0, 1]}
    else:
        expected_fetch = {0: [1, 2, 4, 5], 2: [0, 4], 4: [0, 2], 1: [0, 3, 5], 3: [1], 5: [0, 1]}
    expected_tcp = {0: 2, 1: 2, 5: 2, 2: 0, 3: 0, 4: 0}
    for p, (_, _, connections, remote_peers) in enumerate(results):
        assert connections["fetch"] == expected_fetch[p], p
        assert connections["control"] == [], p
        assert remote_peers == expected_tcp[p], p


@pytest.mark.parametrize("stream, in_place", [(True, False), (False, True)])
def test_streamed_and_in_place_gradients_give_the_same_bits(stream, in_place):
    hosts = LAYOUTS["2x2"]
    weights, grads, counts = make(30011, 4, seed=3)
    expected = reference(weights, grads, counts, hosts)
    param = AllReduceParameter(4, 30011, codec="raw", timeout=30)
    results = raise_first(
        run_partitions(param, steps(weights, grads, counts, stream, in_place), hosts=hosts)
    )
    for p, (seen, hierarchical, _, _) in enumerate(results):
        assert hierarchical
        for got, want in zip(seen, expected):
            assert np.array_equal(got, want), p


def test_a_lossy_codec_rounds_each_host_sum_once_more_and_stays_close():
    hosts = LAYOUTS["interleaved"]
    weights, grads, counts = make(5000, 6, seed=4)
    expected = reference(weights, grads, counts, hosts)
    param = AllReduceParameter(6, 5000, codec="bf16", timeout=30)
    results = raise_first(run_partitions(param, steps(weights, grads, counts), hosts=hosts))
    finals = [seen[-1] for seen, _, _, _ in results]
    assert all(np.array_equal(final, finals[0]) for final in finals)  # the same bits everywhere
    assert np.allclose(finals[0], expected[-1], rtol=0.05, atol=0.05)


def test_allreduce_and_the_exact_allreduce_go_through_the_hosts():
    hosts = LAYOUTS["one alone first"]
    rng = np.random.default_rng(5)
    vectors = [rng.standard_normal(777).astype(np.float32) for _ in range(6)]

    def body(p):
        return (
            p.collectives.allreduce(vectors[p.info.partition_id]),
            p.collectives.allreduce_exact([p.info.partition_id, 0.5]),
            p.info.hierarchical,
        )

    results = raise_first(
        run_partitions(AllReduceParameter(6, 10, codec="raw", timeout=30), body, hosts=hosts)
    )
    host_sums = [vectors[0], vectors[1] + vectors[2] + vectors[3], vectors[4] + vectors[5]]
    expected = host_sums[0] + host_sums[1] + host_sums[2]
    for summed, exact, hierarchical in results:
        assert hierarchical
        assert np.array_equal(summed, expected)
        assert exact.tolist() == [15.0, 3.0]


def test_a_raw_allreduce_goes_through_the_hosts_unrounded_by_a_lossy_codec():
    hosts = LAYOUTS["one alone first"]
    rng = np.random.default_rng(6)
    vectors = [rng.standard_normal(777).astype(np.float32) for _ in range(6)]

    def body(p):
        vector = vectors[p.info.partition_id]
        return p.collectives.allreduce(vector, raw=True), p.collectives.allreduce(vector)

    results = raise_first(
        run_partitions(AllReduceParameter(6, 10, codec="int8", timeout=30), body, hosts=hosts)
    )
    host_sums = [vectors[0], vectors[1] + vectors[2] + vectors[3], vectors[4] + vectors[5]]
    expected = host_sums[0] + host_sums[1] + host_sums[2]
    for raw, coded in results:
        assert np.array_equal(raw, expected)
        assert not np.array_equal(coded, expected)  # int8 rounds the same sum through the codec


def test_a_nan_gradient_is_named_by_its_partition():
    hosts = LAYOUTS["2x2"]
    weights, grads, counts = make(400, 4, seed=6)
    grads[3][123] = np.nan
    param = AllReduceParameter(4, 400, codec="raw", timeout=30)
    results = run_partitions(param, steps(weights, grads, counts), hosts=hosts)
    errors = [r for r in results if isinstance(r, NonFiniteGradientError)]
    assert errors and all("partition 3" in str(e) and "index 123" in str(e) for e in errors), (
        results
    )
    assert all(isinstance(r, BaseException) for r in results)  # nobody goes on with it


def test_a_member_that_dies_fails_every_partition_naming_it():
    hosts = LAYOUTS["2x2"]
    weights, grads, counts = make(400, 4, seed=7)
    body = steps(weights, grads, counts)

    def dying(p):
        if p.info.partition_id == 3:
            p.init(weights)
            p.get_weights()
            raise RuntimeError("the model blew up on partition 3")
        return body(p)

    results = run_partitions(
        AllReduceParameter(4, 400, codec="raw", timeout=60), dying, hosts=hosts, timeout=90
    )
    assert isinstance(results[3], RuntimeError)
    for p in (0, 1, 2):
        assert isinstance(results[p], PeerLostError), (p, results[p])
        assert "partition 3 failed: RuntimeError: the model blew up" in str(results[p]), p


def test_other_strategies_stay_flat_and_hierarchical_is_refused_for_them():
    with pytest.raises(
        ConfigurationError,
        match="topology='hierarchical' goes with strategy='bsp' and no backup "
        "workers, not with strategy='ssp'.* or set strategy='bsp'",
    ):
        AllReduceParameter(4, 10, strategy=Strategy("ssp", staleness=1), topology="hierarchical")
    with pytest.raises(
        ConfigurationError,
        match="topology must be one of 'auto', 'hierarchical', 'flat', got 'ring'",
    ):
        AllReduceParameter(4, 10, topology="ring")
    param = AllReduceParameter(4, 10, strategy=Strategy("asp"))

    def body(p):
        return p.info.hierarchical

    assert raise_first(run_partitions(param, body, hosts=LAYOUTS["2x2"])) == [False] * 4


def test_host_layout_orders_hosts_by_their_leaders_and_groups_any_partitions():
    hosts = HostLayout(["b", "a", "b", None, "a", "c"])
    assert hosts.hosts == ((0, 2), (1, 4), (3,), (5,))
    assert hosts.leaders == (0, 1, 3, 5) and hosts.leader(4) == 1 and hosts.nested
    assert hosts.grouped([5, 4, 2, 0]) == [(0, 2), (4,), (5,)]
    assert hosts.neighbours(2, hierarchical=True) == (0,)
    assert hosts.neighbours(1, hierarchical=True) == (0, 3, 4, 5)
    assert hosts.neighbours(2, hierarchical=False) == (0, 1, 3, 4, 5)
    assert not HostLayout(["x"] * 4).nested and not HostLayout([None] * 4).nested


def test_signals_go_through_the_leaders_and_the_waiter_sees_every_one():
    hosts = LAYOUTS["interleaved"]  # partition 3 signals late, from another host, not a leader
    zero_waits = threading.Event()
    signalled: list[int] = []

    def body(p):
        if p.info.partition_id == 3:
            zero_waits.wait(30)
        if p.info.partition_id != 0:
            signalled.append(p.info.partition_id)
            p.collectives.signal(1)
            return None
        p.collectives.signal(1)
        zero_waits.set()
        p.collectives.wait_for_signals(1)
        return sorted(signalled), p.info.connections["control"]

    results = raise_first(run_partitions(AllReduceParameter(6, 10, timeout=30), body, hosts=hosts))
    seen, control = results[0]
    assert seen == [1, 2, 3, 4, 5]  # 3's signal came through its leader, 1
    assert control == [1, 2, 4, 5]  # this host's partitions and the other leaders, not 3
