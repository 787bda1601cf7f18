"""A fit's scalars as TensorBoard event files (the ``tensorboard_dir`` setting), live.

A watcher (``driver.watchers``) of the fit's merged steps and epochs, as the progress bar
hears them, written with tensorboardX's ``SummaryWriter``: a small, well-kept writer of
the event format that needs neither TensorFlow nor the ``tensorboard`` package (torch's
own writer needs the latter). The tags:

- ``train/loss``, ``train/samples_per_s``, ``train/learning_rate`` at each global step,
  0-based (``samples_per_s``: the step's rows over its slowest partition's time; the
  learning rate after the optimizer's schedule);
- ``epoch/loss`` (the epoch's mean training loss, as the history has it) and each of the
  epoch's metrics (``epoch/val_loss``, ``epoch/val_accuracy``, ``epoch/train_rmse``, ...)
  at each epoch;
- ``fit/samples_per_s`` and ``fit/seconds``, the whole fit's, at its last step.

The steps and epochs are numbered as the fit numbers them, on from the initial model's in
a continued fit (``fit(initial=...)``, a streaming fit's micro-batches), so the fits of one
folder draw one curve; each event file is flushed at each epoch's end and when the fit ends.
"""

from __future__ import annotations

import os
from typing import Any

from allreduce_param.errors import ConfigurationError


class TensorBoardWriter:
    """The watcher that writes one fit's scalars into ``folder`` (see the module)."""

    def __init__(self, writer: Any, optimizer: Any, steps_before: int = 0) -> None:
        self._writer = writer
        self._lr_at = getattr(optimizer, "lr_at", None)
        self._before = steps_before  # the initial model's steps: this fit's first is the next
        self._done = 0  # this fit's steps heard (or resumed after)
        self._epoch_loss = self._epoch_samples = 0.0

    @classmethod
    def open(cls, folder: str | os.PathLike, fit: Any) -> TensorBoardWriter:
        """A writer into ``folder`` (made if missing) for ``fit`` (a ``WatchedFit``)."""
        try:
            from tensorboardX import SummaryWriter
        except ImportError as error:
            raise ConfigurationError(
                f"tensorboard_dir={os.fspath(folder)!r} writes TensorBoard event files with "
                "tensorboardX, which is not installed here: pip install "
                "'allreduce-param[tensorboard]', or leave tensorboard_dir unset"
            ) from error
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as error:
            raise ConfigurationError(
                f"tensorboard_dir={os.fspath(folder)!r} cannot be made ({error}): give a "
                "folder this driver can write to"
            ) from error
        before = 0 if fit.initial is None else fit.initial.steps_done
        return cls(SummaryWriter(logdir=os.fspath(folder)), fit.optimizer, before)

    def __call__(self, kind: str, fields: dict) -> None:
        if kind == "start" and fields.get("done"):  # a run again of the stage, from a checkpoint
            self._done = fields["done"]
        elif kind == "step":
            self._step(fields)
        elif kind == "epoch":
            self._epoch(fields)

    def _step(self, step: dict) -> None:
        at, samples = self._before + self._done, step["samples"]
        self._done += 1
        self._writer.add_scalar("train/loss", step["loss"], at)
        seconds = sum(value for name, value in step.items() if name.endswith("_s"))
        if seconds > 0:
            self._writer.add_scalar("train/samples_per_s", samples / seconds, at)
        if callable(self._lr_at):
            self._writer.add_scalar("train/learning_rate", self._lr_at(at), at)
        if samples:
            self._epoch_loss += step["loss"] * samples
            self._epoch_samples += samples

    def _epoch(self, epoch: dict) -> None:
        at = epoch["epoch"]
        if self._epoch_samples:
            self._writer.add_scalar("epoch/loss", self._epoch_loss / self._epoch_samples, at)
        self._epoch_loss = self._epoch_samples = 0.0
        for name, value in epoch.items():
            if isinstance(value, float):
                self._writer.add_scalar(f"epoch/{name}", value, at)
        self._writer.flush()

    def finished(self, trained: Any, fit: Any) -> None:
        """The fit's end: its whole-fit figures (samples/s, seconds) at its last step."""
        history = trained.history
        at = self._before + max(len(history.steps), 1) - 1
        self._writer.add_scalar("fit/samples_per_s", history.samples_per_second, at)
        self._writer.add_scalar("fit/seconds", history.seconds, at)

    def failed(self, error: BaseException) -> None:
        """Nothing more to write: what the fit reached is in the files."""

    def close(self) -> None:
        self._writer.close()
