"""Benchmark: hierarchical sync with and without host arenas, on simulated hosts.

Every partition is a thread of this process; the meeting places them on hosts (as
``tests/conftest.run_partitions(hosts=...)`` does), so partitions of one host meet over
Unix sockets and shared memory and the hosts over TCP on 127.0.0.1. Each round runs the
README's BSP loop (``gradient_buffer()``, put, aggregate, update, send, ``get_weights``)
with ``host_arena=True`` and then ``False`` (alternating, so a change of the machine's load
falls on both alike) and takes the slowest partition's median step; the table gives the
median over rounds and the ratio's range. Every round's final weights must be the same
bits both ways (the arenas sum in the blocks' order), or the job fails saying so.

    PYTHONPATH=$PWD python jobs/bench_host_arenas.py --hosts 2 --slots 2 --sizes 1M,10M --rounds 5

Nothing crosses a real network: this measures the copies and hand-offs within each host
(what the arenas remove), not a link's bandwidth (``jobs/bench_hosts.py`` does that, with
Spark, across network namespaces).
"""

from __future__ import annotations

import argparse
import sys

from benchkit import host_arenas


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: a bad option stops here, naming it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2, help="simulated hosts (default 2)")
    parser.add_argument("--slots", type=int, default=2, help="partitions a host (default 2)")
    parser.add_argument("--sizes", default="1M,10M", help="float32 elements, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=10, help="timed steps a round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark as the command line (``argv``, else ``sys.argv``) says; the exit status."""
    return host_arenas.run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
