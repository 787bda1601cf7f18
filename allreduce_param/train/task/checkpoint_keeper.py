"""A partition's checkpoints as its fit writes them: when one is due, and its part of it.

Each owner writes only what it owns (its weight slice, its slice of the optimizer state,
its model buffers, its slice of early stopping's best weights, its records), then signals;
partition 0 waits for every signal and writes the manifest last (``train.checkpoint``), so
a checkpoint is complete or absent. It runs on the thread that owns the optimizer state: a
background owner's, under its strategies.
"""

from __future__ import annotations

import numpy as np

from allreduce_param.engine.parameter import ConnectedParameter
from allreduce_param.models.base import has_buffers
from allreduce_param.train.checkpoint import CheckpointWriter
from allreduce_param.train.task.batching import StepPlan
from allreduce_param.train.task.evaluator import Evaluator
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.recorder import StepRecorder
from allreduce_param.train.task.updater import Updater


class CheckpointKeeper:
    """Writes this partition's checkpoints where ``job.checkpoints`` asks for them (None:
    never), from what the fit's other parts hold: the weights (``p``), the optimizer state
    (``updater``), the epochs and early stopping (``evaluator``), the step records and the
    owner's updates (``recorder``)."""

    def __init__(
        self,
        job: TrainingJob,
        p: ConnectedParameter,
        plan: StepPlan,
        updater: Updater,
        evaluator: Evaluator,
        recorder: StepRecorder,
        rows: int,
    ) -> None:
        self.job, self.p, self.plan = job, p, plan
        self.updater, self.evaluator, self.recorder = updater, evaluator, recorder
        self.rows = rows  # this partition's training rows, which a checkpoint records
        self.writer = CheckpointWriter(job.checkpoints) if job.checkpoints is not None else None

    def due(self, index: int) -> bool:
        """Whether a checkpoint follows global step ``index``."""
        return self.writer is not None and self.writer.settings.due(index, self.plan.steps)

    def write(self, steps_done: int) -> None:
        """Write this partition's part of the checkpoint after ``steps_done`` global steps;
        on partition 0, once every part is written, the manifest."""
        job, p, state = self.job, self.p, self.updater.state
        local = job.local_sgd
        own = p.info.layout.bounds(p.info.partition_id)
        arrays = {"weights": p.weight_partition.copy()}
        arrays.update(
            {f"{'local' if local else 'state'}/{name}": state[name].copy() for name in state}
        )
        if local:  # the owners' slices of the state are not kept: cut them from the own whole one
            arrays.update({f"state/{name}": state[name][own].copy() for name in state})
        if has_buffers(job.model):  # its own (under SSP and ASP: as training left them just now)
            arrays.update({f"buffers/{name}": value for name, value in job.model.buffers().items()})
        early = self.evaluator.early
        if early is not None and early.best_weights is not None:  # load_best joins the slices
            arrays["best/weights"] = early.best_weights[own].copy()
        records = {
            "steps": self.recorder.steps_until(steps_done, self.plan.steps),
            "epochs": self.evaluator.shares_before(self.plan.epoch_after(steps_done)),
            "updates": self.updates_table(before=steps_done).tolist(),
            "resumed": self.recorder.resumed,
            "rows": self.rows,
        }
        self.writer.write_part(
            steps_done, p.info.partition_id, p.info.partition_num, arrays, records
        )
        p.collectives.signal(steps_done)
        if p.info.partition_id == 0:
            p.collectives.wait_for_signals(steps_done)
            self.writer.write_manifest(
                steps_done,
                p.info.partition_num,
                p.info.layout.size,
                tuple(state),
                local,
                job.manifest_settings(),
                None if early is None else early.state(),
                (job.start.steps_before, job.start.epochs_before),
            )

    def updates_table(self, before: int | None = None) -> np.ndarray:
        """With backup workers, the own owner's updates before ``before`` and the earlier
        run's (``StepRecorder.updates_table``); else an empty table."""
        p = self.p
        updates = p.background.updates if p.info.strategy.backup_workers else None
        return self.recorder.updates_table(updates, p.info.partition_num, before)
