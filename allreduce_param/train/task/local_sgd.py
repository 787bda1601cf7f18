"""Local SGD's loop (``sync_every=k`` or ``"epoch"``): each partition steps a copy of its
own, with optimizer state of its own, for k steps, then the partitions average their models
(weighted by the rows each trained on since the last sync) or sum their updates
(``FitSettings.averages_models``: which, chosen once per fit)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import numpy as np

from allreduce_param.engine.parameter import ConnectedParameter
from allreduce_param.train.task.loops import FitParts, Loop


class LocalSync(ABC):
    """How the partitions' copies become one at a sync."""

    @abstractmethod
    def put(self, p: ConnectedParameter, weights: np.ndarray, synced: np.ndarray, rows: float):
        """Put this partition's contribution: its copy ``weights`` (``synced``: the copy at
        the last sync; ``rows``: the rows it trained on since)."""

    @abstractmethod
    def aggregate(self, p: ConnectedParameter) -> None:
        """Make the own slice of the synced model from every partition's contribution."""

    def __call__(
        self, p: ConnectedParameter, weights: np.ndarray, synced: np.ndarray, rows: float
    ) -> tuple[float, float, float, float]:
        """Sync: every partition's ``weights`` (and ``synced``) become the synced model; the
        put, aggregate, send and get times."""
        t0 = time.perf_counter()
        self.put(p, weights, synced, rows)
        t1 = time.perf_counter()
        self.aggregate(p)
        t2 = time.perf_counter()
        p.send_weight_partition()
        t3 = time.perf_counter()
        p.get_weights(out=weights)
        synced[:] = weights
        return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3


class AverageModels(LocalSync):
    """The models averaged, each weighted by the rows it trained on since the last sync."""

    def put(self, p: ConnectedParameter, weights: np.ndarray, synced: np.ndarray, rows: float):
        p.put_gradients(weights * np.float32(rows), count=rows)

    def aggregate(self, p: ConnectedParameter) -> None:
        p.weight_partition[:] = p.aggregate_gradient_partition()


class SumUpdates(LocalSync):
    """The partitions' updates since the last sync summed onto the synced model."""

    def put(self, p: ConnectedParameter, weights: np.ndarray, synced: np.ndarray, rows: float):
        p.put_gradients(weights - synced, count=1)

    def aggregate(self, p: ConnectedParameter) -> None:
        p.weight_partition[:] += p.aggregate_gradient_partition(avg=1)


class LocalSgdLoop(Loop):
    """Each partition steps its own copy of the model (``weights``); every ``sync_every``
    steps and at the end of every epoch the copies are synced (``LocalSync``). A checkpoint
    due waits for the next sync, where every copy is the same."""

    def __init__(self, parts: FitParts) -> None:
        super().__init__(parts)
        settings = parts.job.settings
        self.sync = AverageModels() if settings.averages_models else SumUpdates()
        self.every = len(self.plan) if settings.sync_every == "epoch" else int(settings.sync_every)

    def run(self, start: int) -> None:
        p, plan, weights = self.p, self.plan, self.weights
        compute, updater = self.parts.compute, self.parts.updater
        evaluator, keeper, recorder = self.parts.evaluator, self.parts.keeper, self.parts.recorder
        p.get_weights(out=weights)
        synced = weights.copy()
        rows = since = 0
        checkpoint_due = False
        for index in range(start, len(plan)):
            batch = self.parts.rows.of(*self.at(index))
            t0 = time.perf_counter()
            loss_sum, grad_sum, count = compute(weights, *batch)
            t1 = time.perf_counter()
            if count:
                updater.hold(grad_sum)
                updater.clip_own(grad_sum, count)
                updater.step(weights, grad_sum, index, grad_scale=1.0 / count)
            t2 = time.perf_counter()
            rows, since = rows + count, since + 1
            epoch_ends = plan.ends_epoch(index)
            phases = [0.0, t1 - t0, 0.0, 0.0, t2 - t1, 0.0]
            checkpoint_due = checkpoint_due or keeper.due(index)
            synced_now = since == self.every or epoch_ends
            if synced_now:
                phases[2], phases[3], phases[5], phases[0] = self.sync(p, weights, synced, rows)
                rows = since = 0
            recorder.report_step(self.keep(index, loss_sum, count, phases))
            if (
                epoch_ends
                and plan[index][0] < plan.last_epoch
                and evaluator.epoch_done(plan[index][0], weights)
            ):
                return  # early stopping
            if synced_now and checkpoint_due:
                keeper.write(index + 1)
                checkpoint_due = False
        evaluator.epoch_done(plan.last_epoch, weights, last=True)
