"""Benchmark: one full step of allreduce-param against MLlib-style sync and gloo, one table.

A step is the loop a user writes (``--loops readme``: the README's, word for word; ``tuned``:
a reused output buffer and an in-place update): get_weights, put_gradients,
aggregate_gradient_partition, the update of the own slice, send_weight_partition, timed
inside one Spark barrier stage on every partition; a step's time is the slowest
partition's, a round's figure the median over its steps. Rounds alternate with gloo's
``all_reduce`` between processes on loopback (when torch is installed), so that the
machine's drift hits both alike: the table gives the medians over the rounds and the median
of the per-round ratios, with their range. MLlib's way (broadcast the weights,
treeAggregate the gradients) runs once per size.

    python jobs/bench_allreduce.py                      # local[*], 10K / 1M / 10M float32
    python jobs/bench_allreduce.py --sizes 10000000 --codecs raw,bf16 --loops readme,tuned
    python jobs/bench_allreduce.py --sizes 1000000 --codecs raw,lz4 --data sparse
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from allreduce_param import CODECS, AllReduceParameter
from allreduce_param.session import java_problem, local_spark

import baselines  # jobs/baselines.py, beside this file

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
PHASES = ("get", "put", "aggregate", "update", "send")
#: How same-host partitions reach each other: AllReduceParameter settings per name.
TRANSPORTS = {"shared": dict(unix_sockets=True, shared_memory=True),
              "unix": dict(unix_sockets=True, shared_memory=False),
              "tcp": dict(unix_sockets=False, shared_memory=False)}
#: The step as users write it: ``readme`` is the README's loop word for word (``w =
#: p.get_weights()``, ``p.weight_partition[:] -= 0.1 * g``); ``tuned`` fills a buffer of
#: its own (``get_weights(out=w)``) and updates in place without a temporary.
LOOPS = ("readme", "tuned")


def engine_task(params: list[AllReduceParameter], loops: list[str], steps: int, warmup: int, sparse: bool):
    """The barrier task: time every phase of ``warmup + steps`` steps for each parameter and loop."""

    def task(_rows):
        report = []
        for param in params:
            with param.connect() as p:
                rng = np.random.default_rng(p.partition_id)
                gradient = rng.standard_normal(param.size).astype(np.float32)
                if sparse:  # as after a ReLU or for sparse features: 90% zeros
                    gradient[rng.random(param.size) < 0.9] = 0.0
                p.init(rng.standard_normal(param.size).astype(np.float32) * np.float32(1e-3))
                for loop in loops:
                    timings = np.zeros((warmup + steps, len(PHASES)))
                    weights = np.empty(param.size, np.float32)
                    for step in range(warmup + steps):
                        t0 = time.perf_counter()
                        if loop == "readme":
                            w = p.get_weights()
                        else:
                            w = p.get_weights(out=weights)
                        t1 = time.perf_counter()
                        p.put_gradients(gradient, count=1.0)
                        t2 = time.perf_counter()
                        g = p.aggregate_gradient_partition()
                        t3 = time.perf_counter()
                        if loop == "readme":
                            p.weight_partition[:] -= 0.1 * g
                        else:
                            np.multiply(g, np.float32(-0.1), out=g)
                            p.weight_partition[:] += g
                        t4 = time.perf_counter()
                        p.send_weight_partition()
                        t5 = time.perf_counter()
                        timings[step] = np.diff((t0, t1, t2, t3, t4, t5))
                    del w
                    report.append((param.size, param.codec, transport_of(param), loop, timings[warmup:] * 1000.0))
        yield report

    return task


def transport_of(param: AllReduceParameter) -> str:
    return next(name for name, settings in TRANSPORTS.items()
                if all(getattr(param, key) == value for key, value in settings.items()))


def engine_medians(report: list, config: tuple) -> tuple[float, list[float]]:
    """Median over steps of the slowest partition's step, and of each phase likewise."""
    per_partition = np.stack([timings for *key, timings in report if tuple(key) == config])
    slowest_step = per_partition.sum(axis=2).max(axis=0)
    slowest_phase = per_partition.max(axis=0)
    return float(np.median(slowest_step)), [float(x) for x in np.median(slowest_phase, axis=0)]


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
    parser.add_argument("--loops", default="readme", help=f"the user's step, of {', '.join(LOOPS)}")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating rounds (engine, gloo, engine, ...); the ratio is their median")
    parser.add_argument("--steps", type=int, default=15, help="timed syncs per round, size, codec and loop")
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
    codecs, loops, transports = args.codecs.split(","), args.loops.split(","), args.transports.split(",")
    for name, chosen, known in (("loop", loops, LOOPS), ("codec", codecs, CODECS), ("transport", transports, TRANSPORTS)):
        if set(chosen) - set(known):
            parser.error(f"unknown {name} {sorted(set(chosen) - set(known))}: choose of {', '.join(known)}")
    partitions = args.partitions or local_slots(args.master)
    gloo_installed = not args.no_baselines and baselines.gloo_available()

    spark = local_spark(args.master, "allreduce-param-bench", CONF_DIR)
    try:
        print(f"machine: {machine()}")
        print(f"{partitions} partitions on {args.master}; {args.rounds} rounds alternating engine and gloo; "
              f"each the median of {args.steps} steps after {args.warmup} warm-up; {args.data} gradients", flush=True)
        params = [AllReduceParameter(partitions, size, codec=codec, timeout=300, **TRANSPORTS[transport])
                  for size in sizes for codec in codecs for transport in transports]
        configs = [(size, codec, transport, loop) for size in sizes for codec in codecs
                   for transport in transports for loop in loops]
        rdd = spark.sparkContext.parallelize(range(partitions), partitions)
        task = engine_task(params, loops, args.steps, args.warmup, args.data == "sparse")
        engine = {config: [] for config in configs}  # per round: (median ms, phase medians)
        gloo = {size: [] for size in sizes}  # per round: median ms
        for _ in range(args.rounds):
            report = [entry for part in rdd.barrier().mapPartitions(task).collect() for entry in part]
            for config in configs:
                engine[config].append(engine_medians(report, config))
            for size in sizes if gloo_installed else ():
                gloo[size].append(baselines.gloo_allreduce_ms(
                    size, processes=partitions, steps=args.steps, warmup=args.warmup))
        rows = []
        for size in sizes:
            tree = None if args.no_baselines else baselines.mllib_sync_ms(
                spark, size, partitions=partitions, steps=5, warmup=1)
            for config in configs:
                if config[0] != size:
                    continue
                _, codec, transport, loop = config
                name = f"{codec}" + (f" ({transport})" if len(transports) > 1 else "") \
                    + (f", {loop} loop" if len(loops) > 1 else "")
                rows.append((label(size), f"allreduce-param {name}", engine[config], gloo[size], tree))
            if not args.no_baselines:
                rows.append((label(size), "MLlib broadcast+treeAggregate", None, gloo[size], tree))
                rows.append((label(size), "gloo all_reduce (torch)", None, gloo[size], tree))
        print_table(rows, gloo_installed)
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


def print_table(rows: list, gloo_installed: bool) -> None:
    """One line a sync: medians over the rounds, and the median of the per-round ratios to gloo
    (with their range), so that the machine's drift between rounds cancels out."""
    header = ("size", "sync", "median ms", *(f"{p} ms" for p in PHASES), "x gloo (range)", "faster than treeAgg")
    lines = []
    for size, name, rounds, gloo, tree in rows:
        phases = [""] * len(PHASES)
        if rounds is not None:  # the engine, one (median, phases) per round
            totals = [total for total, _ in rounds]
            value = statistics.median(totals)
            phases = [f"{statistics.median(p[i] for _, p in rounds):,.1f}" for i in range(len(PHASES))]
        elif name.startswith("gloo"):
            totals = gloo
            value = statistics.median(gloo) if gloo_installed else None
        else:
            totals, value = [tree] * len(gloo), tree
        if value is None:
            lines.append((size, name, "not installed", *phases, "", ""))
            continue
        ratio = ""
        if gloo_installed and len(gloo) == len(totals):
            ratios = [ours / theirs for ours, theirs in zip(totals, gloo)]
            ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        lines.append((size, name, f"{value:,.1f}", *phases, ratio, f"{tree / value:.1f}x" if tree else ""))
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
