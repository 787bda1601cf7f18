"""Benchmark: how the cost of one sync grows with the vector's size and with the partitions.

Two tables, measured as ``bench_allreduce.py`` measures (``benchkit.rounds``): rounds
that alternate one Spark barrier stage timing the engine's step (the README's loop: get,
put, aggregate, update, send; raw codec, shared memory between partitions on this host)
with gloo's ``all_reduce`` between as many processes; a round's figure is the median over
its steps of the slowest partition's step, the table's the median over the rounds, and
``x gloo`` the median of the per-round ratios with their range.

(a) time per sync against the size (``--sizes``, default 10K to 200M float32) on
    ``--master`` (default local[*]);
(b) time per sync against the number of partitions N (``--ns``, default 2,3,4) at one size
    (``--n-size``, default 10M), each N on its own Spark master ``local-cluster[N,1,1024]``
    (N executor JVMs; ``local[N]`` if that cannot start, and the table says so) with gloo
    between N processes.

Both give the bound ``2(N-1)/N x bytes / memory-copy bandwidth``: the ring allreduce's
traffic per partition (nccl-tests' bus bandwidth) at the speed this machine copies memory
(``np.copyto`` of a 40 MB array, median of 5, measured first and printed). ``GB/s`` is the
vector's bytes over the time of one sync (nccl-tests' algorithm bandwidth).

Memory: a partition holds about four vectors at once (gradient, weights out, its stored
gradient chunks, the fetched ones), 800 MB each at 200M; gloo's ranks one each, and the
two never run at the same time. Big sizes take few steps unless ``--steps`` says otherwise
(15 steps up to 10M, then ``2e8 / size``, at least 6; warm-up 3 up to 10M, then 2: the first
syncs also touch every page of the peers' shared memory for the first time).

    python jobs/bench_growth.py                                   # both tables, long
    python jobs/bench_growth.py --tables sizes --sizes 10K,100K --rounds 2 --steps 3
    python jobs/bench_growth.py --tables partitions --ns 2,3 --n-size 100K --rounds 2 --steps 3
"""

from __future__ import annotations

import argparse
import sys

from benchkit import growth
from benchkit.rounds import LOOPS, TRANSPORTS

from allreduce_param.engine import CODECS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: a bad option stops here, naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tables", default="sizes,partitions", help="which tables: sizes, partitions or both"
    )
    parser.add_argument(
        "--master", default="local[*]", help="Spark master of table (a) (default: local[*])"
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="barrier tasks of table (a) (default: the master's task slots)",
    )
    parser.add_argument(
        "--sizes",
        default=growth.DEFAULT_SIZES,
        help=f"table (a): float32 elements (default {growth.DEFAULT_SIZES})",
    )
    parser.add_argument("--ns", default="2,3,4", help="table (b): partition counts (default 2,3,4)")
    parser.add_argument("--n-size", default="10M", help="table (b): float32 elements (default 10M)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="alternating rounds (engine, gloo, ...) per size and N",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed syncs per round (default: 15, fewer above {growth.STEP_ELEMENTS // 15:,} elements, at least 6)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed syncs first (default: 3, 2 above 10M)"
    )
    parser.add_argument("--codec", default="raw", choices=CODECS)
    parser.add_argument("--transport", default="shared", choices=tuple(TRANSPORTS))
    parser.add_argument("--loop", default="readme", choices=LOOPS)
    parser.add_argument("--no-gloo", action="store_true", help="the engine alone")
    args = parser.parse_args(argv)
    tables = set(args.tables.split(","))
    if tables - {"sizes", "partitions"}:
        parser.error(
            f"unknown tables {sorted(tables - {'sizes', 'partitions'})}: choose of sizes, partitions"
        )
    if args.rounds < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--rounds and --steps must be at least 1")
    if min(int(n) for n in args.ns.split(",")) < 1:
        parser.error("--ns: partition counts of at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark as the command line (``argv``, else ``sys.argv``) says; the exit status."""
    return growth.run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
