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
import sys

from benchkit import overlap
from benchkit.links import LINK_BURST


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: a bad option stops here, naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="local[*]", help="Spark master (default: local[*])")
    parser.add_argument(
        "--models",
        default=",".join(overlap.MODELS),
        help=f"of {', '.join(overlap.MODELS)} (comma-separated)",
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
    kinds = args.models.split(",")
    if set(kinds) - set(overlap.MODELS):
        parser.error(
            f"unknown model {sorted(set(kinds) - set(overlap.MODELS))}: choose of {', '.join(overlap.MODELS)}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark as the command line (``argv``, else ``sys.argv``) says; the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    return overlap.run(parse_args(argv), argv, script=__file__)


if __name__ == "__main__":
    sys.exit(main())
