"""``bench_allreduce.py``'s run: one full step of allreduce-param against MLlib-style sync and
gloo, in alternating rounds inside Spark barrier stages, one table (the script says how)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from allreduce_param.engine import AllReduceParameter
from allreduce_param.spark.session import java_problem, local_spark
from benchkit import baselines
from benchkit.links import HOST, LINK_LATENCY, bits_per_second, run_in_links
from benchkit.machine import CONF_DIR, local_slots, machine
from benchkit.rounds import TRANSPORTS, alternate
from benchkit.sync_table import (
    engine_row,
    gloo_row,
    mllib_row,
    print_encryption_table,
    print_table,
)
from benchkit.tables import parse_sizes


def run(args: argparse.Namespace, argv: list[str], script: str) -> int:
    """Measure as ``args`` (the script's, checked there) say: plain processes with
    ``--processes``, once per link rate in namespaces with ``--link`` (running ``script``
    again with ``argv``), else in one Spark session here."""
    if args.processes:
        from benchkit import processes

        return processes.run(args)
    if args.link:
        return run_in_links(
            args.link.split(","),
            argv,
            args.link_burst,
            script=script,
            print_all=lambda rows: print_table(rows, with_link=True),
        )
    problem = java_problem()
    if problem:  # before anything else: say so, no traceback
        print(f"error: {problem}", file=sys.stderr)
        return 2
    sizes = parse_sizes(args.sizes or "10000,1000000,10000000")
    link = args.inside_link or HOST
    if args.inside_link:
        bits_per_second(link)
    transports = transports_of(args)
    partitions = args.partitions or local_slots(args.master)
    spark = local_spark(args.master, "allreduce-param-bench", CONF_DIR)
    try:
        print_setup(args, partitions, link)
        rows, engine = measure(spark, args, sizes, transports, partitions, link)
        print_table(rows, with_link=bool(args.inside_link or args.results))
        print_encryption_table(engine)
        if args.results:
            Path(args.results).write_text(json.dumps(rows))
    finally:
        spark.stop()
    return 0


def transports_of(args: argparse.Namespace) -> list[str]:
    """The transports to measure: ``--transports`` (TCP alone inside a shaped link, as peers on
    other hosts meet), each once per ``--fetch-threads`` count, named ``"shared f8"`` (added
    to :data:`TRANSPORTS` under that name)."""
    transports = args.transports.split(",")
    if args.inside_link:
        transports = [name for name in transports if name.startswith("tcp")] or ["tcp"]
    if args.fetch_threads:
        counts = [int(count) for count in args.fetch_threads.split(",")]
        transports = [f"{transport} f{count}" for transport in transports for count in counts]
        for transport in transports:
            name, count = transport.rsplit(" f", 1)
            TRANSPORTS[transport] = dict(TRANSPORTS[name], fetch_threads=int(count))
    return transports


def print_setup(args: argparse.Namespace, partitions: int, link: str) -> None:
    """The table's heading: the machine, the partitions and rounds, and the link."""
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


def measure(
    spark,
    args: argparse.Namespace,
    sizes: list[int],
    transports: list[str],
    partitions: int,
    link: str,
) -> tuple[list[dict], dict]:
    """The alternating rounds of every size, codec, transport and loop, then MLlib's sync once
    per size: the table's rows, and the engine's figures by configuration."""
    codecs, loops = args.codecs.split(","), args.loops.split(",")
    params = [
        AllReduceParameter(
            partitions,
            size,
            codec=codec.split("+")[0],
            gradient_codec=codec.split("+")[-1],
            timeout=300,
            **TRANSPORTS[transport],
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
        gloo=not args.no_baselines and baselines.gloo_available(),
    )
    rows = []
    for size in sizes:
        tree = (
            None
            if args.no_baselines or args.inside_link
            else baselines.mllib_sync_ms(spark, size, partitions=partitions, steps=5, warmup=1)
        )
        named = len(transports) > 1 or args.results
        rows += size_rows(link, size, partitions, engine, gloo[size], tree, named, len(loops) > 1)
        if tree is not None:
            rows.append(mllib_row(link, size, partitions, gloo[size], tree))
        if not args.no_baselines:
            rows.append(gloo_row(link, size, partitions, gloo[size], tree))
    return rows, engine


def size_rows(
    link: str,
    size: int,
    partitions: int,
    engine: dict,
    gloo: list,
    tree: float | None,
    name_transport: bool,
    name_loop: bool,
) -> list[dict]:
    """The engine's rows at ``size``, one per codec, transport and loop measured."""
    rows = []
    for (config_size, codec, transport, loop), rounds in engine.items():
        if config_size != size:
            continue
        name = (
            f"{codec}"
            + (f" ({transport})" if name_transport else "")
            + (f", {loop} loop" if name_loop else "")
        )
        rows.append(
            engine_row(link, size, partitions, f"allreduce-param {name}", rounds, gloo, tree)
        )
    return rows
