"""N plain processes (no Spark) meeting through a StaticRendezvous, as a benchmark or MPI-style launcher would."""

from __future__ import annotations

import multiprocessing
import socket

import numpy as np
import pytest

from allreduce_param import AllReduceParameter, StaticRendezvous, UsageError


def free_loopback_ports(count: int) -> list[int]:
    """Ports the kernel just handed out on 127.0.0.1; the processes bind them again at once."""
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def partition(param: AllReduceParameter, addresses: list, partition_id: int, results) -> None:
    try:
        with param.connect(StaticRendezvous(partition_id, addresses)) as p:
            p.init(np.arange(param.size, dtype=np.float32))
            p.put_gradients(np.full(param.size, partition_id + 1.0, np.float32), count=2.0)
            p.weight_partition[:] -= p.aggregate_gradient_partition()
            p.send_weight_partition()
            results.put((partition_id, p.get_weights(), p.allreduce(np.ones(3), op="sum")))
    except BaseException as error:  # reported to the test, which fails on it
        results.put((partition_id, repr(error), None))


def test_static_addresses_sync_plain_processes():
    partitions, size = 3, 100_003
    param = AllReduceParameter(partitions, size, codec="raw", timeout=60)
    addresses = [("127.0.0.1", port) for port in free_loopback_ports(partitions)]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=partition, args=(param, addresses, i, results))
        for i in range(partitions)
    ]
    for process in processes:
        process.start()
    try:
        got = sorted((results.get(timeout=120) for _ in processes), key=lambda entry: entry[0])
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
    # gradient sums 1+2+3 over 3 partitions x 2 samples: the mean is 1
    expected = np.arange(size, dtype=np.float32) - np.float32(6.0) / np.float32(6.0)
    for _partition_id, weights, total in got:
        assert isinstance(weights, np.ndarray), weights
        assert np.array_equal(weights, expected)
        assert np.array_equal(total, np.full(3, 3.0, np.float32))
    assert all(process.exitcode == 0 for process in processes)


def test_a_process_that_never_starts_is_named_after_the_timeout():
    own, absent = free_loopback_ports(2)
    param = AllReduceParameter(2, 10, codec="raw")
    with pytest.raises(
        UsageError,
        match=rf"partition 1 at 127.0.0.1:{absent} did not start serving within "
        r"0.3 s .*start all 2 processes with the same address list",
    ):
        param.connect(StaticRendezvous(0, [("127.0.0.1", own), ("127.0.0.1", absent)], timeout=0.3))


def vanish(param: AllReduceParameter, addresses: list, partition_id: int, results) -> None:
    """Partition 1 meets partition 0 (it reads its weights), then its process ends at once, as a
    killed executor's does."""
    import os

    try:
        with param.connect(StaticRendezvous(partition_id, addresses)) as p:
            p.init(np.zeros(param.size, np.float32))
            if partition_id == 1:
                p.get_weights()  # partition 0 is serving: it has met us
                os._exit(1)
            p.put_gradients(np.ones(param.size, np.float32), count=1.0)
            p.aggregate_gradient_partition()
        results.put((partition_id, "finished"))
    except BaseException as error:
        results.put((partition_id, f"{type(error).__name__}: {error}"))


def test_a_peer_lost_without_a_word_points_at_executor_memory():
    param = AllReduceParameter(2, 1000, codec="raw", timeout=60)
    addresses = [("127.0.0.1", port) for port in free_loopback_ports(2)]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=vanish, args=(param, addresses, i, results)) for i in range(2)
    ]
    for process in processes:
        process.start()
    try:
        partition_id, outcome = results.get(timeout=120)
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
    assert partition_id == 0 and outcome.startswith("PeerLostError: partition 1 at 127.0.0.1"), (
        outcome
    )
    assert (
        "without a word: its task failed or its executor was lost, often killed for using too much memory"
        in outcome
        and "spark.executor.memory" in outcome
    )
