"""``bench_hosts.py``'s run: hierarchical against flat sync, and encrypted against plain,
across simulated hosts (the script says how).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from allreduce_param.engine import AllReduceParameter, NetworkSettings
from allreduce_param.engine.blocks.codec import get_codec
from benchkit.machine import machine
from benchkit.tables import label, ms_text, parse_sizes, render

#: The configurations, in a round's order (every other round runs them backwards).
TOPOLOGIES = ("flat", "hierarchical")
ENCRYPTIONS = (False, True)
#: The line the driver prints its results on, for the process that submitted it.
MARKER = "RESULT = "
#: How long a partition waits for a peer (AllReduceParameter's timeout), in seconds: a
#: flat 10M step on a slow link of a busy 2-core machine takes seconds.
PEER_TIMEOUT = 600.0
#: The gradient's learning rate in the README's update line.
LEARNING_RATE = 0.1
#: A lossy codec passes if partition 0's weights are this close to numpy's, as a fraction
#: of the largest value the steps could reach (codecs here round to 1/254 of a part's
#: largest value at worst, once per put and once per publish).
LOSSY_TOLERANCE = 0.02
SEED = 12


# ---- inside the tasks ------------------------------------------------------------------------


def gradient_of(size: int, partition: int) -> np.ndarray:
    """Partition ``partition``'s gradient, the same every step (a task and the driver's check
    make the same one)."""
    return np.random.default_rng([SEED, partition]).standard_normal(size, dtype=np.float32)


def digest(vector: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(vector, np.float32).data).hexdigest()


def link_bytes_sent() -> int | None:
    """What this network namespace's ``eth0`` has sent (``/proc/self/net/dev``, which is per
    namespace); None without an eth0."""
    with open("/proc/self/net/dev") as table:
        for line in table:
            name, _, counters = line.partition(":")
            if name.strip() == "eth0":
                return int(counters.split()[8])  # 8 receive counters, then transmitted bytes
    return None


def timed_task(params: list[AllReduceParameter], steps: int, warmup: int, keep_vector: bool):
    """The barrier task: for each parameter in turn, ``warmup`` then ``steps`` timed steps of
    the README's loop; yields one report of the task with, per parameter, the steps'
    milliseconds, the bytes its host's link sent meanwhile (on the host's first partition
    only), and the final weights' digest (partition 0 also the weights, with
    ``keep_vector``)."""

    def task(_rows):
        gradients: dict[int, np.ndarray] = {}
        entries, hosts, partition = [], None, None
        for param in params:
            with param.connect() as p:
                partition, hosts = p.info.partition_id, [list(members) for members in p.info.hosts]
                if param.size not in gradients:
                    gradients[param.size] = gradient_of(param.size, p.info.partition_id)
                grad_sum = p.gradient_buffer()
                grad_sum[:] = gradients[param.size]
                p.init(np.zeros(param.size, np.float32))
                # error feedback, as the README asks of a lossy gradient codec
                residual = (
                    np.zeros(param.size, np.float32)
                    if get_codec(param.gradient_codec).lossy
                    else None
                )
                reports_link = any(members[0] == p.info.partition_id for members in hosts)
                times, sent_before = [], None
                for step in range(warmup + steps):
                    if step == warmup:
                        sent_before = link_bytes_sent() if reports_link else None
                    started = time.perf_counter()
                    w = p.get_weights()
                    p.put_gradients(grad_sum, count=1.0, residual=residual)
                    g = p.aggregate_gradient_partition()
                    p.weight_partition[:] -= LEARNING_RATE * g
                    p.send_weight_partition()
                    times.append((time.perf_counter() - started) * 1000.0)
                sent_after = link_bytes_sent() if reports_link else None
                w = p.get_weights()
                entries.append(
                    {
                        "size": param.size,
                        "topology": param.topology,
                        "encrypt": param.network.encrypt,
                        "ms": times[warmup:],
                        "digest": digest(w),
                        "sent": None
                        if sent_before is None or sent_after is None
                        else sent_after - sent_before,
                        "weights": w.copy() if keep_vector and p.info.partition_id == 0 else None,
                    }
                )
                del w, g, grad_sum
        yield {"partition": partition, "hosts": hosts, "entries": entries}

    return task


# ---- the driver, under spark-submit on h1 ----------------------------------------------------


def expected_weights(size: int, steps: int, hosts: list[list[int]]) -> tuple[np.ndarray, float]:
    """The weights every partition must end with after ``steps`` steps from zeros, summed as
    the engine sums (``layout.HostLayout``: each host's partitions in order, then the host
    sums in host order, in float32, divided by the summed counts); and the largest value a
    gradient has."""
    total, largest = None, 0.0
    for members in hosts:
        host_sum = None
        for partition in members:
            gradient = gradient_of(size, partition)
            largest = max(largest, float(np.abs(gradient).max()))
            host_sum = gradient if host_sum is None else host_sum + gradient
        total = host_sum if total is None else total + host_sum
    total /= np.float32(sum(len(members) for members in hosts))
    weights = np.zeros(size, np.float32)
    for _ in range(steps):
        weights -= LEARNING_RATE * total
    return weights, largest


def check(reports: list[dict], codec: str, steps: int, first_round: bool, expected: dict) -> None:
    """Raise SystemExit, naming the configuration and partitions, unless every partition's
    final weights are what numpy gives (see the module); ``expected`` caches numpy's."""
    lossy = get_codec(codec).lossy
    hosts = reports[0]["hosts"]
    for index, entry in enumerate(reports[0]["entries"]):
        name = f"{label(entry['size'])} {codec} {entry['topology']}, encrypt={entry['encrypt']}"
        digests = {report["partition"]: report["entries"][index]["digest"] for report in reports}
        key = (entry["size"], json.dumps(hosts))
        if key not in expected:
            weights, largest = expected_weights(entry["size"], steps, hosts)
            expected[key] = (weights, digest(weights), largest)
        weights, wanted, largest = expected[key]
        if not lossy:
            wrong = sorted(partition for partition, seen in digests.items() if seen != wanted)
            if wrong:
                raise SystemExit(
                    f"error: {name}: the weights of partitions {wrong} differ from numpy's float32 "
                    f"sums after {steps} steps (hosts {hosts})"
                )
            continue
        if len(set(digests.values())) != 1:
            raise SystemExit(
                f"error: {name}: the partitions ended with different weights: {digests}"
            )
        if first_round:
            [seen] = [
                report["entries"][index]["weights"]
                for report in reports
                if report["partition"] == 0
            ]
            error = float(np.abs(seen - weights).max())
            bound = LOSSY_TOLERANCE * LEARNING_RATE * steps * largest
            if not error <= bound:
                raise SystemExit(
                    f"error: {name}: partition 0's weights are {error:.3g} off numpy's after {steps} "
                    f"steps (at most {bound:.3g} allowed for a lossy codec)"
                )


def run_driver(args: argparse.Namespace) -> int:
    """The rounds, on the cluster spark-submit gave; prints ``RESULT = {json}``."""
    from pyspark.sql import SparkSession

    partitions = args.hosts * args.slots
    spark = SparkSession.builder.appName("allreduce-param bench_hosts").getOrCreate()
    try:
        params = [
            AllReduceParameter(
                partitions,
                size,
                codec=args.codec,
                timeout=PEER_TIMEOUT,
                topology=topology,
                network=NetworkSettings(encrypt=encrypt),
            )
            for size in args.sizes
            for encrypt in ENCRYPTIONS
            for topology in TOPOLOGIES
        ]
        rdd = spark.sparkContext.parallelize(range(partitions), partitions)
        figures = {id(param): [] for param in params}
        sent = {id(param): [] for param in params}
        expected: dict = {}
        hosts = None
        for number in range(args.rounds):
            order = params if number % 2 == 0 else params[::-1]
            task = timed_task(order, args.steps, args.warmup, keep_vector=number == 0)
            started = time.monotonic()
            reports = rdd.barrier().mapPartitions(task).collect()
            check(reports, args.codec, args.warmup + args.steps, number == 0, expected)
            hosts = reports[0]["hosts"]
            for index, param in enumerate(order):
                steps = np.array([report["entries"][index]["ms"] for report in reports])
                # the slowest partition's step
                figures[id(param)].append(float(np.median(steps.max(axis=0))))
                links = [report["entries"][index]["sent"] for report in reports]
                sent[id(param)].append(sum(b for b in links if b is not None) / args.steps)
            print(
                f"round {number + 1} of {args.rounds}: {time.monotonic() - started:.0f} s, checked",
                flush=True,
            )
        result = {
            "hosts": hosts,
            "codec": args.codec,
            "lossy": get_codec(args.codec).lossy,
            "configs": [
                {
                    "size": param.size,
                    "topology": param.topology,
                    "encrypt": param.network.encrypt,
                    "ms": figures[id(param)],
                    "link_bytes": sent[id(param)],
                }
                for param in params
            ],
        }
    finally:
        spark.stop()
    print(MARKER + json.dumps(result), flush=True)
    return 0


# ---- the tables ------------------------------------------------------------------------------


def ratio_text(ours: list[float], theirs: list[float]) -> str:
    """The median of the per-round ratios ours/theirs, with their range."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def print_tables(result: dict, args: argparse.Namespace) -> None:
    """The topology table and the encryption table, then what the figures mean."""
    configs = {(c["size"], c["topology"], c["encrypt"]): c for c in result["configs"]}
    print_topology_table(configs, result["codec"], args)
    print_encryption_table(configs, result["codec"], args)
    print_bounds(result, args)


def median_ms(configs: dict, size: int, topology: str, encrypt: bool) -> str:
    """A configuration's median step, as the tables show it."""
    return ms_text(statistics.median(configs[size, topology, encrypt]["ms"]))


def link_mb(configs: dict, size: int, topology: str, encrypt: bool) -> str:
    """A configuration's median MB a step over the links, as the tables show it."""
    megabytes = statistics.median(configs[size, topology, encrypt]["link_bytes"]) / 1e6
    return f"{megabytes:,.1f}" if megabytes >= 10 else f"{megabytes:.3g}"


def print_topology_table(configs: dict, codec: str, args: argparse.Namespace) -> None:
    """Hierarchical against flat, plain and encrypted, at each size."""

    def ms(size, topology, encrypt):
        return median_ms(configs, size, topology, encrypt)

    lines = [
        (
            label(size),
            codec,
            "on" if encrypt else "off",
            ms(size, "flat", encrypt),
            ms(size, "hierarchical", encrypt),
            ratio_text(
                configs[size, "hierarchical", encrypt]["ms"], configs[size, "flat", encrypt]["ms"]
            ),
            link_mb(configs, size, "flat", encrypt),
            link_mb(configs, size, "hierarchical", encrypt),
        )
        for size in args.sizes
        for encrypt in ENCRYPTIONS
    ]
    print(
        "\nhierarchical against flat (a step's median ms; the ratio's median over rounds, and range):"
    )
    print(
        render(
            (
                "size",
                "codec",
                "encrypt",
                "flat ms",
                "hierarchical ms",
                "hierarchical / flat (range)",
                "flat link MB/step",
                "hierarchical link MB/step",
            ),
            lines,
            left=3,
        )
    )


def print_encryption_table(configs: dict, codec: str, args: argparse.Namespace) -> None:
    """Encrypted against plain, for each topology, at each size."""

    def ms(size, topology, encrypt):
        return median_ms(configs, size, topology, encrypt)

    lines = [
        (
            label(size),
            codec,
            topology,
            ms(size, topology, False),
            ms(size, topology, True),
            ratio_text(configs[size, topology, True]["ms"], configs[size, topology, False]["ms"]),
        )
        for size in args.sizes
        for topology in TOPOLOGIES
    ]
    print(
        "\nencrypted against plain (encrypt=True: AES-256-GCM on the TCP connections between hosts):"
    )
    print(
        render(
            ("size", "codec", "topology", "plain ms", "encrypted ms", "encrypted / plain (range)"),
            lines,
            left=3,
        )
    )


def print_bounds(result: dict, args: argparse.Namespace) -> None:
    """The links' bound at each size, and what was checked."""
    codec = result["codec"]
    rate = rate_bits(args.rate) / 8
    bounds = ", ".join(
        f"{label(size)} {ms_text(2 * (args.hosts - 1) / args.hosts * 4 * size / rate * 1e3)} ms"
        for size in args.sizes
    )
    print(
        f"\nlink bound: any allreduce moves at least 2(H-1)/H x the fp32 vector over each host's link, each way: "
        f"at {args.rate}, {bounds}. Flat moves L = {args.slots} times that (every partition exchanges with every "
        f"partition of the other hosts), hierarchical that (one leader per host). "
        f"Hosts (partitions): {result['hosts']}."
    )
    print(
        "checked: every configuration, every round: "
        + (
            "each partition's weights bit for bit numpy's float32 sums"
            if not result["lossy"]
            else f"the same bits on every partition, within {LOSSY_TOLERANCE:.0%} of numpy's ({codec} is lossy)"
        ),
        flush=True,
    )


# ---- the run: hosts, cluster, spark-submit ---------------------------------------------------


def rate_bits(rate: str) -> float:
    """``1gbit`` -> 1e9 bits per second, as tc reads rates (k, m, g: powers of 1000)."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not found:
        raise argparse.ArgumentTypeError(
            f"cannot read rate {rate!r}: write it as tc does, e.g. 100mbit, 1gbit"
        )
    return float(found.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[found.group(2)]


def link_rate(text: str) -> str:
    rate_bits(text)
    return text.strip().lower()


def _interrupted(signum, _frame) -> None:
    """The first Ctrl-C (or SIGTERM) ends the run through the teardowns; later ones are
    ignored so that they finish."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def _echo_rounds(log: Path, stop: threading.Event) -> None:
    """Print the driver's ``round ...`` lines as they reach ``log`` (spark-submit's output),
    once a second, until ``stop`` is set (and once more then): a long run shows that it moves."""
    done, pending, stopped = 0, "", False
    while not stopped:
        stopped = stop.wait(1.0)
        with contextlib.suppress(OSError), open(log, errors="replace") as out:
            out.seek(done)
            pending += out.read()
            done = out.tell()
        *lines, pending = pending.split("\n")
        for line in lines:
            if line.startswith("round "):
                print(f"  {line}", flush=True)


def run_benchmark(args: argparse.Namespace, argv: list[str], script: str) -> int:
    """Make the hosts and the cluster, submit the job's driver (``script``) there, print its tables."""
    if os.geteuid() != 0:
        print(
            "error: bench_hosts.py needs root: it makes network namespaces, a bridge and veth links, and tc "
            "limits them (run it with sudo)",
            file=sys.stderr,
        )
        return 2
    try:
        import pytest
        from harness.sim_hosts import simulated_hosts
        from harness.spark_standalone import SPARK_SUBMIT
    except ImportError as error:
        print(
            f"error: bench_hosts.py makes its hosts and cluster with jobs/harness/sim_hosts.py and "
            f"jobs/harness/spark_standalone.py (shared with the tests), which need pytest: "
            f"pip install -e '.[test]' ({error})",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)
    partitions = args.hosts * args.slots
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f} at the start")
    print(
        f"{args.hosts} simulated hosts x {args.slots} task slots ({partitions} partitions), each host's link "
        f"{args.rate} both ways (tc tbf); {args.rounds} rounds alternating flat/hierarchical and plain/encrypted, "
        f"each the median of {args.steps} steps after {args.warmup} warm-up; the README's loop, {args.codec}",
        flush=True,
    )
    command = submit_command(SPARK_SUBMIT, args, argv, script)
    started = time.monotonic()
    try:
        with (
            tempfile.TemporaryDirectory(prefix="bench-hosts-") as scratch,
            simulated_hosts(args.hosts, rate=args.rate) as made,
        ):
            status = run_on_cluster(
                made.hosts,
                Path(scratch),
                command,
                args,
                started,
            )
            if status:
                return status
    except pytest.skip.Exception as why:  # what simulated_hosts says when namespaces cannot be made
        print(f"error: cannot make the simulated hosts here: {why.msg}", file=sys.stderr)
        return 2
    except pytest.fail.Exception as why:  # the cluster did not start, or spark-submit ran too long
        print(f"error: {why.msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the cluster and the simulated hosts are stopped", file=sys.stderr)
        return 130
    print(
        f"in all {time.monotonic() - started:.0f} s, load average {os.getloadavg()[0]:.1f} at the end; the cluster "
        "and the simulated hosts are stopped",
        flush=True,
    )
    return 0


def run(args: argparse.Namespace, argv: list[str], script: str) -> int:
    """Measure as the command line ``argv`` (``bench_hosts.py``'s, checked there) says: on the
    simulated hosts' cluster, submitting ``script`` with ``argv`` there, or as that driver
    (``--inside-cluster``); the exit status."""
    args.sizes = parse_sizes(args.sizes)
    if args.inside_cluster:
        return run_driver(args)
    return run_benchmark(args, argv, script)


def submit_command(
    spark_submit, args: argparse.Namespace, argv: list[str], script: str
) -> list[str]:
    """``spark-submit`` of ``script`` with ``argv`` as the driver on the cluster (no master yet)."""
    partitions = args.hosts * args.slots
    return [
        str(spark_submit),
        "--properties-file",
        "conf/cluster/standalone.conf",
        "--conf",
        f"spark.cores.max={partitions}",
        "--conf",
        f"spark.executor.cores={args.slots}",
        "--conf",
        "spark.executor.memory=1g",
        "--conf",
        "spark.ui.enabled=false",
        # a failure is the benchmark's result: no second attempt of the stage
        "--conf",
        "spark.stage.maxConsecutiveAttempts=1",
        str(Path(script).resolve()),
        *argv,
        "--inside-cluster",
    ]


def run_on_cluster(
    hosts: list,
    scratch: Path,
    command: list[str],
    args: argparse.Namespace,
    started: float,
) -> int:
    """Start the standalone cluster on ``hosts`` (its master on the first), submit ``command``
    there and print the driver's tables: 0, or 1 when the driver failed (its output printed)."""
    from harness.spark_standalone import python_environment, standalone_cluster

    first = hosts[0]
    with standalone_cluster(
        scratch / "cluster",
        host=first.address,
        prefix=first.prefix,
        cores=args.slots,
        environment=python_environment(),
        worker_places=[(host.address, host.prefix) for host in hosts],
    ) as cluster:
        print(
            f"cluster up in {time.monotonic() - started:.0f} s: master {cluster.url}",
            flush=True,
        )
        log, stop = scratch / "submit.log", threading.Event()
        echo = threading.Thread(target=_echo_rounds, args=(log, stop), daemon=True)
        echo.start()
        try:
            status, output = cluster.run(
                [command[0], "--master", cluster.url, *command[1:]],
                log,
                timeout=args.timeout,
            )
        finally:
            stop.set()
            echo.join()
        found = [line for line in output.splitlines() if line.startswith(MARKER)]
        if status != 0 or len(found) != 1:
            print(output[-6000:], file=sys.stderr)
            print(
                f"error: the driver (spark-submit on h1) exited with status {status}"
                + ("" if found else ", printing no result"),
                file=sys.stderr,
            )
            return 1
        print_tables(json.loads(found[0][len(MARKER) :]), args)
    return 0
