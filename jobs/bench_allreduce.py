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
    python jobs/bench_allreduce.py --sizes 10000000 --codecs raw,bf16 --link host,1gbit,10gbit
    python jobs/bench_allreduce.py --sizes 1M,10M --codecs raw,lz4 --transports tcp,tcp-encrypted --no-baselines
    python jobs/bench_allreduce.py --processes 2,4 --sizes 1M,10M   # no Spark: N plain processes

``--processes N,...`` measures without Spark (no JVM, any many-core machine): N plain
processes on this host, the README's loop against gloo's in the same processes, with the
copy bandwidth and each row's floor (``bench_processes.py`` says how; it takes ``--sizes``,
``--rounds``, ``--steps``, ``--warmup`` and ``--no-baselines`` and ignores the rest). With
``--own-gradient`` it compares ``p.gradient_buffer()`` with a vector of the loop's own
instead of gloo; with ``--memory`` it measures each process's memory instead of time.

``--transports tcp,tcp-encrypted`` measures what encryption in transit costs
(``AllReduceParameter(network=NetworkSettings(encrypt=True))``, AES-256-GCM records, ``sealing.py``): the same
partitions over loopback TCP without and with it, in the same barrier stage of every round
(their order swapped from one round to the next), and a second table gives the median of
the per-round ratios, encrypted over plain, with their range.

``--link RATE,...`` simulates hosts joined by a link of that rate: for each rate the
benchmark runs itself again (same arguments, ``--inside-link RATE`` instead of ``--link``)
in a private network namespace (``unshare -n``, root needed) whose loopback is brought up
and limited with ``tc qdisc add dev lo root tbf rate RATE burst 256kb latency 50ms``
(``--link-burst``; tc accepts 256kb although lo's MTU is 64 KiB: a burst must only exceed
one packet). There the engine takes the cross-host path (TCP: no Unix sockets, no shared
memory), gloo crosses the same loopback, and MLlib's treeAggregate is left out (in local
mode its blocks never leave the JVM). ``host`` in the list is a run without a namespace.
Each run prints its table; then one table of them all, with a ``link`` column, the ring
allreduce's bound ``2(N-1)/N x bytes / rate`` (what each of N partitions must send at
least, on a link of its own) and each sync's ratio to it. All N partitions here share the
one shaped loopback, so the floor of this simulation is N times the ring bound: gloo near
``x bound`` = N runs at the link's rate. Nothing leaves the namespace.

The functions here (``alternate``, ``engine_task``, ``render``, ``machine``, ...) are also
what ``bench_growth.py`` measures with.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import baselines  # jobs/baselines.py, beside this file
import numpy as np

from allreduce_param.engine import CODECS, AllReduceParameter, NetworkSettings
from allreduce_param.engine.blocks.codec import get_codec
from allreduce_param.spark.session import java_problem, local_spark

if __name__ != "__main__":  # imported (bench_growth.py): the executors cannot import jobs/,
    from pyspark import cloudpickle  # so the barrier task must travel with this module's code

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: The codecs that can carry weights (topk keeps only some values: gradients only).
DENSE_CODECS = tuple(name for name in CODECS if not get_codec(name).sparse)
CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "local"  # Spark settings for this machine
PHASES = ("get", "put", "aggregate", "update", "send")
#: How same-host partitions reach each other: AllReduceParameter settings per name
#: (``tcp-encrypted``: as peers on other hosts meet where the traffic is encrypted).
TRANSPORTS = {
    "shared": dict(unix_sockets=True, shared_memory=True, encrypt=False),
    "unix": dict(unix_sockets=True, shared_memory=False, encrypt=False),
    "tcp": dict(unix_sockets=False, shared_memory=False, encrypt=False),
    "tcp-encrypted": dict(unix_sockets=False, shared_memory=False, encrypt=True),
}
#: The step as users write it: ``readme`` is the README's loop word for word (``w =
#: p.get_weights()``, ``p.weight_partition[:] -= 0.1 * g``); ``tuned`` fills a buffer of
#: its own (``get_weights(out=w)``) and updates in place without a temporary.
LOOPS = ("readme", "tuned")
#: The link of a run outside any namespace.
HOST = "host"
#: tbf's settings besides the rate; the burst must exceed one packet (lo's MTU is 64 KiB).
LINK_BURST, LINK_LATENCY = "256kb", "50ms"
#: lo's MTU on Linux: a tbf burst below it lets no full-size packet through.
LOOPBACK_MTU = 65536
#: Bursts to try when tc refuses the one asked for.
LARGER_BURSTS = ("512kb", "1mb", "2mb")


def engine_task(
    params: list[AllReduceParameter], loops: list[str], steps: int, warmup: int, sparse: bool
):
    """The barrier task: time every phase of ``warmup + steps`` steps for each parameter and loop."""

    def task(_rows):
        report = []
        for param in params:
            with param.connect() as p:
                rng = np.random.default_rng(p.info.partition_id)
                # as the README's loop computes it: into the engine's buffer, which a raw put
                # publishes where it lies (float32 straight from the generator: no float64
                # vector twice the size at 200M)
                gradient = p.gradient_buffer()
                gradient[:] = rng.standard_normal(param.size, dtype=np.float32)
                if sparse:  # as after a ReLU or for sparse features: 90% zeros
                    gradient[rng.random(param.size, dtype=np.float32) < 0.9] = 0.0
                weights = rng.standard_normal(param.size, dtype=np.float32)
                weights *= np.float32(1e-3)
                p.init(weights)
                del weights
                # error feedback, as the README asks of a lossy gradient codec (the trainer's way)
                residual = (
                    np.zeros(param.size, np.float32)
                    if get_codec(param.gradient_codec).lossy
                    else None
                )
                for loop in loops:
                    timings = np.zeros((warmup + steps, len(PHASES)))
                    weights = np.empty(param.size, np.float32) if loop == "tuned" else None
                    for step in range(warmup + steps):
                        t0 = time.perf_counter()
                        if loop == "readme":
                            w = p.get_weights()
                        else:
                            w = p.get_weights(out=weights)
                        t1 = time.perf_counter()
                        p.put_gradients(gradient, count=1.0, residual=residual)
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
                    del w, weights
                    report.append(
                        (
                            param.size,
                            codec_of(param),
                            transport_of(param),
                            loop,
                            timings[warmup:] * 1000.0,
                        )
                    )
                del gradient
        yield report

    return task


def codec_of(param: AllReduceParameter) -> str:
    """The codec as ``--codecs`` names it: ``int8``, or ``int8+topk`` with a gradient codec of its own."""
    return (
        param.codec
        if param.gradient_codec == param.codec
        else f"{param.codec}+{param.gradient_codec}"
    )


def transport_of(param: AllReduceParameter) -> str:
    """The transport (with ``--fetch-threads``, and its fetch threads) ``param`` was made with."""

    def setting(key):
        return param.network.encrypt if key == "encrypt" else getattr(param, key)

    return max(
        (
            name
            for name, settings in TRANSPORTS.items()
            if all(setting(key) == value for key, value in settings.items())
        ),
        key=lambda name: len(TRANSPORTS[name]),
    )


def engine_medians(report: list, config: tuple) -> tuple[float, list[float]]:
    """Median over steps of the slowest partition's step, and of each phase likewise."""
    per_partition = np.stack([timings for *key, timings in report if tuple(key) == config])
    slowest_step = per_partition.sum(axis=2).max(axis=0)
    slowest_phase = per_partition.max(axis=0)
    return float(np.median(slowest_step)), [float(x) for x in np.median(slowest_phase, axis=0)]


def alternate(
    spark,
    partitions: int,
    params: list[AllReduceParameter],
    loops: list[str],
    *,
    rounds: int,
    steps: int,
    warmup: int,
    sparse: bool = False,
    gloo: bool = True,
) -> tuple[dict, dict]:
    """``rounds`` rounds of: one barrier stage of ``partitions`` tasks timing every parameter
    and loop (:func:`engine_task`), then gloo's ``all_reduce`` between ``partitions``
    processes at each parameter's size (when ``gloo``).

    Returns ``engine``: ``(size, codec, transport, loop)`` -> one ``(median ms, [phase
    medians])`` per round, and ``gloo_ms``: size -> one median ms per round (empty lists
    without gloo), for :func:`engine_row` and :func:`gloo_row`.
    """
    configs = [
        (param.size, codec_of(param), transport_of(param), loop)
        for param in params
        for loop in loops
    ]
    rdd = spark.sparkContext.parallelize(range(partitions), partitions)
    task = engine_task(params, loops, steps, warmup, sparse)
    # every other round: the other order
    swapped = engine_task(params[::-1], loops, steps, warmup, sparse)
    engine = {config: [] for config in configs}
    gloo_ms = {param.size: [] for param in params}
    for number in range(rounds):
        stage = task if number % 2 == 0 else swapped
        report = [entry for part in rdd.barrier().mapPartitions(stage).collect() for entry in part]
        for config in configs:
            engine[config].append(engine_medians(report, config))
        for size in gloo_ms if gloo else ():
            gloo_ms[size].append(
                baselines.gloo_allreduce_ms(size, processes=partitions, steps=steps, warmup=warmup)
            )
    return engine, gloo_ms


# ---- rows and tables -----------------------------------------------------------------------
# A row is a dict that json can carry from a run in a namespace to the run that started it:
# link, size, partitions, sync (its name), kind (engine | mllib | gloo), rounds (the
# engine's (median, phases) per round), gloo (gloo's ms per round), tree (treeAggregate's ms).


def engine_row(
    link: str, size: int, partitions: int, name: str, rounds: list, gloo: list, tree=None
) -> dict:
    return dict(
        link=link,
        size=size,
        partitions=partitions,
        sync=name,
        kind="engine",
        rounds=[[total, list(phases)] for total, phases in rounds],
        gloo=list(gloo),
        tree=tree,
    )


def gloo_row(link: str, size: int, partitions: int, gloo: list, tree=None) -> dict:
    return dict(
        link=link,
        size=size,
        partitions=partitions,
        sync="gloo all_reduce (torch)",
        kind="gloo",
        rounds=None,
        gloo=list(gloo),
        tree=tree,
    )


def mllib_row(link: str, size: int, partitions: int, gloo: list, tree: float) -> dict:
    return dict(
        link=link,
        size=size,
        partitions=partitions,
        sync="MLlib broadcast+treeAggregate",
        kind="mllib",
        rounds=None,
        gloo=list(gloo),
        tree=tree,
    )


def row_totals(row: dict) -> list[float] | None:
    """The row's figure per round (None when it has none: gloo not installed)."""
    if row["kind"] == "engine":
        return [total for total, _ in row["rounds"]]
    if row["kind"] == "gloo":
        return row["gloo"] or None
    return [row["tree"]] * max(1, len(row["gloo"]))


def row_phases(row: dict) -> list[str]:
    """The median over the rounds of each phase's figure, as text ('' but for the engine)."""
    if row["kind"] != "engine":
        return [""] * len(PHASES)
    return [
        f"{statistics.median(phases[i] for _, phases in row['rounds']):,.1f}"
        for i in range(len(PHASES))
    ]


def ratio_text(ours: list[float], gloo: list[float]) -> str:
    """The median of the per-round ratios ours/gloo, with their range ('' without gloo)."""
    if not gloo or len(gloo) != len(ours):
        return ""
    ratios = [a / b for a, b in zip(ours, gloo)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def ring_bound_ms(size_bytes: float, partitions: int, bytes_per_second: float) -> float:
    """The ring allreduce's bound: each of N partitions sends (and receives) at least
    2(N-1)/N x the vector's bytes (nccl-tests' bus bandwidth), here at ``bytes_per_second``."""
    return 2 * (partitions - 1) / partitions * size_bytes / bytes_per_second * 1e3


def ms_text(ms: float) -> str:
    """Milliseconds as a table shows them: one decimal from 10 ms, two from 1 ms, else three digits."""
    return f"{ms:,.1f}" if ms >= 10 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3g}"


def render(header: tuple, lines: list, left: int = 2) -> str:
    """A markdown table; the first ``left`` columns flush left, the others right."""
    widths = [max(len(str(line[i])) for line in [header, *lines]) for i in range(len(header))]

    def show(line):
        return (
            "| "
            + " | ".join(
                str(cell).ljust(width) if i < left else str(cell).rjust(width)
                for i, (cell, width) in enumerate(zip(line, widths))
            )
            + " |"
        )

    return "\n".join(
        [show(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(show, lines)]
    )


def print_table(rows: list[dict], with_link: bool = False) -> None:
    """One line a sync: medians over the rounds, and the median of the per-round ratios to gloo
    (with their range), so that the machine's drift between rounds cancels out. With
    ``with_link``, a ``link`` column first and, for shaped links, the ring bound and the ratio
    to it."""
    links = [row for row in rows if row["link"] != HOST]
    # no treeAggregate in a namespace: no column
    trees = any(row["tree"] for row in rows) or not links
    header = (
        *(("link",) if with_link else ()),
        "size",
        "sync",
        "median ms",
        *(f"{p} ms" for p in PHASES),
        "x gloo (range)",
        *(("faster than treeAgg",) if trees else ()),
        *(("ring bound ms", "x bound") if links else ()),
    )
    lines = []
    for row in rows:
        start = (row["link"],) if with_link else ()
        totals = row_totals(row)
        if totals is None:
            lines.append(
                (
                    *start,
                    label(row["size"]),
                    row["sync"],
                    "not installed",
                    *row_phases(row),
                    "",
                    *(("",) if trees else ()),
                    *(("", "") if links else ()),
                )
            )
            continue
        value = statistics.median(totals)
        tree = row["tree"]
        bound = ()
        if links:
            bound = ("", "")
            if row["link"] != HOST:
                ms = ring_bound_ms(
                    4 * row["size"], row["partitions"], bits_per_second(row["link"]) / 8
                )
                bound = (ms_text(ms), f"{value / ms:.2f}")
        lines.append(
            (
                *start,
                label(row["size"]),
                row["sync"],
                f"{value:,.1f}",
                *row_phases(row),
                ratio_text(totals, row["gloo"]),
                *((f"{tree / value:.1f}x" if tree else "",) if trees else ()),
                *bound,
            )
        )
    print(render(header, lines, left=3 if with_link else 2))
    if links:
        counts = sorted({row["partitions"] for row in links})
        print(
            f"ring bound: 2(N-1)/N x fp32 bytes / link rate (N = {', '.join(map(str, counts))}), what each "
            "partition sends on a link of its own; here all N partitions share the one shaped loopback, "
            "so nothing goes below N x the bound (x bound = N is the link's full rate)."
        )
    sys.stdout.flush()


def print_encryption_table(engine: dict) -> None:
    """Plain TCP against encrypted TCP, for every size, codec and loop measured both ways:
    their medians over the rounds, and the median of the per-round ratios with their range
    (both ran in the same barrier stage of each round, so the machine's drift cancels)."""
    lines = []
    for (size, codec, transport, loop), sealed in engine.items():
        plain = engine.get((size, codec, "tcp", loop))
        if transport != "tcp-encrypted" or plain is None:
            continue
        ratios = [s / p for (s, _), (p, _) in zip(sealed, plain)]
        plain_ms, sealed_ms = (
            statistics.median(total for total, _ in rounds) for rounds in (plain, sealed)
        )
        lines.append(
            (
                label(size),
                codec + (f", {loop} loop" if len({key[3] for key in engine}) > 1 else ""),
                ms_text(plain_ms),
                ms_text(sealed_ms),
                f"{sealed_ms - plain_ms:+.2f}",
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
            )
        )
    if lines:
        print(
            "\nencryption in transit (a step's median ms over TCP, without and with encrypt=True):"
        )
        print(
            render(
                ("size", "codec", "tcp ms", "tcp-encrypted ms", "difference ms", "x tcp (range)"),
                lines,
            )
        )
        sys.stdout.flush()


def machine() -> str:
    try:
        with open("/proc/meminfo") as info:
            memory = f"{int(info.readline().split()[1]) / 2**20:.0f} GiB"
    except OSError:
        memory = "? GiB"
    import pyspark

    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {memory}, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, PySpark {pyspark.__version__}"
    )


def label(size: int) -> str:
    """``10_000`` -> ``'10K'``, ``10_000_000`` -> ``'10M'``."""
    for factor, suffix in ((1_000_000, "M"), (1_000, "K")):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{suffix}"
    return str(size)


def parse_sizes(text: str) -> list[int]:
    """``'10K,1M,10000000'`` -> ``[10000, 1000000, 10000000]`` (K and M as :func:`label` prints them)."""
    sizes = []
    for part in text.split(","):
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", part)
        if not found:
            raise SystemExit(
                f"cannot read size {part!r}: write float32 elements, e.g. 10000, 10K, 1M"
            )
        sizes.append(
            int(float(found.group(1)) * {"": 1, "k": 1_000, "m": 1_000_000}[found.group(2).lower()])
        )
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="local[*]", help="Spark master (default: local[*])")
    parser.add_argument(
        "--sizes",
        default=None,
        help="float32 elements, comma-separated (10K, 1M accepted; default 10K,1M,10M, "
        "with --processes 1M,10M)",
    )
    parser.add_argument(
        "--processes",
        default=None,
        help="N plain processes instead of Spark, comma-separated (e.g. 2,4,8,16): the "
        "engine against gloo in the same processes, no JVM (jobs/bench_processes.py)",
    )
    parser.add_argument(
        "--own-gradient",
        action="store_true",
        help="with --processes, instead of gloo: the README's loop putting "
        "p.gradient_buffer() against it putting a vector of its own, beside one copy of it",
    )
    parser.add_argument(
        "--memory",
        nargs="?",
        const="arena,blocks",
        help="with --processes, instead of timings: each process's memory after --steps "
        "steps through the host arena and blocks (or the ways named: arena, blocks), in "
        "vectors (jobs/bench_process_memory.py)",
    )
    parser.add_argument(
        "--codecs",
        default=",".join(DENSE_CODECS),
        help=f"of {', '.join(DENSE_CODECS)}; WEIGHTS+GRADIENTS (e.g. int8+topk) for a "
        "gradient codec of its own",
    )
    parser.add_argument("--loops", default="readme", help=f"the user's step, of {', '.join(LOOPS)}")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="alternating rounds (engine, gloo, engine, ...); the ratio is their median",
    )
    parser.add_argument(
        "--steps", type=int, default=15, help="timed syncs per round, size, codec and loop"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed syncs first")
    parser.add_argument(
        "--data",
        choices=("dense", "sparse"),
        default="dense",
        help="gradients of random noise, or 90%% zeros",
    )
    parser.add_argument(
        "--transports",
        default="shared",
        help="how partitions on this host meet, of shared, unix, tcp (comma-separated)",
    )
    parser.add_argument(
        "--fetch-threads",
        default=None,
        help="AllReduceParameter(fetch_threads=...) to compare, comma-separated (default: unset)",
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="barrier tasks (default: the master's task slots)",
    )
    parser.add_argument("--no-baselines", action="store_true", help="skip treeAggregate and gloo")
    parser.add_argument(
        "--link",
        default=None,
        help="run once per link rate, each in a network namespace whose loopback tc limits "
        "to it (e.g. host,1gbit,10gbit; 'host' = no namespace); root, unshare, ip and tc "
        "needed",
    )
    parser.add_argument(
        "--link-burst",
        default=LINK_BURST,
        help=f"tc tbf burst for --link (default {LINK_BURST}; larger ones are tried if tc refuses)",
    )
    # the run in a namespace: its rate
    parser.add_argument("--inside-link", default=None, help=argparse.SUPPRESS)
    # where that run leaves its rows (json)
    parser.add_argument("--results", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.processes:
        import bench_processes  # beside this file; it imports this module

        return bench_processes.run_parsed(args)
    if args.link:
        return run_in_links(
            args.link.split(","), sys.argv[1:] if argv is None else argv, args.link_burst
        )
    problem = java_problem()
    if problem:  # before anything else: say so, no traceback
        print(f"error: {problem}", file=sys.stderr)
        return 2
    sizes = parse_sizes(args.sizes or "10000,1000000,10000000")
    codecs, loops, transports = (
        args.codecs.split(","),
        args.loops.split(","),
        args.transports.split(","),
    )
    named = [part for codec in codecs for part in codec.split("+", 1)]
    for name, chosen, known in (
        ("loop", loops, LOOPS),
        ("codec", named, CODECS),
        ("transport", transports, TRANSPORTS),
    ):
        if set(chosen) - set(known):
            parser.error(
                f"unknown {name} {sorted(set(chosen) - set(known))}: choose of {', '.join(known)}"
            )
    link = args.inside_link or HOST
    if args.inside_link:
        bits_per_second(link)
        transports = [name for name in transports if name.startswith("tcp")] or [
            "tcp"
        ]  # as peers on other hosts
    if args.fetch_threads:  # each transport once per fetch thread count, named "shared f8"
        counts = [int(count) for count in args.fetch_threads.split(",")]
        transports = [f"{transport} f{count}" for transport in transports for count in counts]
        for transport in transports:
            name, count = transport.rsplit(" f", 1)
            TRANSPORTS[transport] = dict(TRANSPORTS[name], fetch_threads=int(count))
    partitions = args.partitions or local_slots(args.master)
    gloo_installed = not args.no_baselines and baselines.gloo_available()

    spark = local_spark(args.master, "allreduce-param-bench", CONF_DIR)
    try:
        print(f"machine: {machine()}")
        print(
            f"{partitions} partitions on {args.master}; {args.rounds} rounds alternating engine and gloo; "
            f"each the median of {args.steps} steps after {args.warmup} warm-up; {args.data} gradients",
            flush=True,
        )
        if args.inside_link:
            print(
                f"link: {link} (tc tbf rate {link} burst {args.link_burst} latency {LINK_LATENCY} on the loopback "
                "of a private network namespace); the engine over TCP, gloo over the same link; no treeAggregate",
                flush=True,
            )
        elif args.results:
            print("link: host (no namespace, no limit)", flush=True)
        params = [
            AllReduceParameter(
                partitions,
                size,
                codec=codec.split("+")[0],
                gradient_codec=codec.split("+")[-1],
                timeout=300,
                network=NetworkSettings(encrypt=TRANSPORTS[transport]["encrypt"]),
                **{k: v for k, v in TRANSPORTS[transport].items() if k != "encrypt"},
            )
            for size in sizes
            for codec in codecs
            for transport in transports
        ]
        engine, gloo = alternate(
            spark,
            partitions,
            params,
            loops,
            rounds=args.rounds,
            steps=args.steps,
            warmup=args.warmup,
            sparse=args.data == "sparse",
            gloo=gloo_installed,
        )
        rows = []
        for size in sizes:
            tree = (
                None
                if args.no_baselines or args.inside_link
                else baselines.mllib_sync_ms(spark, size, partitions=partitions, steps=5, warmup=1)
            )
            for (config_size, codec, transport, loop), rounds in engine.items():
                if config_size != size:
                    continue
                name = (
                    f"{codec}"
                    + (f" ({transport})" if len(transports) > 1 or args.results else "")
                    + (f", {loop} loop" if len(loops) > 1 else "")
                )
                rows.append(
                    engine_row(
                        link, size, partitions, f"allreduce-param {name}", rounds, gloo[size], tree
                    )
                )
            if tree is not None:
                rows.append(mllib_row(link, size, partitions, gloo[size], tree))
            if not args.no_baselines:
                rows.append(gloo_row(link, size, partitions, gloo[size], tree))
        print_table(rows, with_link=bool(args.inside_link or args.results))
        print_encryption_table(engine)
        if args.results:
            Path(args.results).write_text(json.dumps(rows))
    finally:
        spark.stop()
    return 0


def bits_per_second(rate: str) -> float:
    """``1gbit`` -> 1e9, as tc reads rates (k, m, g: powers of 1000)."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not found:
        raise SystemExit(
            f"cannot read link rate {rate!r}: write it as tc does, e.g. 100mbit, 1gbit, 10gbit "
            f"(or '{HOST}' for no limit)"
        )
    return float(found.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[found.group(2)]


def link_setup(rate: str, burst: str) -> str:
    """The shell commands that make a namespace's loopback a link of ``rate``; exit status 91
    when ``ip`` fails, 92 when ``tc`` does."""
    return (
        f"ip link set lo up || exit 91; "
        f"tc qdisc add dev lo root tbf rate {rate} burst {burst} latency {LINK_LATENCY} || exit 92; "
    )


def link_problem(rate: str, burst: str) -> tuple[str | None, str]:
    """Try the namespace and the shaping once, running nothing in it: ``(None, burst)`` with
    the burst tc took (``burst`` or, if tc refuses it, a larger one), else ``(why, '')``."""
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (
            f"--link needs the tools unshare (util-linux), ip and tc (iproute2); missing: {', '.join(missing)}"
            " (apt-get install util-linux iproute2)"
        ), ""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)(b|k|kb|m|mb)?", burst.strip().lower())
    if not found:
        return f"--link-burst {burst!r}: write it as tc does, e.g. 256kb, 1mb", ""
    if (
        float(found.group(1))
        * {None: 1, "b": 1, "k": 1024, "kb": 1024, "m": 2**20, "mb": 2**20}[found.group(2)]
        < LOOPBACK_MTU
    ):
        # tc takes it, but tbf then drops every full-size packet on lo and the run hangs
        return (
            f"--link-burst {burst} is below the loopback's MTU ({LOOPBACK_MTU} bytes): take 256kb or more",
            "",
        )
    refused = []
    for candidate in dict.fromkeys((burst, *LARGER_BURSTS)):
        done = subprocess.run(
            ["unshare", "-n", "sh", "-c", link_setup(rate, candidate)],
            capture_output=True,
            text=True,
        )
        said = done.stderr.strip().replace("\n", "; ")
        if done.returncode == 0:
            if refused:
                print(
                    f"note: tc refused burst {burst} ({refused[0]}); using burst {candidate}",
                    file=sys.stderr,
                )
            return None, candidate
        if done.returncode == 91:
            return f"--link: 'ip link set lo up' failed inside the namespace: {said}", ""
        if done.returncode != 92:
            why = (
                "not running as root"
                if os.geteuid() != 0
                else "root without CAP_SYS_ADMIN (a container?)"
            )
            return f"--link: 'unshare -n' is not permitted here ({why}): {said}", ""
        refused.append(f"burst {candidate}: {said}")
    return (
        f"--link: tc refused 'tbf rate {rate} latency {LINK_LATENCY}' with every burst tried: "
        + "; ".join(refused),
        "",
    )


def without_link(argv: list[str]) -> list[str]:
    """The command line without ``--link RATES`` / ``--link=RATES``."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--link":
            skip = True
        elif not arg.startswith("--link="):
            rest.append(arg)
    return rest


def run_in_links(
    rates: list[str],
    argv: list[str],
    burst: str,
    script: str = __file__,
    group: str = "size",
    print_all=lambda rows: print_table(rows, with_link=True),
) -> int:
    """Run the benchmark ``script`` (this one by default) again once per rate, each inside a
    private network namespace with its loopback limited to the rate (``host``: as it is, no
    namespace); then ``print_all`` of their rows, grouped by the field ``group``, in the
    order of the rates within a group. The script takes ``--inside-link RATE``,
    ``--link-burst`` and ``--results FILE`` (where it leaves its rows as JSON). The exit
    status is that of the first run that failed, else 0."""
    rates = [rate.strip() for rate in rates if rate.strip()]
    for rate in rates:
        if rate != HOST:
            bits_per_second(rate)  # a bad rate fails before anything starts
    bursts = {}
    for rate in rates:
        if rate != HOST:
            problem, bursts[rate] = link_problem(rate, burst)
            if problem:
                print(f"error: {problem}", file=sys.stderr)
                return 2
    rest = without_link(argv)
    script = os.path.abspath(script)
    status, rows = 0, []
    with tempfile.TemporaryDirectory(prefix="bench-link-") as scratch:
        for number, rate in enumerate(rates):
            results = os.path.join(scratch, f"{number}.json")
            if rate == HOST:
                command = [sys.executable, script, *rest, "--results", results]
                environment = None
            else:
                command = [
                    "unshare",
                    "-n",
                    "sh",
                    "-c",
                    link_setup(rate, bursts[rate]) + 'exec "$0" "$@"',
                    sys.executable,
                    script,
                    *rest,
                    "--link-burst",
                    bursts[rate],
                    "--inside-link",
                    rate,
                    "--results",
                    results,
                ]
                # c10d's reverse lookups of 127.0.0.1 fail without a resolver in the namespace: harmless
                environment = {
                    **os.environ,
                    "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
                }
            print(
                f"== link {rate}" + ("" if rate == HOST else f" (tc tbf burst {bursts[rate]})"),
                flush=True,
            )
            done = subprocess.run(command, env=environment)
            if done.returncode:
                print(
                    f"error: the run on link {rate} failed (exit status {done.returncode})",
                    file=sys.stderr,
                )
            status = status or done.returncode
            if os.path.exists(results):
                rows += json.loads(Path(results).read_text())
    if len(rates) > 1 and rows:
        order = {rate: i for i, rate in enumerate(rates)}
        groups = {row[group]: None for row in rows}  # in the order they first came
        # stable within
        rows.sort(key=lambda row: (list(groups).index(row[group]), order[row["link"]]))
        print(f"\n== all links ({', '.join(rates)})")
        print_all(rows)
    return status


def local_slots(master: str) -> int:
    """How many tasks run at once on a local master: local[4] -> 4, local[*] -> the cores."""
    found = re.fullmatch(
        r"local\[(\d+|\*)(?:,\d+)?\]|local-cluster\[(\d+),(\d+),\d+\]|local", master
    )
    if not found:
        raise SystemExit(f"cannot tell the task slots of master {master!r}: pass --partitions")
    if found.group(2):
        return int(found.group(2)) * int(found.group(3))
    if found.group(1) and found.group(1) != "*":
        return int(found.group(1))
    return 1 if master == "local" else os.cpu_count() or 1


if __name__ == "__main__":
    sys.exit(main())
