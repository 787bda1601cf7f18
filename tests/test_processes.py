"""N plain processes (no Spark) meeting through a StaticRendezvous, as a benchmark or MPI-style launcher would."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from static_partition import expected_digest

from allreduce_param import AllReduceError, UsageError
from allreduce_param.engine import (
    AllReduceParameter,
    AuthenticationError,
    NetworkSettings,
    StaticRendezvous,
)


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
            weights, total = p.get_weights(), p.collectives.allreduce(np.ones(3), op="sum")
            results.put((partition_id, weights, total, p.info.hosts, p.info.remote_peers))
    except BaseException as error:  # reported to the test, which fails on it
        results.put((partition_id, repr(error), None, None, None))


@pytest.mark.slow
@pytest.mark.parametrize("unix_sockets", [True, False])
def test_static_addresses_sync_plain_processes(unix_sockets):
    """Plain processes on one host find each other's scope (each asks the others for their
    full address) and meet over Unix sockets and shared memory, as tasks of one executor
    host do; with Unix sockets off each is a host of its own, over TCP. The same bits."""
    partitions, size = 3, 100_003
    param = AllReduceParameter(partitions, size, codec="raw", timeout=60, unix_sockets=unix_sockets)
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
    for _partition_id, weights, total, hosts, remote_peers in got:
        assert isinstance(weights, np.ndarray), weights
        assert np.array_equal(weights, expected)
        assert np.array_equal(total, np.full(3, 3.0, np.float32))
        if unix_sockets:
            assert hosts == ((0, 1, 2),) and remote_peers == 0
        else:
            assert hosts == ((0,), (1,), (2,)) and remote_peers == 2
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


def lost_peer_outcome(param: AllReduceParameter) -> tuple[int, str]:
    """Run ``vanish`` in two spawned processes: the first outcome reported (partition 0's,
    which lost partition 1 without a word)."""
    addresses = [("127.0.0.1", port) for port in free_loopback_ports(2)]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=vanish, args=(param, addresses, i, results)) for i in range(2)
    ]
    for process in processes:
        process.start()
    try:
        return results.get(timeout=120)
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()


@pytest.mark.slow
def test_a_peer_lost_without_a_word_points_at_the_python_workers_memory():
    # the blocks' path (the host arena's wait: test_host_arena)
    param = AllReduceParameter(2, 1000, codec="raw", timeout=60, host_arena=False)
    partition_id, outcome = lost_peer_outcome(param)
    assert partition_id == 0 and outcome.startswith("PeerLostError: partition 1 at 127.0.0.1"), (
        outcome
    )
    assert (
        "without a word: it failed, or its process was killed, most often for using more memory"
        in outcome
    )
    assert (
        "spark.executor.pyspark.memory where it is set, else spark.executor.memoryOverhead"
        in outcome
    )


# ---- one host is one kernel and network namespace, whatever the host name or /dev/shm ------

PARTITION_SCRIPT = Path(__file__).resolve().parent / "static_partition.py"


def run_static_partitions(param, addresses, prefixes, tmp_path, timeout=120.0) -> list[dict]:
    """Partition i as a program of its own (``static_partition.py``) after ``prefixes[i]``
    (a namespace to run in); each one's JSON report, in partition order. Every process is
    ended on every path."""
    pickled = tmp_path / "param.pickle"
    pickled.write_bytes(pickle.dumps(param))
    processes = [
        subprocess.Popen(
            [
                *prefix,
                sys.executable,
                str(PARTITION_SCRIPT),
                str(pickled),
                str(i),
                json.dumps(addresses),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        for i, prefix in enumerate(prefixes)
    ]
    outputs = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=timeout)
            assert process.returncode == 0, f"exit {process.returncode}: {err[-3000:]}"
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(30)
    return outputs


def _need_root_and(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("namespaces of its own (unshare) need root")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)} on this machine (util-linux)")


@pytest.mark.netns
@pytest.mark.parametrize("host_arena", [True, False])
def test_a_process_with_a_private_dev_shm_still_shares_memory_with_its_host(tmp_path, host_arena):
    """As two containers of one pod: the same kernel and network namespace, but partition 1
    has IPC and pid namespaces and a /dev/shm of its own. Shared memory travels as descriptors over
    the Unix socket, never by a /dev/shm name, so they are still one host, and exact: the
    host arena's segment as the blocks' (which then travel over no connection at all)."""
    _need_root_and("unshare", "mount")
    partitions, size = 2, 300_001
    param = AllReduceParameter(partitions, size, codec="raw", timeout=60, host_arena=host_arena)
    addresses = [["127.0.0.1", port] for port in free_loopback_ports(partitions)]
    private_shm = (  # and a pid namespace of its own: a pid of the other's means nothing here
        "unshare", "--ipc", "--mount", "--pid", "--fork", "--propagation", "private", "sh", "-c",
        'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"',
    )  # fmt: skip
    reports = run_static_partitions(param, addresses, [(), private_shm], tmp_path)
    assert reports[0]["shm_device"] != reports[1]["shm_device"]  # two /dev/shm indeed
    for report in reports:
        assert report["hosts"] == [[0, 1]] and report["remote_peers"] == 0, report
        assert report["host_arena"] == host_arena, report
        assert report["families"] == ([] if host_arena else ["AF_UNIX"]), report
        assert report["digest"] == expected_digest(size, partitions)


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.parametrize("host_arena", [True, False])
def test_processes_in_other_network_namespaces_are_other_hosts_over_tcp(tmp_path, host_arena):
    """The same kernel (boot id) but network namespaces of their own, as containers with
    their own network: their abstract Unix sockets cannot be reached, so they are hosts of
    their own and meet over TCP; within a namespace, over a Unix socket. The same bits,
    through the first host's arena (hierarchical) or its blocks."""
    from harness.sim_hosts import simulated_hosts

    partitions, size = 3, 300_001
    param = AllReduceParameter(partitions, size, codec="raw", timeout=60, host_arena=host_arena)
    with simulated_hosts(2) as made:
        first, second = made.hosts
        places = [first, first, second]
        addresses = [[host.address, 23200 + i] for i, host in enumerate(places)]
        reports = run_static_partitions(
            param, addresses, [host.prefix for host in places], tmp_path
        )
    expected = expected_digest(size, partitions)
    for report in reports:
        assert report["hosts"] == [[0, 1], [2]] and report["digest"] == expected, report
        assert report["host_arena"] == host_arena, report
    # hierarchical: partition 0 leads the first host; 1 reaches only 0, over its Unix socket
    # (through the arena, for the host sums alone: 0 reads 1's gradients and weights there)
    assert [report["remote_peers"] for report in reports] == [1, 0, 1]
    assert [report["families"] for report in reports] == [
        ["AF_INET"] if host_arena else ["AF_INET", "AF_UNIX"], ["AF_UNIX"], ["AF_INET"],
    ]  # fmt: skip


@pytest.mark.slow
def test_processes_of_different_parameters_are_refused_when_they_meet():
    """Asking a peer for its full address proves the secret: partitions that each made an
    AllReduceParameter of their own fail at connect(), each saying what to do (one refused
    keeps refusing a while, so a peer that comes later hears it too)."""
    import threading

    addresses = [("127.0.0.1", port) for port in free_loopback_ports(2)]
    errors: list = [None, None]

    def meet(partition_id: int) -> None:
        # a secret of its own; refusing each other, each lingers a connect timeout
        param = AllReduceParameter(
            2, 10, codec="raw", timeout=10, network=NetworkSettings(connect_timeout=1.0)
        )
        try:
            with param.connect(StaticRendezvous(partition_id, addresses, timeout=30)):
                pass
        except AllReduceError as error:
            errors[partition_id] = error

    threads = [threading.Thread(target=meet, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    hint = "the secrets differ. Every partition must use the same AllReduceParameter"
    assert all(isinstance(error, AuthenticationError) and hint in str(error) for error in errors), (
        errors
    )
