"""Hierarchical sync through host arenas (``AllReduceParameter(host_arena=True)`` on several
hosts): each host's leader makes its arena; the host's gradients are summed from it and the
other hosts' slices fetched into it. The same bits as without arenas, and every way a wait
ends: a peer's failure on this host or another, a silent peer, a dead leader's process.

Partitions run as threads placed on simulated hosts (``run_partitions(hosts=...)``).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import run_partitions
from test_hierarchy import LAYOUTS, make

from allreduce_param import FetchTimeoutError, PeerLostError
from allreduce_param.engine import AllReduceParameter
from allreduce_param.engine.blocks.arena import HostArena
from allreduce_param.engine.blocks.arena_signals import PID, PID_NAMESPACE, WEIGHT, pid_namespace
from allreduce_param.engine.movement.peers import PART_LENGTH
from allreduce_param.errors import StoreClosedError, UsageError

LR = np.float32(0.25)
STEPS = 3


def steps(weights, grads, counts, lent):
    def body(p):
        p.init(weights)
        seen = []
        for step in range(STEPS):
            seen.append(p.get_weights().copy())
            gradient = p.gradient_buffer() if lent else np.empty_like(grads[0])
            np.multiply(grads[p.info.partition_id], np.float32(step + 1), out=gradient)
            p.put_gradients(gradient, count=counts[p.info.partition_id])
            p.weight_partition[:] -= LR * p.aggregate_gradient_partition()
            p.send_weight_partition()
        seen.append(p.get_weights().copy())
        return seen, p.info.hierarchical, p.info.host_arena

    return body


@pytest.mark.parametrize(
    "layout, size, lent",
    [
        ("2x2", 2 * PART_LENGTH + 7919, True),  # several parts per slice
        ("interleaved", 5003, False),  # the caller's own vector, copied in
        ("one alone first", 5003, True),  # a host of one partition has its arena too
    ],
)
def test_arenas_give_the_hierarchical_blocks_bits(layout, size, lent):
    hosts = LAYOUTS[layout]
    partitions = sum(map(len, hosts))
    weights, grads, counts = make(size, partitions, seed=7)
    runs = []
    for arena in (True, False):
        param = AllReduceParameter(partitions, size, "raw", timeout=30, host_arena=arena)
        results = run_partitions(param, steps(weights, grads, counts, lent), hosts=hosts)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        assert all(hierarchical and used == arena for _, hierarchical, used in results)
        runs.append([seen for seen, _, _ in results])
    for mine, theirs in zip(*runs, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    first = runs[0][0]
    for seen in runs[0]:  # every partition reads the same weights
        assert all(np.array_equal(a, b) for a, b in zip(seen, first, strict=True))


def param(timeout: float) -> AllReduceParameter:
    return AllReduceParameter(4, 1000, "raw", timeout=timeout, host_arena=True)


def param_of(size: int) -> AllReduceParameter:
    return AllReduceParameter(4, size, "raw", timeout=30, host_arena=True)


def test_a_failing_member_ends_its_leader_s_wait_with_its_reason():
    """Partition 1 raises before its put: its leader, waiting in the arena to sum the
    host's gradients, hears its reason at once, and the other host the root cause."""

    def body(p):
        p.init(np.zeros(1000, np.float32))
        p.get_weights()
        if p.info.partition_id == 1:
            raise RuntimeError("boom in partition 1")
        p.put_gradients(np.ones(1000, np.float32))
        p.aggregate_gradient_partition()

    results = run_partitions(param(60), body, hosts=[[0, 1], [2, 3]])
    assert isinstance(results[1], RuntimeError)
    assert isinstance(results[0], PeerLostError), results[0]
    assert "partition 1 at 127.0.0.1" in str(results[0]) and "gradient block" in str(results[0])
    assert "boom in partition 1" in str(results[0])
    for other in (2, 3):
        assert "boom in partition 1" in str(results[other]), results[other]


def test_a_failure_on_another_host_reaches_a_member_through_its_leader():
    """Partition 3 raises before its init: its leader's wait for its slice ends with the
    reason, the other leader's fetch of that host's slices with the root cause, and
    partition 1, waiting in its arena for slices its leader brings, hears its leader."""

    def body(p):
        if p.info.partition_id == 3:
            raise RuntimeError("boom in partition 3")
        p.init(np.zeros(1000, np.float32))
        p.get_weights()

    results = run_partitions(param(60), body, hosts=[[0, 1], [2, 3]])
    assert isinstance(results[3], RuntimeError)
    assert isinstance(results[2], PeerLostError) and "partition 3 at" in str(results[2])
    assert isinstance(results[1], PeerLostError), results[1]
    message = str(results[1])
    assert (
        "partition 0 at 127.0.0.1" in message and "this host's leader, which brings it" in message
    )
    assert "weight block from partition 2 to all, version 0" in message
    assert "boom in partition 3" in message


def test_a_silent_leader_is_a_timeout_naming_it():
    """Partition 0 never reads the weights: partition 1 waits in its arena for the other
    host's slices, which its leader would bring, and times out naming the leader."""
    stop = threading.Event()

    def body(p):
        p.init(np.zeros(1000, np.float32))
        if p.info.partition_id == 0:
            stop.wait(30)  # until the others have given up
            return None
        try:
            p.get_weights()
        finally:
            if p.info.partition_id == 1:
                stop.set()

    results = run_partitions(param(0.5), body, hosts=[[0, 1], [2, 3]])
    assert isinstance(results[1], FetchTimeoutError), results[1]
    message = str(results[1])
    assert "partition 0 at 127.0.0.1" in message and "(this host's leader) did not bring" in message
    assert "weight block from partition 2 to all, version 0" in message


def test_a_silent_member_is_a_timeout_naming_it():
    stop = threading.Event()

    def body(p):
        p.init(np.zeros(1000, np.float32))
        if p.info.partition_id == 3:
            stop.wait(30)
            return None
        try:
            p.get_weights()
            p.put_gradients(np.ones(1000, np.float32))
            p.aggregate_gradient_partition()
        finally:
            if p.info.partition_id == 2:
                stop.set()

    results = run_partitions(param(0.5), body, hosts=[[0, 1], [2, 3]])
    assert isinstance(results[2], FetchTimeoutError), results[2]
    message = str(results[2])
    assert "partition 3 at 127.0.0.1" in message
    assert "did not publish the gradient block from partition 3 to partition 2" in message


def test_a_dead_leader_s_process_ends_a_wait_for_what_it_brings():
    """A member waits for another host's slice, whose word its leader writes; the leader's
    process is gone (killed, not yet reaped): its pidfd ends the wait at once."""
    arena = HostArena.create(3, 10, 1, timeout=60)  # partition 1's view; 2 is on another host
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        arena.writers = [0, 1, 0]
        line = arena.signals.line(0)
        line[PID_NAMESPACE], line[PID] = pid_namespace(), leader.pid
        leader.kill()
        with pytest.raises(PeerLostError) as lost:
            arena.wait(WEIGHT, 0, [2])
    finally:
        leader.kill()
        leader.wait()
        arena.close()
    message = str(lost.value)
    assert f"partition 0 (this host's leader, which brings it) (pid {leader.pid}) exited" in message
    assert "weight block from partition 2 to all, version 0" in message
    assert "without a word" in message


def test_a_partition_maps_its_host_s_gradients_only():
    """An arena has a slot for every partition's gradient; a partition maps the weights
    and its own host's gradients only, so more hosts add no address space (a limit such
    as spark.executor.pyspark.memory counts it)."""
    size = 1_000_000
    both_in = threading.Barrier(4)
    mapped = []

    def arena_bytes() -> int:
        total = 0
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "allreduce-param-arena" in line:
                    start, end = line.split()[0].split("-")
                    total += int(end, 16) - int(start, 16)
        return total

    def body(p):
        p.init(np.zeros(size, np.float32))
        both_in.wait(30)
        if p.info.partition_id == 0:
            mapped.append(arena_bytes())
        both_in.wait(30)
        return p.info.host_arena

    gc.collect()  # earlier tests' arenas, unmapped once their last views are garbage
    before = arena_bytes()  # any still held elsewhere in this process
    results = run_partitions(param_of(size), body, hosts=[[0, 1], [2, 3]])
    assert results == [True] * 4, results
    vector = 4 * size
    # 4 partitions, each the weights and its host's 2 gradients (and a few control pages)
    assert 4 * 3 * vector <= mapped[0] - before < 4 * 3 * vector + 4 * (1 << 20), (mapped, before)


def test_our_own_shutdown_ends_a_wait_for_what_the_leader_brings():
    """Partition 1 waits in its arena for the other host's slices, which its leader
    (stalled) would bring; a shutdown of partition 1 from another thread (a task kill's
    cleanup) ends the wait with its own shutting down, not the timeout."""
    handles = {}
    waiting, done = threading.Event(), threading.Event()

    def body(p):
        p.init(np.zeros(1000, np.float32))
        handles[p.info.partition_id] = p
        if p.info.partition_id == 0:
            waiting.wait(30)
            handles[1]._peers.shutdown()  # partition 1's, from this thread
            done.wait(30)
            return "shut partition 1 down"
        if p.info.partition_id == 1:
            waiting.set()  # whether before or in the wait below, it ends with our shutdown
            try:
                p.get_weights()
            finally:
                done.set()
        return None

    results = run_partitions(param(60), body, hosts=[[0, 1], [2, 3]])
    assert results[0] == "shut partition 1 down"
    assert isinstance(results[1], (StoreClosedError, UsageError)), results[1]
    assert "partition 1 is shutting down" in str(results[1]) or "closed" in str(results[1])
