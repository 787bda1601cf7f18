"""The training loop one partition runs inside the fit's barrier task: ``train_partition``.

A fit is a plan of global steps (``batching``): every partition knows, for each step, which
of its rows are its share of the step's global batch. How a step synchronises follows from
the settings (``fit.PartitionFit``). The driver is not in this path; it only receives the
records yielded (``train.records``).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Iterator

import numpy as np

from allreduce_param.engine.movement.rendezvous import Rendezvous
from allreduce_param.errors import TrainingError
from allreduce_param.models.base import has_buffers
from allreduce_param.spark.rendezvous import DriverRendezvous
from allreduce_param.train.records import (
    Buffers,
    Clock,
    Epochs,
    OptimizerState,
    Reached,
    Resumed,
    Steps,
    Updates,
    Weights,
    task_failure,
)
from allreduce_param.train.task.compute import SubBatches
from allreduce_param.train.task.disk_rows import DiskRows
from allreduce_param.train.task.fit import PartitionFit
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.memory_rows import Rows
from allreduce_param.train.task.reporter import ProgressReporter
from allreduce_param.train.task.spill import split_rows


def train_partition(
    job: TrainingJob,
    X: np.ndarray,
    y: np.ndarray,
    split: np.ndarray,
    weight: np.ndarray | None = None,
    rendezvous: Rendezvous | None = None,
    clock: dict | None = None,
) -> Iterator[tuple[str, bytes]]:
    """Run the whole fit on this partition; yields its records for the driver, encoded
    (``records.Record.encode``: ``(kind, payload)``).

    ``weight``: each row's sample weight (None: every row counts once); the gradients, the
    losses and the metrics are then weighted means. ``clock``: the task's ``time.time()``
    when it ``started`` and had ``loaded`` its rows; its ``Clock`` record adds when it
    ``met`` its peers and ``trained``. The records: ``Steps``, ``Epochs``, ``Clock``,
    ``Updates`` (with backup workers), ``Buffers`` (a model with buffers: this partition's
    own, its model being its own copy), ``OptimizerState`` (with ``keep_optimizer_state``),
    and from partition 0 ``Resumed``, ``Reached`` and ``Weights``.
    ``rendezvous`` defaults to meeting at the driver through ``job.driver``, else the
    Spark barrier stage's ``allGather``.
    """
    rows, validation = split_rows(X, y, split, weight)
    try:
        yield from train_rows(job, rows, validation, rendezvous, clock)
    finally:
        if job.driver is not None:
            job.driver.close()


def train_rows(
    job: TrainingJob,
    rows: Rows | DiskRows,
    validation: Rows | DiskRows,
    rendezvous: Rendezvous | None = None,
    clock: dict | None = None,
) -> Iterator[tuple[str, bytes]]:
    """``train_partition`` over the partition's training and validation rows as they are
    held: in memory (``memory_rows.Rows``) or in row files (``disk_rows.DiskRows``). The caller
    closes ``job.driver`` after it (the stage's task, once its rows are released)."""
    clock = dict(clock or {"started": time.time(), "loaded": time.time()})
    if has_buffers(job.model):  # a task's closure is its own; partitions on threads share one
        job = dataclasses.replace(job, model=copy.deepcopy(job.model))
    weighted = rows.weight is not None if isinstance(rows, Rows) else rows.weighted
    compute = SubBatches(job.model, job.settings.threads, weighted=weighted)
    reporter = ProgressReporter(job.driver) if job.report_progress else None
    try:
        if rendezvous is None and job.driver is not None:
            rendezvous = DriverRendezvous(job.driver, job.param.network.meeting_patience)
        with job.param.connect(rendezvous) as p:
            clock["met"] = time.time()
            fit = None
            try:
                fit = PartitionFit(job, p, compute, rows, validation, reporter)
                fit.run()
                clock["trained"] = time.time()
            except Exception as error:
                # raised inside the with-block, so the peers hear where it happened too
                place = (
                    ", setting up its fit (model, optimizer, data)"
                    if fit is None
                    else "".join(f", {k} {v}" for k, v in fit.where.items() if v is not None)
                )
                raise task_failure(p.info.partition_id, place, error) from error
        yield Steps(np.asarray(fit.records, dtype=np.float64)).encode()
        yield Epochs(fit.epochs).encode()
        yield Clock(clock).encode()
        if job.param.strategy.backup_workers:
            yield Updates(fit.updates_table()).encode()
        if has_buffers(job.model):
            yield Buffers(job.model.buffers(), rows.row_count).encode()
        if job.settings.keep_optimizer_state:
            yield OptimizerState(p.info.partition_id, fit.state_slice()).encode()
        if p.info.partition_id == 0:
            yield Resumed(fit.resumed).encode()
            yield Reached(*fit.reached()).encode()
            yield Weights(fit.weights).encode()
    except TrainingError:
        raise
    except Exception as error:  # meeting the peers failed
        raise task_failure(_partition_of(rendezvous), ", meeting its peers", error) from error
    finally:
        compute.close()


def _partition_of(rendezvous: Rendezvous | None) -> int | str:
    """This task's partition, for an error before the handle that knows it exists."""
    if rendezvous is not None:
        return rendezvous.partition_id
    try:
        from pyspark import TaskContext

        return TaskContext.get().partitionId()
    except Exception:  # not in a task: say so rather than guess
        return "(outside a Spark task)"
