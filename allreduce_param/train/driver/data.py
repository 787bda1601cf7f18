"""Training data, checked and shaped on the driver before any task starts.

On the driver, ``prepare`` checks the columns before any task starts (a missing column,
vectors of different lengths, null rows, NaN labels, NaN or Inf features, sparse vectors
whose indices are out of range or order, and for a classifier labels that are no class id
each get a clear error naming the first bad row) and shapes the DataFrame into
``features, label: double, split: int`` (0 train, 1 validation). ``features`` stays a
vector column where the data has one (sparse vectors stay sparse: a task reads their parts
into a CSR matrix, ``train.features``), else ``array<float>``. With a column of sample
weights (``weight_col``) it adds a fourth, ``weight: double``, after them: each weight must
be a finite number >= 0, and each split's weights must not all be 0 (the gradient is the
weighted mean; a split that weighs nothing has none). Without one the DataFrame keeps the
three columns, and nothing changes for an unweighted fit. Every row check is part of its
one pass over the data (numpy over Arrow batches, one Spark stage), so a bad row fails the
fit there, in seconds, not as a NonFiniteGradientError or a label error at some step of
the barrier stage. The same pass counts the stored non-zeros, which decide whether the fit
trains on sparse rows (``DataSummary.sparse``). The pass is ``data_pass.py``'s, the row
checks and their messages ``row_checks.py``'s.
Inside a task, ``train.rows`` turns the partition's rows into numpy arrays.
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.spark.info import SparkInfo
from allreduce_param.train.columns import (
    TRAIN,
    VALIDATION,
    WEIGHT_COLUMN,
)
from allreduce_param.train.driver.data_pass import POSITION_BITS, check_pass
from allreduce_param.train.driver.row_checks import refuse_bad_rows, row_checks
from allreduce_param.train.features import is_sparse
from allreduce_param.train.rows import features_column, is_vector_type


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


@dataclass(frozen=True, eq=False)  # one summary per check: compared (and hashed) by identity
class DataSummary:
    """What the driver learnt about the data while checking it.

    ``partition_counts``: one ``PartitionCount`` per (split, partition) of the prepared
    DataFrame that holds rows of that split, sorted by split then partition; what
    ``partitioning.place_rows`` needs to place rows by their index without a job of its own.
    ``partition_num``: how many partitions the prepared DataFrame has, empty ones too (the
    tasks of the checks' job), so the driver need not ask Spark again. ``cached``: whether
    the data checked was cached (``df.cache()``), so its partitions stay the ones counted.
    ``weighted``: whether it was prepared with ``weight_col``, so its rows carry the
    ``weight`` column (``columns.prepared_columns(summary.weighted)`` are its columns): what
    ``partitioning.place_rows_once`` goes by, without asking Spark for the schema (under
    Spark Connect a round trip). ``sparse``: the data trains as CSR rows (its ``nonzeros``,
    the stored values that are not 0 over both splits, fill at most ``SPARSE_DENSITY`` of
    rows x n_features; ``features.is_sparse``), and ``sample`` is then a CSR row too.
    """

    n_features: int
    sample: tuple  # one training row as (X [1, n_features] float32, y [1]), to try the model on
    partition_counts: tuple[PartitionCount, ...] = ()
    partition_num: int | None = None
    cached: bool = False
    weighted: bool = False
    sparse: bool = False
    nonzeros: int = 0
    train_labels: tuple | None = None  # the training rows' distinct labels (None: too many)

    def rows(self, split: int = TRAIN) -> int:
        """How many rows of ``split`` (TRAIN or VALIDATION) the data has."""
        return sum(count.rows for count in self.partition_counts if count.split == split)


def prepare(
    df,
    features_col: str,
    label_col: str,
    validation=None,
    *,
    task: str | None = None,
    num_classes: int | None = None,
    weight_col: str | None = None,
):
    """Check ``df`` (and ``validation``) and shape them for training; (DataFrame, DataSummary).

    Runs one Spark job of one stage for both DataFrames (row counts per split and partition,
    vector lengths, missing labels, non-finite features, the labels a classifier cannot take,
    and with ``weight_col`` the weights' checks and sums). Its counts are of the returned
    DataFrame's own partitions, so ``partitioning.place_rows`` on that DataFrame can index
    its rows without counting again.

    ``task`` is the model's (``"classification"`` or ``"regression"``); for classification
    every label must be a whole number >= 0, and below ``num_classes`` when the model says
    how many classes it has (``Model.num_classes``). ``weight_col`` names a numeric column
    of sample weights, in ``validation`` too (its rows are weighted in evaluation): each
    must be a finite number >= 0, and each DataFrame's weights must sum to more than 0; the
    result then has the ``weight`` column and ``DataSummary.weighted``. Each error names the
    data, the column, how many rows are bad and the first of them (its index from 0 in the
    DataFrame's order).
    """
    classes = checked_class_count(num_classes) if task == "classification" else None
    frames = [("training", df, TRAIN)] + (
        [("validation", validation, VALIDATION)] if validation is not None else []
    )
    parts = [
        _shape(frame, features_col, label_col, name, split, weight_col)
        for name, frame, split in frames
    ]
    if len(parts) == 2:
        parts = _same_features_type(parts)
    prepared = parts[0] if len(parts) == 1 else parts[0].unionByName(parts[1])
    weighted = weight_col is not None
    checks = row_checks(task == "classification", classes, weight_col)
    stats_by_split, partition_num = check_pass(
        prepared, [check.name for check in checks], classes, weighted
    )
    lengths, counts, nonzeros, rows = [], [], 0, 0
    for name, _, split in frames:
        stats = stats_by_split.get(split)
        refuse_bad_rows(name, stats, features_col, label_col, checks, classes, weight_col)
        lengths.append(stats["longest"])
        counts.extend(
            PartitionCount(
                split,
                int(part["partition"]),
                int(part["rows"]),
                int(part["first"]) & ((1 << POSITION_BITS) - 1),
            )
            for part in stats["partitions"]
        )
        if split == TRAIN:
            first_row, first_label = stats["first_features"], stats["first_label"]
            labels = stats["labels"]
        nonzeros += stats["nonzeros"]
        rows += stats["rows"]
    if len(lengths) == 2 and lengths[0] != lengths[1]:
        raise InputError(
            f"training vectors have {lengths[0]} elements but validation vectors {lengths[1]}"
        )
    cached = all(is_cached(frame) for _, frame, _ in frames)
    n_features = int(lengths[0])
    sparse = is_sparse(nonzeros, rows, n_features)
    sample = (sample_row(first_row, n_features, sparse), np.asarray([first_label]))
    return prepared, DataSummary(
        n_features,
        sample,
        tuple(sorted(counts)),
        partition_num,
        cached,
        weighted=weighted,
        sparse=sparse,
        nonzeros=nonzeros,
        train_labels=None if labels is None else tuple(labels),
    )


def sample_row(entries: dict, n_features: int, sparse: bool):
    """One row (``{"size", "indices", "values"}``, a check's ``first_features``) as a
    (1, n_features) float32 matrix: CSR where the data trains sparse, else dense."""
    columns = np.asarray(entries["indices"], np.int64)
    values = np.asarray(entries["values"], np.float32)
    if sparse:
        from scipy.sparse import csr_matrix

        return csr_matrix((values, columns, np.asarray([0, len(values)])), shape=(1, n_features))
    X = np.zeros((1, n_features), np.float32)
    X[0, columns] = values
    return X


class CachedFrameResults:
    """What a driver found about cached DataFrames, remembered for later fits on the same
    data: the newest ``keep`` results, each under its settings and frames. Only cached
    frames are remembered (their rows stay what they were when read, where a DataFrame read
    anew from its source might not); the same data means the same query
    (``sameSemantics``) over a cache that is still there. Fits may run on several threads
    of one driver."""

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._entries: list[tuple[tuple, list, object]] = []  # newest last
        self._lock = threading.Lock()

    def find(self, settings: tuple, frames: list):
        """The newest result remembered for ``frames`` with ``settings``; None where there is
        none (or a frame is no longer cached)."""
        with self._lock:
            earlier = list(reversed(self._entries))
        for earlier_settings, earlier_frames, result in earlier:
            if (
                earlier_settings == settings
                and len(earlier_frames) == len(frames)
                and all(is_cached(a) and a.sameSemantics(b) for a, b in zip(earlier_frames, frames))
            ):
                return result
        return None

    def remember(self, settings: tuple, frames: list, result) -> None:
        """Keep ``result`` for ``frames`` (all cached) with ``settings``."""
        with self._lock:
            self._entries.append((settings, list(frames), result))
            del self._entries[: -self._keep]


#: ``prepare_once``'s checked cached DataFrames.
_checked = CachedFrameResults()


def prepare_once(
    df,
    features_col: str,
    label_col: str,
    validation=None,
    *,
    task: str | None = None,
    num_classes: int | None = None,
    weight_col: str | None = None,
):
    """``prepare``, once per cached data: for DataFrames that are cached (``df.cache()``), the
    result of an earlier call with the same settings on the same data, if this process made
    one, without its Spark job; otherwise ``prepare`` itself.

    Several fits on the same cached data (tuning a learning rate, a grid search) then check
    it once. Only cached DataFrames are remembered: their rows stay what they were when
    checked, where a DataFrame read anew from its source might not. The same data means
    the same query (``sameSemantics``) over the same cache; the same settings include
    ``weight_col`` (a weighted fit's prepared data has a column an unweighted one's lacks).
    """
    frames = [df] if validation is None else [df, validation]
    settings = None
    if all(is_cached(frame) for frame in frames):
        settings = (
            SparkInfo(df.sparkSession).application_id,
            features_col,
            label_col,
            task,
            num_classes,
            weight_col,
        )
        earlier = _checked.find(settings, frames)
        if earlier is not None:
            return earlier
    result = prepare(
        df,
        features_col,
        label_col,
        validation,
        task=task,
        num_classes=num_classes,
        weight_col=weight_col,
    )
    if settings is not None:
        _checked.remember(settings, frames, result)
    return result


def is_cached(frame) -> bool:
    """Whether ``frame`` itself is cached (persisted at some storage level)."""
    level = frame.storageLevel
    return level.useMemory or level.useDisk or level.useOffHeap


def checked_class_count(num_classes) -> int | None:
    """The model's ``num_classes`` as an int >= 1, or None when it does not say."""
    if num_classes is None:
        return None
    try:
        count = None if isinstance(num_classes, bool) else operator.index(num_classes)
    except TypeError:
        count = None
    if count is None or count < 1:
        raise ConfigurationError(
            f"the model's num_classes must be a whole number >= 1 (or None), got {num_classes!r}"
        )
    return count


def check_label_column(frame, label_col: str, name: str | None = None, role: str = "label_col"):
    """InputError, on the driver, where ``frame`` has no numeric column ``label_col``: named
    by ``role`` (the setting or Param that named it) and, where given, which data (``name``:
    "training", "validation"). Every entry point checks labels here, the Estimators too."""
    from pyspark.sql.types import NumericType

    whose = f"the {name} " if name else "the "
    fields = {field.name: field.dataType for field in frame.schema.fields}
    if label_col not in fields:
        raise InputError(
            f"{whose}data has no column {label_col!r} ({role}); its columns are {sorted(fields)}"
        )
    if not isinstance(fields[label_col], NumericType):
        raise InputError(
            f"{whose}label column {label_col!r} ({role}) is {fields[label_col].simpleString()}; "
            "it must be numeric (use StringIndexer for string classes)"
        )


def _same_features_type(parts: list) -> list:
    """The shaped training and validation data with one type of ``features``: where one is a
    vector column and the other an array one, the array one as (dense) vectors, so that they
    union and no vector is made dense."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    vectors = [is_vector_type(part.schema["features"].dataType) for part in parts]
    if all(vectors) or not any(vectors):
        return parts
    return [
        part if vector else part.withColumn("features", array_to_vector(F.col("features")))
        for part, vector in zip(parts, vectors)
    ]


def _shape(
    frame, features_col: str, label_col: str, name: str, split: int, weight_col: str | None = None
):
    """``frame`` as the prepared columns (``prepared_columns``): ``features: array<float>``
    from a vector or numeric-array column, ``label: double``, ``split: int`` (all ``split``),
    and with ``weight_col`` the weights as ``weight: double``."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import NumericType

    features = features_column(frame, features_col, name)
    check_label_column(frame, label_col, name)
    fields = {field.name: field.dataType for field in frame.schema.fields}
    columns = [
        features.alias("features"),
        F.col(label_col).cast("double").alias("label"),
        F.lit(split).alias("split"),
    ]
    if weight_col is not None:
        if weight_col not in fields:
            raise InputError(
                f"the {name} data has no column {weight_col!r} (weight_col); its columns are "
                f"{sorted(fields)}"
            )
        if not isinstance(fields[weight_col], NumericType):
            raise InputError(
                f"the {name} weight column {weight_col!r} (weight_col) is {fields[weight_col].simpleString()}; "
                f"it must be numeric: a finite number >= 0 per row (cast it first, e.g. "
                f"df.withColumn({weight_col!r}, F.col({weight_col!r}).cast('double')))"
            )
        columns.append(F.col(weight_col).cast("double").alias(WEIGHT_COLUMN))
    return frame.select(*columns)


def shape_training(frame, features_col: str, label_col: str, weight_col: str | None = None):
    """``frame`` as training rows' prepared columns (``prepare``'s shaping, without its
    check job): the columns checked on the driver (missing, of the wrong type), the rows
    left to whoever reads them next (the linear models' stage checks them as it reads)."""
    return _shape(frame, features_col, label_col, "training", TRAIN, weight_col)
