"""Where a fit starts: ``StartPoint``, the one record every way of starting becomes.

A fit starts from the model's initial weights (``StartPoint()``), from a checkpoint
(``fit(resume_from=...)``, or the newest intact one of its own when the stage runs again:
``of_checkpoint``), or from a ``TrainedModel`` (``fit(initial=...)``: ``of_model``). The
driver decides which and checks it against the model and the optimizer; each task reads
its part of it in ``task.resume`` through ``part``, the same call whatever the source:
its slice of the weights, its optimizer state (None: start the optimizer afresh), its
model's buffers, and its records of the fit so far (a checkpoint's, on as many workers).

Besides the values, a start point says how far training had come before this fit:
``steps_before`` (global steps of earlier fits: the optimizer's step count, which drives a
learning-rate schedule and Adam's bias correction) and ``epochs_before`` (the epochs of
earlier fits: this fit's epochs are numbered on from there, and each epoch's seeded
shuffle follows its number). So a fit of k epochs from a fit of k epochs' result, with its
optimizer state and the same data, is the same bits as one fit of 2k epochs under BSP.
``step``: how many of this fit's own global steps are done already (a checkpoint's step;
0 for a model or the start).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from allreduce_param.engine.layout import SliceLayout
from allreduce_param.models.base import has_buffers
from allreduce_param.train.checkpoint import Manifest, load_best, load_buffers, load_part


@dataclass(frozen=True)
class StartPart:
    """What one partition starts with: ``weights`` (its slice, or the whole vector, which
    ``ConnectedParameter.init`` cuts), ``state`` (its optimizer state; None: afresh),
    ``buffers`` (None: the model's own), ``records`` (a checkpoint's records of the fit so
    far: ``steps``, ``epochs``, ``updates``, ``resumed``; empty otherwise), and from a
    checkpoint of a fit that stops early, ``best`` (its best weights so far)."""

    weights: np.ndarray
    state: dict[str, np.ndarray] | None = None
    buffers: dict[str, np.ndarray] | None = None
    records: dict = field(default_factory=dict)
    best: np.ndarray | None = None


@dataclass(frozen=True)
class StartPoint:
    """Where a fit starts (see the module's docstring). Made on the driver, shipped to the
    tasks in the ``TrainingJob``; exactly one of ``checkpoint`` and ``weights`` or neither
    (the model's initial weights)."""

    steps_before: int = 0
    epochs_before: int = 0
    checkpoint: Manifest | None = None
    weights: np.ndarray | None = None
    state: Mapping[str, np.ndarray] | None = None
    buffers: Mapping[str, np.ndarray] | None = None

    @classmethod
    def of_checkpoint(cls, manifest: Manifest) -> StartPoint:
        """Resume from a checkpoint: its fit's own start (steps and epochs before it) comes
        along, so a continued fit's checkpoint resumes as that fit."""
        return cls(manifest.steps_before, manifest.epochs_before, checkpoint=manifest)

    @classmethod
    def of_model(cls, trained: Any, with_state: bool) -> StartPoint:
        """Continue from a ``TrainedModel``: its weights and buffers, where its training
        stopped, and where ``with_state`` its optimizer state (checked on the driver to be
        there)."""
        return cls(
            int(trained.steps_done),
            int(trained.epochs_done),
            weights=np.asarray(trained.weights, np.float32),
            state=dict(trained.optimizer_state) if with_state else None,
            buffers=dict(trained.buffers) or None,
        )

    @property
    def step(self) -> int:
        """How many of this fit's own global steps are done already."""
        return 0 if self.checkpoint is None else self.checkpoint.step

    @property
    def fresh(self) -> bool:
        """Whether the fit starts from the model's initial weights."""
        return self.checkpoint is None and self.weights is None

    def describe(self) -> str:
        """Where this starts, for a message: ``<folder> (step 8)``, ``the initial model``..."""
        if self.checkpoint is not None:
            return f"{self.checkpoint.folder} (step {self.checkpoint.step})"
        if self.weights is not None:
            return f"the initial model (after {self.steps_before} steps)"
        return "step 0"

    def part(
        self, model: Any, seed: int, partition: int, layout: SliceLayout, local: bool
    ) -> StartPart:
        """Partition ``partition``'s part of this start, on ``layout``; ``local``: the fit
        trains a whole copy per partition (local SGD), whose optimizer state is the whole
        model's. Every checkpoint part read is checked again (``checkpoint.load_part``)."""
        if self.checkpoint is not None:
            return self._checkpoint_part(partition, layout, local, has_buffers(model))
        if self.weights is None:
            return StartPart(model.init(np.random.default_rng(seed)))
        state = None
        if self.state is not None:
            cut = slice(None) if local else layout.bounds(partition)
            state = {name: np.array(value[cut], np.float32) for name, value in self.state.items()}
        buffers = (
            None if self.buffers is None else {k: np.array(v) for k, v in self.buffers.items()}
        )
        return StartPart(self.weights.copy(), state, buffers)

    def _checkpoint_part(
        self, partition: int, layout: SliceLayout, local: bool, buffered: bool
    ) -> StartPart:
        manifest = self.checkpoint
        arrays, records = load_part(manifest, partition, layout)
        names = manifest.state_names
        if not local:
            state = {name: arrays[f"state/{name}"] for name in names}
        elif all(f"local/{name}" in arrays for name in names):
            state = {name: arrays[f"local/{name}"] for name in names}
        else:  # no whole state of this partition's own there (not local SGD, or other workers)
            state = None
        buffers = load_buffers(manifest, partition, layout.partition_num) if buffered else None
        best = load_best(manifest) if manifest.early_stopping is not None else None
        return StartPart(arrays["weights"], state, buffers, records, best)
