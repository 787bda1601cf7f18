"""Benchmark: one full sync of allreduce-param against MLlib-style sync and gloo, one table.

A sync is put_gradients + aggregate_gradient_partition + send_weight_partition +
get_weights, timed inside one Spark barrier stage on every partition; a step's time is the
slowest partition's, and the table shows the median over the steps. Beside it, in the same
run: MLlib's way (broadcast the weights, treeAggregate the gradients) and, when torch is
installed, gloo's all_reduce between processes on loopback.

    python jobs/bench_allreduce.py                      # local[*], 10K / 1M / 10M float32
    python jobs/bench_allreduce.py --sizes 1000000 --codecs raw,lz4 --data sparse
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np

from allreduce_param import CODECS, AllReduceParameter
from allreduce_param.session import java_problem, local_spark

import baselines  # jobs/baselines.py, beside this file

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
PHASES = ("put", "aggregate", "send", "get")
#: How same-host partitions reach each other: AllReduceParameter settings per name.
TRANSPORTS = {"shared": dict(unix_sockets=True, shared_memory=True),
              "unix": dict(unix_sockets=True, shared_memory=False),
              "tcp": dict(unix_sockets=False, shared_memory=False)}


def engine_task(params: list[AllReduceParameter], steps: int, warmup: int, sparse: bool):
    """The barrier task: time every phase of ``warmup + steps`` syncs for each parameter."""

    def task(_rows):
        report = []
        for param in params:
            with param.connect() as p:
                rng = np.random.default_rng(p.partition_id)
                gradient = rng.standard_normal(param.size).astype(np.float32)
                if sparse:  # as after a ReLU or for sparse features: 90% zeros
                    gradient[rng.random(param.size) < 0.9] = 0.0
                p.init(rng.standard_normal(param.size).astype(np.float32))
                weights = np.empty(param.size, np.float32)
                timings = np.zeros((warmup + steps, len(PHASES)))
                for step in range(warmup + steps):
                    t0 = time.perf_counter()
                    p.put_gradients(gradient, count=1.0)
                    t1 = time.perf_counter()
                    update = p.aggregate_gradient_partition()
                    t2 = time.perf_counter()
                    p.weight_partition[:] -= np.float32(1e-3) * update  # the optimizer: not timed
                    t3 = time.perf_counter()
                    p.send_weight_partition()
                    t4 = time.perf_counter()
                    p.get_weights(out=weights)
                    t5 = time.perf_counter()
                    timings[step] = (t1 - t0, t2 - t1, t4 - t3, t5 - t4)
                report.append((param.size, param.codec, transport_of(param), timings[warmup:] * 1000.0))
        yield report

    return task


def transport_of(param: AllReduceParameter) -> str:
    return next(name for name, settings in TRANSPORTS.items()
                if all(getattr(param, key) == value for key, value in settings.items()))


def engine_medians(report: list, size: int, codec: str, transport: str) -> tuple[float, list[float]]:
    """Median over steps of the slowest partition's sync, and of each phase likewise."""
    per_partition = np.stack([timings for s, c, t, timings in report if (s, c, t) == (size, codec, transport)])
    slowest_sync = per_partition.sum(axis=2).max(axis=0)
    slowest_phase = per_partition.max(axis=0)
    return float(np.median(slowest_sync)), [float(x) for x in np.median(slowest_phase, axis=0)]


def machine() -> str:
    try:
        with open("/proc/meminfo") as info:
            memory = f"{int(info.readline().split()[1]) / 2**20:.0f} GiB"
    except OSError:
        memory = "? GiB"
    import pyspark

    return (f"{platform.machine()}, {os.cpu_count()} cores, {memory}, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}, PySpark {pyspark.__version__}")


def label(size: int) -> str:
    """``10_000`` -> ``'10K'``, ``10_000_000`` -> ``'10M'``."""
    for factor, suffix in ((1_000_000, "M"), (1_000, "K")):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{suffix}"
    return str(size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="local[*]", help="Spark master (default: local[*])")
    parser.add_argument("--sizes", default="10000,1000000,10000000", help="float32 elements, comma-separated")
    parser.add_argument("--codecs", default=",".join(CODECS), help=f"of {', '.join(CODECS)}")
    parser.add_argument("--steps", type=int, default=15, help="timed syncs per size and codec")
    parser.add_argument("--warmup", type=int, default=3, help="untimed syncs first")
    parser.add_argument("--data", choices=("dense", "sparse"), default="dense",
                        help="gradients of random noise, or 90%% zeros")
    parser.add_argument("--transports", default="shared",
                        help="how partitions on this host meet, of shared, unix, tcp (comma-separated)")
    parser.add_argument("--partitions", type=int, default=None,
                        help="barrier tasks (default: the master's task slots)")
    parser.add_argument("--no-baselines", action="store_true", help="skip treeAggregate and gloo")
    args = parser.parse_args(argv)
    problem = java_problem()
    if problem:  # before anything else: say so, no traceback
        print(f"error: {problem}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    codecs = args.codecs.split(",")

    partitions = args.partitions or local_slots(args.master)
    # gloo first, before Spark's JVM is up and competing for the cores
    gloo = {size: None if args.no_baselines else baselines.gloo_allreduce_ms(
        size, processes=partitions, steps=args.steps, warmup=args.warmup) for size in sizes}
    spark = local_spark(args.master, "allreduce-param-bench", CONF_DIR)
    try:
        print(f"machine: {machine()}")
        print(f"{partitions} partitions on {args.master}; medians of {args.steps} steps after "
              f"{args.warmup} warm-up; {args.data} gradients", flush=True)
        transports = args.transports.split(",")
        params = [AllReduceParameter(partitions, size, codec=codec, timeout=300, **TRANSPORTS[transport])
                  for size in sizes for codec in codecs for transport in transports]
        rdd = spark.sparkContext.parallelize(range(partitions), partitions)
        task = engine_task(params, args.steps, args.warmup, args.data == "sparse")
        report = [entry for part in rdd.barrier().mapPartitions(task).collect() for entry in part]
        rows = []
        for size in sizes:
            tree = None if args.no_baselines else baselines.mllib_sync_ms(
                spark, size, partitions=partitions, steps=5, warmup=1)
            for codec in codecs:
                for transport in transports:
                    total, phases = engine_medians(report, size, codec, transport)
                    name = f"allreduce-param {codec}" + (f" ({transport})" if len(transports) > 1 else "")
                    rows.append((label(size), name, total, phases, gloo[size], tree))
            if not args.no_baselines:
                rows.append((label(size), "MLlib broadcast+treeAggregate", tree, None, gloo[size], tree))
                rows.append((label(size), "gloo all_reduce (torch)", gloo[size], None, gloo[size], tree))
        print_table(rows)
    finally:
        spark.stop()
    return 0


def local_slots(master: str) -> int:
    """How many tasks run at once on a local master: local[4] -> 4, local[*] -> the cores."""
    found = re.fullmatch(r"local\[(\d+|\*)(?:,\d+)?\]|local-cluster\[(\d+),(\d+),\d+\]|local", master)
    if not found:
        raise SystemExit(f"cannot tell the task slots of master {master!r}: pass --partitions")
    if found.group(2):
        return int(found.group(2)) * int(found.group(3))
    if found.group(1) and found.group(1) != "*":
        return int(found.group(1))
    return 1 if master == "local" else os.cpu_count() or 1


def print_table(rows: list) -> None:
    header = ("size", "sync", "median ms", *(f"{p} ms" for p in PHASES), "x gloo", "faster than treeAgg")
    lines = []
    for size, name, value, phases, gloo, tree in rows:
        if value is None:
            lines.append((size, name, "not installed", *([""] * len(PHASES)), "", ""))
            continue
        lines.append((
            size, name, f"{value:,.1f}",
            *([f"{x:,.1f}" for x in phases] if phases else [""] * len(PHASES)),
            f"{value / gloo:.2f}" if gloo else "",
            f"{tree / value:.1f}x" if tree else "",
        ))
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]
    def show(row):
        return "| " + " | ".join(str(cell).rjust(width) if i > 1 else str(cell).ljust(width)
                                 for i, (cell, width) in enumerate(zip(row, widths))) + " |"
    print(show(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in lines:
        print(show(line))


if __name__ == "__main__":
    sys.exit(main())
