"""What a linear model's fit learns on the driver before its barrier stage, without a pass of
Python over the rows, and the data checks' error after it.

The stage checks the rows itself as it reads them (``task.glm_checks``); the driver needs
only what the problem and the engine's vector are made of before it starts (``GlmFacts``),
and finds it as MLlib does: the features' width from the column's ML metadata
(``VectorAssembler``, ``HashingTF``: ``ml_attr.num_attrs``), else from one row (a job of
one row, in the JVM); a classifier's largest label, where neither the model nor the label's
metadata says how many classes there are, by one aggregate in the JVM (MLlib's
``numClasses``: the largest label + 1). Only whole labels >= 0 count there: the others are
refused by the stage's checks, with their own error. Data with no row to read a width from
(no rows, or every vector null) or no label to count is checked by the driver's check job
(``data.prepare``), whose error says what is wrong.

A refused stage returns every task's figures (``CHECKS`` records); ``refuse_checked``
merges them (``data_pass.merge_parts``) and raises what the check job would have raised
over the same rows (``row_checks.refuse_bad_rows``), row numbers and all.

For a cached DataFrame the facts and its partitions are remembered (``start_facts``), so a
second fit on it (a tuning loop's) runs no job before its stage; its rows are checked by
every fit's stage all the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from allreduce_param.errors import InputError, TrainingError
from allreduce_param.spark.info import SparkInfo
from allreduce_param.train.columns import TRAIN, prepared_columns
from allreduce_param.train.driver.data import CachedFrameResults, is_cached, prepare
from allreduce_param.train.driver.data_pass import merge_parts
from allreduce_param.train.driver.row_checks import RowCheck, refuse_bad_rows
from allreduce_param.train.task.glm_checks import CHECKS


@dataclass(frozen=True)
class GlmFacts:
    """What a linear model's problem is made of before the stage: the features' width, and
    for a classifier whose class count nobody says, its largest whole label >= 0."""

    n_features: int
    largest_label: float | None = None


def glm_facts(
    data, prepared, features_col: str, label_col: str, classification: bool, told_classes
) -> GlmFacts | None:
    """``data``'s ``GlmFacts`` (``prepared``: its prepared columns), by its metadata and at
    most one small JVM job; None where the data has no row to take them from."""
    from pyspark.sql import functions as F

    width = metadata_width(data, features_col)
    largest = None
    if classification and told_classes is None:
        label = F.col("label")
        whole = (~F.isnan(label)) & (F.abs(label) < float("inf")) & (label >= 0)
        found = [F.max(F.when(whole & (label % 1 == 0), label))]
        if width is None:  # any row's width: the stage refuses other widths
            found.append(F.first(F.col("features"), ignorenulls=True))
        row = prepared.agg(*found).first()
        largest = row[0]
        if width is None and row[1] is not None:
            width = len(row[1])
        if largest is None:
            return None
    elif width is None:
        row = prepared.where(F.col("features").isNotNull()).select("features").first()
        width = None if row is None else len(row[0])
    return None if width is None else GlmFacts(int(width), largest)


#: The facts and partitions ``start_facts`` found for cached DataFrames.
_seen = CachedFrameResults()


def start_facts(
    spark: SparkInfo,
    data,
    prepared,
    indexed,
    features_col: str,
    label_col: str,
    classification: bool,
    told_classes,
    weight_col: str | None,
) -> tuple[GlmFacts, int]:
    """(``checked_facts``, the partitions of ``indexed``, the stage's input), found once per
    cached DataFrame: where ``data`` is cached (``df.cache()``), an earlier fit's in this
    process with the same columns on the same data (the same query, ``sameSemantics``,
    over the same cache), without a job, as ``data.prepare_once`` remembers its checks; a
    tuning loop's fits then start with no job before their stage."""
    settings = (spark.application_id, features_col, label_col, classification, told_classes)
    cached = is_cached(data)
    if cached and (found := _seen.find(settings, [data])) is not None:
        return found
    facts = checked_facts(
        data, prepared, features_col, label_col, classification, told_classes, weight_col
    )
    found = (facts, partition_count(spark, indexed))
    if cached:
        _seen.remember(settings, [data], found)
    return found


def checked_facts(
    data,
    prepared,
    features_col: str,
    label_col: str,
    classification: bool,
    told_classes,
    weight_col: str | None,
) -> GlmFacts:
    """``glm_facts``, or where the data gives none, the driver's check job's error (or its
    facts, were it to find nothing wrong)."""
    facts = glm_facts(data, prepared, features_col, label_col, classification, told_classes)
    if facts is not None:
        return facts
    _, summary = prepare(
        data,
        features_col,
        label_col,
        task="classification" if classification else None,
        num_classes=told_classes,
        weight_col=weight_col,
    )
    labels = summary.train_labels
    return GlmFacts(summary.n_features, max(labels) if labels else None)


def metadata_width(data, features_col: str) -> int | None:
    """The features' width the column's ML metadata says (``ml_attr.num_attrs``), or None."""
    try:
        told = data.schema[features_col].metadata.get("ml_attr", {}).get("num_attrs")
    except (KeyError, AttributeError):
        return None
    return None if told is None else int(told)


def stage_rows(prepared, weighted: bool):
    """The stage's input: the prepared columns and each row's ``monotonically_increasing_id``
    as ``row`` (its partition and position in ``prepared``, which the checks' figures name
    rows by, wherever a shuffle takes them)."""
    from pyspark.sql import functions as F

    return prepared.select(
        *prepared_columns(weighted), F.monotonically_increasing_id().alias("row")
    )


def partition_count(spark: SparkInfo, frame) -> int:
    """How many partitions ``frame`` has: Spark's plan says (no job); under Spark Connect,
    which has no RDDs, one job over a column of nothing, each task saying its partition."""
    if not spark.connect:
        return frame.rdd.getNumPartitions()
    from pyspark.sql import functions as F

    def task(batches):
        from pyspark import TaskContext

        from allreduce_param.spark.arrow import record_batch

        for _ in batches:
            pass
        yield record_batch(partition=[str(TaskContext.get().partitionId())])

    told = frame.select(F.lit(0).alias("nothing")).mapInArrow(task, "partition string").collect()
    return max((int(row["partition"]) for row in told), default=-1) + 1


def refuse_checked(
    records: dict[str, bytes],
    features_col: str,
    label_col: str,
    checks: list[RowCheck],
    classes: int | None,
    weight_col: str | None,
    n_features: int,
) -> None:
    """Where the stage refused the data (its tasks returned ``CHECKS`` records), the error
    the driver's check job would have raised over the same rows; nothing otherwise."""
    found = [payload for kind, payload in records.items() if kind.startswith(CHECKS + "/")]
    if not found:
        return
    parts = [part for payload in found for part in json.loads(payload)]
    stats = merge_parts(parts, [check.name for check in checks]).get(TRAIN)
    refuse_bad_rows("training", stats, features_col, label_col, checks, classes, weight_col)
    if stats["longest"] != n_features:
        raise InputError(
            f"the training column {features_col!r} holds vectors of {stats['longest']} "
            f"elements, but its ML metadata (ml_attr num_attrs) says {n_features}: fix the "
            "metadata where the column is made, or drop it, e.g. "
            f"df.withColumn({features_col!r}, F.col({features_col!r}).alias({features_col!r}, "
            "metadata={}))"
        )
    raise TrainingError(
        "the linear model's stage refused its data, but its tasks' figures show no bad row: "
        f"{stats}"
    )
