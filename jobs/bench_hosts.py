"""Benchmark: hierarchical against flat sync, and encrypted against plain, across simulated hosts.

Root only. The job makes H simulated hosts on this machine (``--hosts``, default 4:
network namespaces on a bridge, 192.0.2.1..H, made by ``harness.sim_hosts``), limits
each host's link to ``--rate`` both ways (``tc`` tbf, default 1gbit), starts a Spark
standalone cluster on them (``harness.spark_standalone``: the master on h1, one worker of
``--slots`` cores on each host, so L partitions share a host as they share a machine of a
real cluster) and submits itself to it with ``spark-submit`` from h1. That driver times
the loop a user writes (the README's: ``get_weights``, ``put_gradients`` of the gradient
in ``gradient_buffer()``, ``aggregate_gradient_partition``, the update of the own slice,
``send_weight_partition``) for each size of ``--sizes``, in four configurations:
``AllReduceParameter(topology="flat" | "hierarchical", network=NetworkSettings(encrypt=...))``.

Measuring rules: the machine drifts between runs, so the configurations alternate within
one run. Each round is one barrier stage in which every task runs every configuration in
turn (connect, warm-up steps, timed steps, close), in the opposite order every other
round; a step is timed inside the task (``time.perf_counter``, no Spark call in the
timed loop), a step's time is the slowest partition's, and a round's figure the median
over its steps. The tables give the median over the rounds of each configuration, and
the median, with its range, of the per-round ratios hierarchical / flat and encrypted /
plain: the configurations of one round ran in the same stage, about a minute apart at
most, under the same drift.

Every configuration is checked, every round: each partition's weights after the steps
(the sha256 of its last ``get_weights``) must be numpy's float32 sums of the same
gradients in the engine's order (each host's partitions in order, then the hosts), bit
for bit with a lossless codec; with a lossy one, the same bits on every partition and,
in the first round, partition 0's weights within 2% of the largest value the steps could
reach. A mismatch stops the job with an error. ``link MB/step`` is what crossed the
hosts' links per step (the growth of each host's ``eth0`` transmit counter over the
timed steps, summed over the hosts: payload, headers and Spark's own traffic, which is
small beside it).

Everything the job starts (namespaces, the cluster's daemons, spark-submit and the
executors) is stopped when it ends, on an error or Ctrl-C too; a second Ctrl-C does not
interrupt that. Nothing leaves the namespaces: the driver, the cluster and the tasks all
run inside them, on 192.0.2.x and the namespaces' own loopbacks. Its hosts and cluster are
made by the same modules as the tests' (beside this file, skipping and failing as pytest
does), so it needs pytest (``pip install -e '.[test]'``), and tc, ip, unshare and nsenter.

    sudo .venv/bin/python jobs/bench_hosts.py                        # 4 hosts x 4 slots, 1gbit, 1M and 10M
    sudo .venv/bin/python jobs/bench_hosts.py --sizes 10M --rate 10gbit --rounds 7
    sudo .venv/bin/python jobs/bench_hosts.py --hosts 2 --slots 2 --sizes 10K --rounds 1 --steps 2
"""

from __future__ import annotations

import argparse
import sys

from benchkit import hosts
from benchkit.rounds import DENSE_CODECS


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, checked: a bad option stops here, naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=4, help="simulated hosts (default 4)")
    parser.add_argument(
        "--slots", type=int, default=4, help="task slots (worker cores) per host (default 4)"
    )
    parser.add_argument(
        "--rate",
        type=hosts.link_rate,
        default="1gbit",
        help="each host's link, each way, as tc writes it (default 1gbit)",
    )
    parser.add_argument(
        "--sizes", default="1M,10M", help="float32 elements, comma-separated (default 1M,10M)"
    )
    parser.add_argument(
        "--codec", default="raw", choices=DENSE_CODECS, help="the codec (default raw)"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="alternating rounds; ratios are their median"
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps per round and configuration (default 5)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3 * 3600.0,
        help="seconds the driver may run in all (default 3 hours)",
    )
    # the driver's run
    parser.add_argument("--inside-cluster", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hosts < 2 or args.hosts > 254 or args.slots < 1:
        parser.error(
            "--hosts must be 2 to 254 (one host has nothing to compare) and --slots at least 1"
        )
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be at least 1, --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark as the command line (``argv``, else ``sys.argv``) says; the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    return hosts.run(parse_args(argv), argv, script=__file__)


if __name__ == "__main__":
    sys.exit(main())
