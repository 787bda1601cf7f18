"""The loops a partition's fit runs, over its composed parts (``FitParts``):

- ``BspLoop``, plain BSP, ``sync_every=1``: fetch the weights, compute the share's loss
  and gradient and put it (the fit's ``GradientPath``), aggregate the own slice, clip by
  the global norm, let the optimizer update the own slice (its state lives here: 1/N of
  it), publish the slice;
- ``AsynchronousLoop`` (SSP, ASP) and ``BackupsLoop`` (BSP with backup workers): fetch the
  weights the strategy allows, compute, put; a background owner
  (``ConnectedParameter.serve_updates``) updates the own slice and writes the checkpoints.

Local SGD's loop is ``local_sgd.LocalSgdLoop``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from allreduce_param.engine.parameter import ConnectedParameter
from allreduce_param.optim import squared_norm
from allreduce_param.train.records import STEP_FIELDS
from allreduce_param.train.task.batching import StepPlan
from allreduce_param.train.task.checkpoint_keeper import CheckpointKeeper
from allreduce_param.train.task.compute import SubBatches
from allreduce_param.train.task.evaluator import Evaluator
from allreduce_param.train.task.gradient_path import GradientPath
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.recorder import StepRecorder
from allreduce_param.train.task.step_rows import StepRows
from allreduce_param.train.task.updater import Updater

PUT = STEP_FIELDS.index("put_s")
AGGREGATE_TO_SEND = slice(STEP_FIELDS.index("aggregate_s"), STEP_FIELDS.index("send_s") + 1)


@dataclass
class FitParts:
    """One partition's fit as its parts, each the one owner of what it holds. ``weights``:
    the whole vector as the fit last read it (local SGD: its own copy)."""

    job: TrainingJob
    p: ConnectedParameter
    plan: StepPlan
    rows: StepRows
    compute: SubBatches
    path: GradientPath
    updater: Updater
    evaluator: Evaluator
    keeper: CheckpointKeeper
    recorder: StepRecorder
    weights: np.ndarray


class Loop(ABC):
    """A fit's loop over its global steps from ``start``, and what every loop shares."""

    def __init__(self, parts: FitParts) -> None:
        self.parts = parts
        self.p, self.plan, self.weights = parts.p, parts.plan, parts.weights

    @abstractmethod
    def run(self, start: int) -> None:
        """Train every global step from ``start`` on, then ``finish``."""

    def at(self, index: int) -> tuple[int, int]:
        """Global step ``index`` as (epoch, step), which errors from here on name."""
        epoch, step = self.plan.at(index)
        self.parts.recorder.at(epoch, step)
        return epoch, step

    def read(self, index: int) -> float:
        """Fetch the weights the strategy allows before global step ``index``; its seconds."""
        self.at(index)
        started = time.perf_counter()
        self.p.get_weights(out=self.weights)
        return time.perf_counter() - started

    def epochs_before(self, index: int) -> bool:
        """Evaluate the epochs ended before step ``index``; whether early stopping ended the fit."""
        return self.parts.evaluator.epochs_before(index, self.weights)

    def keep(self, index: int, loss_sum: float, count: float, phases, staleness: int = 0):
        """Keep the record of global step ``index`` (``StepRecorder.keep``)."""
        epoch, step = self.plan[index]
        return self.parts.recorder.keep(epoch, step, loss_sum, count, phases, staleness)

    def compute_and_put(self, index: int, read_s: float, staleness: int = 0) -> np.ndarray:
        """This partition's share of step ``index``, computed and put by the fit's path; the
        step's record, kept before the put, its put time filled in after."""
        kept: list[np.ndarray] = []

        def keep(loss_sum: float, count: float, compute_s: float) -> np.ndarray:
            record = self.keep(
                index, loss_sum, count, (read_s, compute_s, 0.0, 0.0, 0.0, 0.0), staleness
            )
            kept.append(record)
            return record

        epoch, step = self.at(index)
        put_s = self.parts.path.step(self.weights, self.parts.rows.of(epoch, step), keep)
        record = kept[0]
        record[PUT] = put_s
        return record

    def finish(self) -> None:
        """The final weights, on every partition, and the last epoch's metrics with them
        (where early stopping ended the fit, it has done both)."""
        if not self.p.info.strategy.inline_owner:
            self.p.background.finish_updates()
        if self.parts.evaluator.stopped:
            return
        self.p.get_weights(out=self.weights)
        self.parts.evaluator.last_done(self.weights)


class BspLoop(Loop):
    """Plain BSP: every step's update of the own slice on this thread."""

    def run(self, start: int) -> None:
        p, updater, keeper = self.p, self.parts.updater, self.parts.keeper
        for index in range(start, len(self.plan)):
            read_s = self.read(index)
            if self.epochs_before(index):
                break
            record = self.compute_and_put(index, read_s)
            t0 = time.perf_counter()
            gradient = p.aggregate_gradient_partition()
            t1 = time.perf_counter()
            updater.hold(gradient)
            scale = 1.0
            if updater.clip_norm is not None:  # by the global norm: one scalar allreduce
                squared = p.collectives.allreduce_exact([squared_norm(gradient)])[0]
                scale = updater.global_clip_scale(float(squared))
            updater.step(p.weight_partition, gradient, index, grad_scale=scale)
            t2 = time.perf_counter()
            p.send_weight_partition()
            t3 = time.perf_counter()
            record[AGGREGATE_TO_SEND] = (t1 - t0, t2 - t1, t3 - t2)
            self.parts.recorder.report_step(record)
            if keeper.due(index):
                keeper.write(index + 1)
        self.finish()


class AsynchronousLoop(Loop):
    """SSP, ASP: read what the strategy allows, compute, put; the background owner does the
    rest."""

    def serve(self) -> None:
        """Start the background owner: it updates the own slice with the optimizer, and writes
        the checkpoints (it owns the optimizer state)."""
        updater, keeper = self.parts.updater, self.parts.keeper

        def steps_done(done: int) -> None:
            if keeper.due(done - 1):
                keeper.write(done)

        def update(gradient: np.ndarray, weights: np.ndarray, step: int) -> None:
            updater.hold(gradient)
            updater.step(weights, gradient, step)

        self.p.background.serve_updates(update, len(self.plan), steps_done)

    def run(self, start: int) -> None:
        p, recorder = self.p, self.parts.recorder
        self.serve()
        for index in range(start, len(self.plan)):
            read_s = self.read(index)
            self.epochs_before(index)
            staleness = index - p.info.strategy.clock(p.info.last_read_version)
            recorder.report_step(self.compute_and_put(index, read_s, staleness=staleness))
        self.finish()


class BackupsLoop(AsynchronousLoop):
    """BSP with backup workers: each read takes the newest step; steps missed are skipped."""

    def run(self, start: int) -> None:
        p, recorder, plan = self.p, self.parts.recorder, self.plan
        self.serve()
        index = start  # the first global step not yet recorded
        while True:
            read_s = self.read(index)
            version = min(p.info.last_read_version, len(plan))
            for skipped in range(index, version):  # the others went on without us
                recorder.report_step(self.keep(skipped, 0.0, 0, (0.0,) * 6))
            self.epochs_before(version)
            if version == len(plan):
                break
            recorder.report_step(self.compute_and_put(version, read_s))
            index = version + 1
        self.finish()
