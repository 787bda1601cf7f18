"""What a task computes on its rows: a batch's loss and gradient (split over threads), and
the sums that evaluate a model (loss, metric, rows)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from allreduce_param.errors import InputError
from allreduce_param.models.base import (
    CLASSIFICATION,
    batch_count,
    dense_for,
    has_buffers,
    is_sparse_matrix,
    model_task,
    optional_call,
    takes_sample_weight,
    takes_sparse,
    weight_keywords,
)
from allreduce_param.train.settings import workload_shares

EVAL_CHUNK = 8192
#: Sparse rows evaluated by a model that takes only dense ones go in chunks of at most this
#: many elements once made dense.
DENSE_CHUNK_ELEMENTS = 2**22


def evaluate(
    model,
    weights: np.ndarray,
    X: np.ndarray,
    y: np.ndarray,
    sample_weight: np.ndarray | None = None,
) -> list[float]:
    """``[loss_sum, metric_sum, count]`` over the rows: metric is correct answers
    (classification), the squared error (regression), or 0 for a model without ``task``
    (its metrics are the loss alone, and ``predict`` is not called). With
    ``sample_weight`` each row counts its weight times, in the loss, the metric and the
    count (the weights' sum). A model with buffers
    is evaluated with its own (this partition's), unchanged: where it has no
    ``loss_and_predictions``, the ``loss_and_grad`` calls that give the loss may change
    them, and they are put back afterwards."""

    def part(start: int, stop: int):
        return (
            X[start:stop],
            y[start:stop],
            (None if sample_weight is None else sample_weight[start:stop]),
        )

    return evaluate_parts(model, weights, part, X.shape[0], X.shape[1], is_sparse_matrix(X))


def evaluate_rows(model, weights: np.ndarray, rows) -> list[float]:
    """``evaluate`` over a partition's rows as the fit holds them: in memory (``memory_rows.Rows``)
    or in a row file (``disk_rows.DiskRows``), read a chunk at a time; the same sums, in the
    same order, either way."""

    def part(start: int, stop: int):
        return tuple(rows.rows_between(start, stop))

    return evaluate_parts(model, weights, part, rows.row_count, rows.n_features, rows.sparse)


def evaluate_parts(model, weights: np.ndarray, part, count: int, width: int, sparse: bool):
    """``evaluate`` over ``count`` rows of ``width`` features that ``part(start, stop)`` gives
    as ``(X, y, sample_weight)``, chunk by chunk."""
    task = model_task(model)
    both = optional_call(model, "loss_and_predictions", ("loss_and_grad", "predict"))
    before = model.buffers() if both is None and has_buffers(model) else None
    try:
        return _evaluate(model, task, both, weights, part, count, width, sparse)
    finally:
        if before is not None:
            model.set_buffers(before)


def _evaluate(
    model,
    task: str | None,
    both,
    weights: np.ndarray,
    part,
    count: int,
    width: int,
    sparse: bool,
) -> list[float]:
    total = np.zeros(3, dtype=np.float64)
    chunk = EVAL_CHUNK
    if sparse and not takes_sparse(model):  # chunks made dense: 2^22 elements at most
        chunk = max(1, min(EVAL_CHUNK, DENSE_CHUNK_ELEMENTS // max(1, width)))
    for start in range(0, count, chunk):
        X, labels, chunk_weight = part(start, start + chunk)
        rows = dense_for(model, X)
        weighted = weight_keywords(chunk_weight)
        if both is not None:  # one forward pass
            loss_sum, predicted, count = both(weights, rows, labels, **weighted)
        else:
            loss_sum, _, count = model.loss_and_grad(weights, rows, labels, **weighted)
            predicted = model.predict(weights, rows) if task is not None else None
        if task is None:
            metric = 0.0
        else:
            per_row = (
                (predicted == labels).astype(np.float64)
                if task == CLASSIFICATION
                else (np.asarray(predicted, np.float64) - labels) ** 2
            )
            metric = float(per_row @ weighted["sample_weight"] if weighted else per_row.sum())
        total += (loss_sum, metric, count)
    return total.tolist()


class SubBatches:
    """Computes a batch's loss and gradient as sub-batches on threads, then merges them.

    ``threads`` is a count (equal sub-batches) or a list of relative workloads (uneven
    sub-batches, as MXNet splits a batch over devices of different speeds). ``weighted``:
    the fit passes sample weights, so ``loss_and_grad_into`` streams only where it takes them.
    """

    def __init__(
        self, model, threads: int | Sequence[float] | None, weighted: bool = False
    ) -> None:
        self.model = model
        shares = workload_shares(threads)
        self._cuts = np.cumsum([0.0, *shares])
        self._pool = (
            ThreadPoolExecutor(len(shares), thread_name_prefix="allreduce-subbatch")
            if len(shares) > 1
            else None
        )
        self._weighted = weighted

    @property
    def streams(self) -> bool:
        """Whether a batch's gradient can be written into a given vector range by range as
        backward finishes it: one thread, and a model with ``loss_and_grad_into`` (that
        takes ``sample_weight`` where the fit is weighted)."""
        into = optional_call(self.model, "loss_and_grad_into", ("loss_and_grad",))
        return (
            self._pool is None
            and into is not None
            and (not self._weighted or takes_sample_weight(into))
        )

    def touched(
        self,
        weights: np.ndarray,
        X,
        y: np.ndarray,
        sample_weight: np.ndarray | None = None,
    ):
        """The batch's ``(loss_sum, SparseGradient, count)`` from the model's
        ``loss_and_touched_grad`` (CSR rows, one thread: ``train/task/touched.py``)."""
        return self.model.loss_and_touched_grad(weights, X, y, **weight_keywords(sample_weight))

    def into(
        self,
        weights: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        out: np.ndarray,
        ready: Callable[[int, int], None] | None,
        sample_weight: np.ndarray | None = None,
    ) -> tuple[float, float]:
        """The batch's ``(loss_sum, count)``, its gradient written into ``out`` with ``ready``
        (if any) called for each range as it is final (only where ``streams``). The count must be
        ``batch_count``'s: the stream has sent it with the first chunk."""
        X = dense_for(self.model, X)
        loss_sum, count = self.model.loss_and_grad_into(
            weights, X, y, out, ready, **weight_keywords(sample_weight)
        )
        expected = batch_count(X.shape[0], sample_weight)
        if not np.isclose(count, expected, rtol=1e-9, atol=0):
            what = (
                f"{X.shape[0]} rows; it must be the number of rows"
                if sample_weight is None
                else f"{X.shape[0]} rows of weights summing to {expected!r}; it must be the sum of the sample weights"
            )
            raise InputError(
                f"the model's loss_and_grad_into gave count={count!r} for a batch of {what}"
            )
        return loss_sum, count

    def __call__(
        self,
        weights: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        sample_weight: np.ndarray | None = None,
    ) -> tuple[float, np.ndarray, float]:
        def compute(start: int, stop: int):
            part_weight = None if sample_weight is None else sample_weight[start:stop]
            rows = dense_for(self.model, X[start:stop])
            return self.model.loss_and_grad(
                weights, rows, y[start:stop], **weight_keywords(part_weight)
            )

        if self._pool is None or X.shape[0] < len(self._cuts) - 1:
            return compute(0, X.shape[0])
        bounds = np.round(self._cuts * X.shape[0]).astype(np.int64)
        results = list(self._pool.map(compute, bounds[:-1], bounds[1:]))
        loss = sum(r[0] for r in results)
        grad = results[0][1]
        for _, other, _ in results[1:]:
            grad += other
        return loss, grad, sum(r[2] for r in results)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
