"""What one partition's fit holds while it runs: its rows, its handle on the parameter, the
optimizer's state, its records so far. The fit's concepts (``steps``, ``epochs``,
``resume``, ``fit``) each add their methods to this one state."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from allreduce_param.engine.blocks.codec import get_codec
from allreduce_param.engine.parameter import ConnectedParameter
from allreduce_param.models.base import is_sparse_matrix
from allreduce_param.train.checkpoint import CheckpointWriter
from allreduce_param.train.regularisation import local_moments
from allreduce_param.train.task.batching import epoch_order
from allreduce_param.train.task.compute import SubBatches
from allreduce_param.train.task.device_encoding import (
    check_device_encoding,
    device_encoding_refusal,
)
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.reporter import ProgressReporter
from allreduce_param.train.task.touched import uses_touched_sync


class Rows(NamedTuple):
    """A partition's rows of one split: features (a float32 matrix, dense or CSR), labels,
    sample weights (or None)."""

    X: np.ndarray
    y: np.ndarray
    weight: np.ndarray | None

    @property
    def row_count(self) -> int:
        """How many rows (``X`` may be a sparse matrix, whose ``len`` is ambiguous)."""
        return self.X.shape[0]

    @property
    def n_features(self) -> int:
        return self.X.shape[1]

    @property
    def sparse(self) -> bool:
        """Whether ``X`` is a CSR matrix."""
        return is_sparse_matrix(self.X)

    def take(self, index: np.ndarray, room: Rows | None = None) -> Rows:
        """The rows at ``index``, in that order: in fresh arrays, or, dense rows given a
        ``room`` (``room_for``) of at least ``len(index)`` rows, in views of its arrays, which
        the next such call fills again (a fit's step uses its rows before it asks for the
        next: no fresh pages, faulted in and zeroed, each step)."""
        if room is None or self.sparse:
            return Rows(
                self.X[index], self.y[index], None if self.weight is None else self.weight[index]
            )
        count = len(index)
        X, y = room.X[:count], room.y[:count]
        # "clip": unbuffered (numpy buffers ``out`` under "raise"); an epoch order's indices
        # are in range
        np.take(self.X, index, axis=0, out=X, mode="clip")
        np.take(self.y, index, out=y, mode="clip")
        weight = None
        if self.weight is not None:
            weight = room.weight[:count]
            np.take(self.weight, index, out=weight, mode="clip")
        return Rows(X, y, weight)

    def room_for(self, count: int) -> Rows:
        """Arrays for ``count`` of these rows, of their dtypes (``take``'s ``room``)."""
        return Rows(
            np.empty((count, *self.X.shape[1:]), self.X.dtype),
            np.empty(count, self.y.dtype),
            None if self.weight is None else np.empty(count, self.weight.dtype),
        )

    def rows_between(self, start: int, stop: int) -> Rows:
        """Rows ``start:stop``, in order (views where numpy makes them)."""
        weight = None if self.weight is None else self.weight[start:stop]
        return Rows(self.X[start:stop], self.y[start:stop], weight)

    def epoch_order(self, seed: int, epoch: int, partition_id: int) -> np.ndarray:
        """The order the rows train in during ``epoch`` (``batching.epoch_order``)."""
        return epoch_order(self.row_count, seed, epoch, partition_id)

    def moments(self) -> tuple[np.ndarray, np.ndarray, float, float]:
        """The rows' ``regularisation.local_moments``."""
        return local_moments(self.X, self.weight)

    def release(self) -> None:
        """Nothing to let go of (rows in a file, ``disk_rows.DiskRows``, delete it)."""


class FitState:
    """One partition's fit, as data. ``where`` tracks the epoch and step for error messages;
    ``records``: its row of ``STEP_FIELDS`` for each step so far; ``epochs``: its share of
    each epoch's metrics so far; ``resumed``: the steps the fit resumed at.
    ``first_epoch``, ``last_epoch``: this fit's epochs, numbered on from the earlier fits'
    it continues (``job.start``); ``steps_before``: their global steps, which the
    optimizer's step count adds to this fit's (schedules, bias correction)."""

    def __init__(
        self,
        job: TrainingJob,
        p: ConnectedParameter,
        compute: SubBatches,
        train: Rows,
        validation: Rows,
        reporter: ProgressReporter | None = None,
    ) -> None:
        settings = job.settings
        self.job, self.settings, self.p, self.compute = job, settings, p, compute
        self.train, self.validation = train, validation
        self.where: dict[str, int | None] = {"epoch": None, "step": None}
        self.records: list[np.ndarray] = []
        self.epochs: list[dict] = []
        self.resumed: list[int] = []
        self._earlier_updates: list[
            list[float]
        ] = []  # backup workers: the owner's, before a resume
        self.weights = np.empty(job.param.size, dtype=np.float32)
        # error feedback: what a lossy codec rounded off this partition's gradients, sent next time
        lossy = get_codec(job.param.gradient_codec).lossy
        self._residual = np.zeros(job.param.size, dtype=np.float32) if lossy else None
        # the optimizer's: of the own slice, or with local SGD the whole model's
        self.state: dict[str, np.ndarray] = {}
        self._writer = CheckpointWriter(job.checkpoints) if job.checkpoints is not None else None
        self._report = reporter.report if reporter is not None else (lambda report: None)
        self._order_epoch, self._order = -1, np.empty(0, np.int64)
        # dense rows in memory: where each step's rows are gathered (``Steps._batch``)
        self._batch_room: Rows | None = None
        early = settings.early_stopping  # this partition's; every one decides alike
        self._early = None if early is None else early.tracker()
        self.stopped = False  # whether early stopping ended the fit before its last epoch
        self.first_epoch = job.start.epochs_before
        self.last_epoch = self.first_epoch + settings.epochs - 1
        self.steps_before = job.start.steps_before
        self._next_epoch = self.first_epoch  # the first epoch not yet evaluated
        self.plan: list[tuple[int, int]] = []  # every global step as (epoch, step in the epoch)
        self.cuts = np.zeros(1, np.int64)
        self._steps_per_epoch = 0
        self.start = 0
        # overlap: send the gradient as backward finishes it (BSP, where the checkpoints are
        # this thread's, so a step's record is kept before any other thread sees its gradient);
        # "auto": where there is wire time to hide, or backward runs on a GPU, off the cores
        wanted = (
            p.remote_peers > 0 or bool(getattr(job.model, "uses_gpu", False))
            if settings.overlap == "auto"
            else settings.overlap
        )
        into_buffer = p.strategy.inline_owner and not job.local_sgd and compute.streams
        self._streams = bool(wanted and into_buffer)
        # else, where it can: the gradient computed into the parameter's own buffer (BSP: it
        # is summed before the next step writes it), not into a fresh vector each step
        self._into_buffer = bool(into_buffer)
        # sparse rows: only the elements a step touches put, where they can be (touched.py)
        self._touched = uses_touched_sync(job, p)
        if self._touched:
            self._streams = self._into_buffer = False
        # a lossy gradient codec run where a torch model's gradient lies (models/device_codecs):
        # encoded there, its residual kept there; streamed owner by owner as backward
        # finishes each where the float32 gradient would have been, else put after backward
        self._encoder = self._device_encoder(job, p, compute)
        self._streams_encoded = self._encoder is not None and self._streams
        if self._encoder is not None:
            self._streams = self._into_buffer = False
            self._residual = None

    def _device_encoder(self, job: TrainingJob, p: ConnectedParameter, compute: SubBatches):
        """The model's encoder of this partition's gradient puts on its device
        (``TorchModel.device_encoder``), where the model asks for one and this fit can use
        it (``device_encoding.device_encoding_refusal``); None otherwise."""
        make = getattr(compute.model, "device_encoder", None)
        if make is None or getattr(compute.model, "encode_on_device", False) is False:
            return None
        refusal = device_encoding_refusal(
            job.settings,
            p.gradient_put_plan().codec,
            p.strategy.inline_owner,
            getattr(job.optimizer, "clip_norm", None),
        )
        if refusal is None and (self._touched or not compute.streams):
            refusal = "its steps do not compute one dense gradient on one thread"
        check_device_encoding(compute.model, refusal)
        return None if refusal is not None else make(p.gradient_put_plan())
