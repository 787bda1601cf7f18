"""Benchmark: a fit's memory with its partitions on disk, on data of 1x, 4x and 16x the
Python worker's memory limit, and its speed against the in-memory path.

One Spark session whose Python workers are limited to ``--limit-mb``
(``spark.executor.pyspark.memory``: an address-space limit, RLIMIT_AS). The data is
generated inside the tasks (``--features`` float32 features, a label from a fixed linear
rule with noise), ``factor x limit`` bytes of features in all, over ``--workers`` partitions
(each partition is ``factor / workers`` times the limit). For each size a logistic
regression trains with ``data_in="disk"`` (each task writes its partition to row files in
Spark's local directory and reads them back a block at a time), and on the small data
(``--small`` of the limit) with ``data_in="memory"`` too. A sampler in this process reads
every Python process's resident memory under the session every 20 ms: the table gives the
peak of each task process (the Python workers, the daemon they fork from left out) and of
the driver's Python process during each fit. Peak RSS must not grow with the data.

Then ``--rounds`` alternating rounds (memory, disk, memory, disk, ...) on the small data,
which the page cache holds: samples/s of each (training samples over the fit's training
phase: from the tasks meeting to their last step), the median ratio disk / memory and its
range, and the accuracy of both on their training rows.

    python jobs/bench_memory.py                       # limit 512 MB: 0.5, 2 and 8 GB of data
    python jobs/bench_memory.py --limit-mb 1024 --factors 1,4,16 --workers 4
    python jobs/bench_memory.py --compare-only --rounds 5  # the memory/disk rounds alone
    python jobs/bench_memory.py --reads-only --rounds 9    # no Spark: an epoch's batches

``--reads-only`` times, without Spark, what the two paths differ in: the CPU time of taking
one epoch's batches (``--rows`` rows of ``--features``, a partition's share of
``--batch-size``) from rows in memory (``memory_rows.Rows.take`` into a reused room) and from a
row file in a temporary folder, which the page cache holds (``DiskRows.take``: each block
``pread``, checked against its checksum, gathered), in alternating rounds.

The defaults run on a 2-core, 24 GiB VM in a few minutes; the 16x data needs about twice
its size free in the local directory (Spark's shuffle files and the row files).
"""

from __future__ import annotations

import argparse
import sys

from benchkit import memory


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: a bad option stops here, naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--limit-mb", type=int, default=512, help="spark.executor.pyspark.memory")
    parser.add_argument("--factors", default="1,4,16", help="data sizes, times the limit")
    parser.add_argument("--small", type=float, default=0.125, help="the small data, x limit")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3, help="alternating memory/disk rounds")
    parser.add_argument("--compare-epochs", type=int, default=5, help="epochs of those rounds")
    parser.add_argument(
        "--compare-only",
        action="store_true",
        help="only the alternating rounds (no fits on 1x, 4x, 16x data, no memory table)",
    )
    parser.add_argument(
        "--reads-only", action="store_true", help="no Spark: an epoch's batches, memory/disk"
    )
    parser.add_argument("--rows", type=int, default=32768, help="--reads-only: the partition")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark as the command line (``argv``, else ``sys.argv``) says; the exit status."""
    return memory.run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
