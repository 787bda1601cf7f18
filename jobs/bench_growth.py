"""Benchmark: how the cost of one sync grows with the vector's size and with the partitions.

Two tables, measured as ``bench_allreduce.py`` measures (its functions, imported): rounds
that alternate one Spark barrier stage timing the engine's step (the README's loop: get,
put, aggregate, update, send; raw codec, shared memory between partitions on this host)
with gloo's ``all_reduce`` between as many processes; a round's figure is the median over
its steps of the slowest partition's step, the table's the median over the rounds, and
``x gloo`` the median of the per-round ratios with their range.

(a) time per sync against the size (``--sizes``, default 10K to 200M float32) on
    ``--master`` (default local[*]);
(b) time per sync against the number of partitions N (``--ns``, default 2,3,4) at one size
    (``--n-size``, default 10M), each N on its own Spark master ``local-cluster[N,1,1024]``
    (N executor JVMs; ``local[N]`` if that cannot start, and the table says so) with gloo
    between N processes.

Both give the bound ``2(N-1)/N x bytes / memory-copy bandwidth``: the ring allreduce's
traffic per partition (nccl-tests' bus bandwidth) at the speed this machine copies memory
(``np.copyto`` of a 40 MB array, median of 5, measured first and printed). ``GB/s`` is the
vector's bytes over the time of one sync (nccl-tests' algorithm bandwidth).

Memory: a partition holds about four vectors at once (gradient, weights out, its stored
gradient chunks, the fetched ones), 800 MB each at 200M; gloo's ranks one each, and the
two never run at the same time. Big sizes take few steps unless ``--steps`` says otherwise
(15 steps up to 10M, then ``2e8 / size``, at least 6; warm-up 3 up to 10M, then 2: the first
syncs also touch every page of the peers' shared memory for the first time).

    python jobs/bench_growth.py                                   # both tables, long
    python jobs/bench_growth.py --tables sizes --sizes 10K,100K --rounds 2 --steps 3
    python jobs/bench_growth.py --tables partitions --ns 2,3 --n-size 100K --rounds 2 --steps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import baselines  # jobs/baselines.py, beside this file
import bench_allreduce as bench
import numpy as np

from allreduce_param.engine import CODECS, AllReduceParameter
from allreduce_param.spark.session import java_problem, local_spark

DEFAULT_SIZES = "10K,100K,1M,10M,50M,200M"
#: Default steps: 15 up to this many elements per step, fewer beyond (at least 6).
STEP_ELEMENTS = 200_000_000
#: A local-cluster executor's memory (MB); the Python workers' memory is outside it.
EXECUTOR_MB = 1024


def copy_bandwidth(megabytes: int = 40, repeats: int = 5) -> float:
    """Bytes per second that ``np.copyto`` moves between two arrays of ``megabytes`` MB:
    the median of ``repeats`` copies, after one that takes the pages."""
    source = np.ones(megabytes * 1_000_000 // 4, np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)  # page faults out of the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return source.nbytes / statistics.median(times)


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
        partitions, size, codec=args.codec, timeout=600, **bench.TRANSPORTS[args.transport]
    )
    engine, gloo_ms = bench.alternate(
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
        totals = bench.row_totals(row)
        bound = bench.ring_bound_ms(4 * row["size"], row["partitions"], bandwidth)
        if totals is None:
            lines.append(
                (
                    *lead(row),
                    row["sync"],
                    "not installed",
                    *bench.row_phases(row),
                    "",
                    "",
                    bench.ms_text(bound),
                    "",
                )
            )
            continue
        value = statistics.median(totals)
        lines.append(
            (
                *lead(row),
                row["sync"],
                bench.ms_text(value),
                *bench.row_phases(row),
                f"{4 * row['size'] / value / 1e6:,.2f}",
                bench.ratio_text(totals, row["gloo"]),
                bench.ms_text(bound),
                f"{value / bound:.1f}",
            )
        )
    return lines


TAIL = ("GB/s", "x gloo (range)", "bound ms", "x bound")


def sizes_table(args, sizes: list[int], bandwidth: float, gloo: bool) -> None:
    partitions = args.partitions or bench.local_slots(args.master)
    spark = local_spark(args.master, "allreduce-param-growth", bench.CONF_DIR)
    try:
        print(
            f"\n(a) per-sync time against size: {partitions} partitions on {args.master}; {args.rounds} rounds "
            f"alternating engine and gloo; {args.codec}, {args.transport}, {args.loop} loop",
            flush=True,
        )
        rows = []
        for size in sizes:
            rounds, gloo_ms, steps, warmup = measure(spark, partitions, size, args, gloo)
            print(
                f"  {bench.label(size)}: {steps} steps after {warmup} warm-up a round", flush=True
            )
            name = f"allreduce-param {args.codec}"
            rows.append(bench.engine_row("host", size, partitions, name, rounds, gloo_ms))
            if gloo:
                rows.append(bench.gloo_row("host", size, partitions, gloo_ms))
    finally:
        spark.stop()
    header = ("size", "sync", "median ms", *(f"{p} ms" for p in bench.PHASES), *TAIL)
    print(
        bench.render(header, lines_for(rows, bandwidth, lambda row: (bench.label(row["size"]),))),
        flush=True,
    )


def start_cluster(n: int) -> tuple[object, str]:
    """A session on ``local-cluster[n,1,EXECUTOR_MB]`` with all n executors registered, or on
    ``local[n]`` (said on stdout) when that cannot start."""
    master = f"local-cluster[{n},1,{EXECUTOR_MB}]"
    why = ""
    spark = None
    try:
        spark = local_spark(master, "allreduce-param-growth", bench.CONF_DIR)
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
    return local_spark(fallback, "allreduce-param-growth", bench.CONF_DIR), fallback


def partitions_table(args, ns: list[int], bandwidth: float, gloo: bool) -> None:
    size = args.n_size
    print(
        f"\n(b) per-sync time against partitions at {bench.label(size)}: local-cluster[N,1,{EXECUTOR_MB}] per N "
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
                **bench.engine_row(
                    "host", size, n, f"allreduce-param {args.codec}", rounds, gloo_ms
                ),
                "master": master,
            }
        )
        if gloo:
            rows.append({**bench.gloo_row("host", size, n, gloo_ms), "master": f"{n} processes"})
    header = ("N", "master", "size", "sync", "median ms", *(f"{p} ms" for p in bench.PHASES), *TAIL)
    lead = lambda row: (row["partitions"], row["master"], bench.label(row["size"]))  # noqa: E731
    print(bench.render(header, lines_for(rows, bandwidth, lead), left=4), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tables", default="sizes,partitions", help="which tables: sizes, partitions or both"
    )
    parser.add_argument(
        "--master", default="local[*]", help="Spark master of table (a) (default: local[*])"
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="barrier tasks of table (a) (default: the master's task slots)",
    )
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"table (a): float32 elements (default {DEFAULT_SIZES})",
    )
    parser.add_argument("--ns", default="2,3,4", help="table (b): partition counts (default 2,3,4)")
    parser.add_argument("--n-size", default="10M", help="table (b): float32 elements (default 10M)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="alternating rounds (engine, gloo, ...) per size and N",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed syncs per round (default: 15, fewer above {STEP_ELEMENTS // 15:,} elements, at least 6)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed syncs first (default: 3, 2 above 10M)"
    )
    parser.add_argument("--codec", default="raw", choices=CODECS)
    parser.add_argument("--transport", default="shared", choices=tuple(bench.TRANSPORTS))
    parser.add_argument("--loop", default="readme", choices=bench.LOOPS)
    parser.add_argument("--no-gloo", action="store_true", help="the engine alone")
    args = parser.parse_args(argv)
    tables = set(args.tables.split(","))
    if tables - {"sizes", "partitions"}:
        parser.error(
            f"unknown tables {sorted(tables - {'sizes', 'partitions'})}: choose of sizes, partitions"
        )
    if args.rounds < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--rounds and --steps must be at least 1")
    sizes = bench.parse_sizes(args.sizes)
    (args.n_size,) = bench.parse_sizes(args.n_size)
    ns = [int(n) for n in args.ns.split(",")]
    if min(ns) < 1:
        parser.error("--ns: partition counts of at least 1")
    problem = java_problem()
    if problem:  # before anything else: say so, no traceback
        print(f"error: {problem}", file=sys.stderr)
        return 2
    gloo = not args.no_gloo and baselines.gloo_available()

    bandwidth = copy_bandwidth()
    print(f"machine: {bench.machine()}")
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


if __name__ == "__main__":
    sys.exit(main())
