"""A linear model's partition rows, in memory or on disk, as the full-batch solver reads them:
every pass (the statistics once, the loss and gradient at each evaluation) goes over all of
them, chunk by chunk, and sums what each chunk gives (``RowChunks.total``).

- In memory (``data_in="memory"``): one chunk, the partition's rows as one float64 matrix
  (dense or CSR), so the sums are the ones a single matrix gives; each Arrow batch converted
  into place as it arrives (``rows.RowGatherer``), so the rows are held once.
- On disk (``data_in="disk"``): the partition's Arrow batches written once, as they arrive,
  to a row file in the executor's local directory (``train.row_file``, with float64 values:
  the solver's own precision), then read a block (about 1 MB) at a time at every pass: a
  partition larger than the Python worker's memory is solved holding a block or two of it.
  The chunks' sums are added in block order, so the result differs from the in-memory one
  by rounding only (about 1e-15 relative).
- ``"auto"`` chooses by DistriOptimizer's fits' rule (``spill.gather``): the rows are
  gathered in memory while they take at most ``spill.memory_budget``; past it, what was
  gathered and the rest go to the row file.

The row file is named and claimed as DistriOptimizer's (``spill.Place``, ``row_claims``):
removed when the task ends, whichever way, and by the next task of the session in that
directory where the task was killed before it could.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from allreduce_param.train.row_file import RowFile, RowFileWriter, block_rows_for
from allreduce_param.train.rows import BatchRows, RowGatherer, batch_arrays
from allreduce_param.train.task.row_claims import claimed
from allreduce_param.train.task.spill import Place, gather, memory_budget

#: One chunk of rows: features (float64, dense or CSR), labels, weights (None: 1 each).
Chunk = tuple[Any, np.ndarray, "np.ndarray | None"]


def batch_rows(batch, n_features: int, sparse: bool) -> BatchRows:
    """One prepared Arrow batch (``features``, ``label``, maybe ``weight``) as float64 rows
    (``BatchRows``): CSR where ``sparse`` (the driver found the data sparse), else dense."""
    return batch_arrays(batch, n_features, sparse, np.float64)


def joined(chunks: Iterable[BatchRows], n_features: int, sparse: bool) -> Chunk:
    """Chunks of float64 rows (``batch_rows``') as one (features, labels, weights or None),
    each copied into place as it comes (``rows.RowGatherer``: the rows held once, not listed
    then concatenated); zero rows where there are none."""
    gatherer = RowGatherer(n_features, sparse, np.float64)
    for rows in chunks:
        gatherer.add(rows)
        del rows  # let go of before the next one is made
    X, y, _, w = gatherer.finish()
    return X, y, w


class RowChunks:
    """A partition's rows as chunks the solver sums over: ``chunks()`` yields them in order
    (a chunk's arrays may be reused by the next: use each before asking for another);
    ``count`` chunks, held in ``where`` ("memory" or "disk")."""

    def __init__(self, chunks: Callable[[], Iterator[Chunk]], count: int, where: str) -> None:
        self._chunks, self.count, self.where = chunks, count, where

    @classmethod
    def in_memory(cls, features, labels, weights) -> RowChunks:
        """Rows held whole: one chunk."""
        return cls(lambda: iter([(features, labels, weights)]), 1, "memory")

    @classmethod
    def of_file(cls, file: RowFile) -> RowChunks:
        """A complete row file's rows, a block a chunk, read anew at each pass."""

        def blocks() -> Iterator[Chunk]:
            for index in range(file.block_count):
                block = file.block(index)
                yield block.X, block.y, block.weight

        return cls(blocks, file.block_count, "disk")

    def chunks(self) -> Iterator[Chunk]:
        return self._chunks()

    def first(self, check: Callable[..., str | None]) -> str | None:
        """The first chunk's answer to ``check(X, y, w)`` that is not None (a problem found)."""
        for chunk in self.chunks():
            found = check(*chunk)
            if found is not None:
                return found
        return None

    def total(self, part: Callable[..., Any]) -> Any:
        """``part(X, y, w)`` summed over the chunks, in order: an array, a number, or a tuple
        of them. One chunk: its answer itself (the in-memory bits)."""
        total = None
        for chunk in self.chunks():
            found = part(*chunk)
            if total is None:  # a copy: the next call may reuse what it returned
                total = _copied(found) if self.count > 1 else found
            else:
                total = _added(total, found)
        return total


def _copied(value):
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    return value.copy() if isinstance(value, np.ndarray) else value


def _added(total, value):
    if isinstance(total, tuple):
        return tuple(_added(t, v) for t, v in zip(total, value))
    return total + value


@contextlib.contextmanager
def held_rows(
    batches: Iterable,
    n_features: int,
    sparse: bool,
    weighted: bool,
    data_in: str,
    secret: bytes,
    partitions: int,
) -> Iterator[RowChunks]:
    """This task's rows for the ``with`` block, where ``data_in`` says ("memory", "disk",
    "auto"); on disk, a row file at this task's ``Place`` (the fit named by ``secret``),
    removed on every way out. ``partitions``: the fit's tasks, for "auto"'s budget."""
    place = Place.of_task(secret)
    with claimed(place, data_in != "memory"):
        gatherer = RowGatherer(n_features, sparse, np.float64)

        def arrays(batch) -> BatchRows:
            return batch_rows(batch, n_features, sparse)

        budget = memory_budget(partitions)
        rest = gather(iter(batches), gatherer, gatherer.add_batch, arrays, data_in, budget, place)
        if rest is None:
            X, y, _, w = gatherer.finish()
            yield RowChunks.in_memory(X, y, np.zeros(0) if weighted and w is None else w)
            return
        place.remove_leftovers()  # an earlier attempt's, killed before its clean-up
        file = None
        try:
            file = _written(rest, n_features, sparse, weighted, place)
            if file is None:  # no rows: nothing to write
                X, y, w = joined([], n_features, sparse)
                yield RowChunks.in_memory(X, y, np.zeros(0) if weighted else None)
            else:
                yield RowChunks.of_file(file)
        finally:
            if file is not None:
                file.close()
            place.remove_leftovers()


def _written(
    chunks: Iterator[BatchRows], n_features: int, sparse: bool, weighted: bool, place: Place
) -> RowFile | None:
    """The chunks written to a new row file at ``place``, complete; None where none has a row."""
    writer = None
    try:
        for X, y, _, w, _ in chunks:
            if y.shape[0] == 0:
                continue
            if writer is None:
                size = X.data.nbytes + X.indices.nbytes if sparse else X.nbytes
                writer = RowFileWriter(
                    place.path("glm"),
                    n_features,
                    block_rows_for(size / y.shape[0] + 16),
                    sparse,
                    weighted,
                    float64=True,
                )
            writer.append(X, y, w)
        return None if writer is None else writer.close()
    except BaseException:
        if writer is not None:
            writer.abandon()
        raise
