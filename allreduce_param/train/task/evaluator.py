"""A partition's evaluation of each epoch as it ends: its share of the epoch's metrics
(the driver merges the partitions'), and early stopping's decision, which every partition
takes alike from the exactly summed validation loss."""

from __future__ import annotations

from typing import Any

import numpy as np

from allreduce_param.engine.parameter import ConnectedParameter
from allreduce_param.models.base import model_task
from allreduce_param.train.early_stopping import EarlyStopper
from allreduce_param.train.records import EpochDone
from allreduce_param.train.task.batching import StepPlan
from allreduce_param.train.task.compute import evaluate_rows
from allreduce_param.train.task.disk_rows import DiskRows
from allreduce_param.train.task.memory_rows import Rows
from allreduce_param.train.task.recorder import StepRecorder


class Evaluator:
    """Evaluates each epoch once, in order, and stops the fit where early stopping says so.

    ``epochs``: this partition's share of each epoch's metrics so far; ``next_epoch``: the
    first epoch not yet evaluated; ``stopped``: whether early stopping ended the fit before
    its last epoch. ``validation`` is None where the fit has no validation rows.
    """

    def __init__(
        self,
        model: Any,
        p: ConnectedParameter,
        plan: StepPlan,
        train: Rows | DiskRows,
        validation: Rows | DiskRows | None,
        early: EarlyStopper | None,
        recorder: StepRecorder,
    ) -> None:
        self.model, self.p, self.plan = model, p, plan
        self.train, self.validation = train, validation
        self.early = early  # this partition's; every one decides alike
        self.recorder = recorder
        self.epochs: list[dict] = []
        self.next_epoch = plan.first_epoch
        self.stopped = False

    def restore(
        self,
        next_epoch: int,
        shares: list[dict],
        early_state: dict | None = None,
        best: np.ndarray | None = None,
    ) -> None:
        """Continue from an earlier run that had evaluated the epochs before ``next_epoch``
        (``shares``: its records of them; any later ones are dropped), with early stopping's
        state and best weights as its checkpoint kept them (None: the checkpoint has none)."""
        self.next_epoch = next_epoch
        self.epochs = [share for share in shares if share["epoch"] < next_epoch]
        if self.early is not None and early_state is not None:
            self.early.restore(early_state, best)

    def shares_before(self, epoch: int) -> list[dict]:
        """The shares of the epochs before ``epoch`` (what a checkpoint there keeps)."""
        return [share for share in self.epochs if share["epoch"] < epoch]

    def epoch_done(self, epoch: int, weights: np.ndarray, last: bool = False) -> bool:
        """This partition's share of ``epoch``'s metrics, with ``weights`` (the fit's, just
        read); whether the fit ends with this epoch (``last``, or early stopping says so). On
        the fit's last epoch, early stopping puts the best epoch's weights back into
        ``weights`` first, and the training metrics are theirs."""
        self.recorder.at(epoch, None)
        metrics: dict[str, Any] = {
            "epoch": epoch,
            "partition": self.p.info.partition_id,
            "task": model_task(self.model),
        }
        if self.validation is not None:
            metrics["val"] = evaluate_rows(self.model, weights, self.validation)
        if self.early is not None:
            # every partition's rows: the same sums, bits and decision on every partition
            stop = self.early.after_epoch(
                epoch, self.p.collectives.allreduce_exact(metrics["val"]), weights
            )
            self.stopped, last = stop and not last, last or stop
            metrics.update(best_epoch=self.early.best_epoch, stopped=self.stopped)
            if last and self.early.best_weights is not None:
                weights[:] = self.early.best_weights
        if last:
            metrics["train"] = evaluate_rows(self.model, weights, self.train)
        self.epochs.append(metrics)
        self.next_epoch = epoch + 1
        self.recorder.report(EpochDone(metrics))
        return last

    def epochs_before(self, index: int, weights: np.ndarray) -> bool:
        """Evaluate, with ``weights``, every epoch that ended before global step ``index``
        and is not yet done; whether early stopping ended the fit there."""
        plan = self.plan
        while (
            not self.stopped
            and self.next_epoch < plan.last_epoch
            and (index >= len(plan) or plan[index][0] > self.next_epoch)
        ):
            self.epoch_done(self.next_epoch, weights)
        return self.stopped

    def last_done(self, weights: np.ndarray) -> None:
        """The fit's last epoch, evaluated with the final ``weights`` (unless early stopping
        ended the fit at an epoch before it)."""
        if not self.epochs_before(len(self.plan), weights):
            self.epoch_done(self.plan.last_epoch, weights, last=True)

    def reached(self) -> tuple[int, int]:
        """How far this fit's plan came: (its global steps, the epochs up to its end). Where
        early stopping ended it, the steps and epochs up to the one it stopped after."""
        if self.stopped:
            return self.plan.steps_before_epoch(self.next_epoch), self.next_epoch
        return len(self.plan), self.plan.last_epoch + 1
