"""One partition's fit, composed: its plan of global steps (``batching.StepPlan``), its
rows of each step (``step_rows``), the gradient path chosen once (``gradient_path``), the
optimizer over what it updates (``updater``), the evaluator of its epochs (``evaluator``),
its checkpoints (``checkpoint_keeper``), its records and reports (``recorder``), started
where the driver said (``resume.begin``) and run in the loop the settings call for
(``loops``: BSP, a background owner's; ``local_sgd``)."""

from __future__ import annotations

import numpy as np

from allreduce_param.engine.parameter import ConnectedParameter
from allreduce_param.train.regularisation import OwnedRegularisation, feature_std
from allreduce_param.train.task.batching import StepPlan
from allreduce_param.train.task.checkpoint_keeper import CheckpointKeeper
from allreduce_param.train.task.compute import SubBatches
from allreduce_param.train.task.disk_rows import DiskRows
from allreduce_param.train.task.evaluator import Evaluator
from allreduce_param.train.task.gradient_path import choose_path, clips_own
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.local_sgd import LocalSgdLoop
from allreduce_param.train.task.loops import (
    AsynchronousLoop,
    BackupsLoop,
    BspLoop,
    FitParts,
    Loop,
)
from allreduce_param.train.task.memory_rows import Rows
from allreduce_param.train.task.recorder import StepRecorder
from allreduce_param.train.task.reporter import ProgressReporter
from allreduce_param.train.task.resume import begin
from allreduce_param.train.task.step_rows import StepRows
from allreduce_param.train.task.updater import Updater


def all_counts(p: ConnectedParameter, rows: int) -> list[int]:
    """Every partition's row count, learnt with one exact allreduce."""
    own = np.zeros(p.info.partition_num)
    own[p.info.partition_id] = rows
    return [int(count) for count in p.collectives.allreduce_exact(own)]


def loop_for(job: TrainingJob, p: ConnectedParameter) -> type[Loop]:
    """The loop the settings call for: local SGD, plain BSP, backup workers, or SSP/ASP."""
    if job.local_sgd:
        return LocalSgdLoop
    if p.info.strategy.inline_owner:
        return BspLoop
    if p.info.strategy.backup_workers:
        return BackupsLoop
    return AsynchronousLoop


class PartitionFit:
    """One partition's fit: made from its job, handle, compute and rows (the gradient path
    chosen, and refused where the fit cannot serve it, here), then ``run``. Afterwards its
    ``records``, ``epochs``, ``resumed``, final ``weights``, ``state_slice``, ``reached``
    and ``updates_table`` are what the task yields; ``where`` names the epoch and step it is
    at for a task's error."""

    def __init__(
        self,
        job: TrainingJob,
        p: ConnectedParameter,
        compute: SubBatches,
        train: Rows | DiskRows,
        validation: Rows | DiskRows,
        reporter: ProgressReporter | None = None,
    ) -> None:
        self.job, self.p, self.compute = job, p, compute
        self.train, self.validation = train, validation
        self.recorder = StepRecorder(
            p.info.partition_id, reporter.report if reporter is not None else None
        )
        self.weights = np.empty(job.param.size, dtype=np.float32)
        self.parts: FitParts | None = None
        # a background owner's strategies with clip_norm: each partition clips what it puts
        clip = self._clip_whole_own if clips_own(job, p) else None
        self.path = choose_path(job, p, compute, clip)

    def _clip_whole_own(self, gradient: np.ndarray, count: float) -> None:
        self.parts.updater.clip_whole_own(gradient, count)

    def run(self) -> None:
        """Train every step of the plan from where the fit starts; the records are kept."""
        job, p, settings = self.job, self.p, self.job.settings
        first = job.start.epochs_before
        plan = StepPlan(
            all_counts(p, self.train.row_count),
            p.info.partition_id,
            settings.batch_size,
            first,
            first + settings.epochs - 1,
        )
        regularisation = OwnedRegularisation(
            settings.regularization,
            settings.fit_intercept,
            job.model,
            p.info.layout.size,
            slice(0, p.info.layout.size)
            if job.local_sgd
            else p.info.layout.bounds(p.info.partition_id),
            feature_std(p, moments=self.train.moments())
            if settings.regularization.standardizes
            else None,
            clips_whole=clips_own(job, p),
        )
        updater = Updater(job.optimizer, regularisation, job.start.steps_before)
        validation = self.validation if job.has_validation else None
        early = settings.early_stopping  # each partition tracks alike, and decides alike
        evaluator = Evaluator(
            job.model,
            p,
            plan,
            self.train,
            validation,
            None if early is None else early.tracker(),
            self.recorder,
        )
        keeper = CheckpointKeeper(
            job, p, plan, updater, evaluator, self.recorder, self.train.row_count
        )
        rows = StepRows(self.train, plan, settings.seed, p.info.partition_id)
        self.parts = FitParts(
            job, p, plan, rows, self.compute, self.path, updater, evaluator, keeper,
            self.recorder, self.weights,
        )  # fmt: skip
        start = begin(job, p, plan, updater, evaluator, self.recorder)
        loop_for(job, p)(self.parts).run(start)
        self.recorder.at(None, None)

    # ---- what the task yields ------------------------------------------------------------

    @property
    def where(self) -> dict[str, int | None]:
        return self.recorder.where

    @property
    def records(self) -> list[np.ndarray]:
        return self.recorder.records

    @property
    def resumed(self) -> list[int]:
        return self.recorder.resumed

    @property
    def epochs(self) -> list[dict]:
        return self.parts.evaluator.epochs

    def state_slice(self) -> dict[str, np.ndarray]:
        """This partition's slice of the optimizer's state, as the fit left it (with local
        SGD, the slice of its own whole state), for the ``TrainedModel`` to keep."""
        bounds = self.p.info.layout.bounds(self.p.info.partition_id) if self.job.local_sgd else None
        return self.parts.updater.state_slice(bounds)

    def reached(self) -> tuple[int, int]:
        """How far training has come, earlier fits included: (global steps, epochs). Where
        early stopping ended the fit, the steps and epochs up to the one it stopped after."""
        steps, epochs = self.parts.evaluator.reached()
        return self.job.start.steps_before + steps, epochs

    def updates_table(self) -> np.ndarray:
        """With backup workers: the own owner's updates, earlier runs' included."""
        return self.parts.keeper.updates_table()
