"""One partition's fit: the loop the settings call for.

- plain BSP, ``sync_every=1`` (``_bsp``): fetch the weights, compute the loss and gradient
  of the share, put the gradient, aggregate the own slice, clip, let the optimizer update
  the own slice (its state lives here: 1/N of it), publish the slice;
- BSP with backup workers (``_with_backups``), SSP, ASP (``_asynchronous``): fetch the
  weights the strategy allows, compute, put; a background owner
  (``AllReduceParameter.serve_updates``) updates the own slice;
- ``sync_every=k`` or ``"epoch"`` (``_local_sgd``): each partition steps a copy of its own
  for k steps, then the partitions average their models (or sum their updates).

Every update goes with the fit's regularisation on the part it updates
(``OwnedRegularisation``: MLlib's regParam, elasticNetParam and fitIntercept).
"""

from __future__ import annotations

import time

import numpy as np

from allreduce_param.optim import clip_scale, squared_norm
from allreduce_param.train.records import STEP_FIELDS
from allreduce_param.train.regularisation import OwnedRegularisation, feature_std
from allreduce_param.train.task.epochs import Epochs
from allreduce_param.train.task.resume import Checkpoints
from allreduce_param.train.task.steps import Steps


class PartitionFit(Steps, Epochs, Checkpoints):
    """One partition's fit: its steps (``Steps``), epochs (``Epochs``) and checkpoints
    (``Checkpoints``), run in the loop its settings call for."""

    def run(self) -> None:
        """Train every step of the plan from where the fit starts; the records are kept."""
        job, p = self.job, self.p
        self._plan()
        self.regularisation = OwnedRegularisation(
            self.settings.regularization,
            self.settings.fit_intercept,
            job.model,
            p.layout.size,
            slice(0, p.layout.size) if job.local_sgd else p.layout.bounds(p.partition_id),
            feature_std(p, moments=self.train.moments())
            if self.settings.regularization.standardizes
            else None,
            clips_whole=self._clips_own,
        )
        self.start = self._begin()
        if job.local_sgd:
            self._local_sgd()
        elif p.strategy.inline_owner:
            self._bsp()
        elif p.strategy.backup_workers:
            self._with_backups()
        else:
            self._asynchronous()
        self.where.update(epoch=None, step=None)

    # ---- the loops -----------------------------------------------------------------------

    def _bsp(self) -> None:
        job, p = self.job, self.p
        state, regularisation = self.state, self.regularisation
        for index in range(self.start, len(self.plan)):
            read_s = self._read(index)
            if self._epochs_before(index):
                break
            record = self._compute_and_put(index, read_s)
            t0 = time.perf_counter()
            gradient = p.aggregate_gradient_partition()
            t1 = time.perf_counter()
            regularisation.hold(gradient)
            scale = 1.0
            if job.optimizer.clip_norm is not None:  # by the global norm: one scalar allreduce
                squared = p.allreduce_exact([squared_norm(gradient)])[0]
                scale = clip_scale(float(squared), job.optimizer.clip_norm)
            job.optimizer.step(
                p.weight_partition,
                gradient,
                state,
                self.steps_before + index,
                grad_scale=scale,
                **regularisation.step_arguments,
            )
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
        optimizer, state, regularisation = self.job.optimizer, self.state, self.regularisation
        before = self.steps_before  # the earlier fits' steps: the optimizer counts on

        def steps_done(done: int) -> None:
            if self._checkpoint_due(done - 1):
                self._checkpoint(done)

        def update(gradient: np.ndarray, weights: np.ndarray, step: int) -> None:
            regularisation.hold(gradient)
            optimizer.step(weights, gradient, state, before + step, **regularisation.step_arguments)

        self.p.serve_updates(update, len(self.plan), steps_done)

    def _asynchronous(self) -> None:
        """SSP, ASP: read what the strategy allows, compute, put; the owner does the rest."""
        p = self.p
        self._serve()
        for index in range(self.start, len(self.plan)):
            read_s = self._read(index)
            self._epochs_before(index)
            staleness = index - p.strategy.clock(p.last_read_version)
            self._report_step(self._compute_and_put(index, read_s, staleness=staleness))
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
            self._report_step(self._compute_and_put(version, read_s))
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
        every = (
            len(self.plan) if self.settings.sync_every == "epoch" else int(self.settings.sync_every)
        )
        rows = since = 0
        checkpoint_due = False  # a checkpoint waits for the next sync, where every copy is the same
        for index in range(self.start, len(self.plan)):
            batch = self._batch(index)
            t0 = time.perf_counter()
            loss_sum, grad_sum, count = self.compute(self.weights, *batch)
            t1 = time.perf_counter()
            if count:
                self.regularisation.hold(grad_sum)
                self._clip_own(grad_sum, count)
                job.optimizer.step(
                    self.weights,
                    grad_sum,
                    state,
                    self.steps_before + index,
                    grad_scale=1.0 / count,
                    **self.regularisation.step_arguments,
                )
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
                and self.plan[index][0] < self.last_epoch
                and self._epoch_done(self.plan[index][0])
            ):
                return  # early stopping
            if synced_now and checkpoint_due:
                self._checkpoint(index + 1)
                checkpoint_due = False
        self._epoch_done(self.last_epoch, last=True)

    def _sync(self, synced: np.ndarray, rows: int) -> tuple[float, float, float, float]:
        """Local SGD's sync; the put, aggregate, send and get times."""
        p = self.p
        t0 = time.perf_counter()
        if self.settings.averages_models:
            p.put_gradients(self.weights * np.float32(rows), count=rows)
        else:
            p.put_gradients(self.weights - synced, count=1)
        t1 = time.perf_counter()
        if self.settings.averages_models:
            p.weight_partition[:] = p.aggregate_gradient_partition()
        else:
            p.weight_partition[:] += p.aggregate_gradient_partition(avg=1)
        t2 = time.perf_counter()
        p.send_weight_partition()
        t3 = time.perf_counter()
        p.get_weights(out=self.weights)
        synced[:] = self.weights
        return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3

    def state_slice(self) -> dict[str, np.ndarray]:
        """This partition's slice of the optimizer's state, as the fit left it (with local
        SGD, the slice of its own whole state), for the ``TrainedModel`` to keep."""
        if not self.job.local_sgd:
            return {name: value.copy() for name, value in self.state.items()}
        bounds = self.p.layout.bounds(self.p.partition_id)
        return {name: value[bounds].copy() for name, value in self.state.items()}

    def reached(self) -> tuple[int, int]:
        """How far training has come, earlier fits included: (global steps, epochs). Where
        early stopping ended the fit, the steps and epochs up to the one it stopped after."""
        if self.stopped:
            steps = sum(1 for epoch, _ in self.plan if epoch < self._next_epoch)
            return self.steps_before + steps, self._next_epoch
        return self.steps_before + len(self.plan), self.last_epoch + 1

    def _finish(self) -> None:
        """The final weights, on every partition, and the last epoch's metrics with them
        (where early stopping ended the fit, it has done both)."""
        if not self.p.strategy.inline_owner:
            self.p.finish_updates()
        if self.stopped:
            return
        self.p.get_weights(out=self.weights)
        if not self._epochs_before(len(self.plan)):
            self._epoch_done(self.last_epoch, last=True)
