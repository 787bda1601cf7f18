"""The update rules, PyTorch's element for element: SGD, Adam, AdamW, Adagrad, RMSprop."""

from __future__ import annotations

import math

import numpy as np

from allreduce_param.errors import ConfigurationError
from allreduce_param.optim.base import Optimizer
from allreduce_param.optim.kernels import add_weight_decay, descend, ema, momentum_update
from allreduce_param.optim.schedules import Schedule
from allreduce_param.optim.settings import flag_setting, real_setting


class SGD(Optimizer):
    """Stochastic gradient descent with optional (Nesterov) momentum; PyTorch semantics.

    With ``d = g + weight_decay * w`` and buffer ``b`` (zero at first, dampening 0)::

        b = momentum * b + d                         (if momentum > 0)
        d = d + momentum * b  if nesterov  else  b   (if momentum > 0)
        w = w - lr * d

    State: ``momentum_buffer`` when ``momentum > 0``, nothing otherwise.
    """

    _fields = ("lr", "momentum", "nesterov", "weight_decay", "schedule", "clip_norm")

    def __init__(
        self,
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        schedule: Schedule | None = None,
        clip_norm: float | None = None,
    ) -> None:
        super().__init__(lr, weight_decay, schedule, clip_norm)
        self.momentum = real_setting("SGD", "momentum", momentum, 0.0)
        self.nesterov = flag_setting("SGD", "nesterov", nesterov)
        if self.nesterov and self.momentum == 0.0:
            raise ConfigurationError("SGD: nesterov=True needs momentum > 0, got momentum=0.0")

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def _update(self, w, g, s, lr, t, tmp):
        d = add_weight_decay(w, g, self.weight_decay, tmp[0])
        if self.momentum:
            buf = s["momentum_buffer"]
            momentum_update(buf, d, self.momentum)
            if self.nesterov:
                np.multiply(buf, self.momentum, out=tmp[1])
                tmp[1] += d
                d = tmp[1]
            else:
                d = buf
        descend(w, d, lr, tmp[2])


class Adam(Optimizer):
    """Adam (Kingma and Ba) with L2 weight decay added to the gradient; PyTorch semantics.

    With ``d = g + weight_decay * w``, 1-based step ``t = step + 1`` and moments ``m``,
    ``v`` (zero at first)::

        m = beta1 * m + (1 - beta1) * d
        v = beta2 * v + (1 - beta2) * d * d
        v_max = max(v_max, v)                        (amsgrad; then v_max replaces v below)
        denom = sqrt(v) / sqrt(1 - beta2 ** t) + eps
        w = w - (lr / (1 - beta1 ** t)) * (m / denom)

    State: ``exp_avg``, ``exp_avg_sq`` and, with ``amsgrad``, ``max_exp_avg_sq``.
    """

    _fields = ("lr", "betas", "eps", "weight_decay", "amsgrad", "schedule", "clip_norm")
    _decoupled = False  # AdamW: decay the weights instead of adding to the gradient

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        schedule: Schedule | None = None,
        clip_norm: float | None = None,
    ) -> None:
        super().__init__(lr, weight_decay, schedule, clip_norm)
        owner = type(self).__name__
        try:
            beta1, beta2 = betas
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"{owner}: betas must be a pair (beta1, beta2), each in [0, 1), got {betas!r}"
            ) from None
        self.betas = (
            real_setting(owner, "betas[0]", beta1, 0.0, 1.0, high_open=True),
            real_setting(owner, "betas[1]", beta2, 0.0, 1.0, high_open=True),
        )
        self.eps = real_setting(owner, "eps", eps, 0.0, low_open=True)
        self.amsgrad = flag_setting(owner, "amsgrad", amsgrad)

    @property
    def state_names(self) -> tuple[str, ...]:
        names = ("exp_avg", "exp_avg_sq")
        return names + ("max_exp_avg_sq",) if self.amsgrad else names

    def _update(self, w, g, s, lr, t, tmp):
        beta1, beta2 = self.betas
        if self._decoupled:
            if self.weight_decay:
                w *= 1.0 - lr * self.weight_decay
            d = g
        else:
            d = add_weight_decay(w, g, self.weight_decay, tmp[0])
        m, v = s["exp_avg"], s["exp_avg_sq"]
        ema(m, d, beta1, tmp[1])
        np.multiply(d, d, out=tmp[1])
        ema(v, tmp[1], beta2, tmp[1])
        if self.amsgrad:
            np.maximum(s["max_exp_avg_sq"], v, out=s["max_exp_avg_sq"])
            v = s["max_exp_avg_sq"]
        denom = np.sqrt(v, out=tmp[1])
        denom /= math.sqrt(1.0 - beta2**t)
        denom += self.eps
        np.divide(m, denom, out=tmp[1])
        descend(w, tmp[1], lr / (1.0 - beta1**t), tmp[1])


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov and Hutter); PyTorch semantics.

    First ``w = w * (1 - lr * weight_decay)`` (``lr`` after the schedule), then the Adam
    update of ``Adam`` with the raw gradient ``d = g``. State as ``Adam``'s.
    """

    _decoupled = True

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        schedule: Schedule | None = None,
        clip_norm: float | None = None,
    ) -> None:
        super().__init__(lr, betas, eps, weight_decay, amsgrad, schedule, clip_norm)


class Adagrad(Optimizer):
    """Adagrad (Duchi et al.); PyTorch semantics without ``lr_decay`` (use a schedule).

    With ``d = g + weight_decay * w`` and accumulator ``a`` (``initial_accumulator_value``
    at first)::

        a = a + d * d
        w = w - lr * (d / (sqrt(a) + eps))

    State: ``sum`` (PyTorch's name for ``a``).
    """

    _fields = ("lr", "eps", "initial_accumulator_value", "weight_decay", "schedule", "clip_norm")

    def __init__(
        self,
        lr: float = 1e-2,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        weight_decay: float = 0.0,
        schedule: Schedule | None = None,
        clip_norm: float | None = None,
    ) -> None:
        super().__init__(lr, weight_decay, schedule, clip_norm)
        self.eps = real_setting("Adagrad", "eps", eps, 0.0, low_open=True)
        self.initial_accumulator_value = real_setting(
            "Adagrad", "initial_accumulator_value", initial_accumulator_value, 0.0
        )

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("sum",)

    def init_state(self, length: int) -> dict[str, np.ndarray]:
        """The accumulator ``sum``, filled with ``initial_accumulator_value``."""
        state = super().init_state(length)
        state["sum"].fill(self.initial_accumulator_value)
        return state

    def _update(self, w, g, s, lr, t, tmp):
        d = add_weight_decay(w, g, self.weight_decay, tmp[0])
        acc = s["sum"]
        np.multiply(d, d, out=tmp[1])
        acc += tmp[1]
        std = np.sqrt(acc, out=tmp[1])
        std += self.eps
        np.divide(d, std, out=tmp[1])
        descend(w, tmp[1], lr, tmp[1])


class RMSprop(Optimizer):
    """RMSprop (Hinton), optionally centred and with momentum; PyTorch semantics.

    With ``d = g + weight_decay * w``, ``v``, ``ga`` and buffer ``b`` zero at first::

        v = alpha * v + (1 - alpha) * d * d
        ga = alpha * ga + (1 - alpha) * d            (centered)
        avg = sqrt(max(v - ga * ga, 0)) + eps  if centered  else  sqrt(v) + eps
        b = momentum * b + d / avg;  w = w - lr * b  (momentum > 0)
        w = w - lr * (d / avg)                       (momentum == 0)

    (The ``max(., 0)`` guards against a rounding-negative variance, where PyTorch would
    produce NaN.) State: ``square_avg``, plus ``momentum_buffer`` (momentum > 0) and
    ``grad_avg`` (centered).
    """

    _fields = (
        "lr",
        "alpha",
        "eps",
        "momentum",
        "centered",
        "weight_decay",
        "schedule",
        "clip_norm",
    )

    def __init__(
        self,
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        momentum: float = 0.0,
        centered: bool = False,
        weight_decay: float = 0.0,
        schedule: Schedule | None = None,
        clip_norm: float | None = None,
    ) -> None:
        super().__init__(lr, weight_decay, schedule, clip_norm)
        self.alpha = real_setting("RMSprop", "alpha", alpha, 0.0, 1.0, high_open=True)
        self.eps = real_setting("RMSprop", "eps", eps, 0.0, low_open=True)
        self.momentum = real_setting("RMSprop", "momentum", momentum, 0.0)
        self.centered = flag_setting("RMSprop", "centered", centered)

    @property
    def state_names(self) -> tuple[str, ...]:
        names: tuple[str, ...] = ("square_avg",)
        if self.momentum:
            names += ("momentum_buffer",)
        if self.centered:
            names += ("grad_avg",)
        return names

    def _update(self, w, g, s, lr, t, tmp):
        d = add_weight_decay(w, g, self.weight_decay, tmp[0])
        v = s["square_avg"]
        np.multiply(d, d, out=tmp[1])
        ema(v, tmp[1], self.alpha, tmp[1])
        if self.centered:
            ga = s["grad_avg"]
            ema(ga, d, self.alpha, tmp[1])
            np.multiply(ga, ga, out=tmp[1])
            np.subtract(v, tmp[1], out=tmp[1])
            np.maximum(tmp[1], 0.0, out=tmp[1])
            avg = np.sqrt(tmp[1], out=tmp[1])
        else:
            avg = np.sqrt(v, out=tmp[1])
        avg += self.eps
        np.divide(d, avg, out=tmp[1])
        if self.momentum:
            buf = s["momentum_buffer"]
            momentum_update(buf, tmp[1], self.momentum)
            descend(w, buf, lr, tmp[1])
        else:
            descend(w, tmp[1], lr, tmp[1])
