"""A partition's checkpoints: where its fit starts (the job's ``StartPoint``: a checkpoint
of its own fit, one to resume from, a trained model to continue, or the model's initial
weights), and the checkpoints it writes."""

from __future__ import annotations

import numpy as np

from allreduce_param.models.base import has_buffers
from allreduce_param.train.records import STEP_FIELDS, UPDATE_FIELDS, Started
from allreduce_param.train.task.state import FitState


class Checkpoints(FitState):
    """Starts the fit from where it is, writes its checkpoints, and keeps the records a
    checkpoint holds."""

    # ---- checkpoints -----------------------------------------------------------------------

    def _begin(self) -> int:
        """Initialise the weights, the optimizer state and the model's buffers from where
        the driver said the fit starts (``job.start``: the model's initial weights, a
        checkpoint, or a trained model; ``train.start``); the global step to start at.
        Every checkpoint part read is checked again (size, checksum, format): damage since
        the driver looked fails the task with the file named, and the next attempt passes
        over that checkpoint."""
        job, p = self.job, self.p
        local = job.local_sgd
        start = job.start
        part = start.part(job.model, self.settings.seed, p.info.partition_id, p.info.layout, local)
        if part.state is not None:  # an earlier fit's: the held coordinates' start afresh
            self.state = part.state
            self.regularisation.initial_state(self.state, job.optimizer.init_state(1))
        else:
            self.state = job.optimizer.init_state(
                p.info.layout.size if local else p.info.slice_length
            )
        if part.buffers is not None and has_buffers(job.model):
            job.model.set_buffers(part.buffers)
        records = part.records
        self.records = [np.asarray(row, dtype=np.float64) for row in records.get("steps", [])]
        self._next_epoch = self._evaluated_before(start.step)
        self.epochs = [
            share for share in records.get("epochs", []) if share["epoch"] < self._next_epoch
        ]
        self._earlier_updates = records.get("updates", [])
        self.resumed = records.get("resumed", []) + ([start.step] if start.step else [])
        manifest = start.checkpoint
        if self._early is not None and manifest is not None and manifest.early_stopping is not None:
            self._early.restore(manifest.early_stopping, part.best)
        self._report_start(start.step)  # before init: no peer can report a step before it
        own = p.info.layout.bounds(p.info.partition_id)
        p.init(self.regularisation.initial(part.weights, own), step=start.step)
        return start.step

    def _evaluated_before(self, start: int) -> int:
        """How many epochs a fit had evaluated when it checkpointed after ``start`` steps
        (the same on every partition, whatever records came along): with local SGD an epoch
        is evaluated at its last step, before the checkpoint there; otherwise at the next
        epoch's first step, after it."""
        if start == 0:
            return self.first_epoch
        if start >= len(self.plan):
            return self.last_epoch
        return self.plan[start][0] if self.job.local_sgd else self.plan[start - 1][0]

    def _report_start(self, start: int) -> None:
        resumed = list(self.plan[start]) if 0 < start < len(self.plan) else None
        self._report(
            Started(
                self.p.info.partition_id,
                self._steps_per_epoch,
                self.settings.epochs,
                start,
                resumed,
            )
        )

    def _checkpoint_due(self, index: int) -> bool:
        return self._writer is not None and self._writer.settings.due(index, self.plan)

    def _checkpoint(self, steps_done: int) -> None:
        """Write this partition's part of the checkpoint after ``steps_done`` global steps; on
        partition 0, once every part is written, the manifest. Runs on the thread that owns
        the optimizer state (a background owner's, under its strategies)."""
        job, p = self.job, self.p
        local = job.local_sgd
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
                    f"state/{name}": self.state[name][
                        p.info.layout.bounds(p.info.partition_id)
                    ].copy()
                    for name in self.state
                }
            )
        if has_buffers(job.model):  # its own (under SSP and ASP: as training left them just now)
            arrays.update({f"buffers/{name}": value for name, value in job.model.buffers().items()})
        early = self._early
        if early is not None and early.best_weights is not None:  # load_best joins the slices
            arrays["best/weights"] = early.best_weights[
                p.info.layout.bounds(p.info.partition_id)
            ].copy()
        end_epoch = self.plan[steps_done][0] if steps_done < len(self.plan) else self.last_epoch
        steps = [row.tolist() for row in self.records[:steps_done]]
        # a straggler's steps the others went on without
        for index in range(len(steps), steps_done):
            steps.append([*self.plan[index], 0.0, 0.0] + [0.0] * (len(STEP_FIELDS) - 4))
        records = {
            "steps": steps,
            "epochs": [share for share in self.epochs if share["epoch"] < end_epoch],
            "updates": self.updates_table(before=steps_done).tolist(),
            "resumed": self.resumed,
            "rows": self.train.row_count,
        }
        self._writer.write_part(
            steps_done, p.info.partition_id, p.info.partition_num, arrays, records
        )
        p.collectives.signal(steps_done)
        if p.info.partition_id == 0:
            p.collectives.wait_for_signals(steps_done)
            self._writer.write_manifest(
                steps_done,
                p.info.partition_num,
                p.info.layout.size,
                tuple(self.state),
                local,
                job.manifest_settings(),
                None if early is None else early.state(),
                (job.start.steps_before, job.start.epochs_before),
            )

    def updates_table(self, before: int | None = None) -> np.ndarray:
        """With backup workers: the own owner's updates (those of steps before ``before``), as
        rows of ``UPDATE_FIELDS`` then one 0/1 column per partition, earlier ones included."""
        p = self.p
        table = np.zeros((0, len(UPDATE_FIELDS) + p.info.partition_num), dtype=np.float64)
        if not p.info.strategy.backup_workers:
            return table
        updates = [
            update for update in p.background.updates if before is None or update.step < before
        ]
        table = np.zeros(
            (len(updates), len(UPDATE_FIELDS) + p.info.partition_num), dtype=np.float64
        )
        for row, update in zip(table, updates):
            row[: len(UPDATE_FIELDS)] = p.info.partition_id, update.step, update.count
            row[len(UPDATE_FIELDS) + np.asarray(update.sources, dtype=np.int64)] = 1
        earlier = np.asarray(self._earlier_updates, dtype=np.float64).reshape(-1, table.shape[1])
        return np.concatenate([earlier, table])
