"""The data checks' one pass: a single Spark stage over the prepared rows, its figures merged.

``prepare`` (``data.py``) asks one job of one stage (numpy over Arrow batches, no shuffle)
for everything it checks: per split, the row count, the vectors' lengths, the stored
non-zeros, the labels (distinct, when few), and for each row check (``row_checks.py``)
how many rows fail it and the first of them; per partition, its row count and first row.
Each task reports its figures by split and partition (``row_figures.partition_figures``);
the driver merges them in row order (``merge_parts``).

Rows are numbered as ``monotonically_increasing_id`` numbers them (the partition above
``POSITION_BITS`` bits, the position below), which ``partitioning.place_rows`` reads too;
``first_bad_row`` turns such an id back into the row's index in the DataFrame's order.
Kept apart from ``data.py`` because it is the part that runs in the executors and the part
whose figures must merge the same in any partitioning.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from allreduce_param.spark import arrow
from allreduce_param.train.columns import prepared_columns
from allreduce_param.train.row_figures import POSITION_BITS, merge_figures, partition_figures

__all__ = ["POSITION_BITS", "check_pass", "first_bad_row", "merge_parts"]


def check_pass(
    prepared, names: Sequence[str] = (), classes: int | None = None, weighted: bool = False
) -> tuple[dict, int]:
    """One pass over the prepared rows, in a single Spark stage (no shuffle, no query to
    compile): per split, what ``prepare`` checks, and per partition its row count and first
    row (as ``monotonically_increasing_id`` numbers it, which ``place_rows`` reads); and how
    many partitions (tasks) there are.

    For each row check named in ``names`` (``RowCheck.name``): how many rows fail it and
    the first of them (``row``: its id, ``value``: what the message quotes of it); for the
    class-count check also the largest label. ``weighted`` (the data has the ``weight``
    column): also ``weight_sum``, the sum of the split's good weights (float64; each >= 0,
    so no cancellation).
    """
    from pyspark.sql import functions as F

    def task(batches):
        from pyspark import TaskContext

        for part in partition_figures(batches, names, classes, weighted):
            yield arrow.record_batch(stats=[json.dumps(part)])
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
    by_split = merge_parts([record for record in records if "task" not in record], names)
    return by_split, max(tasks, default=-1) + 1  # a DataFrame may have no partitions at all


def merge_parts(parts: list[dict], names: Sequence[str] = ()) -> dict[int, dict]:
    """Figures parts (``row_figures``: one per split and partition a task read, in any
    order) merged into one figures dict per split, each with ``partitions``: its rows'
    partitions in order, each's row count and first row (what ``first_bad_row`` reads)."""
    by_split: dict[int, dict] = {}
    partitions: dict[int, list[dict]] = {}
    # in row order: by partition, then position; a partition's pieces (several tasks' where
    # the rows were shuffled) are next to each other, the one with its first row first
    for part in sorted(parts, key=lambda part: part["first"]):
        split = part.pop("split")
        places = partitions.setdefault(split, [])
        if places and places[-1]["partition"] == part["partition"]:
            places[-1]["rows"] += part["rows"]
        else:
            places.append({key: part[key] for key in ("partition", "rows", "first")})
        by_split[split] = merge_figures(by_split.get(split), part, names)
    for split, total in by_split.items():
        total["partitions"] = partitions[split]
    return by_split


def first_bad_row(stats: dict, check: str) -> int:
    """The index (from 0, in the DataFrame's order) of the first row that failed ``check``.

    Its ``monotonically_increasing_id`` holds its partition and its position there; the rows
    of the split's earlier partitions come before it.
    """
    row = int(stats[check + "_first"]["row"])
    partition, position = row >> POSITION_BITS, row & ((1 << POSITION_BITS) - 1)
    before, start = 0, position
    for part in stats["partitions"]:
        if part["partition"] < partition:
            before += int(part["rows"])
        elif part["partition"] == partition:
            start = int(part["first"]) & ((1 << POSITION_BITS) - 1)
    return before + position - start
