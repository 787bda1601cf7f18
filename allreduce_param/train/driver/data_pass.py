"""The data checks' one pass: a single Spark stage over the prepared rows, its figures merged.

``prepare`` (``data.py``) asks one job of one stage (numpy over Arrow batches, no shuffle)
for everything it checks: per split, the row count, the vectors' lengths, the stored
non-zeros, the labels (distinct, when few), and for each row check (``row_checks.py``)
how many rows fail it and the first of them; per partition, its row count and first row.
Each task reports its partition's figures by split (``_partition_statistics``); the driver
merges them in row order (``check_pass``).

Rows are numbered as ``monotonically_increasing_id`` numbers them (the partition above
``POSITION_BITS`` bits, the position below), which ``partitioning.place_rows`` reads too;
``first_bad_row`` turns such an id back into the row's index in the DataFrame's order.
Kept apart from ``data.py`` because it is the part that runs in the executors and the part
whose figures must merge the same in any partitioning.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from allreduce_param.spark import arrow
from allreduce_param.train.columns import WEIGHT_COLUMN, prepared_columns
from allreduce_param.train.features import VectorParts

#: monotonically_increasing_id() holds the partition index above this many bits.
POSITION_BITS = 33


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
    for key, pick in (("shortest", min), ("longest", max)):  # the first such row kept
        if part[key] is not None and (
            total[key] is None or pick(total[key], part[key]) != total[key]
        ):
            total[key], total[key + "_first"] = part[key], part[key + "_first"]
    key = "too_large_labels_largest"
    if part[key] is not None:
        total[key] = part[key] if total[key] is None else max(total[key], part[key])
    for name in ("missing_features", "bad_indices", *names):
        if total[name + "_first"] is None:
            total[name + "_first"] = part[name + "_first"]
    return total


def _partition_statistics(
    batches, names: Sequence[str], classes: int | None, weighted: bool = False
) -> dict[int, dict]:
    """Inside a task: ``check_pass``'s figures of this partition (its rows numbered in
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
            present_rows = rows[~parts.null[rows]]
            present = parts.size[present_rows]
            stats = {
                "partition": int(ids[first]) >> POSITION_BITS,
                "first": int(ids[first]),
                "rows": len(rows),
                "shortest": int(present.min()) if len(present) else None,
                "longest": int(present.max()) if len(present) else None,
                # the first row of each length, for the error of rows of different lengths
                "shortest_first": _first_of(ids, present_rows[[np.argmin(present)]])
                if len(present)
                else None,
                "longest_first": _first_of(ids, present_rows[[np.argmax(present)]])
                if len(present)
                else None,
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
