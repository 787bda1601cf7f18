"""A partition held in memory costs its rows' bytes once, not three times: in a real Spark
task over the stage's own input (shuffled, sorted by its order keys, real Arrow batches from
the JVM), the task's ``partition_rows`` peaks at most 1.5x the partition above where its
Python worker stood before the first batch; and ``data_in="auto"`` chooses disk where a
partition would not fit that bound in what the worker may use."""

from __future__ import annotations

import sys

import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F

from allreduce_param.train.columns import TRAIN, VALIDATION
from allreduce_param.train.task.spill import PEAK_FACTOR, memory_budget, partition_bytes

FEATURES = 64
ROWS = 96_000  # 96,000 x (64 x 4 + 8) bytes: a 25.3 MB partition, in 10 Arrow batches


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the task below, by value


def placed_rows(spark, rows: int):
    """``rows`` rows as the fit's stage gets them from a shuffled placement: features
    (float32), label, split (every tenth row validation), the order keys, in one partition
    that Spark sorted by (split, _order, _i) after the shuffle."""
    values = F.expr(
        f"transform(sequence(0, {FEATURES - 1}), i -> cast(((id * 7 + i * 13) % 101) / 101.0 "
        "as float))"
    )
    split = F.when(F.col("id") % 10 == 0, VALIDATION).otherwise(TRAIN)
    return (
        spark.range(0, rows, 1, 2)
        .select(
            values.alias("features"),
            (F.col("id") % 2).cast("double").alias("label"),
            split.cast("int").alias("split"),
            (-F.col("id")).alias("_order"),
            F.col("id").alias("_i"),
        )
        .repartition(1)
        .sortWithinPartitions("split", "_order", "_i")
    )


def _tiny_stream():
    """An Arrow stream of 10 rows of the placed columns."""
    import numpy as np
    import pyarrow as pa

    values = pa.array(np.zeros(10 * FEATURES, np.float32))
    offsets = pa.array(np.arange(0, 10 * FEATURES + 1, FEATURES, dtype=np.int32))
    batch = pa.RecordBatch.from_pydict(
        {
            "features": pa.ListArray.from_arrays(offsets, values),
            "label": pa.array(np.zeros(10)),
            "split": pa.array(np.zeros(10, np.int32)),
            "_order": pa.array(np.arange(10)),
            "_i": pa.array(np.arange(10)),
        }
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def held_in_memory(batches):
    """A Spark task: its partition's rows held by the fit's own ``partition_rows`` in
    memory; the worker's peak resident memory above its start, and what was held."""
    import ctypes
    import gc

    import numpy as np
    import pyarrow as pa

    from allreduce_param.train.task.spill import partition_rows

    def status(field: str) -> int:
        with open("/proc/self/status") as lines:
            return next(int(line.split()[1]) << 10 for line in lines if line.startswith(field))

    # the code that reads a batch and holds rows paged in first, over a tiny stream of the
    # same columns (a library's pages count in resident memory once, whatever the data)
    warm = _tiny_stream()
    partition_rows(pa.ipc.open_stream(warm), FEATURES, False, "memory")
    del warm
    # what earlier tasks left free in this reused worker's allocators goes back to the
    # system, so that using it again counts in the peak; the peak starts from here
    gc.collect()
    pa.default_memory_pool().release_unused()
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    start = status("VmRSS:")
    train, validation = partition_rows(batches, FEATURES, False, "memory")
    peak = status("VmHWM:")
    shared = np.shares_memory(train.X, validation.X) or train.X.base is validation.X.base
    yield pa.RecordBatch.from_pydict(
        {
            "growth": [peak - start],
            "train": [train.row_count],
            "validation": [validation.row_count],
            "order": [int(train.y[:4].sum() + validation.y[:4].sum())],
            "one_matrix": [bool(shared)],
        }
    )


@pytest.mark.slow
def test_a_partition_in_memory_peaks_at_most_one_and_a_half_times_its_rows(spark):
    (held,) = (
        placed_rows(spark, ROWS)
        .mapInArrow(
            held_in_memory,
            "growth long, train long, validation long, order long, one_matrix boolean",
        )
        .collect()
    )
    assert (held.train, held.validation) == (ROWS - ROWS // 10, ROWS // 10)
    assert held.one_matrix  # the validation rows are no copy of their own
    partition = partition_bytes(ROWS, FEATURES)
    assert held.growth <= PEAK_FACTOR * partition, (
        f"the worker's peak rose {held.growth / 1e6:.1f} MB above its start for a partition "
        f"of {partition / 1e6:.1f} MB ({held.growth / partition:.2f}x)"
    )


def test_auto_keeps_a_partition_in_memory_only_where_one_and_a_half_times_it_fits(monkeypatch):
    """The budget "auto" keeps to: what a worker may use (here a limit 1 GiB above the
    address space this process maps, less that space and the model's 100 MB) over
    ``PEAK_FACTOR``. The limit is set from this process's own mapping, which depends on what
    it has imported (torch, a JVM's client...): a fixed 1 GiB would leave no room at all."""
    with open("/proc/self/status") as lines:
        mapped = next(int(line.split()[1]) << 10 for line in lines if line.startswith("VmSize:"))
    monkeypatch.setenv("PYSPARK_EXECUTOR_MEMORY_MB", str((mapped >> 20) + 1024))
    limit = ((mapped >> 20) + 1024) << 20
    budget = memory_budget(4, reserved=100 << 20)
    assert abs(budget - (limit - mapped - (100 << 20)) / PEAK_FACTOR) < 64 << 20
    assert memory_budget(4, reserved=2 << 30) == 0  # no room: every partition to disk
    # the partition: 1 GB of rows with 1 GiB left to the worker goes to disk
    assert partition_bytes(1_000_000, 250) > budget
    monkeypatch.delenv("PYSPARK_EXECUTOR_MEMORY_MB")
    assert memory_budget(1) > memory_budget(4) > 0  # the machine's memory, shared
