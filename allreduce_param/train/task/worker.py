"""The training loop one partition runs inside the fit's barrier task.

A fit is a plan of global steps (``batching``): every partition knows, for each step, which
of its rows are its share of the step's global batch. How a step synchronises follows from
the settings:

- plain BSP, ``sync_every=1``: fetch the weights, compute the loss and gradient of the
  share (split into sub-batches on threads), put the gradient, aggregate the own slice,
  clip, let the optimizer update the own slice (its state lives here: 1/N of it), publish
  the slice;
- BSP with backup workers, SSP, ASP: fetch the weights the strategy allows, compute, put;
  a background owner (``AllReduceParameter.serve_updates``) updates the own slice;
- ``sync_every=k`` or ``"epoch"`` (local SGD, BSP): each partition steps a copy of its own
  for k steps, then the partitions average their models (or sum their updates).

The driver is not in this path; it only receives the records yielded.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from allreduce_param.engine.blocks.codec import get_codec
from allreduce_param.engine.movement.rendezvous import Rendezvous
from allreduce_param.engine.parameter import AllReduceParameter, ConnectedParameter
from allreduce_param.engine.wire.messages import MessageClient
from allreduce_param.errors import ConfigurationError, InputError, TrainingError
from allreduce_param.models.base import (
    CLASSIFICATION,
    batch_count,
    has_buffers,
    model_task,
    optional_call,
    takes_sample_weight,
)
from allreduce_param.optim import clip_scale, squared_norm
from allreduce_param.spark.rendezvous import DriverRendezvous
from allreduce_param.train.checkpoint import (
    CheckpointSettings,
    CheckpointWriter,
    Manifest,
    load_best,
    load_buffers,
    load_part,
    newest,
)
from allreduce_param.train.driver.data import TRAIN, VALIDATION
from allreduce_param.train.early_stopping import EarlyStopping
from allreduce_param.train.progress import ProgressReporter
from allreduce_param.train.result import STEP_FIELDS, UPDATE_FIELDS
from allreduce_param.train.task.batching import (
    epoch_order,
    global_batch_sizes,
    share_bounds,
    steps_per_epoch,
)

EVAL_CHUNK = 8192


@dataclass(frozen=True)
class TrainingJob:
    """Everything a task needs, made on the driver and shipped in the closure.

    The strategy is ``param.strategy``. ``sync_every``: steps between syncs (1: every
    step), or ``"epoch"``; ``model_averaging``: with ``sync_every`` other than 1, whether a
    sync averages the models (weighted by rows) or sums the partitions' updates.
    ``checkpoints``: where and how often to write checkpoints (None: never); a task that
    finds one there (the stage ran again) resumes from the newest. ``resume``: the
    checkpoint to start from otherwise (``fit(resume_from=...)``). ``settings``: what the
    manifest records of the fit's settings. ``driver``: the task's way to the driver, where
    the partitions meet and, with ``report_progress``, report their steps (None: they meet
    through ``allGather`` and report nothing). ``overlap``: under plain BSP, send the
    gradient chunk by chunk as backward finishes it, where the model and the threads allow:
    True, False, or ``"auto"``: when some peer is reached over the network.
    ``early_stopping``: its settings, with no state yet (each partition trains a copy), when
    the fit stops once the validation loss stops improving.
    """

    model: Any
    optimizer: Any
    param: AllReduceParameter
    batch_size: int
    epochs: int
    seed: int
    threads: int | Sequence[float] | None
    n_features: int
    has_validation: bool
    driver: MessageClient | None = None
    sync_every: int | str = 1
    model_averaging: bool = True
    checkpoints: CheckpointSettings | None = None
    resume: Manifest | None = None
    settings: dict | None = None
    report_progress: bool = False
    overlap: bool | str = "auto"
    early_stopping: EarlyStopping | None = None


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
    task = model_task(model)
    both = optional_call(model, "loss_and_predictions", ("loss_and_grad", "predict"))
    before = model.buffers() if both is None and has_buffers(model) else None
    try:
        return _evaluate(model, task, both, weights, X, y, sample_weight)
    finally:
        if before is not None:
            model.set_buffers(before)


def _evaluate(
    model,
    task: str | None,
    both,
    weights: np.ndarray,
    X: np.ndarray,
    y: np.ndarray,
    sample_weight: np.ndarray | None,
) -> list[float]:
    total = np.zeros(3, dtype=np.float64)
    for start in range(0, len(X), EVAL_CHUNK):
        rows, labels = X[start : start + EVAL_CHUNK], y[start : start + EVAL_CHUNK]
        weighted = (
            {}
            if sample_weight is None
            else {"sample_weight": sample_weight[start : start + EVAL_CHUNK]}
        )
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


def buffers_payload(buffers: dict[str, np.ndarray], rows: int) -> bytes:
    """A partition's ``buffers`` record: its buffers and its training row count, as npz."""
    stream = io.BytesIO()
    np.savez(
        stream, rows=np.int64(rows), **{f"buffer/{name}": value for name, value in buffers.items()}
    )
    return stream.getvalue()


def buffers_from_payload(payload: bytes) -> tuple[dict[str, np.ndarray], int]:
    """``buffers_payload``'s ``(buffers, rows)`` back."""
    with np.load(io.BytesIO(bytes(payload))) as arrays:
        return (
            {
                name[len("buffer/") :]: arrays[name]
                for name in arrays.files
                if name.startswith("buffer/")
            },
            int(arrays["rows"]),
        )


def workload_shares(threads: int | Sequence[float] | None) -> list[float]:
    """Each sub-batch's share of a batch (summing to 1), from a thread count or workloads."""
    try:
        weights = (
            [1.0] * threads if isinstance(threads, int) else [float(w) for w in (threads or [1.0])]
        )
    except (TypeError, ValueError):
        weights = []
    if not weights or any(not w > 0 for w in weights):
        raise ConfigurationError(
            f"threads must be a positive count or a list of positive workloads, got {threads!r}"
        )
    return [w / sum(weights) for w in weights]


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

    def into(
        self,
        weights: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        out: np.ndarray,
        ready: Callable[[int, int], None],
        sample_weight: np.ndarray | None = None,
    ) -> tuple[float, float]:
        """The batch's ``(loss_sum, count)``, its gradient written into ``out`` with ``ready``
        called for each range as it is final (only where ``streams``). The count must be
        ``batch_count``'s: the stream has sent it with the first chunk."""
        weighted = {} if sample_weight is None else {"sample_weight": sample_weight}
        loss_sum, count = self.model.loss_and_grad_into(weights, X, y, out, ready, **weighted)
        expected = batch_count(len(X), sample_weight)
        if not np.isclose(count, expected, rtol=1e-9, atol=0):
            what = (
                f"{len(X)} rows; it must be the number of rows"
                if sample_weight is None
                else f"{len(X)} rows of weights summing to {expected!r}; it must be the sum of the sample weights"
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
            weighted = {} if sample_weight is None else {"sample_weight": sample_weight[start:stop]}
            return self.model.loss_and_grad(weights, X[start:stop], y[start:stop], **weighted)

        if self._pool is None or len(X) < len(self._cuts) - 1:
            return compute(0, len(X))
        bounds = np.round(self._cuts * len(X)).astype(np.int64)
        results = list(self._pool.map(compute, bounds[:-1], bounds[1:]))
        loss = sum(r[0] for r in results)
        grad = results[0][1]
        for _, other, _ in results[1:]:
            grad += other
        return loss, grad, sum(r[2] for r in results)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def all_counts(p: ConnectedParameter, rows: int) -> list[int]:
    """Every partition's row count, learnt with one exact allreduce."""
    own = np.zeros(p.partition_num)
    own[p.partition_id] = rows
    return [int(count) for count in p.allreduce_exact(own)]


def train_partition(
    job: TrainingJob,
    X: np.ndarray,
    y: np.ndarray,
    split: np.ndarray,
    weight: np.ndarray | None = None,
    rendezvous: Rendezvous | None = None,
    clock: dict | None = None,
) -> Iterator[tuple[str, bytes]]:
    """Run the whole fit on this partition; yields ``(kind, payload)`` records for the driver.

    ``weight``: each row's sample weight (None: every row counts once); the gradients, the
    losses and the metrics are then weighted means.

    Kinds: ``steps`` (this partition's record of every global step, float64), ``epochs``
    (JSON: this partition's share of each epoch's metrics), ``clock`` (JSON: the ``clock``
    given, the task's ``time.time()`` when it ``started`` and had ``loaded`` its rows, with
    when it ``met`` its peers and ``trained``), ``updates`` (with backup workers: which
    partitions' gradients each of this owner's updates took), for a model with buffers
    ``buffers`` (``buffers_payload``: this partition's final buffers and training row
    count; the model is this partition's own copy, so they are its own), and from
    partition 0 ``weights`` (the final float32 vector). ``rendezvous`` defaults to meeting
    at the driver through ``job.driver``, else the Spark barrier stage's ``allGather``.
    """
    clock = dict(clock or {"started": time.time(), "loaded": time.time()})
    if has_buffers(job.model):  # a task's closure is its own; partitions on threads share one
        job = dataclasses.replace(job, model=copy.deepcopy(job.model))
    train, valid = split == TRAIN, split == VALIDATION
    rows = _Rows(X[train], y[train], None if weight is None else weight[train])
    validation = _Rows(X[valid], y[valid], None if weight is None else weight[valid])
    compute = SubBatches(job.model, job.threads, weighted=weight is not None)
    reporter = (
        ProgressReporter(job.driver) if job.driver is not None and job.report_progress else None
    )
    try:
        if rendezvous is None and job.driver is not None:
            rendezvous = DriverRendezvous(job.driver, job.param.network.meeting_patience)
        with job.param.connect(rendezvous) as p:
            clock["met"] = time.time()
            fit = _Fit(job, p, compute, rows, validation, reporter)
            try:
                fit.run()
                clock["trained"] = time.time()
            except Exception as error:
                # raised inside the with-block, so the peers hear where it happened too
                place = "".join(f", {k} {v}" for k, v in fit.where.items() if v is not None)
                raise TrainingError(
                    f"partition {p.partition_id}{place}: {type(error).__name__}: {error}"
                ) from error
        yield (
            "steps",
            np.asarray(fit.records, dtype=np.float64).reshape(-1, len(STEP_FIELDS)).tobytes(),
        )
        yield "epochs", json.dumps(fit.epochs).encode()
        yield "clock", json.dumps(clock).encode()
        if job.param.strategy.backup_workers:
            yield "updates", fit.updates_table().tobytes()
        if has_buffers(job.model):
            yield "buffers", buffers_payload(job.model.buffers(), len(rows.X))
        if p.partition_id == 0:
            yield "resumed", json.dumps(fit.resumed).encode()
            yield "weights", fit.weights.tobytes()
    except TrainingError:
        raise
    except Exception as error:  # meeting the peers failed
        raise TrainingError(
            f"partition {_partition_of(rendezvous)}, meeting its peers: "
            f"{type(error).__name__}: {error}"
        ) from error
    finally:
        compute.close()
        if job.driver is not None:
            job.driver.close()


def _partition_of(rendezvous: Rendezvous | None) -> int | str:
    """This task's partition, for an error before the handle that knows it exists."""
    if rendezvous is not None:
        return rendezvous.partition_id
    try:
        from pyspark import TaskContext

        return TaskContext.get().partitionId()
    except Exception:  # not in a task: say so rather than guess
        return "(outside a Spark task)"


class _Rows(NamedTuple):
    """A partition's rows of one split: features, labels, sample weights (or None)."""

    X: np.ndarray
    y: np.ndarray
    weight: np.ndarray | None

    def take(self, index: np.ndarray) -> _Rows:
        return _Rows(
            self.X[index], self.y[index], None if self.weight is None else self.weight[index]
        )


class _Fit:
    """One partition's fit: the plan of global steps, the loop the settings call for, the
    records. ``where`` tracks the epoch and step for error messages."""

    def __init__(
        self,
        job: TrainingJob,
        p: ConnectedParameter,
        compute: SubBatches,
        train: _Rows,
        validation: _Rows,
        reporter: ProgressReporter | None = None,
    ) -> None:
        self.job, self.p, self.compute = job, p, compute
        self.train, self.validation = train, validation
        self.where: dict[str, int | None] = {"epoch": None, "step": None}
        self.records: list[np.ndarray] = []
        self.epochs: list[dict] = []
        self.resumed: list[int] = []  # the steps this fit resumed at, from checkpoints
        self._earlier_updates: list[
            list[float]
        ] = []  # backup workers: the owner's, before a resume
        self.weights = np.empty(job.param.size, dtype=np.float32)
        # error feedback: what a lossy codec rounded off this partition's gradients, sent next time
        self._residual = (
            np.zeros(job.param.size, dtype=np.float32)
            if get_codec(job.param.gradient_codec).lossy
            else None
        )
        self.state: dict[
            str, np.ndarray
        ] = {}  # the optimizer's: of the own slice, or with local SGD the whole model's
        self._writer = CheckpointWriter(job.checkpoints) if job.checkpoints is not None else None
        self._report = reporter.send if reporter is not None else (lambda kind, **fields: None)
        self._order_epoch, self._order = -1, np.empty(0, np.int64)
        self._early = copy.deepcopy(job.early_stopping)  # this partition's; every one decides alike
        self.stopped = False  # whether early stopping ended the fit before its last epoch
        self._next_epoch = 0  # the first epoch not yet evaluated
        # overlap: send the gradient as backward finishes it (BSP, where the checkpoints are
        # this thread's, so a step's record is kept before any other thread sees its gradient)
        wanted = p.remote_peers > 0 if job.overlap == "auto" else job.overlap
        self._streams = (
            wanted and p.strategy.inline_owner and job.sync_every == 1 and compute.streams
        )

    # ---- the plan ------------------------------------------------------------------------

    def _plan(self) -> None:
        """Every global step as (epoch, step in the epoch); this partition's cuts of its rows."""
        p, job = self.p, self.job
        counts = all_counts(p, len(self.train.X))
        steps = steps_per_epoch(sum(counts), job.batch_size)
        sizes = global_batch_sizes(counts, steps)
        self.cuts = share_bounds(len(self.train.X), p.partition_id, p.partition_num, steps)
        self.plan = [
            (epoch, step) for epoch in range(job.epochs) for step in range(steps) if sizes[step]
        ]
        self._steps_per_epoch = int(np.count_nonzero(sizes))

    def _batch(self, index: int) -> _Rows:
        """This partition's rows of global step ``index`` (shuffled anew each epoch)."""
        epoch, step = self._at(index)
        if epoch != self._order_epoch:
            self._order_epoch, self._order = (
                epoch,
                epoch_order(len(self.train.X), self.job.seed, epoch, self.p.partition_id),
            )
        return self.train.take(self._order[self.cuts[step] : self.cuts[step + 1]])

    def _at(self, index: int) -> tuple[int, int]:
        """Global step ``index`` as (epoch, step), which errors from here on name."""
        epoch, step = self.plan[min(index, len(self.plan) - 1)]
        self.where.update(epoch=epoch, step=step)
        return epoch, step

    def _record(
        self, index: int, loss_sum: float, count: float, phases: Sequence[float], staleness: int = 0
    ) -> np.ndarray:
        """Keep the record of global step ``index``; the caller reports it once it is whole."""
        epoch, step = self.plan[index]
        record = np.array([epoch, step, loss_sum, count, *phases, staleness], dtype=np.float64)
        self.records.append(record)
        return record

    def _report_step(self, record: np.ndarray) -> None:
        self._report("step", partition=self.p.partition_id, record=record.tolist())

    def _epoch_done(self, epoch: int, last: bool = False) -> bool:
        """This partition's share of ``epoch``'s metrics, with the weights just read; whether
        the fit ends with this epoch (``last``, or early stopping says so). On the fit's
        last epoch, early stopping puts the best epoch's weights back first, and the training
        metrics are theirs."""
        self.where.update(epoch=epoch, step=None)
        metrics: dict[str, Any] = {
            "epoch": epoch,
            "partition": self.p.partition_id,
            "task": model_task(self.job.model),
        }
        if self.job.has_validation:
            metrics["val"] = evaluate(self.job.model, self.weights, *self.validation)
        if self._early is not None:
            # every partition's rows: the same sums, bits and decision on every partition
            stop = self._early.after_epoch(
                epoch, self.p.allreduce_exact(metrics["val"]), self.weights
            )
            self.stopped, last = stop and not last, last or stop
            metrics.update(best_epoch=self._early.best_epoch, stopped=self.stopped)
            if last and self._early.best_weights is not None:
                self.weights[:] = self._early.best_weights
        if last:
            metrics["train"] = evaluate(self.job.model, self.weights, *self.train)
        self.epochs.append(metrics)
        self._next_epoch = epoch + 1
        self._report("epoch", **metrics)
        return last

    def _epochs_before(self, index: int) -> bool:
        """Evaluate every epoch that ended before global step ``index`` and is not yet done;
        whether early stopping ended the fit there."""
        while (
            not self.stopped
            and self._next_epoch < self.job.epochs - 1
            and (index >= len(self.plan) or self.plan[index][0] > self._next_epoch)
        ):
            self._epoch_done(self._next_epoch)
        return self.stopped

    def _read(self, index: int) -> float:
        """Fetch the weights the strategy allows before global step ``index``; its seconds."""
        self._at(index)
        started = time.perf_counter()
        self.p.get_weights(out=self.weights)
        return time.perf_counter() - started

    def _compute_and_put(
        self, index: int, read_s: float, clip_own: bool, staleness: int = 0
    ) -> np.ndarray:
        """This partition's share of step ``index``: compute it and put the gradient; the step's
        record, kept before the put (a checkpoint a background owner writes once the gradient
        is in then already holds it), its put time filled in after."""
        batch = self._batch(index)
        if self._streams:
            return self._compute_streaming(index, batch, read_s)
        started = time.perf_counter()
        loss_sum, grad_sum, count = self.compute(self.weights, *batch)
        if clip_own:
            self._clip_own(grad_sum, count)
        computed = time.perf_counter()
        record = self._record(
            index, loss_sum, count, (read_s, computed - started, 0.0, 0.0, 0.0, 0.0), staleness
        )
        self.p.put_gradients(grad_sum, count=count, residual=self._residual)
        record[STEP_FIELDS.index("put_s")] = time.perf_counter() - computed
        return record

    def _compute_streaming(self, index: int, batch: _Rows, read_s: float) -> np.ndarray:
        """``_compute_and_put`` under plain BSP with overlap: each owner's chunk of the gradient
        leaves as soon as backward has finished it (``stream_gradients``); the put time is
        what was left to send once backward was done."""
        gradient = self.p.gradient_buffer()
        started = time.perf_counter()
        with self.p.stream_gradients(
            gradient, count=batch_count(len(batch.X), batch.weight), residual=self._residual
        ) as stream:
            loss_sum, count = self.compute.into(
                self.weights, batch.X, batch.y, gradient, stream.ready, batch.weight
            )
            computed = time.perf_counter()
        record = self._record(
            index, loss_sum, count, (read_s, computed - started, 0.0, 0.0, 0.0, 0.0)
        )
        record[STEP_FIELDS.index("put_s")] = time.perf_counter() - computed
        return record

    def _clip_own(self, grad_sum: np.ndarray, count: int) -> None:
        """Clip a gradient by its own norm (where the global norm would need every partition)."""
        clip = self.job.optimizer.clip_norm
        if clip is not None and count:
            grad_sum *= np.float32(clip_scale(squared_norm(grad_sum) / float(count) ** 2, clip))

    # ---- the loops -----------------------------------------------------------------------

    def run(self) -> None:
        job, p = self.job, self.p
        self._plan()
        self.start = self._begin()
        if job.sync_every != 1:
            self._local_sgd()
        elif p.strategy.inline_owner:
            self._bsp()
        elif p.strategy.backup_workers:
            self._with_backups()
        else:
            self._asynchronous()
        self.where.update(epoch=None, step=None)

    # ---- checkpoints -----------------------------------------------------------------------

    def _begin(self) -> int:
        """Initialise the weights and the optimizer state, from the newest checkpoint of this
        fit (the stage ran again), else the one to resume from, else the model; the
        global step to start at."""
        job, p = self.job, self.p
        local = job.sync_every != 1
        found = newest(job.checkpoints.directory) if job.checkpoints is not None else None
        manifest = found or job.resume
        names = job.optimizer.state_names
        if manifest is None:
            self._report_start(0)
            p.init(job.model.init(np.random.default_rng(job.seed)))
            self.state = job.optimizer.init_state(p.layout.size if local else p.slice_length)
            return 0
        arrays, records = load_part(manifest, p.partition_id, p.layout)
        if not local:
            self.state = {name: arrays[f"state/{name}"] for name in names}
        elif all(f"local/{name}" in arrays for name in names):
            self.state = {name: arrays[f"local/{name}"] for name in names}
        else:  # no whole state of this partition's own there (not local SGD, or other workers)
            self.state = job.optimizer.init_state(p.layout.size)
        self.records = [np.asarray(row, dtype=np.float64) for row in records.get("steps", [])]
        self._next_epoch = self._evaluated_before(manifest.step)
        self.epochs = [
            share for share in records.get("epochs", []) if share["epoch"] < self._next_epoch
        ]
        self._earlier_updates = records.get("updates", [])
        self.resumed = records.get("resumed", []) + [manifest.step]
        if has_buffers(job.model):
            buffers = load_buffers(manifest, p.partition_id, p.partition_num)
            if buffers is not None:  # a checkpoint written before buffers were kept has none
                job.model.set_buffers(buffers)
        if self._early is not None and manifest.early_stopping is not None:
            self._early.restore(manifest.early_stopping, load_best(manifest))
        self._report_start(manifest.step)  # before init: no peer can report a step before it
        p.init(arrays["weights"], step=manifest.step)
        return manifest.step

    def _evaluated_before(self, start: int) -> int:
        """How many epochs a fit had evaluated when it checkpointed after ``start`` steps
        (the same on every partition, whatever records came along): with local SGD an epoch
        is evaluated at its last step, before the checkpoint there; otherwise at the next
        epoch's first step, after it."""
        if start >= len(self.plan):
            return self.job.epochs - 1
        return self.plan[start][0] if self.job.sync_every != 1 else self.plan[start - 1][0]

    def _report_start(self, start: int) -> None:
        resumed = (
            {"resumed": list(self.plan[start]) if start < len(self.plan) else None, "done": start}
            if start
            else {}
        )
        self._report(
            "start",
            partition=self.p.partition_id,
            steps=self._steps_per_epoch,
            epochs=self.job.epochs,
            **resumed,
        )

    def _checkpoint_due(self, index: int) -> bool:
        return self._writer is not None and self._writer.settings.due(index, self.plan)

    def _checkpoint(self, steps_done: int) -> None:
        """Write this partition's part of the checkpoint after ``steps_done`` global steps; on
        partition 0, once every part is written, the manifest. Runs on the thread that owns
        the optimizer state (a background owner's, under its strategies)."""
        job, p = self.job, self.p
        local = job.sync_every != 1
        arrays = {"weights": p.weight_partition.copy()}
        arrays.update(
            {
                f"{'local' if local else 'state'}/{name}": self.state[name].copy()
                for name in self.state
            }
        )
        if local:  # the owners' slices of the state are not kept: cut them from the own whole one
            arrays.update(
                {
                    f"state/{name}": self.state[name][p.layout.bounds(p.partition_id)].copy()
                    for name in self.state
                }
            )
        if has_buffers(
            job.model
        ):  # this partition's own (under SSP and ASP: as training left them just now)
            arrays.update({f"buffers/{name}": value for name, value in job.model.buffers().items()})
        early = self._early
        if (
            early is not None and early.best_weights is not None
        ):  # each part its slice: load_best joins them
            arrays["best/weights"] = early.best_weights[p.layout.bounds(p.partition_id)].copy()
        end_epoch = self.plan[steps_done][0] if steps_done < len(self.plan) else job.epochs - 1
        steps = [row.tolist() for row in self.records[:steps_done]]
        for index in range(
            len(steps), steps_done
        ):  # a straggler's steps the others went on without
            steps.append([*self.plan[index], 0.0, 0.0] + [0.0] * (len(STEP_FIELDS) - 4))
        records = {
            "steps": steps,
            "epochs": [share for share in self.epochs if share["epoch"] < end_epoch],
            "updates": self.updates_table(before=steps_done).tolist(),
            "resumed": self.resumed,
            "rows": len(self.train.X),
        }
        self._writer.write_part(steps_done, p.partition_id, p.partition_num, arrays, records)
        p.signal(steps_done)
        if p.partition_id == 0:
            p.wait_for_signals(steps_done)
            self._writer.write_manifest(
                steps_done,
                p.partition_num,
                p.layout.size,
                tuple(self.state),
                local,
                job.settings or {},
                None if early is None else early.state(),
            )

    def updates_table(self, before: int | None = None) -> np.ndarray:
        """With backup workers: the own owner's updates (those of steps before ``before``), as
        rows of ``UPDATE_FIELDS`` then one 0/1 column per partition, earlier ones included."""
        p = self.p
        table = np.zeros((0, len(UPDATE_FIELDS) + p.partition_num), dtype=np.float64)
        if not p.strategy.backup_workers:
            return table
        updates = [update for update in p.updates if before is None or update.step < before]
        table = np.zeros((len(updates), len(UPDATE_FIELDS) + p.partition_num), dtype=np.float64)
        for row, update in zip(table, updates):
            row[: len(UPDATE_FIELDS)] = p.partition_id, update.step, update.count
            row[len(UPDATE_FIELDS) + np.asarray(update.sources, dtype=np.int64)] = 1
        earlier = np.asarray(self._earlier_updates, dtype=np.float64).reshape(-1, table.shape[1])
        return np.concatenate([earlier, table])

    # ---- the loops -----------------------------------------------------------------------

    def _bsp(self) -> None:
        job, p = self.job, self.p
        state = self.state
        for index in range(self.start, len(self.plan)):
            read_s = self._read(index)
            if self._epochs_before(index):
                break
            record = self._compute_and_put(index, read_s, clip_own=False)
            t0 = time.perf_counter()
            gradient = p.aggregate_gradient_partition()
            t1 = time.perf_counter()
            scale = 1.0
            if job.optimizer.clip_norm is not None:  # by the global norm: one scalar allreduce
                squared = p.allreduce_exact([squared_norm(gradient)])[0]
                scale = clip_scale(float(squared), job.optimizer.clip_norm)
            job.optimizer.step(p.weight_partition, gradient, state, index, grad_scale=scale)
            t2 = time.perf_counter()
            p.send_weight_partition()
            t3 = time.perf_counter()
            record[STEP_FIELDS.index("aggregate_s") : STEP_FIELDS.index("send_s") + 1] = (
                t1 - t0,
                t2 - t1,
                t3 - t2,
            )
            self._report_step(record)
            if self._checkpoint_due(index):
                self._checkpoint(index + 1)
        self._finish()

    def _serve(self) -> None:
        """Start the background owner: it updates the own slice with the optimizer, and writes
        the checkpoints (it owns the optimizer state)."""
        optimizer, state = self.job.optimizer, self.state

        def steps_done(done: int) -> None:
            if self._checkpoint_due(done - 1):
                self._checkpoint(done)

        self.p.serve_updates(
            lambda gradient, weights, step: optimizer.step(weights, gradient, state, step),
            len(self.plan),
            steps_done,
        )

    def _asynchronous(self) -> None:
        """SSP, ASP: read what the strategy allows, compute, put; the owner does the rest."""
        p = self.p
        self._serve()
        for index in range(self.start, len(self.plan)):
            read_s = self._read(index)
            self._epochs_before(index)
            staleness = index - p.strategy.clock(p.last_read_version)
            self._report_step(
                self._compute_and_put(index, read_s, clip_own=True, staleness=staleness)
            )
        self._finish()

    def _with_backups(self) -> None:
        """BSP with backup workers: each read takes the newest step; steps missed are skipped."""
        p = self.p
        self._serve()
        index = self.start  # the first global step not yet recorded
        while True:
            read_s = self._read(index)
            version = min(p.last_read_version, len(self.plan))
            for skipped in range(index, version):  # the others went on without us
                self._report_step(self._record(skipped, 0.0, 0, (0.0,) * 6))
            self._epochs_before(version)
            if version == len(self.plan):
                break
            self._report_step(self._compute_and_put(version, read_s, clip_own=True))
            index = version + 1
        self._finish()

    def _local_sgd(self) -> None:
        """Each partition steps its own copy of the model; every ``sync_every`` steps and at the
        end of every epoch the partitions average their models (weighted by the rows each
        trained on since the last sync) or sum their updates."""
        job, p = self.job, self.p
        p.get_weights(out=self.weights)
        synced = self.weights.copy()
        state = self.state  # a whole model's: each partition trains its own
        every = len(self.plan) if job.sync_every == "epoch" else int(job.sync_every)
        rows = since = 0
        checkpoint_due = False  # a checkpoint waits for the next sync, where every copy is the same
        for index in range(self.start, len(self.plan)):
            batch = self._batch(index)
            t0 = time.perf_counter()
            loss_sum, grad_sum, count = self.compute(self.weights, *batch)
            t1 = time.perf_counter()
            if count:
                self._clip_own(grad_sum, count)
                job.optimizer.step(self.weights, grad_sum, state, index, grad_scale=1.0 / count)
            t2 = time.perf_counter()
            rows, since = rows + count, since + 1
            epoch_ends = (
                index + 1 == len(self.plan) or self.plan[index + 1][0] != self.plan[index][0]
            )
            phases = [0.0, t1 - t0, 0.0, 0.0, t2 - t1, 0.0]
            checkpoint_due = checkpoint_due or self._checkpoint_due(index)
            synced_now = since == every or epoch_ends
            if synced_now:
                phases[2], phases[3], phases[5], phases[0] = self._sync(synced, rows)
                rows = since = 0
            self._report_step(self._record(index, loss_sum, count, phases))
            if (
                epoch_ends
                and self.plan[index][0] < job.epochs - 1
                and self._epoch_done(self.plan[index][0])
            ):
                return  # early stopping
            if synced_now and checkpoint_due:
                self._checkpoint(index + 1)
                checkpoint_due = False
        self._epoch_done(job.epochs - 1, last=True)

    def _sync(self, synced: np.ndarray, rows: int) -> tuple[float, float, float, float]:
        """Local SGD's sync; the put, aggregate, send and get times."""
        p = self.p
        t0 = time.perf_counter()
        if self.job.model_averaging:
            p.put_gradients(self.weights * np.float32(rows), count=rows)
        else:
            p.put_gradients(self.weights - synced, count=1)
        t1 = time.perf_counter()
        if self.job.model_averaging:
            p.weight_partition[:] = p.aggregate_gradient_partition()
        else:
            p.weight_partition[:] += p.aggregate_gradient_partition(avg=1)
        t2 = time.perf_counter()
        p.send_weight_partition()
        t3 = time.perf_counter()
        p.get_weights(out=self.weights)
        synced[:] = self.weights
        return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3

    def _finish(self) -> None:
        """The final weights, on every partition, and the last epoch's metrics with them
        (where early stopping ended the fit, it has done both)."""
        if not self.p.strategy.inline_owner:
            self.p.finish_updates()
        if self.stopped:
            return
        self.p.get_weights(out=self.weights)
        if not self._epochs_before(len(self.plan)):
            self._epoch_done(self.job.epochs - 1, last=True)
