"""The data checks' figures of some rows: what a pass over prepared Arrow batches counts for
each row check, computed where the rows are read and merged in any order.

Two passes compute them: the driver's check job (``driver.data_pass``, before a
DistriOptimizer fit) and the linear models' barrier stage (``task.glm_checks``), which
checks the rows it reads anyway instead of a job of its own. Both read batches of the
prepared columns with a ``row`` column of ``monotonically_increasing_id`` numbers (the
partition above ``POSITION_BITS`` bits, the position below), so a row's figures say where
it is in the DataFrame whichever task read it.

``PartitionFigures.add`` takes a batch; its ``parts`` are one figures dict per (split,
partition of the prepared DataFrame) the batches held: the row count and first row, the
vectors' shortest and longest lengths, the stored non-zeros, the distinct labels (when few),
and for each row check how many rows fail it and the first of them (``{"row": id,
"value": what the message quotes}``). ``merge_figures`` adds two such dicts of one split,
keeping the earliest row of each kind whichever comes first, so parts merge the same in
any order (a shuffled stage's tasks each hold pieces of every partition).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from allreduce_param.spark import arrow
from allreduce_param.train.columns import WEIGHT_COLUMN
from allreduce_param.train.features import VectorParts

#: monotonically_increasing_id() holds the partition index above this many bits.
POSITION_BITS = 33
#: The most distinct labels the figures list (a classifier's classes); more: not listed.
DISTINCT_LABELS_KEPT = 10_000
#: The counts every figures dict has beyond its row checks' (``RowCheck.name``).
ALWAYS_COUNTED = ("rows", "nonzeros", "bad_labels", "missing_features", "bad_indices")


class PartitionFigures:
    """The figures of the batches ``add`` was given, by (split, partition): ``parts``.

    ``names``: the row checks counted (``row_checks.RowCheck.name``); ``classes``: a
    classifier's class count where the model says it (labels at or above it are counted
    as ``too_large_labels``); ``weighted``: the batches have the ``weight`` column, whose
    good weights are summed (``weight_sum``)."""

    def __init__(self, names: Sequence[str], classes: int | None, weighted: bool) -> None:
        self.names, self.classes, self.weighted = tuple(names), classes, weighted
        self._parts: dict[tuple[int, int], dict] = {}

    @property
    def parts(self) -> list[dict]:
        """One figures dict per (split, partition), each with its ``split``."""
        return list(self._parts.values())

    def add(self, batch) -> dict:
        """Count ``batch``'s rows in; the batch's own figures, merged over its parts
        (what a caller asks of one batch: did any row fail a check)."""
        mine: dict | None = None
        for key, figures in _batch_figures(batch, self.names, self.classes, self.weighted):
            self._parts[key] = merge_figures(self._parts.get(key), figures, self.names)
            mine = merge_figures(mine, dict(figures), self.names)
        return mine or {}


def partition_figures(
    batches: Iterable, names: Sequence[str], classes: int | None, weighted: bool = False
) -> list[dict]:
    """The figures of every row of ``batches`` (``PartitionFigures.parts``)."""
    figures = PartitionFigures(names, classes, weighted)
    for batch in batches:
        figures.add(batch)
    return figures.parts


def failed_rows(figures: dict, names: Sequence[str]) -> int:
    """How many of the rows ``figures`` counts fail a check (a row failing two counts
    twice): 0 where every row passes."""
    return sum(
        figures.get(name, 0) for name in ("bad_labels", "missing_features", "bad_indices", *names)
    )


def _row(first: dict | None) -> float:
    """A check's first bad row's id, for choosing the earlier of two (none: the last)."""
    return np.inf if first is None else first["row"]


def merge_figures(total: dict | None, part: dict, names: Sequence[str]) -> dict:
    """``total`` (the figures of some rows of a split) with ``part``'s (other rows of it)
    added; ``part`` itself when there is no total yet. Of each kind of row (the first row,
    each check's first bad row, the first row of the shortest and the longest length) the
    earlier one is kept, whichever dict held it."""
    if total is None:
        return part
    for key in (*ALWAYS_COUNTED, *names):
        total[key] += part[key]
    if "weight_sum" in part:
        total["weight_sum"] += part["weight_sum"]
    if part["first"] < total["first"]:
        for key in ("first", "first_features", "first_label"):
            total[key] = part[key]
    total["labels"] = _merge_labels(total.get("labels"), part.get("labels"))
    for key, pick in (("shortest", min), ("longest", max)):
        if part[key] is None:
            continue
        if (
            total[key] is None
            or pick(total[key], part[key]) != total[key]
            or (
                part[key] == total[key] and _row(part[key + "_first"]) < _row(total[key + "_first"])
            )
        ):
            total[key], total[key + "_first"] = part[key], part[key + "_first"]
    key = "too_large_labels_largest"
    if part.get(key) is not None:
        total[key] = part[key] if total.get(key) is None else max(total[key], part[key])
    for name in ("missing_features", "bad_indices", *names):
        if _row(part[name + "_first"]) < _row(total[name + "_first"]):
            total[name + "_first"] = part[name + "_first"]
    return total


def _batch_figures(batch, names: Sequence[str], classes: int | None, weighted: bool):
    """One batch's figures (its rows numbered in ``row``), as ((split, partition), figures)
    pairs, one per split and partition of the prepared DataFrame its rows come from."""
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

    def example(name: str, row: int):
        if name == "bad_weights":
            return None if weight_null[row] else float(weights[row])
        if name == "bad_indices":
            return _indices_example(parts, row)
        if name != "nonfinite_features":
            return float(labels[row])
        return _element_example(parts, bad_element, row)

    partitions = ids >> POSITION_BITS
    keys = splits.astype(np.int64) << 32 | partitions
    for key in np.unique(keys):
        rows = np.flatnonzero(keys == key)
        first = int(rows[0])
        present_rows = rows[~parts.null[rows]]
        present = parts.size[present_rows]
        stats = {
            "split": int(splits[first]),
            "partition": int(partitions[first]),
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
        yield (stats["split"], stats["partition"]), stats


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
