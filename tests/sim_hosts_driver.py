"""The driver of test_sim_hosts, run by ``spark-submit`` on simulated host h1 (not a test
module: pytest does not collect it).

Two barrier stages of PARTITIONS tasks, flat then hierarchical, each task using the
driver's ``AllReduceParameter`` (raw codec) directly: ``init`` with known weights, ROUNDS BSP steps of known gradients
(``put_gradients``, ``aggregate_gradient_partition``, ``weight_partition -= mean``,
``send_weight_partition``), each preceded by a ``get_weights``, and one ``get_weights`` after
the last. Every task reports what it saw (each ``get_weights``' bytes, as sha256), where it
ran (its network namespace, executor address and server address), and a census of its own
process taken after the last ``get_weights``, before ``close``: when every peer has
connected to it and it to every peer, and none has hung up yet (a peer that is done waits
for this one's ``done`` before it closes). It prints one line, ``RESULT = {json}``, with
each stage's reports under ``"flat"`` and ``"hierarchical"``.

    spark-submit --master spark://... tests/sim_hosts_driver.py PARTITIONS SIZE ROUNDS SEED
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import sys
import threading
import time

import numpy as np

#: the line the test looks for
MARKER = "RESULT = "
ESTABLISHED, LISTEN = "01", "0A"  # socket states in /proc/net/tcp
#: where struct tcp_info keeps tcpi_bytes_acked and tcpi_bytes_received (u64 each; Linux >= 4.1);
#: a format, not a struct.Struct: the tasks' functions travel pickled by value, globals with them
_TCP_INFO_BYTES = "<QQ"
_TCP_INFO_BYTES_AT = 120


def start_weights(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 999]).standard_normal(size).astype(np.float32)


def gradient(size: int, seed: int, step: int, partition: int) -> tuple[np.ndarray, float]:
    """Partition ``partition``'s gradient sum of ``step``, and its sample count."""
    values = np.random.default_rng([seed, step, partition]).standard_normal(size).astype(np.float32)
    return values, float(partition + 1)


def expected_weights(
    partitions: int, size: int, rounds: int, seed: int, hosts: list[list[int]]
) -> list[np.ndarray]:
    """What every ``get_weights`` must give, round by round (ROUNDS + 1 of them), computed
    the way the engine sums (``layout.HostLayout``): on each host in partition order, then
    the host sums in host order (hosts by their first partition), in float32, divided by the
    summed counts."""
    weights = start_weights(size, seed)
    seen = [weights.copy()]
    for step in range(rounds):
        data = [gradient(size, seed, step, i) for i in range(partitions)]
        host_sums = []
        for members in sorted(sorted(host) for host in hosts):
            host_sum = data[members[0]][0].copy()
            for member in members[1:]:
                host_sum += data[member][0]
            host_sums.append(host_sum)
        total = host_sums[0]
        for host_sum in host_sums[1:]:
            total = total + host_sum
        total /= np.float32(sum(count for _, count in data))
        weights = weights - total
        seen.append(weights.copy())
    return seen


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, np.float32).tobytes()).hexdigest()


# ---- the census of one task's process ---------------------------------------------------


def _tcp_address(hexadecimal: str) -> tuple[str, int]:
    """A /proc/net/tcp{,6} ``ADDRESS:PORT`` as ``(ip, port)``; an IPv4-mapped IPv6 one as IPv4."""
    address, port = hexadecimal.rsplit(":", 1)
    raw = bytes.fromhex(address)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        ip = socket.inet_ntop(socket.AF_INET6, words).removeprefix("::ffff:")
    return ip, int(port, 16)


def _own_sockets() -> dict[int, int]:
    """This process's sockets: inode -> a descriptor of it."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.setdefault(int(target[8:-1]), int(fd))
    return found


def _bytes_moved(fd: int) -> tuple[int, int]:
    """(bytes sent and acknowledged, bytes received) on a TCP socket, from the kernel."""
    with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as sock:  # a duplicate descriptor
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from(_TCP_INFO_BYTES, info, _TCP_INFO_BYTES_AT)


def census(p, before: dict) -> dict:
    """This process's threads and sockets now, the engine's told apart from the rest.

    TCP: from ``/proc/net/tcp{,6}`` (this host's namespace), the established sockets this
    process holds (their inodes among ``/proc/self/fd``): out, to a peer's block server;
    in, to the own server's address; the rest (PySpark's own, to the executor on
    127.0.0.1) counted as other. Unix: each socket's kernel names (through a duplicate of
    its descriptor): out, connected to a peer's abstract socket; in, accepted on the own.
    """
    peers = p._peers
    server = peers._server
    own_address = tuple(server.address)
    peer_servers = {
        (a.host, a.port): j
        for j, a in enumerate(peers.directory.addresses)
        if j != p.info.partition_id
    }
    peer_names = {
        ("\0" + a.local_name).encode(): j
        for j, a in enumerate(peers.directory.addresses)
        if j != p.info.partition_id and a.local_name
    }
    own_name = ("\0" + server.local_name).encode() if server.local_name else None
    sockets = _own_sockets()
    tcp = {"out": [], "in": [], "listening": [], "other": []}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{table}") as file:
                rows = file.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            inode = int(fields[9])
            if inode not in sockets:
                continue
            local, remote, state = _tcp_address(fields[1]), _tcp_address(fields[2]), fields[3]
            if state == LISTEN:
                tcp["listening"].append(f"{local[0]}:{local[1]}")
            elif state == ESTABLISHED and remote in peer_servers:
                acked, received = _bytes_moved(sockets[inode])
                tcp["out"].append(
                    {
                        "peer": peer_servers[remote],
                        "remote": remote[0],
                        "local": local[0],
                        "received": received,
                        "acked": acked,
                    }
                )
            elif state == ESTABLISHED and local == own_address:
                tcp["in"].append({"remote": remote[0]})
            else:
                tcp["other"].append(f"{local[0]}:{local[1]}->{remote[0]}:{remote[1]} state {state}")
    unix = {"out": [], "in": 0, "listening": 0, "other": 0}
    for fd in sockets.values():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            if sock.family != socket.AF_UNIX:
                continue
            name = sock.getsockname()
            name = name.encode() if isinstance(name, str) else name
            try:
                peer = sock.getpeername()
                peer = peer.encode() if isinstance(peer, str) else peer
            except OSError:
                peer = None
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                unix["listening" if name == own_name else "other"] += 1
            elif peer in peer_names:
                unix["out"].append(peer_names[peer])
            elif own_name is not None and name == own_name:
                unix["in"] += 1
            else:
                unix["other"] += 1
    # A thread being started (a serve pool growing as a request comes in) is in the kernel's
    # list a moment before Python's: take both once they agree (or as they are, at a deadline).
    deadline = time.monotonic() + 10
    while True:
        kernel_threads, names = (
            len(os.listdir("/proc/self/task")),
            [t.name for t in threading.enumerate()],
        )
        if kernel_threads == len(names) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    engine = {
        kind: sum(name.startswith(f"allreduce-{kind}-") for name in names)
        for kind in ("accept", "serve", "fetch", "control")
    }
    return {
        "kernel_threads": kernel_threads,
        "python_threads": len(names),
        "engine_threads": engine,
        "other_threads": sorted(n for n in names if not n.startswith("allreduce-")),
        "before": before,
        "tcp": tcp,
        "unix": unix,
        "server": list(own_address),
    }


def _threads_now() -> dict:
    return {
        "kernel_threads": len(os.listdir("/proc/self/task")),
        "python_threads": threading.active_count(),
        "names": sorted(thread.name for thread in threading.enumerate()),
    }


def _threads_after(before: dict, timeout: float = 10.0) -> dict:
    """The threads once the kernel has let go of those that ended (a joined thread's last
    instructions may still run: /proc/self/task lists it a moment longer); at the deadline,
    as they are."""
    deadline = time.monotonic() + timeout
    while True:
        now = _threads_now()
        if now["kernel_threads"] <= before["kernel_threads"] or time.monotonic() > deadline:
            return now
        time.sleep(0.01)


def task(param, rounds: int, seed: int):
    def run(rows):
        from pyspark import BarrierTaskContext

        list(rows)  # all of the input: PySpark's input reader thread ends with it
        deadline = time.monotonic() + 30
        for thread in threading.enumerate():
            if thread.name == "pyspark-pipelined-reader":
                thread.join(max(0.0, deadline - time.monotonic()))
        context = BarrierTaskContext.get()
        before = _threads_now()
        seen = []
        with param.connect() as p:
            p.init(start_weights(param.size, seed))
            for step in range(rounds):
                seen.append(digest(p.get_weights()))
                values, count = gradient(param.size, seed, step, p.info.partition_id)
                p.put_gradients(values, count=count)
                p.weight_partition[:] -= p.aggregate_gradient_partition()
                p.send_weight_partition()
            seen.append(digest(p.get_weights()))
            counted = census(p, before)
            remote_peers, connections, hierarchical = (
                p.info.remote_peers,
                p.info.connections,
                p.info.hierarchical,
            )
        yield {
            "partition": context.partitionId(),
            "pid": os.getpid(),
            "namespace": os.readlink("/proc/self/ns/net"),
            "hierarchical": hierarchical,
            "connections": connections,
            "executor": context.getTaskInfos()[context.partitionId()].address,
            "seen": seen,
            "remote_peers": remote_peers,
            "census": counted,
            "after": _threads_after(before),
        }

    return run


def main(partitions: int, size: int, rounds: int, seed: int) -> int:
    from pyspark.sql import SparkSession

    from allreduce_param.engine import AllReduceParameter

    spark = SparkSession.builder.appName("allreduce-param simulated hosts").getOrCreate()
    try:
        rdd = spark.sparkContext.parallelize(range(partitions), partitions)
        report = {
            "driver_pid": os.getpid(),
            "driver_namespace": os.readlink("/proc/self/ns/net"),
            "driver_host": spark.conf.get("spark.driver.host", None),
        }
        for topology in ("flat", "hierarchical"):  # one barrier stage each, the same data
            param = AllReduceParameter(
                partitions, size, codec="raw", timeout=120, topology=topology
            )
            started = time.monotonic()
            reports = rdd.barrier().mapPartitions(task(param, rounds, seed)).collect()
            report[topology] = {"tasks": reports, "stage_seconds": time.monotonic() - started}
    finally:
        spark.stop()
    print(MARKER + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(arg) for arg in sys.argv[1:5])))
