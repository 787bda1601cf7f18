"""Early stopping: end a fit once the validation loss stops improving, and keep the best weights.

``EarlyStopping`` is what the user asks for (``FitSettings(early_stopping=...)``);
``EarlyStopper`` its state inside one partition. Every partition holds one of these and
feeds it the same number after each epoch: the validation loss over every partition's
rows, summed exactly (``allreduce_exact``), so all of them decide alike, at the same
epoch, without asking the driver. It runs where each epoch ends on one version of the
weights that every partition holds whole: plain BSP and local SGD (``check_strategy``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from allreduce_param.engine.strategy import Strategy
from allreduce_param.errors import ConfigurationError


def check_patience(patience: Any, min_delta: Any) -> None:
    """A ConfigurationError naming the setting, unless ``patience`` is None or a whole
    number >= 1 and ``min_delta`` a finite number >= 0."""
    if patience is not None and (
        isinstance(patience, bool) or not isinstance(patience, int) or patience < 1
    ):
        raise ConfigurationError(
            f"early_stopping_patience must be a whole number of epochs >= 1 (or None: "
            f"train every epoch), got {patience!r}"
        )
    if (
        isinstance(min_delta, bool)
        or not isinstance(min_delta, (int, float))
        or not min_delta >= 0
        or not math.isfinite(min_delta)
    ):
        raise ConfigurationError(
            f"early_stopping_min_delta must be a finite number >= 0, got {min_delta!r}"
        )


def check_strategy(early_stopping: EarlyStopping | None, strategy: Strategy) -> None:
    """Early stopping needs every partition to evaluate the same weights at each epoch's
    end: not under SSP, ASP or backup workers, where each reads a version of its own."""
    if early_stopping is not None and not strategy.inline_owner:
        raise ConfigurationError(
            f"early_stopping_patience goes with strategy='bsp' and no backup workers (sync_every=k or "
            f"'epoch' too), not with {strategy.as_settings}: there the partitions end an epoch on weights "
            "of different steps, so no one validation loss belongs to it"
        )


@dataclass(frozen=True)
class EarlyStopping:
    """Stop once the validation loss (on ``fit(validation=...)``) has not improved for
    ``patience`` epochs, and keep the best epoch's weights; an epoch improves when its loss
    is below the best so far by more than ``min_delta``. Checked when made, with the job
    files' names (``early_stopping_patience``, ``early_stopping_min_delta``) in the
    messages."""

    patience: int
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if self.patience is None:
            raise ConfigurationError(
                "early_stopping_patience must be a whole number of epochs >= 1; to train every "
                "epoch leave early stopping out (early_stopping=None)"
            )
        check_patience(self.patience, self.min_delta)
        object.__setattr__(self, "min_delta", float(self.min_delta))

    def tracker(self) -> EarlyStopper:
        """This partition's state of early stopping, none yet."""
        return EarlyStopper(self.patience, self.min_delta)


@dataclass
class EarlyStopper:
    """The state of early stopping inside one partition.

    ``patience``: how many epochs in a row without improvement end the fit; an epoch
    improves when its validation loss is below the best so far by more than ``min_delta``.
    ``best_weights`` is a copy of the whole vector of the best epoch (None until one).
    """

    patience: int
    min_delta: float = 0.0
    best_loss: float = math.inf
    best_epoch: int | None = None
    since_best: int = 0
    best_weights: np.ndarray | None = field(default=None, repr=False)

    def after_epoch(self, epoch: int, sums: Sequence[float], weights: np.ndarray) -> bool:
        """Take epoch ``epoch``'s validation ``[loss_sum, metric_sum, count]`` over every
        partition and the weights it was evaluated on; whether the fit stops here. A loss
        that is NaN (or has no rows) never improves."""
        loss_sum, _, count = sums
        loss = loss_sum / count if count else math.nan
        if loss < self.best_loss - self.min_delta:
            self.best_loss, self.best_epoch, self.since_best = float(loss), epoch, 0
            if self.best_weights is None:
                self.best_weights = np.array(weights, dtype=np.float32)
            else:
                np.copyto(self.best_weights, weights)
        else:
            self.since_best += 1
        return self.since_best >= self.patience

    def state(self) -> dict:
        """What a checkpoint's manifest keeps (the weights go in the parts, by slice)."""
        return {
            "best_loss": None if math.isinf(self.best_loss) else self.best_loss,
            "best_epoch": self.best_epoch,
            "since_best": self.since_best,
        }

    def restore(self, state: dict | None, best_weights: np.ndarray | None) -> None:
        """Continue from a checkpoint's ``state()`` and best weights (a checkpoint without
        them, written without early stopping, starts the count afresh)."""
        if not state or state.get("best_epoch") is None or best_weights is None:
            return
        self.best_loss, self.best_epoch = float(state["best_loss"]), int(state["best_epoch"])
        self.since_best = int(state["since_best"])
        self.best_weights = np.array(best_weights, dtype=np.float32)
