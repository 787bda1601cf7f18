"""The benchmark jobs run end to end on tiny sizes and print their tables (no figures are
checked here: speed belongs in the benchmarks' own runs, never in a test).

The jobs run their ``main`` in this process (``run_here``), instead of a Python started
and importing numpy, the engine and the job for each: one on Spark starts and stops its own
session as it does when run as a script, but in the driver JVM that this process's sessions
share (``local_spark`` starts a JVM only where none runs); one of plain processes spawns
them from here. Only bench_hosts.py, which submits itself to a cluster, runs as a script.
"""

from __future__ import annotations

import contextlib
import decimal
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import bench_allreduce
import bench_growth
import bench_host_arenas
import bench_memory
import bench_overlap
import numpy as np
import pytest
from benchkit import hosts as hosts_run
from conftest import TEST_JVM_OPTIONS
from harness.spark_standalone import class_archive_options

pytestmark = [pytest.mark.slow, pytest.mark.spark]

REPO = Path(__file__).resolve().parents[1]


def run_here(main, *args: str) -> str:
    """A job's ``main`` with the command line ``args``, in this process: its output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(list(args))
    assert status == 0, out.getvalue()[-3000:]
    return out.getvalue()


def printed_rounding(cell: str) -> float:
    """The most a number printed as ``cell`` (e.g. ``12.3``, ``+0.0412``, ``1.2e+03``) is
    off its value: half a unit of its last digit."""
    return 0.5 * 10.0 ** decimal.Decimal(cell).as_tuple().exponent


def rows(table: str, name: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("|") and name in line
    ]


@pytest.fixture(scope="module")
def allreduce_on_spark() -> str:
    """One bench_allreduce.py run on Spark that the tests of its tables share: every codec,
    loop and transport they name in one session (a session and its Python workers start in
    seconds of a 2-core machine; the 12 configurations' steps at 10K take a fraction of one)."""
    return run_here(
        bench_allreduce.main, "--master", "local[2]", "--sizes", "10000",
        "--codecs", "raw,int8", "--loops", "readme,tuned",
        "--transports", "shared,tcp,tcp-encrypted",
        "--rounds", "2", "--steps", "2", "--warmup", "1", "--no-baselines",
    )  # fmt: skip


def test_bench_allreduce_prints_a_row_per_codec_and_loop(allreduce_on_spark):
    engine = rows(allreduce_on_spark, "allreduce-param")
    assert [row[1] for row in engine] == [
        f"allreduce-param {codec} ({transport}), {loop} loop"
        for codec in ("raw", "int8")
        for transport in ("shared", "tcp", "tcp-encrypted")
        for loop in ("readme", "tuned")
    ]
    assert all(row[0] == "10K" and float(row[2]) > 0 for row in engine)


def test_bench_allreduce_without_spark_prints_a_row_per_process_count_and_size():
    """``--processes``: plain processes, no JVM; the engine against gloo in alternating
    rounds (gloo's column says "not installed" without torch), a floor and phases per row."""
    out = run_here(
        bench_allreduce.main, "--processes", "2,3", "--sizes", "1K,10K",
        "--rounds", "2", "--steps", "2", "--warmup", "1",
    )  # fmt: skip
    assert out.startswith("machine: ") and "single-core copy bandwidth: " in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header == [
        "N", "size", "floor ms", "ours ms", "gloo ms", "x gloo (range)", "x floor",
        "calls x floor", "get ms", "put ms", "aggregate ms", "update ms", "send ms",
    ]  # fmt: skip
    lines = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert [(line[0], line[1]) for line in lines] == [
        ("2", "1K"), ("2", "10K"), ("3", "1K"), ("3", "10K"),
    ]  # fmt: skip
    for line in lines:
        assert float(line[2]) > 0 and float(line[3]) > 0 and float(line[6]) > 0
        assert 0 < float(line[7]) <= float(line[6])  # the calls alone: the step less the update
        if line[4] != "not installed":
            assert re.fullmatch(r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)", line[5]), line

    # --own-gradient: gradient_buffer() against a vector of the loop's own, beside one copy
    out = run_here(
        bench_allreduce.main, "--processes", "2", "--sizes", "10K", "--own-gradient",
        "--rounds", "2", "--steps", "2", "--warmup", "1",
    )  # fmt: skip
    assert "load average at the start: " in out and "load average at the end: " in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header[:7] == [
        "N", "size", "gradient_buffer() ms", "own vector ms", "own - buffer ms",
        "one copy ms", "difference / copy (range)",
    ]  # fmt: skip
    (line,) = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert line[:2] == ["2", "10K"] and float(line[2]) > 0 and float(line[5]) > 0
    # each figure as printed, to its last digit (two decimals below 10 ms, one from there: a
    # loaded machine's steps pass 10 ms): the difference within their rounding errors together
    rounding = sum(printed_rounding(cell) for cell in line[2:5])
    assert float(line[4]) == pytest.approx(float(line[3]) - float(line[2]), abs=rounding + 1e-9)

    # --memory: each process's memory in vectors, and the host's against 1 + N
    out = run_here(
        bench_allreduce.main, "--processes", "2", "--sizes", "10K", "--memory", "--steps", "1",
    )  # fmt: skip
    memory = rows(out, "10K")
    assert [(line[2], line[3]) for line in memory] == [
        ("host arena", "rank 0"), ("host arena", "rank 1"),
        ("host arena", "host (sum; memfds once)"),
        ("blocks", "rank 0"), ("blocks", "rank 1"), ("blocks", "host (sum; memfds once)"),
    ]  # fmt: skip
    host = memory[2]
    assert host[-1] == "3" and float(host[5]) > 0
    # the arena (weights once, a gradient per partition) is in the memfds: at least 3 vectors
    assert float(host[-2]) >= 3


def test_bench_allreduce_compares_tcp_with_and_without_encryption(allreduce_on_spark):
    """The second table: a row per codec and loop measured over TCP both ways."""
    table = rows(allreduce_on_spark.split("encryption in transit")[1], "10K")
    assert [row[1] for row in table] == [
        f"{codec}, {loop} loop" for codec in ("raw", "int8") for loop in ("readme", "tuned")
    ]
    for row in table:
        plain, sealed, ratio = float(row[2]), float(row[3]), row[5]
        assert plain > 0 and sealed > 0
        assert re.fullmatch(r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)", ratio)


def test_bench_host_arenas_prints_a_row_per_size():
    out = run_here(
        bench_host_arenas.main, "--sizes", "10K,20K", "--rounds", "1", "--steps", "2",
        "--warmup", "1",
    )  # fmt: skip
    assert "machine:" in out and "load average" in out
    assert [row[0] for row in rows(out, ",000 ")] == ["10,000", "20,000"]


def test_bench_growth_prints_a_row_per_size():
    out = run_here(
        bench_growth.main,
        "--tables",
        "sizes",
        "--master",
        "local[2]",
        "--sizes",
        "10K,20K",
        "--rounds",
        "1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--no-gloo",
    )
    assert "memory copy:" in out
    assert [row[0] for row in rows(out, "allreduce-param raw")] == ["10K", "20K"]


def test_bench_allreduce_refuses_an_unknown_codec(capsys):
    """Checked with the command line, before Spark or any process starts: the job's parser
    (in this process; the runs above go through the script's own ``main``)."""
    with pytest.raises(SystemExit) as stopped:
        bench_allreduce.main(["--codecs", "zip"])
    assert stopped.value.code == 2 and "unknown codec ['zip']" in capsys.readouterr().err


def test_bench_overlap_prints_a_row_per_model_and_codec():
    out = run_here(
        bench_overlap.main,
        "--master",
        "local[2]",
        "--models",
        "mlp",
        "--layers",
        "8,16,16,3",
        "--codecs",
        "raw,lz4",
        "--rows",
        "600",
        "--batch",
        "64",
        "--rounds",
        "1",
    )
    table = rows(out, "| host")
    assert [(row[1], row[3]) for row in table] == [("mlp", "raw"), ("mlp", "lz4")]
    for row in table:  # both step times measured, and their ratio printed from them (one round: its
        off, on = (float(cell.split()[0]) for cell in row[5:7])  # ratio), each rounded to 0.1 ms
        ratio = float(row[9].split()[0])
        assert (
            off > 0
            and on > 0
            and (on - 0.05) / (off + 0.05) - 0.005 <= ratio <= (on + 0.05) / (off - 0.05) + 0.005
        )


@pytest.mark.netns
@pytest.mark.cluster
def test_bench_hosts_times_every_configuration_across_simulated_hosts():
    """2 simulated hosts x 2 slots on 1gbit links, one round: a row per configuration with
    positive figures, the ratios as the figures give them, more bytes across the links flat
    than hierarchical (L = 2 times), and the job's own check of every result against numpy.
    Root only; skipped, with the job's reason, where network namespaces cannot be made.
    About a minute: most of it the cluster's start and spark-submit's. Every JVM of the job
    (the cluster's three daemons, the driver, two executors) compiles with the tests' C1
    alone, through JAVA_TOOL_OPTIONS, which the job's cluster passes on (SPARK_SUBMIT_OPTS
    it does not): the job times the tasks' Python processes, not the JVMs, and their C2
    compiler threads took half the test's time on a loaded 2-core VM (118 s -> 66 s). They map
    the class archive of the tests' local sessions too (the daemons do on their own), which
    spares each driver and executor JVM seconds of CPU at its start."""
    if os.geteuid() != 0:
        pytest.skip("bench_hosts.py needs root (network namespaces, veth links, tc)")
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "jobs" / "bench_hosts.py"),
            "--hosts",
            "2",
            "--slots",
            "2",
            "--sizes",
            "100K",
            "--rounds",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
        ],
        cwd=REPO,
        env={
            **os.environ,
            "JAVA_TOOL_OPTIONS": (
                f"{os.environ.get('JAVA_TOOL_OPTIONS', '')} {TEST_JVM_OPTIONS} "
                f"{class_archive_options()}"
            ),
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode == 2 and "cannot make the simulated hosts" in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    topologies, encryption = out.split("encrypted against plain")
    ratio = r"(\d+\.\d\d) \((\d+\.\d\d)-(\d+\.\d\d)\)"
    table = rows(topologies, "| 100K")
    assert [row[1:3] for row in table] == [["raw", "off"], ["raw", "on"]]
    for row in table:
        flat, hierarchical, flat_mb, hierarchical_mb = (
            float(cell) for cell in (row[3], row[4], row[6], row[7])
        )
        median, low, high = map(float, re.fullmatch(ratio, row[5]).groups())
        assert flat > 0 and hierarchical > 0 and median == low == high  # one round: one ratio
        assert abs(median - hierarchical / flat) <= 0.01 + 0.06 * median  # the figures are rounded
        assert flat_mb > hierarchical_mb > 0
    table = rows(encryption, "| 100K")
    assert [row[1:3] for row in table] == [["raw", "flat"], ["raw", "hierarchical"]]
    for row in table:
        assert float(row[3]) > 0 and float(row[4]) > 0 and re.fullmatch(ratio, row[5])
    assert (
        "checked: every configuration, every round: each partition's weights bit for bit numpy's float32 sums"
        in out
    )
    assert "the cluster and the simulated hosts are stopped" in out


def test_bench_hosts_refuses_weights_that_are_not_numpys_sums():
    """The job's check (no Spark here): numpy's float32 sums in the engine's order pass; one
    value one ulp off, or the same sums taken in partition order instead of host by host,
    stop the job naming the partition; a lossy codec's weights far from numpy's too."""
    hosts, size, steps = [[0, 2], [1, 3]], 1000, 3
    weights, _ = hosts_run.expected_weights(size, steps, hosts)

    def reports(seen, vector=None):
        return [
            {
                "partition": i,
                "hosts": hosts,
                "entries": [
                    {
                        "size": size,
                        "topology": "flat",
                        "encrypt": False,
                        "digest": hosts_run.digest(w),
                        "weights": vector if i == 0 else None,
                    }
                ],
            }
            for i, w in enumerate(seen)
        ]

    hosts_run.check(reports([weights] * 4), "raw", steps, True, {})
    off = weights.copy()
    off[7] = np.nextafter(off[7], np.float32(1))
    with pytest.raises(SystemExit, match=r"partitions \[2\] differ from numpy"):
        hosts_run.check(reports([weights, weights, off, weights]), "raw", steps, True, {})
    in_partition_order, _ = hosts_run.expected_weights(size, steps, [[0, 1, 2, 3]])
    assert hosts_run.digest(in_partition_order) != hosts_run.digest(weights)
    with pytest.raises(SystemExit, match=r"partitions \[0, 1, 2, 3\] differ"):
        hosts_run.check(reports([in_partition_order] * 4), "raw", steps, True, {})
    # a lossy codec's: the same on every partition, near numpy's
    rounded = weights + np.float32(1e-3)
    hosts_run.check(reports([rounded] * 4, rounded), "int8", steps, True, {})
    far = weights + np.float32(1.0)
    with pytest.raises(SystemExit, match=r"partition 0's weights are 1 off numpy's"):
        hosts_run.check(reports([far] * 4, far), "int8", steps, True, {})


def test_bench_memory_reads_only_times_an_epoch_from_memory_and_from_a_row_file():
    """``--reads-only``: no Spark; both ways' epoch times and disk over memory with its range."""
    out = run_here(bench_memory.main, "--reads-only", "--rows", "4096", "--features", "8",
                  "--rounds", "2")  # fmt: skip
    assert out.startswith("machine: ") and "no Spark: one partition of 4,096 rows" in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    assert cells[0] == ["data in", "ms an epoch (median)", "x memory (range)"]
    assert [line[0] for line in cells[2:]] == ["memory", "disk"]
    assert float(cells[2][1]) > 0 and float(cells[3][1]) > 0
    assert re.fullmatch(r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)", cells[3][2]), cells[3]
