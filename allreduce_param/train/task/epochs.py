"""A partition's epochs: its share of each epoch's metrics, and early stopping's decision."""

from __future__ import annotations

from typing import Any

from allreduce_param.models.base import model_task
from allreduce_param.train.records import EpochDone
from allreduce_param.train.task.compute import evaluate_rows
from allreduce_param.train.task.state import FitState


class Epochs(FitState):
    """Evaluates each epoch as it ends, and stops the fit where early stopping says so."""

    def _epoch_done(self, epoch: int, last: bool = False) -> bool:
        """This partition's share of ``epoch``'s metrics, with the weights just read; whether
        the fit ends with this epoch (``last``, or early stopping says so). On the fit's
        last epoch, early stopping puts the best epoch's weights back first, and the training
        metrics are theirs."""
        self.where.update(epoch=epoch, step=None)
        metrics: dict[str, Any] = {
            "epoch": epoch,
            "partition": self.p.info.partition_id,
            "task": model_task(self.job.model),
        }
        if self.job.has_validation:
            metrics["val"] = evaluate_rows(self.job.model, self.weights, self.validation)
        if self._early is not None:
            # every partition's rows: the same sums, bits and decision on every partition
            stop = self._early.after_epoch(
                epoch, self.p.collectives.allreduce_exact(metrics["val"]), self.weights
            )
            self.stopped, last = stop and not last, last or stop
            metrics.update(best_epoch=self._early.best_epoch, stopped=self.stopped)
            if last and self._early.best_weights is not None:
                self.weights[:] = self._early.best_weights
        if last:
            metrics["train"] = evaluate_rows(self.job.model, self.weights, self.train)
        self.epochs.append(metrics)
        self._next_epoch = epoch + 1
        self._report(EpochDone(metrics))
        return last

    def _epochs_before(self, index: int) -> bool:
        """Evaluate every epoch that ended before global step ``index`` and is not yet done;
        whether early stopping ended the fit there."""
        while (
            not self.stopped
            and self._next_epoch < self.last_epoch
            and (index >= len(self.plan) or self.plan[index][0] > self._next_epoch)
        ):
            self._epoch_done(self._next_epoch)
        return self.stopped
