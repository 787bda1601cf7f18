"""``bench_memory.py``'s run: a fit's memory with its partitions on disk, on data of 1x, 4x and
16x the (the script says how).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np

from allreduce_param import DistriOptimizer, models, optim
from allreduce_param.spark.session import local_spark
from benchkit.machine import CONF_DIR, copy_bandwidth, machine
from benchkit.tables import render

BATCH_ROWS = 2048  # rows a generating task yields at a time


def generated(spark, rows: int, features: int, partitions: int, seed: int = 0):
    """A DataFrame ``features array<float>, label double`` of ``rows`` rows made inside the
    tasks, batch by batch (never whole anywhere): uniform features in [-1, 1), label 1 where
    a fixed linear rule plus noise is positive. The same rows for the same arguments."""
    import pyarrow as pa

    truth = np.random.default_rng(seed).standard_normal(features).astype(np.float32)
    per = -(-rows // partitions)

    def make(batches):
        for batch in batches:
            for part in batch.column(0).to_pylist():
                rng = np.random.default_rng([seed, part])
                count = max(0, min(per, rows - part * per))
                for start in range(0, count, BATCH_ROWS):
                    n = min(BATCH_ROWS, count - start)
                    X = rng.random((n, features), np.float32) * 2 - 1
                    noise = rng.standard_normal(n).astype(np.float32)
                    y = ((X @ truth) / np.sqrt(features / 3) + 0.3 * noise > 0).astype(np.float64)
                    values = pa.array(X.reshape(-1), pa.float32())
                    offsets = pa.array(np.arange(0, n * features + 1, features, dtype=np.int32))
                    yield pa.RecordBatch.from_arrays(
                        [pa.ListArray.from_arrays(offsets, values), pa.array(y)],
                        ["features", "label"],
                    )

    ids = spark.range(0, partitions, 1, partitions)
    return ids.mapInArrow(make, "features array<float>, label double")


class RssSampler:
    """Reads the resident memory of this process and of every Python worker under the
    session (processes running ``pyspark.daemon``) every ``period`` seconds; ``window()``
    gives each one's peak since the last call."""

    def __init__(self, period: float = 0.02) -> None:
        self.period, self.peaks, self._lock = period, {}, threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(self.period):
            seen = {me: ("driver", _rss(me))}
            for entry in os.listdir("/proc"):
                if entry.isdigit() and int(entry) != me:
                    kind = _worker_kind(int(entry))
                    if kind is not None:
                        seen[int(entry)] = (kind, _rss(int(entry)))
            with self._lock:
                for pid, (kind, rss) in seen.items():
                    if rss is not None:
                        old = self.peaks.get(pid, (kind, (0, 0)))[1]
                        self.peaks[pid] = (kind, tuple(max(a, b) for a, b in zip(old, rss)))

    def window(self) -> dict:
        with self._lock:
            peaks, self.peaks = self.peaks, {}
        return peaks

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _rss(pid: int) -> tuple[int, int] | None:
    """A process's resident memory and address space (VmRSS, VmSize), in bytes."""
    found = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(("VmRSS:", "VmSize:")):
                    found[line[:6]] = int(line.split()[1]) << 10
    except OSError:
        return None
    return (found["VmRSS:"], found["VmSize"]) if len(found) == 2 else None


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def _worker_kind(pid: int) -> str | None:
    """ "worker" for a Python worker of this process's session (forked by the daemon that its
    JVM, this process's child, started), "daemon" for that daemon, else None (other
    sessions' workers on the same machine included)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if b"pyspark.daemon" not in cmdline.read():
                return None
        line = [pid]
        while line[-1] > 1 and len(line) < 5:
            line.append(_parent(line[-1]))
    except (OSError, ValueError, IndexError):
        return None
    me = os.getpid()
    if len(line) > 3 and line[3] == me:  # worker -> daemon -> JVM -> this process
        return "worker"
    if len(line) > 2 and line[2] == me:
        return "daemon"
    return None


def fit(frame, features: int, data_in: str, args, epochs: int | None = None) -> dict:
    """One fit (``epochs``, else ``--epochs``); its samples/s over the training phase,
    accuracy and seconds."""
    result = DistriOptimizer(
        models.LogisticRegression(features),
        optim.Adam(lr=0.01),
        batch_size=args.batch_size,
        epochs=epochs or args.epochs,
        num_workers=args.workers,
        data_in=data_in,
        seed=1,
    ).fit(frame)
    history = result.history
    samples = sum(step["samples"] for step in history.steps)
    training = history.phases.get("training") or history.seconds
    accuracy = history.epochs[-1].get("train_accuracy") or float("nan")
    return {
        "samples/s": samples / training if training else 0.0,
        "accuracy": accuracy,
        "seconds": history.seconds,
        "phases": dict(history.phases),
    }


def megabytes(value: int) -> str:
    return f"{value / 2**20:,.0f}"


def reads(args) -> int:
    """``--reads-only``: an epoch's batches from memory and from a row file, alternating."""
    import tempfile

    from allreduce_param.train.row_file import RowFileWriter, block_rows_for
    from allreduce_param.train.task.disk_rows import DiskRows
    from allreduce_param.train.task.memory_rows import Rows

    rows, width = args.rows, args.features
    batch = max(1, args.batch_size // args.workers)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((rows, width), dtype=np.float32)
    y = rng.integers(0, 2, rows).astype(np.float64)
    print(f"machine: {machine()}")
    print(
        f"memory copy: {copy_bandwidth() / 1e9:.2f} GB/s (np.copyto of 40 MB, median of 5); no "
        f"Spark: one partition of {rows:,} rows of {width} float32 features, batches of "
        f"{batch:,}; CPU time of taking one epoch's batches, {args.rounds} alternating rounds "
        "(median of 3 epochs each)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as folder:
        writer = RowFileWriter(os.path.join(folder, "rows"), width, block_rows_for(4 * width + 8),
                               False, False)  # fmt: skip
        for start in range(0, rows, 4096):
            writer.append(X[start : start + 4096], y[start : start + 4096])
        disk, memory = DiskRows(writer.close()), Rows(X, y, None)
        room = memory.room_for(batch)
        takes = {
            "memory": lambda order: [
                memory.take(order[s : s + batch], room) for s in range(0, rows, batch)
            ],
            "disk": lambda order: [disk.take(order[s : s + batch]) for s in range(0, rows, batch)],
        }
        sources = {"memory": memory, "disk": disk}
        times: dict[str, list[float]] = {"memory": [], "disk": []}
        for turn in range(args.rounds):
            for way in ("memory", "disk") if turn % 2 == 0 else ("disk", "memory"):
                epochs = []
                for epoch in range(3):
                    order = sources[way].epoch_order(0, 3 * turn + epoch, 0)
                    started = time.process_time()
                    takes[way](order)
                    epochs.append(time.process_time() - started)
                times[way].append(1e3 * statistics.median(epochs))
        disk.release()
    ratios = [d / m for d, m in zip(times["disk"], times["memory"])]
    lines = [
        ("memory", f"{statistics.median(times['memory']):.2f}", "1.00"),
        ("disk", f"{statistics.median(times['disk']):.2f}",
         f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"),
    ]  # fmt: skip
    print(render(("data in", "ms an epoch (median)", "x memory (range)"), lines))
    return 0


def run(args: argparse.Namespace) -> int:
    """Measure as the command line (``bench_memory.py``'s, checked there) says; the exit status."""
    if args.reads_only:
        return reads(args)
    bandwidth = copy_bandwidth()
    print(f"machine: {machine()}")
    print(
        f"memory copy: {bandwidth / 1e9:.2f} GB/s (np.copyto of 40 MB, median of 5); "
        f"spark.executor.pyspark.memory {args.limit_mb} MB, {args.workers} workers, "
        f"{args.features} float32 features, logistic regression, batch {args.batch_size}, "
        f"{args.epochs} epoch(s)",
        flush=True,
    )
    spark = limited_spark(args)
    sampler = RssSampler()
    try:
        if not args.compare_only:
            peaks_table(spark, sampler, args)
        if args.rounds:
            compare_table(spark, args)
    finally:
        sampler.stop()
        spark.stop()
    return 0


def limited_spark(args: argparse.Namespace):
    """A session whose Python workers are limited to ``--limit-mb`` and allocate sparingly."""
    # Arrow's default allocator (mimalloc) reserves 1 GiB of address space in each Python
    # worker that reads a batch, more than the limit: the system's, in every worker (the fit's
    # tasks choose it themselves, but the generating tasks run first in the same workers)
    # glibc's malloc the same way: two arenas, and blocks from 1 MiB up mapped on their own
    # (a fit's task sets both for itself; the generating tasks run first in the same workers)
    allocation = {
        "ARROW_DEFAULT_MEMORY_POOL": "system",
        "MALLOC_ARENA_MAX": "2",
        "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
    }
    os.environ.update(allocation)
    return local_spark(
        args.master,
        conf_dir=CONF_DIR,
        **{
            "spark.executor.pyspark.memory": f"{args.limit_mb}m",
            **{f"spark.executorEnv.{name}": value for name, value in allocation.items()},
            # a batch of 10,000 rows (Spark's default) and the checks' temporaries over it
            # take a good share of a few hundred MB
            "spark.sql.execution.arrow.maxRecordsPerBatch": "2048",
            "spark.ui.enabled": "false",
        },
    )


def frame_of(spark, args: argparse.Namespace, factor: float):
    """``factor`` x the limit's bytes of generated rows: (rows, the frame), in partitions of at
    most 64 MB (and at least one per worker)."""
    row_bytes = 4 * args.features
    rows = int(factor * (args.limit_mb << 20) / row_bytes)
    parts = max(args.workers, -(-rows * row_bytes // (64 << 20)))
    return rows, generated(spark, rows, args.features, parts)


def peaks_table(spark, sampler: RssSampler, args: argparse.Namespace) -> None:
    """One fit from memory and one from disk at ``--small`` x the limit, then from disk at each
    of ``--factors``: each fit's peak memory, speed and accuracy."""
    factors = [float(f) for f in args.factors.split(",")]
    lines = []
    for data_in, factor in [("memory", args.small), ("disk", args.small)] + [
        ("disk", f) for f in factors
    ]:
        rows, frame = frame_of(spark, args, factor)
        sampler.window()
        outcome = fit(frame, args.features, data_in, args)
        peaks = sampler.window()
        workers = sorted(rss for kind, rss in peaks.values() if kind == "worker")
        driver = max(rss[0] for kind, rss in peaks.values() if kind == "driver")
        lines.append(
            (
                data_in,
                f"{factor:g}x",
                f"{rows * 4 * args.features / 2**30:.2f}",
                f"{factor / args.workers:g}x",
                f"{rows:,}",
                " ".join(megabytes(w[0]) for w in workers[::-1]),
                " ".join(megabytes(w[1]) for w in workers[::-1]),
                megabytes(driver),
                f"{outcome['samples/s']:,.0f}",
                f"{outcome['accuracy']:.4f}",
                f"{outcome['seconds']:.1f}",
            )
        )
        print(" | ".join(lines[-1]), flush=True)
    header = (
        "data in",
        "data",
        "GiB",
        "partition",
        "rows",
        "task processes' peak RSS, MB",
        "their peak address space, MB",
        "driver MB",
        "samples/s",
        "accuracy",
        "fit s",
    )
    print("\npeak resident memory (sampled every 20 ms) per fit:")
    print(render(header, lines, left=2))


def compare_table(spark, args: argparse.Namespace) -> None:
    """``--rounds`` alternating rounds of fits from memory and from disk on the same rows (in
    the page cache): their speeds and the rounds' ratios."""
    rows, frame = frame_of(spark, args, args.small)
    speeds = {"memory": [], "disk": []}
    accuracy = {}
    for _ in range(args.rounds):
        for data_in in ("memory", "disk"):
            outcome = fit(frame, args.features, data_in, args, args.compare_epochs)
            speeds[data_in].append(outcome["samples/s"])
            accuracy[data_in] = outcome["accuracy"]
    ratios = [d / m for d, m in zip(speeds["disk"], speeds["memory"])]
    print(
        f"\nsamples/s over the training phase, {args.rounds} alternating rounds of "
        f"{args.compare_epochs} epochs on {rows:,} rows ({args.small:g}x the limit, in "
        "the page cache):"
    )
    print(
        render(
            ("data in", "samples/s (median)", "accuracy", "x memory (range)"),
            [
                (
                    "memory",
                    f"{statistics.median(speeds['memory']):,.0f}",
                    f"{accuracy['memory']:.4f}",
                    "1.00",
                ),
                (
                    "disk",
                    f"{statistics.median(speeds['disk']):,.0f}",
                    f"{accuracy['disk']:.4f}",
                    f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
                ),
            ],
            left=1,
        )
    )
