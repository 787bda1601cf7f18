"""``bench_growth.py``'s run: how the cost of one sync grows with the vector's size and
with the partitions (the script says how).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from allreduce_param.engine import AllReduceParameter
from allreduce_param.spark.session import java_problem, local_spark
from benchkit import baselines
from benchkit.links import ring_bound_ms
from benchkit.machine import CONF_DIR, copy_bandwidth, local_slots, machine
from benchkit.rounds import PHASES, TRANSPORTS, alternate
from benchkit.sync_table import engine_row, gloo_row, row_phases, row_totals
from benchkit.tables import label, ms_text, parse_sizes, ratio_text, render

DEFAULT_SIZES = "10K,100K,1M,10M,50M,200M"
#: Default steps: 15 up to this many elements per step, fewer beyond (at least 6).
STEP_ELEMENTS = 200_000_000
#: A local-cluster executor's memory (MB); the Python workers' memory is outside it.
EXECUTOR_MB = 1024


def steps_for(size: int, steps: int | None) -> int:
    return steps if steps else max(6, min(15, STEP_ELEMENTS // size))


def warmup_for(size: int, warmup: int | None) -> int:
    # two at least: the first syncs also touch every page of the peers' shared memory
    return warmup if warmup is not None else (3 if size <= 10_000_000 else 2)


def measure(spark, partitions: int, size: int, args, gloo: bool) -> tuple[list, list, int, int]:
    """Alternating rounds at one size: (engine's (median, phases) per round, gloo's ms per
    round, steps, warm-up)."""
    steps, warmup = steps_for(size, args.steps), warmup_for(size, args.warmup)
    param = AllReduceParameter(
        partitions, size, codec=args.codec, timeout=600, **TRANSPORTS[args.transport]
    )
    engine, gloo_ms = alternate(
        spark,
        partitions,
        [param],
        [args.loop],
        rounds=args.rounds,
        steps=steps,
        warmup=warmup,
        gloo=gloo,
    )
    (rounds,) = engine.values()
    return rounds, gloo_ms[size], steps, warmup


def lines_for(rows: list[dict], bandwidth: float, lead) -> list[tuple]:
    """Table lines for ``bench_allreduce`` rows: ``lead(row)`` (the leading cells), the
    median, the engine's phases, GB/s, x gloo, the bound and the ratio to it."""
    lines = []
    for row in rows:
        totals = row_totals(row)
        bound = ring_bound_ms(4 * row["size"], row["partitions"], bandwidth)
        if totals is None:
            lines.append(
                (
                    *lead(row),
                    row["sync"],
                    "not installed",
                    *row_phases(row),
                    "",
                    "",
                    ms_text(bound),
                    "",
                )
            )
            continue
        value = statistics.median(totals)
        lines.append(
            (
                *lead(row),
                row["sync"],
                ms_text(value),
                *row_phases(row),
                f"{4 * row['size'] / value / 1e6:,.2f}",
                ratio_text(totals, row["gloo"]),
                ms_text(bound),
                f"{value / bound:.1f}",
            )
        )
    return lines


TAIL = ("GB/s", "x gloo (range)", "bound ms", "x bound")


def sizes_table(args, sizes: list[int], bandwidth: float, gloo: bool) -> None:
    partitions = args.partitions or local_slots(args.master)
    spark = local_spark(args.master, "allreduce-param-growth", CONF_DIR)
    try:
        print(
            f"\n(a) per-sync time against size: {partitions} partitions on {args.master}; {args.rounds} rounds "
            f"alternating engine and gloo; {args.codec}, {args.transport}, {args.loop} loop",
            flush=True,
        )
        rows = []
        for size in sizes:
            rounds, gloo_ms, steps, warmup = measure(spark, partitions, size, args, gloo)
            print(f"  {label(size)}: {steps} steps after {warmup} warm-up a round", flush=True)
            name = f"allreduce-param {args.codec}"
            rows.append(engine_row("host", size, partitions, name, rounds, gloo_ms))
            if gloo:
                rows.append(gloo_row("host", size, partitions, gloo_ms))
    finally:
        spark.stop()
    header = ("size", "sync", "median ms", *(f"{p} ms" for p in PHASES), *TAIL)
    print(
        render(header, lines_for(rows, bandwidth, lambda row: (label(row["size"]),))),
        flush=True,
    )


def start_cluster(n: int) -> tuple[object, str]:
    """A session on ``local-cluster[n,1,EXECUTOR_MB]`` with all n executors registered, or on
    ``local[n]`` (said on stdout) when that cannot start."""
    master = f"local-cluster[{n},1,{EXECUTOR_MB}]"
    why = ""
    spark = None
    try:
        spark = local_spark(master, "allreduce-param-growth", CONF_DIR)
        status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus  # the driver counts as one
        deadline = time.monotonic() + 90
        while status().size() < n + 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        if status().size() >= n + 1:
            return spark, master
        why = f"{status().size() - 1} of {n} executors registered within 90 s"
    except Exception as error:  # noqa: BLE001 -- any failure to start means: fall back
        why = f"{type(error).__name__}: {error}".splitlines()[0]
    if spark is not None:
        spark.stop()
    fallback = f"local[{n}]"
    print(
        f"  note: {master} could not start ({why}); falling back to {fallback} (one executor JVM)",
        flush=True,
    )
    return local_spark(fallback, "allreduce-param-growth", CONF_DIR), fallback


def partitions_table(args, ns: list[int], bandwidth: float, gloo: bool) -> None:
    size = args.n_size
    print(
        f"\n(b) per-sync time against partitions at {label(size)}: local-cluster[N,1,{EXECUTOR_MB}] per N "
        f"(on {os.cpu_count()} cores), gloo between N processes; {args.rounds} rounds alternating engine and "
        f"gloo; {args.codec}, {args.transport}, {args.loop} loop",
        flush=True,
    )
    rows = []
    for n in ns:
        spark, master = start_cluster(n)
        try:
            rounds, gloo_ms, steps, warmup = measure(spark, n, size, args, gloo)
        finally:
            spark.stop()
        print(f"  N={n} on {master}: {steps} steps after {warmup} warm-up a round", flush=True)
        rows.append(
            {
                **engine_row("host", size, n, f"allreduce-param {args.codec}", rounds, gloo_ms),
                "master": master,
            }
        )
        if gloo:
            rows.append({**gloo_row("host", size, n, gloo_ms), "master": f"{n} processes"})
    header = ("N", "master", "size", "sync", "median ms", *(f"{p} ms" for p in PHASES), *TAIL)
    lead = lambda row: (row["partitions"], row["master"], label(row["size"]))  # noqa: E731
    print(render(header, lines_for(rows, bandwidth, lead), left=4), flush=True)


def run(args: argparse.Namespace) -> int:
    """Measure as the command line (``bench_growth.py``'s, checked there) says; the exit status."""
    tables = set(args.tables.split(","))
    sizes = parse_sizes(args.sizes)
    (args.n_size,) = parse_sizes(args.n_size)
    ns = [int(n) for n in args.ns.split(",")]
    problem = java_problem()
    if problem:  # before anything else: say so, no traceback
        print(f"error: {problem}", file=sys.stderr)
        return 2
    gloo = not args.no_gloo and baselines.gloo_available()

    bandwidth = copy_bandwidth()
    print(f"machine: {machine()}")
    print(
        f"memory copy: {bandwidth / 1e9:.2f} GB/s (np.copyto of 40 MB, median of 5); "
        f"bound = 2(N-1)/N x bytes / that" + ("" if gloo else "; gloo: not installed or --no-gloo"),
        flush=True,
    )
    if "sizes" in tables:
        sizes_table(args, sizes, bandwidth, gloo)
    if "partitions" in tables:
        partitions_table(args, ns, bandwidth, gloo)
    return 0
