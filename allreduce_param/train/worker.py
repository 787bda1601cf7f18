"""The training loop one partition runs inside the fit's barrier task.

Per step (BSP): fetch the weights, compute the loss and gradient of the partition's share
of the global batch (split into sub-batches on threads), put the gradient, aggregate the
own slice, clip, let the optimizer update the own slice (its state lives here: 1/N of it),
publish the slice. The driver is not in this path; it only receives the records yielded.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import AllReduceError, ConfigurationError
from ..optim import clip_scale, squared_norm
from ..parameter import AllReduceParameter, ConnectedParameter
from ..rendezvous import Rendezvous
from .batching import epoch_order, global_batch_sizes, share_bounds, steps_per_epoch
from .data import TRAIN, VALIDATION
from .progress import ProgressReporter
from .result import STEP_FIELDS

#: A partition's row count travels as two float32 parts, each exact below 2**24.
_COUNT_BASE = 4096
EVAL_CHUNK = 8192


class TrainingError(AllReduceError):
    """A task of the fit failed; the message names the partition, epoch and step."""


@dataclass(frozen=True)
class TrainingJob:
    """Everything a task needs, made on the driver and shipped in the closure."""

    model: Any
    optimizer: Any
    param: AllReduceParameter
    batch_size: int
    epochs: int
    seed: int
    threads: int | Sequence[float] | None
    n_features: int
    has_validation: bool
    reporter: ProgressReporter | None = None


def evaluate(model, weights: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``[loss_sum, metric_sum, count]`` over the rows: metric is correct answers
    (classification) or the squared error (regression)."""
    total = np.zeros(3, dtype=np.float64)
    for start in range(0, len(X), EVAL_CHUNK):
        rows, labels = X[start:start + EVAL_CHUNK], y[start:start + EVAL_CHUNK]
        loss_sum, _, count = model.loss_and_grad(weights, rows, labels)
        predicted = model.predict(weights, rows)
        if model.task == "classification":
            metric = float(np.sum(predicted == labels))
        else:
            metric = float(np.sum((np.asarray(predicted, np.float64) - labels) ** 2))
        total += (loss_sum, metric, count)
    return total


def workload_shares(threads: int | Sequence[float] | None) -> list[float]:
    """Each sub-batch's share of a batch (summing to 1), from a thread count or workloads."""
    try:
        weights = [1.0] * threads if isinstance(threads, int) else [float(w) for w in (threads or [1.0])]
    except (TypeError, ValueError):
        weights = []
    if not weights or any(not w > 0 for w in weights):
        raise ConfigurationError(f"threads must be a positive count or a list of positive workloads, got {threads!r}")
    return [w / sum(weights) for w in weights]


class SubBatches:
    """Computes a batch's loss and gradient as sub-batches on threads, then merges them.

    ``threads`` is a count (equal sub-batches) or a list of relative workloads (uneven
    sub-batches, as MXNet splits a batch over devices of different speeds).
    """

    def __init__(self, model, threads: int | Sequence[float] | None) -> None:
        self.model = model
        shares = workload_shares(threads)
        self._cuts = np.cumsum([0.0, *shares])
        self._pool = ThreadPoolExecutor(len(shares), thread_name_prefix="allreduce-subbatch") if len(shares) > 1 else None

    def __call__(self, weights: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, int]:
        if self._pool is None or len(X) < len(self._cuts) - 1:
            return self.model.loss_and_grad(weights, X, y)
        bounds = np.round(self._cuts * len(X)).astype(np.int64)
        pieces = [(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        results = list(self._pool.map(lambda ab: self.model.loss_and_grad(weights, X[ab[0]:ab[1]], y[ab[0]:ab[1]]),
                                      pieces))
        loss = sum(r[0] for r in results)
        grad = results[0][1]
        for _, other, _ in results[1:]:
            grad += other
        return loss, grad, sum(r[2] for r in results)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def all_counts(p: ConnectedParameter, rows: int) -> list[int]:
    """Every partition's row count, learnt with one allreduce."""
    own = np.zeros(2 * p.partition_num, dtype=np.float32)
    own[2 * p.partition_id:2 * p.partition_id + 2] = divmod(rows, _COUNT_BASE)
    summed = p.allreduce(own, codec="raw").astype(np.int64).reshape(-1, 2)  # exact, whatever the fit's codec
    return [int(high * _COUNT_BASE + low) for high, low in summed]


def train_partition(job: TrainingJob, X: np.ndarray, y: np.ndarray, split: np.ndarray,
                    rendezvous: Rendezvous | None = None) -> Iterator[tuple[str, bytes]]:
    """Run the whole fit on this partition; yields ``(kind, payload)`` records for the driver.

    Kinds: ``steps`` (this partition's step records, float64), and from partition 0 only
    ``epochs`` (JSON of the merged per-epoch metrics) and ``weights`` (the final float32 vector).
    ``rendezvous`` defaults to the Spark barrier stage's.
    """
    X_train, y_train = X[split == TRAIN], y[split == TRAIN]
    X_valid, y_valid = X[split == VALIDATION], y[split == VALIDATION]
    compute = SubBatches(job.model, job.threads)
    try:
        with job.param.connect(rendezvous) as p:
            where = {"epoch": None, "step": None}
            try:
                records, epochs = _fit(job, p, compute, where, X_train, y_train, X_valid, y_valid)
                weights = p.get_weights()
            except Exception as error:
                # raised inside the with-block, so the peers hear where it happened too
                place = "".join(f", {k} {v}" for k, v in where.items() if v is not None)
                raise TrainingError(f"partition {p.partition_id}{place}: {type(error).__name__}: {error}") from error
        yield "steps", np.asarray(records, dtype=np.float64).reshape(-1, len(STEP_FIELDS)).tobytes()
        if p.partition_id == 0:
            yield "epochs", json.dumps(epochs).encode()
            yield "weights", weights.tobytes()
    except TrainingError:
        raise
    except Exception as error:  # meeting the peers failed
        raise TrainingError(f"partition ?, connecting: {type(error).__name__}: {error}") from error
    finally:
        compute.close()
        if job.reporter is not None:
            job.reporter.close()


def _fit(job: TrainingJob, p: ConnectedParameter, compute: SubBatches, where: dict,
         X_train, y_train, X_valid, y_valid) -> tuple[list, list]:
    """Every epoch's steps and metrics; ``where`` tracks the epoch and step for errors."""
    counts = all_counts(p, len(X_train))
    steps = steps_per_epoch(sum(counts), job.batch_size)
    global_sizes = global_batch_sizes(counts, steps)
    cuts = share_bounds(len(X_train), p.partition_id, p.partition_num, steps)
    report = job.reporter.send if job.reporter is not None else (lambda kind, **fields: None)
    report("start", partition=p.partition_id, steps=int(np.count_nonzero(global_sizes)), epochs=job.epochs)
    p.init(job.model.init(np.random.default_rng(job.seed)))
    state = job.optimizer.init_state(p.slice_length)
    weights = np.empty(job.param.size, dtype=np.float32)
    records, epochs = [], []
    global_step = 0
    for epoch in range(job.epochs):
        order = epoch_order(len(X_train), job.seed, epoch, p.partition_id)
        for step in range(steps):
            where.update(epoch=epoch, step=step)
            if global_sizes[step] == 0:
                continue  # every partition sees the same: nobody has rows for it
            rows = order[cuts[step]:cuts[step + 1]]
            record = _step(job, p, compute, weights, X_train[rows], y_train[rows], state, global_step)
            record[:2] = epoch, step
            records.append(record)
            report("step", record=record.tolist())
            global_step += 1
        where.update(step=None)
        epochs.append(_epoch_metrics(job, p, weights, epoch, X_valid, y_valid,
                                     X_train, y_train, last=epoch == job.epochs - 1))
        if p.partition_id == 0:
            report("epoch", **epochs[-1])
    where.update(epoch=None)
    return records, epochs


def _step(job: TrainingJob, p: ConnectedParameter, compute: SubBatches, weights: np.ndarray,
          X: np.ndarray, y: np.ndarray, state, global_step: int) -> np.ndarray:
    """One BSP step; its record with the phase timings."""
    t0 = time.perf_counter()
    p.get_weights(out=weights)
    t1 = time.perf_counter()
    loss_sum, grad_sum, count = compute(weights, X, y)
    t2 = time.perf_counter()
    p.put_gradients(grad_sum, count=count)
    t3 = time.perf_counter()
    gradient = p.aggregate_gradient_partition()
    t4 = time.perf_counter()
    scale = 1.0
    if job.optimizer.clip_norm is not None:  # by the global norm: one scalar allreduce
        squared = p.allreduce(np.array([squared_norm(gradient)], dtype=np.float32), codec="raw")[0]
        scale = clip_scale(float(squared), job.optimizer.clip_norm)
    job.optimizer.step(p.weight_partition, gradient, state, global_step, grad_scale=scale)
    t5 = time.perf_counter()
    p.send_weight_partition()
    t6 = time.perf_counter()
    return np.array([0, 0, loss_sum, count, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5])


def _epoch_metrics(job: TrainingJob, p: ConnectedParameter, weights: np.ndarray, epoch: int,
                   X_valid, y_valid, X_train, y_train, last: bool) -> dict:
    """The epoch's validation metrics (and, after the last epoch, the training ones), merged."""
    p.get_weights(out=weights)
    metrics: dict[str, float] = {"epoch": epoch}
    splits = [("val", X_valid, y_valid)] if job.has_validation else []
    if last:
        splits.append(("train", X_train, y_train))
    for name, X, y in splits:
        loss_sum, metric_sum, count = p.allreduce(evaluate(job.model, weights, X, y).astype(np.float32), codec="raw")
        metrics[f"{name}_loss"] = float(loss_sum / count)
        if job.model.task == "classification":
            metrics[f"{name}_accuracy"] = float(metric_sum / count)
        else:
            metrics[f"{name}_rmse"] = float(np.sqrt(metric_sum / count))
    return metrics
