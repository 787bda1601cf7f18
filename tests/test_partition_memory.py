"""A partition held in memory costs its rows' bytes, not three times them: a real fit's Python
worker, measured through /proc, peaks at most 1.5x its partition above where it stood before
the fit; and ``data_in="auto"`` chooses disk where a partition would not fit that bound in
what the worker may use."""

from __future__ import annotations

import os

import pytest
from pyspark.sql import functions as F

from allreduce_param import DistriOptimizer, models, optim
from allreduce_param.train.task.spill import (
    PEAK_FACTOR,
    memory_budget,
    partition_bytes,
)

FEATURES = 128
ROWS = 48_000  # 48,000 x (128 x 4 + 8) bytes: a 25 MB partition, in 5 Arrow batches


def workers_of_this_session() -> list[int]:
    """The Python workers (forked by ``pyspark.daemon``) under this process's Spark JVM."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if b"pyspark.daemon" not in cmdline.read():
                    continue
            line = [int(entry)]
            for _ in range(3):
                line.append(_parent(line[-1]))
        except (OSError, ValueError):
            continue
        if line[3] == me:  # worker -> daemon -> JVM -> this process
            found.append(int(entry))
    return found


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def frame(spark, rows: int, validation_every: int = 0):
    """``rows`` rows of ``FEATURES`` float32 features made by Spark (no driver-side data)."""
    values = F.expr(
        f"transform(sequence(0, {FEATURES - 1}), i -> cast(((id * 7 + i * 13) % 101) / 101.0 "
        "as float))"
    )
    return spark.range(0, rows, 1, 2).select(
        values.alias("features"), (F.col("id") % 2).cast("double").alias("label")
    )


def trainer(data_in: str = "memory") -> DistriOptimizer:
    return DistriOptimizer(
        models.LogisticRegression(FEATURES),
        optim.SGD(lr=0.1),
        batch_size=256,
        epochs=1,
        num_workers=1,
        data_in=data_in,
        progress=False,
        seed=1,
    )


@pytest.mark.slow
def test_a_partition_in_memory_peaks_at_most_one_and_a_half_times_its_rows(spark):
    trainer().fit(frame(spark, 256))  # workers started, their modules imported
    workers = workers_of_this_session()
    before = {}
    for pid in workers:
        with open(f"/proc/{pid}/clear_refs", "w") as clear:
            clear.write("5")  # the peak (VmHWM) starts again from now
        before[pid] = _status(pid, "VmRSS")
    trainer().fit(frame(spark, ROWS))
    new = set(workers_of_this_session()) - set(workers)
    assert not new, f"the fit ran on workers started after the measure began: {new}"
    growth = max(_status(pid, "VmHWM") - before[pid] for pid in workers)
    partition = partition_bytes(ROWS, FEATURES, sparse_values=None, weighted=False)
    assert growth <= PEAK_FACTOR * partition, (
        f"the worker's peak rose {growth / 1e6:.1f} MB above its start for a partition of "
        f"{partition / 1e6:.1f} MB ({growth / partition:.2f}x)"
    )


def test_auto_keeps_a_partition_in_memory_only_where_one_and_a_half_times_it_fits():
    """The budget "auto" keeps to: what a worker may use over ``PEAK_FACTOR``."""
    one_gib = 1 << 30
    os.environ["PYSPARK_EXECUTOR_MEMORY_MB"] = "1024"
    try:
        budget = memory_budget(4)
    finally:
        del os.environ["PYSPARK_EXECUTOR_MEMORY_MB"]
    assert budget < one_gib / PEAK_FACTOR
    # the partition: 1 GB under a 1 GiB limit goes to disk
    assert partition_bytes(1_000_000, 250, None, False) > budget
