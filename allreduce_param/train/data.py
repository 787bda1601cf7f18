"""Training data: checked and shaped on the driver, turned into numpy arrays inside the task.

On the driver, ``prepare`` checks the columns before any task starts (a missing column, a
vector of the wrong length, NaN labels, ragged rows each get a clear error) and shapes the
DataFrame into ``features: array<float>, label: double, split: int`` (0 train, 1
validation). Inside a task, ``arrays_from_arrow`` turns the partition's Arrow batches into
one contiguous float32 matrix, once, with no per-row Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import InputError

TRAIN, VALIDATION = 0, 1
#: The columns a prepared DataFrame has, and their Spark types.
PREPARED_SCHEMA = "features array<float>, label double, split int"


class PartitionCount(NamedTuple):
    """How many rows of one split one partition of the prepared DataFrame holds, and where.

    ``partition`` is the partition's index in the prepared DataFrame (``spark_partition_id()``);
    its rows of ``split`` are consecutive, from position ``start`` in the partition (a
    partition can hold rows of both splits when Spark's union keeps its inputs' partitioning).
    With these, a row's index in the data follows from its partition and position alone.
    """

    split: int
    partition: int
    rows: int
    start: int


@dataclass(frozen=True)
class DataSummary:
    """What the driver learnt about the data while checking it.

    ``partition_counts``: one ``PartitionCount`` per (split, partition) of the prepared
    DataFrame that holds rows of that split, sorted by split then partition; what
    ``partitioning.place_rows`` needs to place rows by their index without a job of its own.
    """

    n_features: int
    sample: tuple  # one training row as (X [1, n_features] float32, y [1]), to try the model on
    partition_counts: tuple[PartitionCount, ...] = ()

    def rows(self, split: int = TRAIN) -> int:
        """How many rows of ``split`` (TRAIN or VALIDATION) the data has."""
        return sum(count.rows for count in self.partition_counts if count.split == split)


#: monotonically_increasing_id() holds the partition index above this many bits.
_POSITION_BITS = 33


def prepare(df, features_col: str, label_col: str, validation=None):
    """Check ``df`` (and ``validation``) and shape them for training; (DataFrame, DataSummary).

    Runs one small Spark job for both DataFrames (row counts per split and partition, vector
    lengths, missing labels). Its counts are of the returned DataFrame's own partitions, so
    ``partitioning.place_rows`` on that DataFrame can index its rows without counting again.
    """
    from pyspark.sql import functions as F

    frames = [("training", df, TRAIN)] + ([("validation", validation, VALIDATION)] if validation is not None else [])
    parts = [_shape(frame, features_col, label_col, name).withColumn("split", F.lit(split))
             for name, frame, split in frames]
    prepared = parts[0] if len(parts) == 1 else parts[0].unionByName(parts[1])
    stats_by_split = _statistics(prepared)
    lengths, counts = [], []
    for name, _, split in frames:
        stats = stats_by_split.get(split)
        if stats is None or stats["rows"] == 0:
            raise InputError(f"the {name} data has no rows")
        if stats["bad_labels"]:
            raise InputError(
                f"the {name} data has {stats['bad_labels']} rows whose label {label_col!r} is null or NaN; "
                f"drop or fill them first, e.g. df.dropna(subset=[{label_col!r}])"
            )
        if stats["missing_features"]:
            raise InputError(f"the {name} data has {stats['missing_features']} rows without {features_col!r}")
        if stats["shortest"] != stats["longest"]:
            raise InputError(
                f"the {name} column {features_col!r} holds vectors of {stats['shortest']} to "
                f"{stats['longest']} elements; every row needs the same length"
            )
        lengths.append(stats["longest"])
        counts.extend(PartitionCount(split, int(part["partition"]), int(part["rows"]),
                                     int(part["first"]) & ((1 << _POSITION_BITS) - 1))
                      for part in stats["partitions"])
        if split == TRAIN:
            sample = (np.asarray([stats["first_features"]], np.float32), np.asarray([stats["first_label"]]))
    if len(lengths) == 2 and lengths[0] != lengths[1]:
        raise InputError(f"training vectors have {lengths[0]} elements but validation vectors {lengths[1]}")
    return prepared, DataSummary(int(lengths[0]), sample, tuple(sorted(counts)))


def _statistics(prepared) -> dict:
    """One job over the prepared rows: per split, what ``prepare`` checks, and per partition
    its row count and first row (``monotonically_increasing_id``, as ``place_rows`` reads it)."""
    from pyspark.sql import functions as F

    indexed = prepared.select("features", "label", "split", F.monotonically_increasing_id().alias("row"))
    per_partition = indexed.groupBy(
        "split", F.shiftright("row", _POSITION_BITS).cast("int").alias("partition")
    ).agg(
        F.count(F.lit(1)).alias("rows"),
        F.min("row").alias("first"),
        F.min(F.size("features")).alias("shortest"),
        F.max(F.size("features")).alias("longest"),
        F.sum(F.when(F.col("label").isNull() | F.isnan("label"), 1).otherwise(0)).alias("bad_labels"),
        F.sum(F.when(F.col("features").isNull(), 1).otherwise(0)).alias("missing_features"),
        F.min_by("features", "row").alias("first_features"),
        F.min_by("label", "row").alias("first_label"),
    )
    per_split = per_partition.groupBy("split").agg(
        F.sum("rows").alias("rows"),
        F.min("shortest").alias("shortest"),
        F.max("longest").alias("longest"),
        F.sum("bad_labels").alias("bad_labels"),
        F.sum("missing_features").alias("missing_features"),
        F.min_by("first_features", "partition").alias("first_features"),
        F.min_by("first_label", "partition").alias("first_label"),
        F.collect_list(F.struct("partition", "rows", "first")).alias("partitions"),
    )
    return {row["split"]: row for row in per_split.collect()}


def _shape(frame, features_col: str, label_col: str, name: str):
    """``features: array<float>, label: double`` from a vector or numeric-array column."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, NumericType

    fields = {field.name: field.dataType for field in frame.schema.fields}
    for column, role in ((features_col, "features_col"), (label_col, "label_col")):
        if column not in fields:
            raise InputError(
                f"the {name} data has no column {column!r} ({role}); its columns are {sorted(fields)}"
            )
    kind = fields[features_col]
    if isinstance(kind, VectorUDT):
        features = vector_to_array(F.col(features_col), "float32")
    elif isinstance(kind, ArrayType) and isinstance(kind.elementType, NumericType):
        features = F.col(features_col).cast("array<float>")
    else:
        raise InputError(
            f"the {name} column {features_col!r} is {kind.simpleString()}; it must be a vector "
            "(pyspark.ml.linalg) or an array of numbers, e.g. from VectorAssembler"
        )
    if not isinstance(fields[label_col], NumericType):
        raise InputError(
            f"the {name} label column {label_col!r} is {fields[label_col].simpleString()}; it must "
            "be numeric (use StringIndexer for string classes)"
        )
    return frame.select(features.alias("features"), F.col(label_col).cast("double").alias("label"))


def arrays_from_arrow(batches, n_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The partition's prepared Arrow batches as ``(X float32 [rows, n_features], y, split)``."""
    features, labels, splits = [], [], []
    for batch in batches:
        column = batch.column(batch.schema.get_field_index("features"))
        flat = column.flatten().to_numpy(zero_copy_only=False)
        features.append(flat.reshape(len(batch), n_features))
        labels.append(batch.column(batch.schema.get_field_index("label")).to_numpy(zero_copy_only=False))
        splits.append(batch.column(batch.schema.get_field_index("split")).to_numpy(zero_copy_only=False))
    if not features:
        return (np.zeros((0, n_features), np.float32), np.zeros(0, np.float64), np.zeros(0, np.int32))
    return (np.ascontiguousarray(np.concatenate(features), dtype=np.float32),
            np.concatenate(labels), np.concatenate(splits))


def arrays_from_pairs(pairs, n_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A partition of an RDD of ``(features, label)`` pairs as ``(X, y, split)``, all training rows."""
    rows = list(pairs)
    if not rows:
        return np.zeros((0, n_features), np.float32), np.zeros(0, np.float64), np.zeros(0, np.int32)
    X = np.asarray([np.asarray(features, dtype=np.float32) for features, _ in rows], dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != n_features:
        raise InputError(f"expected feature vectors of {n_features} elements, got an array of shape {X.shape}")
    y = np.asarray([label for _, label in rows], dtype=np.float64)
    return X, y, np.zeros(len(rows), np.int32)
