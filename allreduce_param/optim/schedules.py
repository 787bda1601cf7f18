"""Learning-rate schedules: a factor of the base learning rate as a pure function of the step,
so every partition computes the same rate without talking."""

from __future__ import annotations

import math

from allreduce_param.errors import ConfigurationError
from allreduce_param.optim.settings import Config, check_step, integer_setting, real_setting


class Schedule(Config):
    """A learning-rate schedule: ``factor(step)`` multiplies the optimizer's base lr.

    A pure function of the 0-based step, so every partition computes the same value.
    """

    def factor(self, step: int) -> float:
        """The factor for 0-based ``step``."""
        raise NotImplementedError


class StepLR(Schedule):
    """Multiply by ``gamma`` every ``step_size`` steps: ``gamma ** (step // step_size)``.

    PyTorch's ``StepLR`` in closed form: ``StepLR(10, 0.5)`` gives 1 for steps 0..9, 0.5 for
    10..19, 0.25 from 20.
    """

    _fields = ("step_size", "gamma")

    def __init__(self, step_size: int, gamma: float = 0.1) -> None:
        self.step_size = integer_setting("StepLR", "step_size", step_size, 1)
        self.gamma = real_setting("StepLR", "gamma", gamma, 0.0, low_open=True)

    def factor(self, step: int) -> float:
        return self.gamma ** (check_step(step) // self.step_size)


class CosineLR(Schedule):
    """Cosine annealing from 1 down to ``min_factor`` over ``total_steps``, then flat.

    ``min_factor + (1 - min_factor) * (1 + cos(pi * min(step, total_steps) / total_steps)) / 2``:
    1 at step 0, ``(1 + min_factor) / 2`` half-way, ``min_factor`` at ``step == total_steps``
    and after (PyTorch's ``CosineAnnealingLR`` with ``T_max=total_steps`` and
    ``eta_min = min_factor * lr``, without its restarts).
    """

    _fields = ("total_steps", "min_factor")

    def __init__(self, total_steps: int, min_factor: float = 0.0) -> None:
        self.total_steps = integer_setting("CosineLR", "total_steps", total_steps, 1)
        self.min_factor = real_setting("CosineLR", "min_factor", min_factor, 0.0, 1.0)

    def factor(self, step: int) -> float:
        progress = min(check_step(step), self.total_steps) / self.total_steps
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_factor + (1.0 - self.min_factor) * cosine


class LinearWarmup(Schedule):
    """Ramp linearly to 1 over ``warmup_steps``, then follow ``after`` (or stay at 1).

    Step ``s < warmup_steps`` gets ``(s + 1) / warmup_steps`` (from ``1 / warmup_steps`` at
    step 0 to 1 at step ``warmup_steps - 1``); step ``s >= warmup_steps`` gets
    ``after.factor(s - warmup_steps)``: ``after`` counts its steps from the end of warm-up.
    """

    _fields = ("warmup_steps", "after")

    def __init__(self, warmup_steps: int, after: Schedule | None = None) -> None:
        self.warmup_steps = integer_setting("LinearWarmup", "warmup_steps", warmup_steps, 1)
        if after is not None and not isinstance(after, Schedule):
            raise ConfigurationError(
                f"LinearWarmup: after must be a Schedule or None, got {after!r}"
            )
        self.after = after

    def factor(self, step: int) -> float:
        step = check_step(step)
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return 1.0 if self.after is None else self.after.factor(step - self.warmup_steps)
