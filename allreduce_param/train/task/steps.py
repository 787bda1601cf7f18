"""A partition's steps: the plan of global steps, its rows of each, and one step's compute
and put, with the record of its times."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from allreduce_param.engine.parameter import ConnectedParameter
from allreduce_param.engine.vectors import EncodedGradient
from allreduce_param.models.base import batch_count, dense_for
from allreduce_param.optim import clip_scale, squared_norm
from allreduce_param.train.records import STEP_FIELDS, StepDone
from allreduce_param.train.task.batching import (
    global_batch_sizes,
    share_bounds,
    steps_per_epoch,
)
from allreduce_param.train.task.state import FitState, Rows


def all_counts(p: ConnectedParameter, rows: int) -> list[int]:
    """Every partition's row count, learnt with one exact allreduce."""
    own = np.zeros(p.info.partition_num)
    own[p.info.partition_id] = rows
    return [int(count) for count in p.collectives.allreduce_exact(own)]


class Steps(FitState):
    """The plan of global steps, and what one step computes, puts and records."""

    # ---- the plan ------------------------------------------------------------------------

    def _plan(self) -> None:
        """Every global step as (epoch, step in the epoch); this partition's cuts of its rows."""
        p = self.p
        counts = all_counts(p, self.train.row_count)
        steps = steps_per_epoch(sum(counts), self.settings.batch_size)
        sizes = global_batch_sizes(counts, steps)
        self.cuts = share_bounds(
            self.train.row_count, p.info.partition_id, p.info.partition_num, steps
        )
        self.plan = [
            (epoch, step)
            for epoch in range(self.first_epoch, self.last_epoch + 1)
            for step in range(steps)
            if sizes[step]
        ]
        self._steps_per_epoch = int(np.count_nonzero(sizes))

    def _batch(self, index: int) -> Rows:
        """This partition's rows of global step ``index`` (shuffled anew each epoch). Dense
        rows in memory come in views of one room, filled again by the next step's call, as
        a row file's (``disk_rows.DiskRows``): every caller is done with a step's rows before
        it asks for the next step's (a model keeps no batch beyond its call)."""
        epoch, step = self._at(index)
        if epoch != self._order_epoch:
            self._order_epoch, self._order = (
                epoch,
                self.train.epoch_order(self.settings.seed, epoch, self.p.info.partition_id),
            )
        chosen = self._order[self.cuts[step] : self.cuts[step + 1]]
        if not isinstance(self.train, Rows) or self.train.sparse:
            return self.train.take(chosen)  # a row file reuses its own; CSR rows: fresh
        if self._batch_room is None:  # sized once, for this partition's largest share
            self._batch_room = self.train.room_for(int(np.diff(self.cuts).max()))
        return self.train.take(chosen, self._batch_room)

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
        self._report(StepDone(record.tolist(), self.p.info.partition_id))

    def _read(self, index: int) -> float:
        """Fetch the weights the strategy allows before global step ``index``; its seconds."""
        self._at(index)
        started = time.perf_counter()
        self.p.get_weights(out=self.weights)
        return time.perf_counter() - started

    def _compute_and_put(self, index: int, read_s: float, staleness: int = 0) -> np.ndarray:
        """This partition's share of step ``index``: compute it and put the gradient; the step's
        record, kept before the put (a checkpoint a background owner writes once the gradient
        is in then already holds it), its put time filled in after."""
        batch = self._batch(index)
        if self._encoder is not None:
            return self._compute_encoded(index, batch, read_s, staleness)
        if self._streams:
            return self._compute_streaming(index, batch, read_s)
        started = time.perf_counter()
        if self._touched:  # only the elements the rows touch: train/task/touched.py
            loss_sum, grad_sum, count = self.compute.touched(self.weights, *batch)
        elif self._into_buffer:  # no fresh model-sized vector a step (at 2^24 features, 128 MB)
            grad_sum = self.p.gradient_buffer()
            loss_sum, count = self.compute.into(
                self.weights, batch.X, batch.y, grad_sum, None, batch.weight
            )
        else:
            loss_sum, grad_sum, count = self.compute(self.weights, *batch)
        if self._clips_own:
            self.regularisation.hold_whole(grad_sum)  # the held ones' are not trained
            self._clip_own(grad_sum, count)
        computed = time.perf_counter()
        record = self._record(
            index, loss_sum, count, (read_s, computed - started, 0.0, 0.0, 0.0, 0.0), staleness
        )
        self.p.put_gradients(grad_sum, count=count, residual=self._residual)
        record[STEP_FIELDS.index("put_s")] = time.perf_counter() - computed
        return record

    def _compute_encoded(
        self, index: int, batch: Rows, read_s: float, staleness: int
    ) -> np.ndarray:
        """``_compute_and_put`` with the gradient encoded on the model's device
        (``TorchModel.loss_and_encoded_grad``): only the codec's bytes come to the host, and
        the engine writes the blocks around them (``put_gradients(EncodedGradient)``)."""
        if self._streams_encoded:
            return self._compute_encoded_streaming(index, batch, read_s)
        model = self.compute.model
        started = time.perf_counter()
        loss_sum, payload, count = model.loss_and_encoded_grad(
            self.weights, dense_for(model, batch.X), batch.y, self._encoder
        )
        computed = time.perf_counter()
        record = self._record(
            index, loss_sum, count, (read_s, computed - started, 0.0, 0.0, 0.0, 0.0), staleness
        )
        self.p.put_gradients(EncodedGradient(payload), count=count)
        record[STEP_FIELDS.index("put_s")] = time.perf_counter() - computed
        return record

    def _compute_encoded_streaming(self, index: int, batch: Rows, read_s: float) -> np.ndarray:
        """``_compute_encoded`` under plain BSP with overlap: each owner's parts are encoded on
        the device and leave as soon as backward has finished that owner's range
        (``stream_gradients(encoded=True)``); the put time is what was left to send once backward
        was done."""
        model = self.compute.model
        started = time.perf_counter()
        with self.p.stream_gradients(
            count=batch_count(batch.row_count, batch.weight), encoded=True
        ) as stream:
            loss_sum, _, count = model.loss_and_encoded_grad(
                self.weights, dense_for(model, batch.X), batch.y, self._encoder, stream.ready
            )
            computed = time.perf_counter()
        record = self._record(
            index, loss_sum, count, (read_s, computed - started, 0.0, 0.0, 0.0, 0.0)
        )
        record[STEP_FIELDS.index("put_s")] = time.perf_counter() - computed
        return record

    def _compute_streaming(self, index: int, batch: Rows, read_s: float) -> np.ndarray:
        """``_compute_and_put`` under plain BSP with overlap: each owner's chunk of the gradient
        leaves as soon as backward has finished it (``stream_gradients``); the put time is
        what was left to send once backward was done."""
        gradient = self.p.gradient_buffer()
        started = time.perf_counter()
        with self.p.stream_gradients(
            gradient, count=batch_count(batch.row_count, batch.weight), residual=self._residual
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

    @property
    def _clips_own(self) -> bool:
        """Whether each partition clips the whole gradient it puts by its own norm (a
        background owner's strategies with ``clip_norm``), where BSP clips the owners' sum."""
        return (
            not self.job.local_sgd
            and not self.p.info.strategy.inline_owner
            and self.job.optimizer.clip_norm is not None
        )

    def _clip_own(self, grad_sum: np.ndarray, count: int) -> None:
        """Clip a gradient by its own norm (where the global norm would need every partition)."""
        clip = self.job.optimizer.clip_norm
        if clip is not None and count:
            grad_sum *= np.float32(clip_scale(squared_norm(grad_sum) / float(count) ** 2, clip))
