"""How a step's gradient is computed and leaves the partition: chosen once per fit, from
its settings, its model and its handle (``choose_path``), so a step calls one method.

The paths:

- ``DensePut``: the gradient computed into a fresh vector (over threads where asked), put
  (``put_gradients``); where a background owner's strategy clips (``clip_norm``), each
  partition first clips it by its own norm;
- ``BufferPut``: computed into the parameter's own buffer (``gradient_buffer``: under BSP
  it is summed before the next step writes it), not into a fresh model-sized vector a step;
- ``StreamedPut``: BSP with overlap, each owner's chunk leaving as soon as backward has
  finished it (``stream_gradients``);
- ``TouchedPut``: sparse rows, only the elements the step touches put (``sparse_sync``,
  ``touched.py``);
- ``EncodedPut``, ``EncodedStreamedPut``: a lossy codec run where a torch model's
  gradient lies (``device_encoding.py``), only its bytes brought to the host, put after
  backward or streamed owner by owner as backward finishes each.

Local SGD steps its own copy and puts nothing a step; its fit is still checked here, so
what its settings ask for and it cannot do is refused alike.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from allreduce_param.engine.blocks.codec import get_codec
from allreduce_param.engine.parameter import ConnectedParameter
from allreduce_param.engine.vectors import EncodedGradient
from allreduce_param.models.base import batch_count, dense_for
from allreduce_param.train.task.compute import SubBatches
from allreduce_param.train.task.device_encoding import (
    check_device_encoding,
    device_encoding_refusal,
)
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.memory_rows import Rows
from allreduce_param.train.task.touched import uses_touched_sync

#: ``keep(loss_sum, count, compute_s)``: the step's record, kept (``StepRecorder.keep``)
Keep = Callable[[float, float, float], np.ndarray]
#: ``clip(gradient, count)``: a gradient clipped by its own norm, in place
OwnClip = Callable[[np.ndarray, float], None]


class GradientPath(ABC):
    """One way a step's gradient is computed and put, the same every step of a fit."""

    def __init__(self, p: ConnectedParameter, compute: SubBatches) -> None:
        self.p, self.compute = p, compute

    @abstractmethod
    def step(self, weights: np.ndarray, batch: Rows, keep: Keep) -> float:
        """Compute ``batch``'s loss and gradient at ``weights`` and put the gradient; the put's
        seconds. ``keep`` is called with the loss, the count and the compute seconds before
        the gradient leaves (a checkpoint a background owner writes once the gradient is in
        then already holds the step's record), or, streamed, once it has."""


class _PutAfter(GradientPath):
    """The gradient computed whole on the host, then put (clipped by its own norm first
    where ``clip`` is given), with error feedback where the codec is lossy (``residual``)."""

    def __init__(
        self,
        p: ConnectedParameter,
        compute: SubBatches,
        residual: np.ndarray | None = None,
        clip: OwnClip | None = None,
    ) -> None:
        super().__init__(p, compute)
        self.residual, self.clip = residual, clip

    @abstractmethod
    def _compute(self, weights: np.ndarray, batch: Rows) -> tuple[float, Any, float]:
        """``(loss_sum, gradient, count)``."""

    def step(self, weights: np.ndarray, batch: Rows, keep: Keep) -> float:
        started = time.perf_counter()
        loss_sum, grad_sum, count = self._compute(weights, batch)
        if self.clip is not None:
            self.clip(grad_sum, count)
        computed = time.perf_counter()
        keep(loss_sum, count, computed - started)
        self.p.put_gradients(grad_sum, count=count, residual=self.residual)
        return time.perf_counter() - computed


class DensePut(_PutAfter):
    """A fresh gradient vector each step, summed over the batch's sub-batches (``threads``)."""

    def _compute(self, weights: np.ndarray, batch: Rows) -> tuple[float, Any, float]:
        return self.compute(weights, *batch)


class BufferPut(_PutAfter):
    """The gradient computed into the parameter's own buffer (no fresh model-sized vector a
    step: at 2^24 features, 128 MB)."""

    def _compute(self, weights: np.ndarray, batch: Rows) -> tuple[float, Any, float]:
        grad_sum = self.p.gradient_buffer()
        loss_sum, count = self.compute.into(weights, batch.X, batch.y, grad_sum, None, batch.weight)
        return loss_sum, grad_sum, count


class TouchedPut(_PutAfter):
    """Only the elements the rows touch (a ``SparseGradient``: ``touched.py``)."""

    def _compute(self, weights: np.ndarray, batch: Rows) -> tuple[float, Any, float]:
        return self.compute.touched(weights, *batch)


class StreamedPut(GradientPath):
    """Each owner's chunk of the gradient leaves as soon as backward has finished it
    (``stream_gradients``); the put time is what was left to send once backward was done."""

    def __init__(
        self, p: ConnectedParameter, compute: SubBatches, residual: np.ndarray | None = None
    ) -> None:
        super().__init__(p, compute)
        self.residual = residual

    def step(self, weights: np.ndarray, batch: Rows, keep: Keep) -> float:
        gradient = self.p.gradient_buffer()
        started = time.perf_counter()
        with self.p.stream_gradients(
            gradient, count=batch_count(batch.row_count, batch.weight), residual=self.residual
        ) as stream:
            loss_sum, count = self.compute.into(
                weights, batch.X, batch.y, gradient, stream.ready, batch.weight
            )
            computed = time.perf_counter()
        keep(loss_sum, count, computed - started)
        return time.perf_counter() - computed


class EncodedPut(GradientPath):
    """The gradient encoded on the model's device (``TorchModel.loss_and_encoded_grad``):
    only the codec's bytes come to the host, and the engine writes the blocks around them
    (``put_gradients(EncodedGradient(...))``)."""

    def __init__(self, p: ConnectedParameter, compute: SubBatches, encoder: Any) -> None:
        super().__init__(p, compute)
        self.encoder = encoder

    def step(self, weights: np.ndarray, batch: Rows, keep: Keep) -> float:
        model = self.compute.model
        started = time.perf_counter()
        loss_sum, payload, count = model.loss_and_encoded_grad(
            weights, dense_for(model, batch.X), batch.y, self.encoder
        )
        computed = time.perf_counter()
        keep(loss_sum, count, computed - started)
        self.p.put_gradients(EncodedGradient(payload), count=count)
        return time.perf_counter() - computed


class EncodedStreamedPut(EncodedPut):
    """``EncodedPut`` under plain BSP with overlap: each owner's parts are encoded on the
    device and leave as soon as backward has finished that owner's range
    (``stream_gradients(encoded=True)``)."""

    def step(self, weights: np.ndarray, batch: Rows, keep: Keep) -> float:
        model = self.compute.model
        started = time.perf_counter()
        with self.p.stream_gradients(
            count=batch_count(batch.row_count, batch.weight), encoded=True
        ) as stream:
            loss_sum, _, count = model.loss_and_encoded_grad(
                weights, dense_for(model, batch.X), batch.y, self.encoder, stream.ready
            )
            computed = time.perf_counter()
        keep(loss_sum, count, computed - started)
        return time.perf_counter() - computed


def choose_path(
    job: TrainingJob, p: ConnectedParameter, compute: SubBatches, clip: OwnClip | None = None
) -> GradientPath:
    """The path every step of this fit takes, from its settings, model and handle; refuses
    (``ConfigurationError``) ``sparse_sync='touched'`` and ``encode_on_device=True`` where
    the fit cannot serve them, local SGD's included. ``clip``: how a partition clips the
    gradient it puts by its own norm, where it does (``clips_own``)."""
    lossy = get_codec(job.param.gradient_codec).lossy
    # error feedback: what a lossy codec rounded off this partition's gradients, sent next time
    residual = np.zeros(job.param.size, dtype=np.float32) if lossy else None
    # the gradient into the parameter's own buffer where it can (BSP: summed before the
    # next step writes it); overlap streams it from there: "auto" where there is wire time
    # to hide, or backward runs on a GPU, off the cores
    into_buffer = p.info.strategy.inline_owner and not job.local_sgd and compute.streams
    overlap = job.settings.overlap
    wanted = (
        p.info.remote_peers > 0 or bool(getattr(job.model, "uses_gpu", False))
        if overlap == "auto"
        else overlap
    )
    touched = uses_touched_sync(job, p)
    encoder = device_encoder(job, p, compute, touched)
    if encoder is not None:
        if wanted and into_buffer:
            return EncodedStreamedPut(p, compute, encoder)
        return EncodedPut(p, compute, encoder)
    if touched:
        return TouchedPut(p, compute, residual)  # plain BSP only: the owners clip
    if into_buffer:
        return StreamedPut(p, compute, residual) if wanted else BufferPut(p, compute, residual)
    return DensePut(p, compute, residual, clip)


def clips_own(job: TrainingJob, p: ConnectedParameter) -> bool:
    """Whether each partition clips the whole gradient it puts by its own norm (a
    background owner's strategies with ``clip_norm``), where BSP clips the owners' sum."""
    return (
        not job.local_sgd
        and not p.info.strategy.inline_owner
        and getattr(job.optimizer, "clip_norm", None) is not None
    )


def device_encoder(
    job: TrainingJob, p: ConnectedParameter, compute: SubBatches, touched: bool
) -> Any:
    """The model's encoder of this partition's gradient puts on its device
    (``TorchModel.device_encoder``), where the model asks for one and this fit can use it
    (``device_encoding.device_encoding_refusal``); None otherwise."""
    make = getattr(compute.model, "device_encoder", None)
    if make is None or getattr(compute.model, "encode_on_device", False) is False:
        return None
    refusal = device_encoding_refusal(
        job.settings,
        p.info.gradient_put_plan.codec,
        p.info.strategy.inline_owner,
        getattr(job.optimizer, "clip_norm", None),
    )
    if refusal is None and (touched or not compute.streams):
        refusal = "its steps do not compute one dense gradient on one thread"
    check_device_encoding(compute.model, refusal)
    return None if refusal is not None else make(p.info.gradient_put_plan)
