"""What a partition updates with the optimizer, and the optimizer's state of it: its own
slice (BSP inline, or a background owner's thread), or with local SGD its whole copy of
the model. Every update goes with the fit's regularisation on that part
(``OwnedRegularisation``: MLlib's regParam, elasticNetParam and fitIntercept), and the
optimizer counts its steps on from the earlier fits' (schedules, bias correction)."""

from __future__ import annotations

from typing import Any

import numpy as np

from allreduce_param.optim import clip_scale, squared_norm
from allreduce_param.train.regularisation import OwnedRegularisation


class Updater:
    """The optimizer over one part of the vector, with its ``state`` (1/N of it under the
    sharded strategies, a whole model's with local SGD), started by ``start``."""

    def __init__(
        self, optimizer: Any, regularisation: OwnedRegularisation, steps_before: int
    ) -> None:
        self.optimizer, self.regularisation = optimizer, regularisation
        self.steps_before = steps_before  # the earlier fits' global steps
        self.state: dict[str, np.ndarray] = {}

    @property
    def clip_norm(self) -> float | None:
        return self.optimizer.clip_norm

    def start(self, state: dict[str, np.ndarray] | None, length: int) -> None:
        """Start from an earlier fit's ``state`` of this part (the held coordinates' values
        start afresh), or, None, from a fresh one of ``length`` elements."""
        if state is not None:
            self.state = state
            self.regularisation.initial_state(self.state, self.optimizer.init_state(1))
        else:
            self.state = self.optimizer.init_state(length)

    def hold(self, gradient: np.ndarray) -> None:
        """Zero the gradient of the coordinates the regularisation holds at 0, in place."""
        self.regularisation.hold(gradient)

    def step(
        self, weights: np.ndarray, gradient: np.ndarray, index: int, grad_scale: float = 1.0
    ) -> None:
        """Update ``weights`` in place from ``gradient`` (times ``grad_scale``): the fit's
        global step ``index``."""
        self.optimizer.step(
            weights,
            gradient,
            self.state,
            self.steps_before + index,
            grad_scale=grad_scale,
            **self.regularisation.step_arguments,
        )

    def global_clip_scale(self, squared: float) -> float:
        """The scale that clips a gradient whose global squared norm is ``squared``."""
        return clip_scale(squared, self.optimizer.clip_norm)

    def clip_own(self, gradient: np.ndarray, count: float) -> None:
        """Clip a gradient summed over ``count`` rows by its own norm, in place (where the
        global norm would need every partition); nothing without ``clip_norm``."""
        clip = self.optimizer.clip_norm
        if clip is not None and count:
            gradient *= np.float32(clip_scale(squared_norm(gradient) / float(count) ** 2, clip))

    def clip_whole_own(self, gradient: np.ndarray, count: float) -> None:
        """``clip_own`` of a whole gradient a partition puts (a background owner's
        strategies), its held coordinates zeroed first (``hold_whole``), as BSP's clip of
        the owners' held slices leaves them out."""
        self.regularisation.hold_whole(gradient)
        self.clip_own(gradient, count)

    def state_slice(self, bounds: slice | None = None) -> dict[str, np.ndarray]:
        """A copy of the state (of its ``bounds`` alone, where it is a whole model's)."""
        if bounds is None:
            return {name: value.copy() for name, value in self.state.items()}
        return {name: value[bounds].copy() for name, value in self.state.items()}
