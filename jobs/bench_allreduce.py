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

What it measures with (``benchkit.rounds``, ``benchkit.sync_table``, ``benchkit.links``)
is shared with ``bench_growth.py`` and ``bench_overlap.py``; its run is ``benchkit.allreduce``.
"""

from __future__ import annotations

import argparse
import sys

from benchkit import allreduce
from benchkit.links import LINK_BURST
from benchkit.rounds import DENSE_CODECS, LOOPS, TRANSPORTS

from allreduce_param.engine import CODECS


def command_line() -> argparse.ArgumentParser:
    """The command line's options (``--help`` prints them)."""
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
        "vectors (jobs/benchkit/process_memory.py)",
    )
    parser.add_argument(
        "--codecs",
        default=",".join(DENSE_CODECS),
        help=f"of {', '.join(DENSE_CODECS)}; WEIGHTS+GRADIENTS (e.g. int8+topk) for a "
        "gradient codec of its own",
    )
    parser.add_argument("--loops", default="readme", help=f"the user's step, of {', '.join(LOOPS)}")
    add_round_options(parser)
    return parser


def add_round_options(parser: argparse.ArgumentParser) -> None:
    """The options of the rounds, the data, the transports and the simulated links."""
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: unknown loops, codecs or transports stop here, named."""
    parser = command_line()
    args = parser.parse_args(argv)
    named = [part for codec in args.codecs.split(",") for part in codec.split("+", 1)]
    for name, chosen, known in (
        ("loop", args.loops.split(","), LOOPS),
        ("codec", named, CODECS),
        ("transport", args.transports.split(","), TRANSPORTS),
    ):
        if not args.processes and not args.link and set(chosen) - set(known):
            parser.error(
                f"unknown {name} {sorted(set(chosen) - set(known))}: choose of {', '.join(known)}"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark as the command line (``argv``, else ``sys.argv``) says; the exit status."""
    args = parse_args(argv)
    return allreduce.run(args, sys.argv[1:] if argv is None else argv, script=__file__)


if __name__ == "__main__":
    sys.exit(main())
