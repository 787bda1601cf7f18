"""The data checks of a linear model's fit, inside its barrier stage: each task checks the rows
it reads anyway, so the data is read once, not once by a check job and again by the stage.

``RowsChecked`` wraps a task's Arrow batches: it counts every batch's figures
(``row_figures``: nulls, NaN and Inf, widths, labels, weights, the stored non-zeros) and
hands on only batches whose rows all pass, so no bad row reaches the float64 rows; once a
batch fails, the rest are still counted (the error's counts are of all rows) but none is
handed on. Its ``agree`` is the stage's first collective: one exact allreduce of four
scalars (rows failing a check, rows, non-zeros, the good weights' sum), after which every
partition knows the same two things: whether the data is refused (a bad row anywhere, no
rows, weights that sum to 0 or past float64), and whether the fit trains on CSR or dense
rows (``features.is_sparse`` over all rows, the rule the driver's checks applied before).

A refused stage fails no task: each returns its figures as a record (``figures_record``)
and the driver merges them and raises the same error, with the same counts and row
numbers, as the check job would have (``driver.glm_start``). A task's rows gathered in
the other form than the data's (its first batch misled it: ``read``) are turned
into the data's form (``in_form``), so every partition trains on the one form.

Nothing here holds a batch: each is let go of once handed on, as the rows' gathering does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from allreduce_param.train.features import is_sparse
from allreduce_param.train.row_figures import PartitionFigures, failed_rows
from allreduce_param.train.task.glm_rows import RowChunks

#: The record kind of a refused stage's figures (one per task: the kind, "/", the partition).
CHECKS = "glm-checks"


@dataclass(frozen=True)
class RowRules:
    """What the stage's tasks check, made on the driver: the row checks' names
    (``row_checks.RowCheck.name``), the class count the model or the label's metadata says
    (None: any whole label >= 0), whether the rows carry weights, and the features' width
    the problem was made for (every row's vector must have it)."""

    names: tuple[str, ...]
    classes: int | None
    weighted: bool
    n_features: int


@dataclass(frozen=True)
class Agreement:
    """What every partition knows after ``RowsChecked.agree``: the data is ``refused``
    (each task then returns its figures), else the rows train ``sparse`` (CSR) or dense."""

    refused: bool
    sparse: bool


class RowsChecked:
    """A task's batches checked as they stream into its rows (see the module's docstring)."""

    def __init__(self, rules: RowRules) -> None:
        self.rules = rules
        self.figures = PartitionFigures(rules.names, rules.classes, rules.weighted)
        self.failed = 0  # rows failing a check, and rows of another width than n_features
        self.rows = self.nonzeros = 0
        self.weight_sum = 0.0

    def batches(self, batches) -> Iterator[Any]:
        """``batches`` as long as every row passes; after a failed batch, the rest counted
        and none handed on."""
        for batch in batches:
            found = self.figures.add(batch)
            if not found:  # no rows
                continue
            self.rows += found["rows"]
            self.nonzeros += found["nonzeros"]
            self.weight_sum += found.get("weight_sum", 0.0)
            width = self.rules.n_features
            self.failed += failed_rows(found, self.rules.names) + (
                found["longest"] not in (None, width) or found["shortest"] not in (None, width)
            )
            if not self.failed:
                yield batch
            del batch  # let go of before the next is read (the rows hold what they need)

    def read(self, batches) -> tuple[bool, Iterator[Any]]:
        """(this task's guess of the data's form, ``batches`` as ``self.batches`` hands them
        on): the guess by the one rule (``features.is_sparse``) over the first good batch,
        read ahead for it and handed on first, held nowhere else."""
        passed = self.batches(batches)
        ahead = [next(passed, None)]
        guess = is_sparse(self.nonzeros, max(self.rows, 1), self.rules.n_features)

        def handed():
            if ahead[0] is not None:
                yield ahead.pop()
            yield from passed

        return guess, handed()

    def agree(self, handle) -> Agreement:
        """Every partition's figures summed (one exact allreduce of four scalars): refused,
        or the form all rows train on."""
        failed, rows, nonzeros, weight_sum = handle.collectives.allreduce_exact(
            np.array([self.failed, self.rows, self.nonzeros, self.weight_sum], np.float64)
        )
        weights_bad = self.rules.weighted and not (0 < weight_sum < np.inf)
        refused = bool(failed > 0 or rows == 0 or weights_bad)
        return Agreement(refused, not refused and is_sparse(nonzeros, rows, self.rules.n_features))

    def figures_record(self) -> bytes:
        """This task's figures (``PartitionFigures.parts``) as a record's JSON payload."""
        return json.dumps(self.figures.parts).encode()


def in_form(rows: RowChunks, sparse: bool) -> RowChunks:
    """``rows`` as CSR (``sparse``) or dense float64 matrices: themselves where they are
    already; else each chunk turned (in memory once, from a row file at each read)."""

    def turned(X):
        if sparse == hasattr(X, "tocsr"):
            return X
        if sparse:
            from scipy.sparse import csr_matrix

            return csr_matrix(X)
        return X.toarray()

    if rows.where == "memory":
        ((X, y, w),) = list(rows.chunks())
        formed = turned(X)
        return rows if formed is X else RowChunks.in_memory(formed, y, w)

    def chunks():
        for X, y, w in rows.chunks():
            yield turned(X), y, w

    return RowChunks(chunks, rows.count, rows.where)
