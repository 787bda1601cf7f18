"""``bench_overlap.py``'s run: a BSP step with and without overlapping the gradient's sync with
backward (the script says how).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
from pathlib import Path
from unittest import mock

from allreduce_param import DistriOptimizer, models, optim
from allreduce_param.cli import synthetic
from allreduce_param.engine import AllReduceParameter
from allreduce_param.spark.session import java_problem, local_spark
from allreduce_param.train.driver import distri
from benchkit.links import HOST, bits_per_second, run_in_links
from benchkit.machine import CONF_DIR, local_slots, machine
from benchkit.tables import render

MODELS = ("mlp", "torch")
#: The phases of a step, as the history records them (the slowest partition's each).
STEP_PHASES = ("get_s", "compute_s", "put_s", "aggregate_s", "update_s", "send_s")
WARMUP_STEPS = 3


def make_model(kind: str, layers: list[int]):
    """The numpy MLP, or the same network as a torch module."""
    if kind == "mlp":
        return models.MLP(layers)
    import torch

    modules = []
    for fan_in, fan_out in zip(layers[:-1], layers[1:]):
        modules += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return models.TorchModel(torch.nn.Sequential(*modules[:-1]))


def step_times(history) -> tuple[float, float]:
    """A fit's median step time and median put + aggregate, in seconds (first steps left out)."""
    steps = history.steps[WARMUP_STEPS:] or history.steps
    whole = statistics.median(sum(step[phase] for phase in STEP_PHASES) for step in steps)
    sync = statistics.median(step["put_s"] + step["aggregate_s"] for step in steps)
    return whole, sync


def measure(train, model, codec: str, batch: int, rounds: int) -> dict:
    """``rounds`` alternating pairs of fits, overlap off and on; their step times."""
    times = {False: [], True: []}
    for number in range(rounds):
        for overlap in (False, True) if number % 2 == 0 else (True, False):
            fit = DistriOptimizer(
                model,
                optim.Adam(lr=1e-3),
                batch_size=batch,
                epochs=1,
                codec=codec,
                progress=False,
                overlap=overlap,
                seed=0,
            ).fit(train)
            times[overlap].append(step_times(fit.history))
    return times


def row(link: str, kind: str, model, codec: str, partitions: int, times: dict) -> dict:
    ratios = [on[0] / off[0] for off, on in zip(times[False], times[True])]
    return {
        "link": link,
        "model": kind,
        "parameters": model.size,
        "codec": codec,
        "partitions": partitions,
        "off_ms": 1e3 * statistics.median(t[0] for t in times[False]),
        "on_ms": 1e3 * statistics.median(t[0] for t in times[True]),
        "off_sync_ms": 1e3 * statistics.median(t[1] for t in times[False]),
        "on_sync_ms": 1e3 * statistics.median(t[1] for t in times[True]),
        "ratio": statistics.median(ratios),
        "low": min(ratios),
        "high": max(ratios),
    }


def print_rows(rows: list[dict]) -> None:
    header = (
        "link",
        "model",
        "params",
        "codec",
        "N",
        "step off",
        "step on",
        "sync off",
        "sync on",
        "on/off (range)",
    )
    lines = [
        (
            r["link"],
            r["model"],
            f"{r['parameters'] / 1e6:.1f}M",
            r["codec"],
            r["partitions"],
            f"{r['off_ms']:.1f} ms",
            f"{r['on_ms']:.1f} ms",
            f"{r['off_sync_ms']:.1f} ms",
            f"{r['on_sync_ms']:.1f} ms",
            f"{r['ratio']:.2f} ({r['low']:.2f}-{r['high']:.2f})",
        )
        for r in rows
    ]
    print(render(header, lines, left=5))


def run(args: argparse.Namespace, argv: list[str], script: str) -> int:
    """Measure as the command line ``argv`` (``bench_overlap.py``'s, checked there) says, with
    ``--link`` once per rate, running ``script`` again in a namespace; the exit status."""
    if args.link:
        return run_in_links(
            args.link.split(","),
            argv,
            args.link_burst,
            script=script,
            group="model",
            print_all=print_rows,
        )
    problem = java_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    kinds = args.models.split(",")
    layers = [int(width) for width in args.layers.split(",")]
    link = args.inside_link or HOST
    if args.inside_link:
        bits_per_second(link)
    partitions = local_slots(args.master)
    tcp_only = functools.partial(AllReduceParameter, unix_sockets=False, shared_memory=False)
    spark = local_spark(args.master, "allreduce-param-bench-overlap", CONF_DIR)
    try:
        print(f"machine: {machine()}")
        print(
            f"{partitions} partitions on {args.master}; {args.rows} rows of {layers[0]} features, batch "
            f"{args.batch}; {args.rounds} rounds alternating overlap off and on; link {link}"
            + (" (TCP between the partitions)" if args.inside_link else ""),
            flush=True,
        )
        train = synthetic(
            spark, args.rows, layers[0], layers[-1], seed=0, partitions=partitions
        ).cache()
        train.count()
        rows = []
        for kind in kinds:
            try:
                model = make_model(kind, layers)
            except ImportError:
                print(
                    f"{kind}: torch is not installed (pip install -e '.[torch]'); left out",
                    flush=True,
                )
                continue
            for codec in args.codecs.split(","):
                with (
                    mock.patch.object(distri, "AllReduceParameter", tcp_only)
                    if args.inside_link
                    else contextlib.nullcontext()
                ):
                    times = measure(train, model, codec, args.batch, args.rounds)
                rows.append(row(link, kind, model, codec, partitions, times))
        print_rows(rows)
        if args.results:
            Path(args.results).write_text(json.dumps(rows))
    finally:
        spark.stop()
    return 0
