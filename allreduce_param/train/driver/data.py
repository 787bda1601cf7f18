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
trains on sparse rows (``DataSummary.sparse``).
Inside a task, ``train.rows`` turns the partition's rows into numpy arrays.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.spark import arrow
from allreduce_param.spark.info import SparkInfo
from allreduce_param.train.columns import (
    TRAIN,
    VALIDATION,
    WEIGHT_COLUMN,
)
from allreduce_param.train.features import VectorParts, is_sparse
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
    ``weight`` column (``prepared_columns(summary.weighted)`` are its columns): what
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


def prepared_columns(weighted: bool = False) -> tuple[str, ...]:
    """The columns of a prepared DataFrame, in order: ``features, label, split``, then
    ``weight`` for data prepared with ``weight_col`` (``DataSummary.weighted``)."""
    return (
        ("features", "label", "split", WEIGHT_COLUMN)
        if weighted
        else ("features", "label", "split")
    )


#: monotonically_increasing_id() holds the partition index above this many bits.
_POSITION_BITS = 33


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
    classes = _class_count(num_classes) if task == "classification" else None
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
    checks = _row_checks(task == "classification", classes, weight_col)
    stats_by_split, partition_num = _statistics(prepared, checks, classes, weighted)
    lengths, counts, nonzeros, rows = [], [], 0, 0
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
            raise InputError(
                f"the {name} data has {stats['missing_features']} rows whose {features_col!r} is "
                f"null (e.g. row {_first_bad_row(stats, 'missing_features')}); drop them first, "
                f"e.g. df.dropna(subset=[{features_col!r}]), or fill them where they come from "
                "(VectorAssembler(handleInvalid='keep') keeps NaN in a vector instead)"
            )
        if stats["bad_indices"]:
            raise InputError(_bad_indices(name, features_col, stats))
        if stats["shortest"] != stats["longest"]:
            raise InputError(
                f"the {name} column {features_col!r} holds vectors of {stats['shortest']} to "
                f"{stats['longest']} elements; every row needs the same length"
            )
        for check in checks:
            if stats[check.name]:
                raise InputError(check.message(name, features_col, label_col, classes, stats))
        if weighted:
            _check_weight_sum(name, weight_col, stats)
        lengths.append(stats["longest"])
        counts.extend(
            PartitionCount(
                split,
                int(part["partition"]),
                int(part["rows"]),
                int(part["first"]) & ((1 << _POSITION_BITS) - 1),
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
    cached = all(_cached(frame) for _, frame, _ in frames)
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


#: How many checked cached DataFrames ``prepare_once`` remembers (the newest).
CHECKED_KEEP = 8
_checked: list[tuple[tuple, list, tuple]] = []  # (settings, frames, prepare's result), newest last
_checked_lock = threading.Lock()  # fits may run on several threads of one driver


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
    if not all(_cached(frame) for frame in frames):
        return prepare(
            df,
            features_col,
            label_col,
            validation,
            task=task,
            num_classes=num_classes,
            weight_col=weight_col,
        )
    settings = (
        SparkInfo(df.sparkSession).application_id,
        features_col,
        label_col,
        task,
        num_classes,
        weight_col,
    )
    with _checked_lock:
        earlier = list(reversed(_checked))
    for earlier_settings, earlier_frames, result in earlier:
        if (
            earlier_settings == settings
            and len(earlier_frames) == len(frames)
            and all(_cached(a) and a.sameSemantics(b) for a, b in zip(earlier_frames, frames))
        ):
            return result
    result = prepare(
        df,
        features_col,
        label_col,
        validation,
        task=task,
        num_classes=num_classes,
        weight_col=weight_col,
    )
    with _checked_lock:
        _checked.append((settings, frames, result))
        del _checked[:-CHECKED_KEEP]
    return result


def _cached(frame) -> bool:
    """Whether ``frame`` itself is cached (persisted at some storage level)."""
    level = frame.storageLevel
    return level.useMemory or level.useDisk or level.useOffHeap


def _class_count(num_classes) -> int | None:
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


class _RowCheck(NamedTuple):
    """A condition no row may meet: its name (its count's key in the statistics, and its
    condition's in ``_bad_rows``) and the message's wording."""

    name: str
    message: object  # (data name, features_col, label_col, classes, stats) -> str


def _row_checks(
    classification: bool, classes: int | None, weight_col: str | None = None
) -> list[_RowCheck]:
    """The row conditions ``prepare`` refuses, in the order it reports them.

    Features: NaN, +/-Inf or null elements (a double beyond float32's range became Inf when
    the column was cast). Labels: +/-Inf (null and NaN are counted apart, as before); for a
    classifier also fractional, negative, and (when the model says) >= its class count.
    Weights (with ``weight_col``): null, NaN, negative or +/-Inf.
    """
    checks = [
        _RowCheck("nonfinite_features", _nonfinite_features),
        _RowCheck("infinite_labels", _infinite_labels),
    ]
    if classification:
        checks += [
            _RowCheck("fractional_labels", _fractional_labels),
            _RowCheck("negative_labels", _negative_labels),
        ]
        if classes is not None:
            checks.append(_RowCheck("too_large_labels", _too_large_labels))
    if weight_col is not None:
        checks.append(_RowCheck("bad_weights", functools.partial(_bad_weights, weight_col)))
    return checks


def _bad_rows(
    labels: np.ndarray,
    bad_features: np.ndarray,
    classes: int | None,
    weights: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Each row check's condition over a batch: which rows meet it (null labels are NaN here,
    and meet none: ``bad_labels`` counts them; null weights are NaN here too, and bad)."""
    with np.errstate(invalid="ignore"):
        whole = np.abs(labels) < np.inf
        bad = {
            "nonfinite_features": bad_features,
            "infinite_labels": np.abs(labels) == np.inf,
            "fractional_labels": whole & (labels != np.round(labels)),
            "negative_labels": whole & (labels < 0),
            "too_large_labels": whole & (labels >= (np.inf if classes is None else classes)),
        }
        if weights is not None:
            bad["bad_weights"] = ~(np.isfinite(weights) & (weights >= 0))
        return bad


def _nonfinite_features(name, features_col, label_col, classes, stats) -> str:
    example = stats["nonfinite_features_first"]["value"]
    return (
        f"the {name} column {features_col!r} holds NaN, Inf or null in {stats['nonfinite_features']} rows "
        f"(e.g. row {_first_bad_row(stats, 'nonfinite_features')}: {_number(example['value'])} at element "
        f"{example['index']}); drop or fill them before training: df.na.drop() or "
        "pyspark.ml.feature.Imputer on the input columns (before VectorAssembler) for NaN and null, and "
        "filter out or replace infinite values (a number beyond float32's +-3.4e38 becomes Inf too)"
    )


def _bad_indices(name, features_col, stats) -> str:
    example = stats["bad_indices_first"]["value"]
    shown = ", ".join(map(str, example["indices"])) + (", ..." if example["count"] > 8 else "")
    return (
        f"the {name} column {features_col!r} holds sparse vectors whose indices are out of range, "
        f"out of order or not one per value in {stats['bad_indices']} rows (e.g. row "
        f"{_first_bad_row(stats, 'bad_indices')}: size {example['size']}, {example['count']} indices "
        f"[{shown}] for {example['values']} values); a sparse vector's indices must be strictly "
        "increasing, each in 0..size-1, one per value: build it with Vectors.sparse(size, indices, "
        "values), which checks them"
    )


def _infinite_labels(name, features_col, label_col, classes, stats) -> str:
    return (
        f"the {name} data has {stats['infinite_labels']} rows whose label {label_col!r} is infinite "
        f"({_example(stats, 'infinite_labels')}); drop or fix them first, e.g. "
        f"df.filter(F.abs({label_col!r}) < float('inf'))"
    )


def _fractional_labels(name, features_col, label_col, classes, stats) -> str:
    return (
        f"the {name} data has {stats['fractional_labels']} rows whose label {label_col!r} is not a whole "
        f"number ({_example(stats, 'fractional_labels')}), but a classification model takes class ids "
        "0, 1, 2, ...: index the classes with pyspark.ml.feature.StringIndexer, or fit a regression model"
    )


def _negative_labels(name, features_col, label_col, classes, stats) -> str:
    return (
        f"the {name} data has {stats['negative_labels']} rows whose label {label_col!r} is negative "
        f"({_example(stats, 'negative_labels')}), but a classification model takes class ids 0, 1, 2, ...: "
        "re-index the classes with pyspark.ml.feature.StringIndexer"
    )


def _too_large_labels(name, features_col, label_col, classes, stats) -> str:
    largest = int(stats["too_large_labels_largest"])
    return (
        f"the {name} data has {stats['too_large_labels']} rows whose label {label_col!r} is {classes} or "
        f"more ({_example(stats, 'too_large_labels')}; the largest is {largest}), but the model has "
        f"{classes} classes (ids 0..{classes - 1}): use a model with {largest + 1} outputs (e.g. "
        f"MLP([..., {largest + 1}]) or SoftmaxRegression(n_features, {largest + 1})), or re-index the "
        "classes with pyspark.ml.feature.StringIndexer"
    )


def _bad_weights(weight_col, name, features_col, label_col, classes, stats) -> str:
    return (
        f"the {name} data has {stats['bad_weights']} rows whose weight {weight_col!r} (weight_col) is null, NaN, "
        f"negative or infinite ({_example(stats, 'bad_weights')}); a weight must be a finite number >= 0: "
        f"fill them, e.g. df.fillna(1.0, subset=[{weight_col!r}]) for null and NaN, or filter them out, e.g. "
        f"df.filter((F.col({weight_col!r}) >= 0) & (F.col({weight_col!r}) < float('inf')))"
    )


def _check_weight_sum(name: str, weight_col: str, stats: dict) -> None:
    """Refuse a split whose weights (each finite and >= 0) sum to 0, or beyond float64."""
    total = stats["weight_sum"]
    if total == 0:
        raise InputError(
            f"the {name} data's weights in {weight_col!r} (weight_col) sum to 0: all its {stats['rows']} rows "
            "have weight 0, so no row counts (a weighted mean over them is 0/0); at least one row needs a "
            "weight > 0"
        )
    if not math.isfinite(total):
        raise InputError(
            f"the {name} data's weights in {weight_col!r} (weight_col) sum to more than a float64 holds "
            "(about 1.8e308); scale them down: only their ratios matter"
        )


def _example(stats: dict, check: str) -> str:
    return f"e.g. {_number(stats[check + '_first']['value'])} at row {_first_bad_row(stats, check)}"


def _number(value) -> str:
    """A value as a message shows it: NaN, Inf, -Inf, null, whole numbers without '.0'."""
    if value is None:
        return "null"
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() else repr(value)


def _first_bad_row(stats: dict, check: str) -> int:
    """The index (from 0, in the DataFrame's order) of the first row that failed ``check``.

    Its ``monotonically_increasing_id`` holds its partition and its position there; the rows
    of the split's earlier partitions come before it.
    """
    row = int(stats[check + "_first"]["row"])
    partition, position = row >> _POSITION_BITS, row & ((1 << _POSITION_BITS) - 1)
    before, start = 0, position
    for part in stats["partitions"]:
        if part["partition"] < partition:
            before += int(part["rows"])
        elif part["partition"] == partition:
            start = int(part["first"]) & ((1 << _POSITION_BITS) - 1)
    return before + position - start


def _statistics(
    prepared, checks: Sequence[_RowCheck] = (), classes: int | None = None, weighted: bool = False
) -> tuple[dict, int]:
    """One pass over the prepared rows, in a single Spark stage (no shuffle, no query to
    compile): per split, what ``prepare`` checks, and per partition its row count and first
    row (as ``monotonically_increasing_id`` numbers it, which ``place_rows`` reads); and how
    many partitions (tasks) there are.

    For each row check: how many rows fail it and the first of them (``row``: its id,
    ``value``: what the message quotes of it); for the class-count check also the largest
    label. ``weighted`` (the data has the ``weight`` column): also ``weight_sum``, the sum
    of the split's good weights (float64; each >= 0, so no cancellation).
    """
    from pyspark.sql import functions as F

    names = [check.name for check in checks]

    def task(batches):
        from pyspark import TaskContext

        for split, stats in _partition_statistics(batches, names, classes, weighted).items():
            yield arrow.record_batch(stats=[json.dumps({"split": split, **stats})])
        yield arrow.record_batch(stats=[json.dumps({"task": TaskContext.get().partitionId()})])

    # the ids as place_rows numbers the rows: the same projection over the same plan
    indexed = prepared.select(
        *prepared_columns(weighted), F.monotonically_increasing_id().alias("row")
    )
    # in row order: by partition, then position (a local relation numbered on the driver, all
    # in its partition 0, may still be read by several tasks: their parts are joined here)
    records = [
        json.loads(row["stats"]) for row in indexed.mapInArrow(task, "stats string").collect()
    ]
    tasks = [record["task"] for record in records if "task" in record]
    parts = sorted(
        (record for record in records if "task" not in record), key=lambda part: part["first"]
    )
    by_split: dict[int, dict] = {}
    partitions: dict[int, list[dict]] = {}
    for part in parts:
        split = part.pop("split")
        places = partitions.setdefault(split, [])
        if places and places[-1]["partition"] == part["partition"]:
            places[-1]["rows"] += part["rows"]
        else:
            places.append({key: part[key] for key in ("partition", "rows", "first")})
        by_split[split] = _merge_statistics(by_split.get(split), part, names)
    for split, total in by_split.items():
        total["partitions"] = partitions[split]
    return by_split, max(tasks, default=-1) + 1  # a DataFrame may have no partitions at all


def _merge_statistics(total: dict | None, part: dict, names: Sequence[str]) -> dict:
    """``total`` (the figures of some rows) with those of ``part``, rows that come after
    them, added; ``part`` itself when there is no total yet. The first row's features,
    label and id, and each check's first bad row, stay the earlier ones."""
    if total is None:
        return part
    for key in ("rows", "nonzeros", "bad_labels", "missing_features", "bad_indices", *names):
        total[key] += part[key]
    if "weight_sum" in part:
        total["weight_sum"] += part["weight_sum"]
    total["labels"] = _merge_labels(total.get("labels"), part.get("labels"))
    for key, pick in (("shortest", min), ("longest", max), ("too_large_labels_largest", max)):
        if part[key] is not None:
            total[key] = part[key] if total[key] is None else pick(total[key], part[key])
    for name in ("missing_features", "bad_indices", *names):
        if total[name + "_first"] is None:
            total[name + "_first"] = part[name + "_first"]
    return total


def _partition_statistics(
    batches, names: Sequence[str], classes: int | None, weighted: bool = False
) -> dict[int, dict]:
    """Inside a task: ``_statistics``'s figures of this partition (its rows numbered in
    ``row``), by split."""
    found: dict[int, dict] = {}
    for batch in batches:
        ids = arrow.values(batch.column(batch.schema.get_field_index("row")))
        parts = VectorParts.from_arrow(batch.column(batch.schema.get_field_index("features")))
        label_column = batch.column(batch.schema.get_field_index("label"))
        label_null = arrow.nulls(label_column)
        labels = np.where(label_null, np.nan, arrow.values(label_column))
        splits = arrow.values(batch.column(batch.schema.get_field_index("split")))
        bad_element = parts.bad_values()
        bad_features = parts.row_any(bad_element)
        bad_indices = parts.index_problems()
        nonzeros = parts.nonzeros()
        weights = weight_null = None
        if weighted:
            weight_column = batch.column(batch.schema.get_field_index(WEIGHT_COLUMN))
            weight_null = arrow.nulls(weight_column)
            weights = np.where(weight_null, np.nan, arrow.values(weight_column))
        bad = _bad_rows(labels, bad_features, classes, weights)
        bad["bad_indices"] = bad_indices

        def example(name: str, row: int):  # used in this iteration only (B023)
            if name == "bad_weights":
                return None if weight_null[row] else float(weights[row])  # noqa: B023
            if name == "bad_indices":
                return _indices_example(parts, row)  # noqa: B023
            if name != "nonfinite_features":
                return float(labels[row])  # noqa: B023
            return _element_example(parts, bad_element, row)  # noqa: B023

        for split in np.unique(splits):
            rows = np.flatnonzero(splits == split)
            first = int(rows[0])
            present = parts.size[rows][~parts.null[rows]]
            stats = {
                "partition": int(ids[first]) >> _POSITION_BITS,
                "first": int(ids[first]),
                "rows": len(rows),
                "shortest": int(present.min()) if len(present) else None,
                "longest": int(present.max()) if len(present) else None,
                "nonzeros": int(nonzeros[rows].sum()),
                "bad_labels": int(np.count_nonzero(np.isnan(labels[rows]))),
                "missing_features": int(np.count_nonzero(parts.null[rows])),
                "missing_features_first": _first_of(ids, rows[parts.null[rows]]),
                "first_features": _row_entries(parts, first, bad_indices[first]),
                "first_label": None if label_null[first] else float(labels[first]),
                "too_large_labels_largest": None,
                "labels": _distinct_labels(labels[rows]),
            }
            if weighted:  # the good weights only: the bad are counted, and refused, apart
                stats["weight_sum"] = float(weights[rows][~bad["bad_weights"][rows]].sum())
            for name in (*names, "bad_indices"):
                failed = rows[bad[name][rows]]
                stats[name] = len(failed)
                stats[name + "_first"] = (
                    {"row": int(ids[failed[0]]), "value": example(name, int(failed[0]))}
                    if len(failed)
                    else None
                )
                if name == "too_large_labels" and len(failed):
                    stats["too_large_labels_largest"] = float(labels[failed].max())
            found[int(split)] = _merge_statistics(found.get(int(split)), stats, names)
    return found


#: The most distinct labels the check pass lists (a classifier's classes); more: not listed.
DISTINCT_LABELS_KEPT = 10_000


def _distinct_labels(labels: np.ndarray) -> list[float] | None:
    """The distinct finite labels among ``labels``, or None when there are more than
    ``DISTINCT_LABELS_KEPT`` (a regression target: not worth listing)."""
    distinct = np.unique(labels[np.isfinite(labels)])
    return distinct.tolist() if len(distinct) <= DISTINCT_LABELS_KEPT else None


def _merge_labels(first: list | None, second: list | None) -> list | None:
    if first is None or second is None:
        return None
    merged = sorted(set(first) | set(second))
    return merged if len(merged) <= DISTINCT_LABELS_KEPT else None


def _first_of(ids: np.ndarray, rows: np.ndarray) -> dict | None:
    """The first of ``rows`` as a check's first bad row (``{"row": id}``), None if none."""
    return {"row": int(ids[rows[0]]), "value": None} if len(rows) else None


def _element_example(parts: VectorParts, bad_element: np.ndarray, row: int) -> dict:
    """A row's first bad element: its column and value (None for a null element)."""
    start = parts.value_offsets[row]
    position = int(np.argmax(bad_element[start : parts.value_offsets[row + 1]]))
    at = start + position
    index = position
    if not parts.dense[row] and parts.index_offsets[row] + position < parts.index_offsets[row + 1]:
        index = int(parts.indices[parts.index_offsets[row] + position])
    null = parts.value_null is not None and parts.value_null[at]
    return {"index": index, "value": None if null else float(parts.values[at])}


def _indices_example(parts: VectorParts, row: int) -> dict:
    """What a sparse row with bad indices holds: its size, its first indices and how many
    values it has."""
    indices = parts.indices[parts.index_offsets[row] : parts.index_offsets[row + 1]]
    return {
        "size": int(parts.size[row]),
        "indices": indices[:8].tolist(),
        "count": len(indices),
        "values": int(parts.value_offsets[row + 1] - parts.value_offsets[row]),
    }


def _row_entries(parts: VectorParts, row: int, bad_indices: bool) -> dict | None:
    """A row's non-zero entries as ``{"size", "indices", "values"}`` (the sample the driver
    tries the model on, kept small for wide sparse rows); None for a null row or one whose
    indices are refused."""
    if parts.null[row] or bad_indices:
        return None
    start, stop = parts.value_offsets[row], parts.value_offsets[row + 1]
    values = parts.values[start:stop]
    keep = values != 0
    return {
        "size": int(parts.size[row]),
        "indices": parts.row_columns(row)[keep].tolist(),
        "values": values[keep].astype(float).tolist(),
    }


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
