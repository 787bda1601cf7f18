"""Benchmark without Spark: DistributedDataParallel's step on the allreduce_param backend
against the same on gloo, N plain processes on this host, alternating rounds.

The run is ``benchkit/ddp.py``'s (what is measured and how). Needs torch.

    python jobs/bench_torch_backend.py                                  # 2 processes, two MLPs
    python jobs/bench_torch_backend.py --processes 2,4 --hidden 256,1024,2048
    python jobs/bench_torch_backend.py --processes 2 --hidden 16 --rounds 1 --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import sys

from benchkit import ddp
from benchkit.processes import parse_counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: a bad option stops here, naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default=ddp.DEFAULT_PROCESSES, help="N, comma-separated")
    parser.add_argument(
        "--hidden", default=ddp.DEFAULT_HIDDEN, help="the MLP's hidden widths, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, each round")
    args = parser.parse_args(argv)
    try:
        args.hidden = [int(part) for part in args.hidden.split(",")]
    except ValueError:
        parser.error(f"--hidden {args.hidden!r}: write widths as whole numbers, e.g. 256,1024")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark as the command line (``argv``, else ``sys.argv``) says; the exit status."""
    args = parse_args(argv)
    ddp.run(parse_counts(args.processes), args.hidden, args.rounds, args.steps, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
