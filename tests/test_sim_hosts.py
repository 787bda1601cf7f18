"""16 partitions on 4 simulated hosts: exact sums, and the flat and hierarchical designs counted.

Four hosts (``sim_hosts``: network namespaces on a bridge, 192.0.2.1-4) carry a standalone
cluster: the master on h1, one Worker per host with 4 cores, and the driver, through
``spark-submit``, on h1. ``spark.executor.cores=4`` gives one executor per worker, so the 16
barrier tasks are 16 Python processes, four per host. One Worker (and one executor) JVM
per host, not four one-core ones: 16 workers and 16 executors would be 32 JVMs started
at once on this 2-core machine (each takes seconds of CPU to start and hundreds of MiB
to run), for nothing the test counts: the engine runs in the tasks' Python processes,
one per task slot either way, and connects per process, not per JVM.

The driver (``sim_hosts_driver.py``) uses ``AllReduceParameter(16, 1024, codec="raw")``
directly, in two barrier stages: ``topology="flat"``, then ``"hierarchical"``. Every
``get_weights`` of every partition, in both, must be bitwise the float32 sums computed here
with numpy in the documented order (``layout.HostLayout``: each host, then the hosts). Each
task takes a census of its own process before it closes (see the driver): its threads,
and its established TCP and Unix sockets, the engine's told apart from PySpark's. The
counts must be exactly those of ``flat_design`` and ``hierarchical_design`` (the designs as
the code makes them), and each cross-host connection must have carried exactly the bytes
the wire format says (``connection_bytes``); the test prints them as tables.

First, apart from the cluster, two hosts made with a ``rate``: tc limits each link both
ways, and bytes sent either way take at least the time the rate allows.

Root only (``sim_hosts`` skips, saying why, where namespaces cannot be made). About a
minute and a half on the project's 2-core machine: 18 s to start the cluster, about a
minute for spark-submit.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TEST_JVM_OPTIONS
from harness.sim_hosts import simulated_hosts
from harness.spark_standalone import (
    SPARK_SUBMIT,
    class_archive_submit_options,
    python_environment,
    standalone_cluster,
)
from sim_hosts_driver import MARKER, digest, expected_weights

from allreduce_param.engine.blocks.codec import HEADER_SIZE
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.peers import FETCH_THREADS
from allreduce_param.engine.wire.blocks import SERVE_THREADS
from allreduce_param.engine.wire.blocks.protocol import RESPONSE
from allreduce_param.engine.wire.handshake import MAC_SIZE, MAGIC, NONCE_SIZE

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.cluster, pytest.mark.netns]

HOSTS = 4
PER_HOST = 4  # cores per worker: task slots per host
PARTITIONS = HOSTS * PER_HOST
SIZE = 1024  # 16 slices of 64 values: 4 KiB in all
ROUNDS = 3
SEED = 12
DRIVER = Path(__file__).resolve().parent / "sim_hosts_driver.py"


def flat_design(partitions: int, per_host: int, fetch_threads: int | None = None) -> dict:
    """Today's flat design, per task process: N partitions, L = ``per_host`` of them on each
    host, BSP through the worker channel (no signals, no background owner), once every
    partition has fetched from every other (``peers.PeerGroup``, ``transport``).

    - The worker channel holds one connection to each of the N - 1 peers' block servers,
      made at the first fetch: over TCP to the N - L peers on other hosts, over the peer's
      abstract Unix socket to the L - 1 on this one. Every peer's worker channel does the
      same to this partition's server: N - L TCP and L - 1 Unix connections in.
    - Threads: the block server's accept thread (which also watches the idle proven
      connections) and its pool of serve threads, grown on demand (a thread only when
      none is idle) to at most ``SERVE_THREADS`` whatever N (a connection's read and answer
      may be queued at once): 1 <= serve <= SERVE_THREADS; the worker channel's fetch
      pool, which ThreadPoolExecutor grows likewise to at most F = min(fetch_threads, N - 1),
      default min(``FETCH_THREADS``, N - 1), and keeps
      until close: 1 <= fetch <= F; the control channel none (it connects and starts its one
      thread at the first ``wait_for_signals``).
    - In all, N(N - 1) connections: N(N - L) TCP across hosts (2 L^2 between each pair
      of hosts), N(L - 1) Unix ones.
    """
    remote, local = partitions - per_host, per_host - 1
    most = min(fetch_threads or FETCH_THREADS, partitions - 1)
    serving = SERVE_THREADS
    return {
        "tcp_out": remote,
        "tcp_in": remote,
        "unix_out": local,
        "unix_in": local,
        "accept": 1,
        "serve": (1, serving),
        "fetch": (1, most),
        "control": 0,
        "threads": (1 + 1 + 1, 1 + serving + most),
        "tcp_connections": partitions * remote,
        "unix_connections": partitions * local,
    }


def hierarchical_design(
    hosts: int, per_host: int, leader: bool, fetch_threads: int | None = None
) -> dict:
    """The hierarchical design, per task process: H hosts of L partitions, BSP, through
    each host's arena (``host_arena=True``, the default).

    - A leader's worker channel connects to the other H - 1 leaders over TCP and to none
      of its host (their gradients and weights are in the arena); the other leaders
      connect to it, and its host's partitions, for their host sums: H - 1 TCP and L - 1
      Unix in. A partition that is no leader has one connection, to its leader's Unix
      socket (the arena was asked over one more, which the leader ends at once), and
      none in: its server may never start a serve thread.
    - Threads as flat's pools make them: accept, at most ``SERVE_THREADS`` serving (the
      pool does not follow the connections: a read and an answer may be queued at once),
      at most min(``FETCH_THREADS``, N - 1) fetching.
    - In all, H(H - 1) TCP connections and H(L - 1) Unix ones.
    """
    partitions = hosts * per_host
    remote = hosts - 1 if leader else 0
    unix_out, unix_in = (0, per_host - 1) if leader else (1, 0)
    most = min(fetch_threads or FETCH_THREADS, partitions - 1)
    serving = SERVE_THREADS
    fewest_serving = 1 if leader else 0
    return {
        "tcp_out": remote,
        "tcp_in": remote,
        "unix_out": unix_out,
        "unix_in": unix_in,
        "accept": 1,
        "serve": (fewest_serving, serving),
        "fetch": (1, most),
        "control": 0,
        "threads": (1 + fewest_serving + 1, 1 + serving + most),
        "tcp_connections": hosts * (hosts - 1),
        "unix_connections": hosts * (per_host - 1),
    }


def connection_bytes(
    layout: SliceLayout,
    partition: int,
    peer: int,
    rounds: int,
    hosts: list[list[int]] | None = None,
) -> int:
    """What partition ``partition``'s TCP connection to ``peer``'s server has received after
    ``rounds`` BSP steps and a last ``get_weights``: the server's greeting and its answer to
    the handshake, then per fetch a response head, a block header and the float32 payload.
    Flat: each step one fetch of this partition's chunk (reduce-scatter) and, with the last
    ``get_weights``, rounds + 1 of the peer's slice (all-gather); per step of a vector of S
    bytes, 2 S / N of payload each way over every connection. Hierarchical (``hosts`` given;
    between two leaders): each step the peer's host sum of the chunk of every partition of
    this host, and each ``get_weights`` the slice of every partition of the peer's host:
    2 S / H per step."""
    handshake = len(MAGIC) + NONCE_SIZE + 1 + MAC_SIZE
    per_fetch = RESPONSE.size + HEADER_SIZE
    if hosts is None:
        return (
            handshake
            + rounds * (per_fetch + 4 * layout.length(partition))
            + (rounds + 1) * (per_fetch + 4 * layout.length(peer))
        )
    here = next(members for members in hosts if partition in members)
    there = next(members for members in hosts if peer in members)
    return (
        handshake
        + rounds * sum(per_fetch + 4 * layout.length(j) for j in here)
        + (rounds + 1) * sum(per_fetch + 4 * layout.length(j) for j in there)
    )


#: the shaped hosts' test: their links' rate, and how many bytes cross one each way
RATE, RATE_BITS, SENT = "40mbit", 40e6, 2_500_000
#: a receiver on a simulated host: says when it listens, counts what comes, answers the count
_RECEIVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 5001))
print("listening", flush=True)
connection, _ = server.accept()
received = 0
while chunk := connection.recv(1 << 16):
    received += len(chunk)
connection.sendall(str(received).encode())
"""
#: a sender: the bytes, then the seconds from the first byte sent to the receiver's answer
_SENDER = """
import socket, sys, time
connection = socket.create_connection((sys.argv[1], 5001), timeout=60)
started = time.perf_counter()
connection.sendall(bytes(int(sys.argv[2])))
connection.shutdown(socket.SHUT_WR)
print(connection.recv(64).decode(), time.perf_counter() - started)
"""


def _send(hosts, source, target) -> tuple[int, float]:
    """SENT bytes over TCP from ``source`` to ``target``: (bytes received, seconds)."""
    receiver = subprocess.Popen(
        [*target.prefix, sys.executable, "-c", _RECEIVER, target.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert receiver.stdout.readline().strip() == "listening", receiver.stderr.read()
        sent = hosts.run(
            source, f"{sys.executable} -c '{_SENDER}' {target.address} {SENT}", timeout=60
        )
        assert sent.returncode == 0, sent.stderr
        receiver.wait(30)
    finally:
        receiver.kill()
        receiver.wait()
        receiver.stdout.close()
        receiver.stderr.close()
    received, seconds = sent.stdout.split()
    return int(received), float(seconds)


def test_a_rate_limits_the_links_of_simulated_hosts_both_ways():
    """``simulated_hosts(2, rate=...)``: tbf at that rate on each host's eth0, and a transfer
    each way between the two takes at least what the rate allows (an unshaped veth moves
    these bytes in milliseconds). The first tbf passes a burst of 256 KiB at once."""
    with simulated_hosts(2, rate=RATE) as made:
        assert made.rate == RATE
        for host in made.hosts:
            shown = made.run(host, "tc qdisc show dev eth0").stdout
            assert "tbf" in shown and "rate 40Mbit" in shown, (host.name, shown)
        least = (SENT - 256 * 1024) * 8 / RATE_BITS
        for source, target in (made.hosts, made.hosts[::-1]):
            received, seconds = _send(made, source, target)
            assert received == SENT
            assert 0.8 * least <= seconds <= 10 * least, (
                f"{SENT:,} bytes {source.name} -> {target.name} at {RATE} "
                f"took {seconds:.3f} s; at least {least:.3f} s expected"
            )


@pytest.fixture(scope="module")
def hosts():
    with simulated_hosts(HOSTS) as made:
        yield made


@pytest.fixture(scope="module")
def cluster(hosts, tmp_path_factory):
    """The master on h1, one 4-core worker on each host; stopped before the hosts are."""
    first = hosts.hosts[0]
    started = time.monotonic()
    with standalone_cluster(
        tmp_path_factory.mktemp("sim-hosts-cluster"),
        host=first.address,
        prefix=first.prefix,
        cores=PER_HOST,
        memory="1g",
        environment=python_environment(),
        java_options=TEST_JVM_OPTIONS,
        worker_places=[(host.address, host.prefix) for host in hosts.hosts],
    ) as running:
        running.started_in = time.monotonic() - started
        yield running


@pytest.fixture(scope="module")
def stage(cluster, tmp_path_factory):
    """The driver's report of the barrier stage, run with spark-submit on h1."""
    command = [
        str(SPARK_SUBMIT),
        "--master",
        cluster.url,
        "--properties-file",
        "conf/cluster/standalone.conf",
        "--conf",
        f"spark.cores.max={PARTITIONS}",
        "--conf",
        f"spark.executor.cores={PER_HOST}",
        "--conf",
        "spark.executor.memory=1g",
        "--conf",
        "spark.ui.enabled=false",
        *class_archive_submit_options(),  # the JVMs start sooner; nothing here is counted in them
        str(DRIVER),
        str(PARTITIONS),
        str(SIZE),
        str(ROUNDS),
        str(SEED),
    ]
    started = time.monotonic()
    status, output = cluster.run(
        command, tmp_path_factory.mktemp("sim-hosts-stage") / "submit.log", timeout=240
    )
    assert status == 0, f"spark-submit exited with {status}:\n{output[-6000:]}\n{cluster.logs()}"
    lines = [line for line in output.splitlines() if line.startswith(MARKER)]
    assert len(lines) == 1, output[-6000:]
    report = json.loads(lines[0][len(MARKER) :])
    report["submit_seconds"] = time.monotonic() - started
    return report


def _hosts_by_namespace(hosts) -> dict[str, object]:
    return {host.namespace: host for host in hosts.hosts}


def _placement(tasks, hosts) -> dict[int, object]:
    """Each partition's simulated host, from the namespace its task ran in."""
    by_namespace = _hosts_by_namespace(hosts)
    return {task["partition"]: by_namespace[task["namespace"]] for task in tasks}


def _groups(tasks, hosts) -> list[list[int]]:
    """The partitions of each host."""
    host_of = _placement(tasks, hosts)
    return [sorted(p for p, host in host_of.items() if host == each) for each in hosts.hosts]


@pytest.mark.parametrize("topology", ["flat", "hierarchical"])
def test_sixteen_partitions_on_four_hosts_get_the_exact_float32_sums(stage, hosts, topology):
    tasks = stage[topology]["tasks"]
    assert sorted(task["partition"] for task in tasks) == list(range(PARTITIONS))
    assert all(task["hierarchical"] == (topology == "hierarchical") for task in tasks)
    expected = [
        digest(weights)
        for weights in expected_weights(PARTITIONS, SIZE, ROUNDS, SEED, _groups(tasks, hosts))
    ]
    wrong = {task["partition"]: task["seen"] for task in tasks if task["seen"] != expected}
    assert not wrong, (
        f"get_weights differed from numpy's float32 sums on partitions {sorted(wrong)}"
    )
    # four tasks on each simulated host: in its namespace, on its executor, serving on its address
    by_namespace = _hosts_by_namespace(hosts)
    placed = collections.Counter(by_namespace[task["namespace"]].name for task in tasks)
    assert placed == {host.name: PER_HOST for host in hosts.hosts}, placed
    for task in tasks:
        host = by_namespace[task["namespace"]]
        assert task["executor"].rsplit(":", 1)[0] == host.address, (task["executor"], host)
        assert task["census"]["server"][0] == host.address, (task["census"]["server"], host)
    assert (
        stage["driver_namespace"] == hosts.hosts[0].namespace
        and stage["driver_host"] == hosts.hosts[0].address
    )
    assert len({task["pid"] for task in tasks}) == PARTITIONS  # one process per task


def _table(stage, hosts, topology) -> str:
    tasks = stage[topology]["tasks"]
    host_of = _placement(tasks, hosts)
    rows = []
    for task in sorted(tasks, key=lambda task: task["partition"]):
        c = task["census"]
        engine = c["engine_threads"]
        added = c["kernel_threads"] - c["before"]["kernel_threads"]
        threads = f"{engine['accept']}+{engine['serve']}+{engine['fetch']}+{engine['control']}"
        rows.append(
            f"{host_of[task['partition']].name:>4} {task['partition']:>4} {task['pid']:>7} "
            f"{c['kernel_threads']:>7} {added:>6}  {threads:>15}  {len(c['tcp']['out']):>7} "
            f"{len(c['tcp']['in']):>6} {len(c['unix']['out']):>8} {c['unix']['in']:>7}  "
            f"{len(c['tcp']['other']):>9}"
        )
    received = sorted(
        {entry["received"] for task in tasks for entry in task["census"]["tcp"]["out"]}
    )
    layout = SliceLayout(SIZE, PARTITIONS)
    handshake = len(MAGIC) + NONCE_SIZE + 1 + MAC_SIZE
    fetch = RESPONSE.size + HEADER_SIZE + 4 * layout.length(0)
    tcp = sum(len(task["census"]["tcp"]["out"]) for task in tasks)
    unix = sum(len(task["census"]["unix"]["out"]) for task in tasks)
    fetches = (2 * ROUNDS + 1) * (1 if topology == "flat" else PER_HOST)
    what = (
        f"{ROUNDS} chunks and {ROUNDS + 1} slices"
        if topology == "flat"
        else f"{ROUNDS} x {PER_HOST} host sums and {ROUNDS + 1} x {PER_HOST} slices"
    )
    head = "host part     pid threads  added  acc+srv+fch+ctl  tcp-out tcp-in unix-out unix-in  other-tcp\n"
    return (
        f"\n{topology}: {HOSTS} hosts x {PER_HOST} partitions, {SIZE} float32, {ROUNDS} steps; cluster up in "
        f"{stage['cluster_seconds']:.1f} s, spark-submit {stage['submit_seconds']:.1f} s "
        f"(this barrier stage {stage[topology]['stage_seconds']:.1f} s)\n"
        "threads: the task process's (/proc/self/task) before close; added: since before connect();\n"
        "acc+srv+fch+ctl: the engine's accept, serve, fetch and control threads; other-tcp: PySpark's own\n"
        + head
        + "\n".join(rows)
        + f"\nin all: {tcp} TCP connections across hosts, {unix} Unix connections within hosts\n"
        f"bytes each cross-host connection received: {', '.join(map(str, received))} (the wire format's: "
        f"{handshake} handshake + {fetches} fetches x {fetch}, {what})\n"
    )


@pytest.mark.parametrize("topology", ["flat", "hierarchical"])
def test_connections_and_threads_per_process_are_the_designs(
    stage, hosts, cluster, capsys, topology
):
    stage["cluster_seconds"] = cluster.started_in
    table = _table(stage, hosts, topology)
    with capsys.disabled():
        print(table)
    tasks = stage[topology]["tasks"]
    host_of = _placement(tasks, hosts)
    groups = _groups(tasks, hosts)
    leaders = {members[0] for members in groups}
    layout = SliceLayout(SIZE, PARTITIONS)
    for task in tasks:
        i, c = task["partition"], task["census"]
        here = host_of[i]
        beside = {j for j, host in host_of.items() if host == here and j != i}
        if topology == "flat":
            design = flat_design(PARTITIONS, PER_HOST)
            far = {j for j, host in host_of.items() if host != here}
        else:
            design = hierarchical_design(HOSTS, PER_HOST, leader=i in leaders)
            far = leaders - {i} if i in leaders else set()
            # through the arena, a leader reaches none of its host, the others only it
            beside = set() if i in leaders else {next(j for j in leaders if j in beside)}
        where = f"partition {i} on {here.name}: {json.dumps(c)}\n{table}"
        # TCP out: flat, one to each partition on another host; hierarchical, a leader one to
        # each other leader; from this host's address
        outgoing = c["tcp"]["out"]
        assert len(outgoing) == design["tcp_out"], where
        assert {entry["peer"] for entry in outgoing} == far, where
        assert all(
            entry["local"] == here.address and entry["remote"] == host_of[entry["peer"]].address
            for entry in outgoing
        ), where
        # and each carried exactly what the wire format says: the handshake, the steps' blocks
        for entry in outgoing:
            assert entry["received"] == connection_bytes(
                layout, i, entry["peer"], ROUNDS, None if topology == "flat" else groups
            ), where
        # TCP in: from each partition that connects to this one from another host
        incoming = collections.Counter(entry["remote"] for entry in c["tcp"]["in"])
        assert sum(incoming.values()) == design["tcp_in"], where
        assert incoming == collections.Counter(host_of[j].address for j in far), where
        # Unix: flat, one out to each partition on this host, as many in; the server listens
        # on both
        assert sorted(c["unix"]["out"]) == sorted(beside) and len(beside) == design["unix_out"], (
            where
        )
        assert c["unix"]["in"] == design["unix_in"] and c["unix"]["listening"] == 1, where
        assert c["tcp"]["listening"] == [f"{here.address}:{c['server'][1]}"], where
        assert task["remote_peers"] == design["tcp_out"], where
        assert task["connections"] == {"fetch": sorted(far | beside), "control": []}, where
        # threads: exactly the engine's, and nothing else, came with connect()
        engine = c["engine_threads"]
        assert (engine["accept"], engine["control"]) == (design["accept"], design["control"]), where
        assert design["serve"][0] <= engine["serve"] <= design["serve"][1], where
        assert design["fetch"][0] <= engine["fetch"] <= design["fetch"][1], where
        added = sum(engine.values())
        assert design["threads"][0] <= added <= design["threads"][1], where
        assert c["kernel_threads"] - c["before"]["kernel_threads"] == added, where
        assert c["python_threads"] - c["before"]["python_threads"] == added, where
        # and went with close()
        assert task["after"] == c["before"], (
            f"partition {i}: threads before connect {c['before']}, after close {task['after']}"
        )
    assert (
        sum(len(task["census"]["tcp"]["out"]) for task in tasks)
        == design["tcp_connections"]
        == sum(len(task["census"]["tcp"]["in"]) for task in tasks)
    )
    assert (
        sum(len(task["census"]["unix"]["out"]) for task in tasks)
        == design["unix_connections"]
        == sum(task["census"]["unix"]["in"] for task in tasks)
    )
