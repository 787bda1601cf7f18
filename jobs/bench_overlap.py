"""Benchmark: a BSP step with and without overlapping the gradient's sync with backward.

With ``DistriOptimizer(overlap=True)`` (the default) each owner's chunk of the gradient
leaves as soon as backward has finished it, last layer first, while the layers below are
still computed; with ``overlap=False`` the whole gradient is put once backward is done. This
job fits the same model on the same generated rows both ways, in alternating rounds (off,
on, on, off, ...) so that the machine's drift hits both alike, and prints one table: the
median step time of each (a step: the slowest partition's get + compute + put + aggregate +
update + send, the median over a fit's steps after the first three), the sync that was not
hidden (put + aggregate), and the median of the per-round ratios with their range.

    python jobs/bench_overlap.py                                  # local[*], numpy MLP and TorchModel
    python jobs/bench_overlap.py --link host,1gbit                # also across a simulated 1 Gbit/s link
    python jobs/bench_overlap.py --models mlp --layers 100,4096,4096,10 --codecs raw,lz4

``--link`` works as in ``bench_allreduce.py`` (a private network namespace per rate, its
loopback shaped by tc; root needed). There the partitions talk TCP, as partitions on
different hosts do (the trainer chooses Unix sockets and shared memory by itself only for
peers on one host, so the job makes its parameters TCP-only to stand for that).
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

from bench_allreduce import (
    HOST,
    LINK_BURST,
    bits_per_second,
    local_slots,
    machine,
    render,
    run_in_links,
)

from allreduce_param import DistriOptimizer, models, optim
from allreduce_param.cli import synthetic
from allreduce_param.engine import AllReduceParameter
from allreduce_param.spark.session import java_problem, local_spark
from allreduce_param.train.driver import distri

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "local"  # Spark settings for this machine
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="local[*]", help="Spark master (default: local[*])")
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)} (comma-separated)"
    )
    parser.add_argument("--layers", default="100,2048,1024,10", help="layer widths, inputs first")
    parser.add_argument(
        "--codecs", default="lz4", help="codecs, comma-separated (default lz4, the trainer's)"
    )
    parser.add_argument("--rows", type=int, default=30000, help="generated training rows")
    parser.add_argument("--batch", type=int, default=1024, help="the global batch of a step")
    parser.add_argument("--rounds", type=int, default=4, help="alternating pairs of fits (off, on)")
    parser.add_argument(
        "--link", default=None, help="run once per link rate (e.g. host,1gbit), as bench_allreduce"
    )
    parser.add_argument("--link-burst", default=LINK_BURST, help=argparse.SUPPRESS)
    parser.add_argument("--inside-link", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--results", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.link:
        return run_in_links(
            args.link.split(","),
            sys.argv[1:] if argv is None else argv,
            args.link_burst,
            script=__file__,
            group="model",
            print_all=print_rows,
        )
    problem = java_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    kinds = args.models.split(",")
    if set(kinds) - set(MODELS):
        parser.error(
            f"unknown model {sorted(set(kinds) - set(MODELS))}: choose of {', '.join(MODELS)}"
        )
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


if __name__ == "__main__":
    sys.exit(main())
