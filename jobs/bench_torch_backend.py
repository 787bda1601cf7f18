"""Benchmark without Spark: DistributedDataParallel's step on the allreduce_param backend
against the same on gloo, N plain processes, alternating rounds, for an MLP and a small CNN;
on this host, or spread over simulated hosts.

The run is ``benchkit/ddp.py``'s (what is measured and how). Needs torch; ``--hosts`` more
than 1 needs root and pytest (the tests' ``harness.sim_hosts`` makes the hosts).

    python jobs/bench_torch_backend.py                                 # 2 and 4 processes, MLPs, CNN
    python jobs/bench_torch_backend.py --processes 4 --hosts 2 --rate 1gbit
    python jobs/bench_torch_backend.py --processes 2 --hidden 8 --cnn 2,4 --rounds 2 --steps 2
"""

from __future__ import annotations

import argparse
import sys

from benchkit import ddp
from benchkit.hosts import link_rate
from benchkit.processes import parse_counts


def _numbers(parser: argparse.ArgumentParser, option: str, text: str, example: str) -> list[int]:
    """``'32,64'`` -> ``[32, 64]``; ``''`` or ``'none'`` -> ``[]``; else the parser's error."""
    if text.strip().lower() in ("", "none"):
        return []
    try:
        numbers = [int(part) for part in text.split(",")]
    except ValueError:
        numbers = [0]
    if min(numbers) < 1:
        parser.error(f"{option} {text!r}: write positive whole numbers, e.g. {example}")
    return numbers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: a bad option stops here, naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default=ddp.DEFAULT_PROCESSES, help="N, comma-separated")
    parser.add_argument(
        "--hidden", default=ddp.DEFAULT_HIDDEN, help="the MLPs' widths, comma-separated ('none')"
    )
    parser.add_argument(
        "--cnn", default=ddp.DEFAULT_CNN, help="the CNN's two conv layers' channels ('none')"
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, each round")
    parser.add_argument(
        "--hosts", type=int, default=1, help="simulated hosts to spread the ranks over (root)"
    )
    parser.add_argument(
        "--rate", type=link_rate, default=None, help="each simulated host's link, e.g. 1gbit"
    )
    args = parser.parse_args(argv)
    hidden = _numbers(parser, "--hidden", args.hidden, "256,1024")
    cnn = _numbers(parser, "--cnn", args.cnn, "32,64")
    if cnn and len(cnn) != 2:
        parser.error(f"--cnn {args.cnn!r}: give the two conv layers' channels, e.g. 32,64")
    args.specs = [("mlp", width) for width in hidden] + ([("cnn", tuple(cnn))] if cnn else [])
    if not args.specs:
        parser.error("--hidden none --cnn none: nothing to measure; name a model")
    args.counts = parse_counts(args.processes)
    if args.hosts < 1 or any(count % args.hosts for count in args.counts):
        parser.error(
            f"--hosts {args.hosts} with --processes {args.processes}: every process count must "
            "spread evenly over the hosts"
        )
    if args.rate and args.hosts == 1:
        parser.error("--rate limits the simulated hosts' links: give --hosts 2 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark as the command line (``argv``, else ``sys.argv``) says; the exit status."""
    args = parse_args(argv)
    ddp.run(args.counts, args.specs, args.rounds, args.steps, args.warmup, args.hosts, args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
