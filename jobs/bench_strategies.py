"""Benchmark: the update strategies with one partition made slow, on the digits job, one table.

Each fit trains the main job's model (MLP 64-128-10, Adam, batch 64) on scikit-learn's
digits, with partition ``--slow-partition`` sleeping ``--slow-ms`` in every step's compute:
a slower executor, made by this job's own model wrapper (the product path has no sleep).
The strategies take turns, ``--rounds`` times (bsp, backup, ssp, ..., bsp, backup, ...), so
the machine's drift hits them alike; the table shows medians over the rounds of the fit's
time, its global steps per second, the time from the start of the fit until the driver
had an epoch whose validation accuracy reached ``--target`` (each partition's share of an
epoch is evaluated as that partition finishes the epoch), the final test accuracy, the
ratio of the fit's time to BSP's in the same round, and with backup workers in how many
steps the slow partition's gradient was left out.

    python jobs/bench_strategies.py                 # local[2], partition 1 slow by 6 ms a step
    python jobs/bench_strategies.py --master local[4] --workers 4 --slow-ms 20
"""

from __future__ import annotations

import argparse
import sys

from benchkit import strategies


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: a bad option stops here, naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--slow-partition", type=int, default=1)
    parser.add_argument(
        "--slow-ms", type=float, default=6.0, help="sleep per step on the slow partition"
    )
    parser.add_argument("--target", type=float, default=0.95, help="validation accuracy to time")
    parser.add_argument(
        "--strategies",
        default=",".join(strategies.STRATEGIES),
        help="comma-separated names from the table",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="turns each strategy takes, alternating"
    )
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.strategies.split(",")]
    unknown = [name for name in chosen if name not in strategies.STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {list(strategies.STRATEGIES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark as the command line (``argv``, else ``sys.argv``) says; the exit status."""
    return strategies.run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
