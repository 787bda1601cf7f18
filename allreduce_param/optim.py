"""Sharded optimizers, learning-rate schedules and gradient clipping for the trainer.

Each of the N partitions owns a contiguous slice of the flattened float32 parameter vector
and runs the optimizer on that slice only; the optimizer's state (momentum buffers, Adam's
moments...) lives beside the slice, so every partition holds 1/N of it. That works because
every optimizer here is a pure *elementwise* update of (weights, gradient, state): element
i of the result depends only on element i of the inputs and on scalars shared by all
partitions (the learning rate, the step, the clipping factor). Applying it slice by slice
therefore gives, bit for bit, what applying it to the whole vector gives: every element
sees the same float32 operations in the same order (numpy's add, multiply, divide, sqrt and
maximum are correctly rounded IEEE operations whether a SIMD or a scalar loop runs them).

The update rules are PyTorch's (``torch.optim``), element for element, with the same
state names; see each class. ``step`` is 0-based here; PyTorch's step count is ``step + 1``.

Cost. ``Optimizer.step`` runs every training step over millions of elements, so it walks the
slice in cache-sized pieces of ``_PIECE`` elements, with a few preallocated per-thread
temporaries of that size, and uses only ``out=`` and in-place numpy operations: it allocates
nothing proportional to the slice, and each piece stays in cache between the several passes
an update makes over it. All scalars are Python floats, so numpy (2.x, NEP 50) computes in
float32 throughout.

Schedules (``StepLR``, ``CosineLR``, ``LinearWarmup``) give a factor of the base learning
rate as a pure function of the step, so every partition computes the same learning rate
without talking. Clipping by the *global* norm needs one scalar allreduce: each partition
computes ``squared_norm`` of its gradient slice, the trainer sums them across partitions and
scales every slice by ``clip_scale(total, optimizer.clip_norm)`` (or passes that factor as
``step(..., grad_scale=...)``, which saves a pass over the gradient).

Optimizers and schedules are small picklable configurations made on the driver; they hold
no arrays. Settings are checked when they are made: a wrong one raises
``ConfigurationError`` (a ``ValueError``) naming the setting and its allowed range.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError

__all__ = [
    "Optimizer",
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "RMSprop",
    "Schedule",
    "StepLR",
    "CosineLR",
    "LinearWarmup",
    "clip_scale",
    "squared_norm",
]

_F32 = np.dtype(np.float32)

# Elements per piece that ``Optimizer.step`` updates at a time (as the codecs' pieces). An
# update makes several passes over each piece (weights, gradient, one to three state arrays,
# temporaries), which then come from cache. 256K pieces were the fastest tried: much smaller
# ones pay Python's overhead per piece, whole arrays miss the cache, and plain numpy
# expressions also allocate full-size temporaries. Scratch: 4 MiB per thread.
_PIECE = 1 << 18
_TEMPORARIES = 4  # per-thread scratch arrays: three for the updates, one for grad_scale
_scratch = threading.local()


def _workspace(length: int) -> list[np.ndarray]:
    """``_TEMPORARIES`` float32 scratch arrays of ``length`` elements, this thread's own.

    Per thread because partitions may run as threads of one process (and Spark reuses
    Python workers), and an update must never share its temporaries with another one.
    """
    arrays = getattr(_scratch, "arrays", None)
    if arrays is None or arrays[0].shape[0] < length:
        arrays = [np.empty(max(length, _PIECE), _F32) for _ in range(_TEMPORARIES)]
        _scratch.arrays = arrays
    return [a[:length] for a in arrays]


# --------------------------------------------------------------------------- validation


def _describe(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return "finite"


def _real(
    owner: str,
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a Python float; ``ConfigurationError`` unless finite and in range."""
    allowed = _describe(low, high, low_open, high_open)
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if ok:
        value = float(value)
        ok = (
            math.isfinite(value)
            and (low is None or (value > low if low_open else value >= low))
            and (high is None or (value < high if high_open else value <= high))
        )
    if not ok:
        raise ConfigurationError(
            f"{owner}: {name} must be a finite number {allowed}, got {value!r}"
        )
    return value


def _integer(owner: str, name: str, value: Any, low: int) -> int:
    """``value`` as a Python int; ``ConfigurationError`` unless an integer ``>= low``."""
    if (
        not isinstance(value, numbers.Integral)
        or isinstance(value, (bool, np.bool_))
        or int(value) < low
    ):
        raise ConfigurationError(f"{owner}: {name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _flag(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigurationError(f"{owner}: {name} must be True or False, got {value!r}")
    return bool(value)


def _check_step(step: Any) -> int:
    if not isinstance(step, numbers.Integral) or isinstance(step, (bool, np.bool_)) or step < 0:
        raise InputError(f"step must be an integer >= 0 (0-based), got {step!r}")
    return int(step)


class _Config:
    """Shared by schedules and optimizers: repr, equality and hash from ``_fields``."""

    _fields: tuple[str, ...] = ()

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self._fields)

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={value!r}" for name, value in zip(self._fields, self._values()))
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._values()))


# ---------------------------------------------------------------------------- schedules


class Schedule(_Config):
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
        self.step_size = _integer("StepLR", "step_size", step_size, 1)
        self.gamma = _real("StepLR", "gamma", gamma, 0.0, low_open=True)

    def factor(self, step: int) -> float:
        return self.gamma ** (_check_step(step) // self.step_size)


class CosineLR(Schedule):
    """Cosine annealing from 1 down to ``min_factor`` over ``total_steps``, then flat.

    ``min_factor + (1 - min_factor) * (1 + cos(pi * min(step, total_steps) / total_steps)) / 2``:
    1 at step 0, ``(1 + min_factor) / 2`` half-way, ``min_factor`` at ``step == total_steps``
    and after (PyTorch's ``CosineAnnealingLR`` with ``T_max=total_steps`` and
    ``eta_min = min_factor * lr``, without its restarts).
    """

    _fields = ("total_steps", "min_factor")

    def __init__(self, total_steps: int, min_factor: float = 0.0) -> None:
        self.total_steps = _integer("CosineLR", "total_steps", total_steps, 1)
        self.min_factor = _real("CosineLR", "min_factor", min_factor, 0.0, 1.0)

    def factor(self, step: int) -> float:
        progress = min(_check_step(step), self.total_steps) / self.total_steps
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
        self.warmup_steps = _integer("LinearWarmup", "warmup_steps", warmup_steps, 1)
        if after is not None and not isinstance(after, Schedule):
            raise ConfigurationError(
                f"LinearWarmup: after must be a Schedule or None, got {after!r}"
            )
        self.after = after

    def factor(self, step: int) -> float:
        step = _check_step(step)
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return 1.0 if self.after is None else self.after.factor(step - self.warmup_steps)


# ----------------------------------------------------------------------------- clipping


def clip_scale(global_sq_norm: float, clip_norm: float | None) -> float:
    """The factor that brings the gradient's global L2 norm down to at most ``clip_norm``.

    ``min(1, clip_norm / (sqrt(global_sq_norm) + 1e-6))``, and 1.0 when ``clip_norm`` is
    None (PyTorch's ``clip_grad_norm_``). ``global_sq_norm`` is the sum over all partitions
    of ``squared_norm(gradient slice)``: one scalar allreduce. Multiply every slice by the
    result (or pass it as ``Optimizer.step(..., grad_scale=...)``). A NaN norm (a NaN in
    some gradient) gives NaN and an infinite one 0.0, as in PyTorch: non-finite gradients
    stay visible instead of being clipped into plausible numbers.
    """
    if clip_norm is None:
        return 1.0
    if isinstance(global_sq_norm, (bool, np.bool_)) or not isinstance(global_sq_norm, numbers.Real):
        raise InputError(f"global_sq_norm must be a number, got {global_sq_norm!r}")
    total = float(global_sq_norm)
    if math.isnan(total):
        return math.nan
    if total < 0.0:
        raise InputError(f"global_sq_norm is a sum of squares and must be >= 0, got {total!r}")
    scale = float(clip_norm) / (math.sqrt(total) + 1e-6)
    return scale if scale < 1.0 else 1.0


def squared_norm(x: np.ndarray) -> float:
    """``sum(x ** 2)`` of a float32 vector as a Python float, without temporaries.

    What each partition contributes to the global norm for ``clip_scale``. Accumulated per
    ``_PIECE`` elements in float32 (BLAS dot) and across pieces in float64, which keeps the
    relative error near 1e-6 on any length; the trainer sums the partitions' values.
    """
    x = np.asarray(x)
    if x.dtype != _F32 or x.ndim != 1:
        raise InputError(f"squared_norm expects a 1-D float32 vector, got {x.dtype} {x.shape}")
    total = 0.0
    for start in range(0, x.shape[0], _PIECE):
        piece = x[start : start + _PIECE]
        total += float(np.dot(piece, piece))
    return total


# ---------------------------------------------------------------- shared update pieces
# Every helper works on one piece: equal-length float32 arrays; ``tmp`` is a scratch array
# of that length. None allocates.


def _l2(w: np.ndarray, g: np.ndarray, weight_decay: float, tmp: np.ndarray) -> np.ndarray:
    """The gradient with L2 weight decay: ``g + weight_decay * w`` in ``tmp``, or ``g``."""
    if weight_decay == 0.0:
        return g
    np.multiply(w, weight_decay, out=tmp)
    tmp += g
    return tmp


def _ema(avg: np.ndarray, x: np.ndarray, beta: float, tmp: np.ndarray) -> None:
    """``avg = beta * avg + (1 - beta) * x`` in place; ``x`` may be ``tmp`` itself."""
    avg *= beta
    np.multiply(x, 1.0 - beta, out=tmp)
    avg += tmp


def _momentum(buf: np.ndarray, x: np.ndarray, momentum: float) -> None:
    """``buf = momentum * buf + x`` in place (PyTorch's buffer, dampening 0).

    From a zero buffer the first step gives ``buf = x`` exactly, as PyTorch's clone does.
    """
    buf *= momentum
    buf += x


def _descend(w: np.ndarray, direction: np.ndarray, lr: float, tmp: np.ndarray) -> None:
    """``w -= lr * direction``; ``direction`` may be ``tmp`` itself."""
    np.multiply(direction, lr, out=tmp)
    w -= tmp


# --------------------------------------------------------------------------- optimizers


class Optimizer(_Config):
    """Base class: an elementwise update of a weight slice from its gradient slice.

    Subclasses implement ``_update`` on one piece and name their state arrays in
    ``state_names``; this class checks the arguments, applies the schedule and walks the
    slice in cache-sized pieces.

    Attributes: ``lr`` (base learning rate), ``schedule`` (``Schedule`` or None),
    ``clip_norm`` (clip by global norm, or None), ``weight_decay``.
    """

    def __init__(
        self,
        lr: float,
        weight_decay: float,
        schedule: Schedule | None,
        clip_norm: float | None,
    ) -> None:
        owner = type(self).__name__
        self.lr = _real(owner, "lr", lr, 0.0)
        self.weight_decay = _real(owner, "weight_decay", weight_decay, 0.0)
        if schedule is not None and not isinstance(schedule, Schedule):
            raise ConfigurationError(
                f"{owner}: schedule must be a Schedule (StepLR, CosineLR, LinearWarmup) or None, "
                f"got {schedule!r}"
            )
        self.schedule = schedule
        self.clip_norm = (
            None if clip_norm is None else _real(owner, "clip_norm", clip_norm, 0.0, low_open=True)
        )

    @property
    def state_names(self) -> tuple[str, ...]:
        """The names of the per-element state arrays (PyTorch's names), possibly empty."""
        return ()

    def init_state(self, length: int) -> dict[str, np.ndarray]:
        """Zero-initialised float32 state arrays for a slice of ``length`` elements.

        One array of ``length`` per name in ``state_names`` (Adagrad's accumulator starts
        at its ``initial_accumulator_value`` instead of zero). These are what a checkpoint
        of the sharded optimizer state saves.
        """
        length = _integer(type(self).__name__, "length", length, 0)
        return {name: np.zeros(length, _F32) for name in self.state_names}

    def lr_at(self, step: int) -> float:
        """The learning rate for 0-based ``step``: ``lr * schedule.factor(step)``."""
        step = _check_step(step)
        return self.lr if self.schedule is None else self.lr * self.schedule.factor(step)

    def step(
        self,
        weights: np.ndarray,
        grad: np.ndarray,
        state: Mapping[str, np.ndarray],
        step: int,
        *,
        grad_scale: float = 1.0,
    ) -> None:
        """Update ``weights`` in place from ``grad``, and ``state`` with it.

        ``grad`` is the already averaged (and clipped) gradient of the same slice; it is
        not modified. ``step`` is 0-based (Adam's bias correction uses ``step + 1``).
        ``grad_scale`` multiplies the gradient first, e.g. by ``clip_scale(...)``, saving
        the trainer a separate pass: the result equals scaling ``grad`` in float32 first.
        All arrays are 1-D float32 of one length; ``state`` is what ``init_state`` made.
        """
        n = self._check_arrays(weights, grad, state)
        step = _check_step(step)
        lr = self.lr_at(step)
        scale = _real(type(self).__name__, "grad_scale", grad_scale)
        names = self.state_names
        for start in range(0, n, _PIECE):
            stop = min(start + _PIECE, n)
            tmp = _workspace(stop - start)
            g = grad[start:stop]
            if scale != 1.0:
                g = np.multiply(g, scale, out=tmp[3])
            piece_state = {name: state[name][start:stop] for name in names}
            self._update(weights[start:stop], g, piece_state, lr, step + 1, tmp)

    def _update(
        self,
        w: np.ndarray,
        g: np.ndarray,
        s: dict[str, np.ndarray],
        lr: float,
        t: int,
        tmp: list[np.ndarray],
    ) -> None:
        """Update one piece in place: ``lr`` after the schedule, ``t`` the 1-based step;
        ``tmp[0..2]`` are scratch arrays of the piece's length."""
        raise NotImplementedError

    def _check_arrays(
        self, weights: np.ndarray, grad: np.ndarray, state: Mapping[str, np.ndarray]
    ) -> int:
        owner = type(self).__name__
        for what, a in (("weights", weights), ("grad", grad)):
            if not isinstance(a, np.ndarray) or a.dtype != _F32 or a.ndim != 1:
                raise InputError(
                    f"{owner}.step: {what} must be a 1-D float32 numpy array, got "
                    f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}"
                )
        n = weights.shape[0]
        if grad.shape[0] != n:
            raise InputError(f"{owner}.step: grad has {grad.shape[0]} elements, weights {n}")
        if not weights.flags.writeable:
            raise InputError(f"{owner}.step: weights are read-only; they are updated in place")
        if set(state) != set(self.state_names):
            raise InputError(
                f"{owner}.step: state holds {sorted(state)}, expected {sorted(self.state_names)}"
                " (make it with init_state of this optimizer)"
            )
        for name in self.state_names:
            a = state[name]
            if not isinstance(a, np.ndarray) or a.dtype != _F32 or a.shape != (n,):
                raise InputError(
                    f"{owner}.step: state[{name!r}] must be float32 of shape ({n},), got "
                    f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}"
                )
            if not a.flags.writeable:
                raise InputError(f"{owner}.step: state[{name!r}] is read-only")
        return n


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
        self.momentum = _real("SGD", "momentum", momentum, 0.0)
        self.nesterov = _flag("SGD", "nesterov", nesterov)
        if self.nesterov and self.momentum == 0.0:
            raise ConfigurationError("SGD: nesterov=True needs momentum > 0, got momentum=0.0")

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def _update(self, w, g, s, lr, t, tmp):
        d = _l2(w, g, self.weight_decay, tmp[0])
        if self.momentum:
            buf = s["momentum_buffer"]
            _momentum(buf, d, self.momentum)
            if self.nesterov:
                np.multiply(buf, self.momentum, out=tmp[1])
                tmp[1] += d
                d = tmp[1]
            else:
                d = buf
        _descend(w, d, lr, tmp[2])


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
            _real(owner, "betas[0]", beta1, 0.0, 1.0, high_open=True),
            _real(owner, "betas[1]", beta2, 0.0, 1.0, high_open=True),
        )
        self.eps = _real(owner, "eps", eps, 0.0, low_open=True)
        self.amsgrad = _flag(owner, "amsgrad", amsgrad)

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
            d = _l2(w, g, self.weight_decay, tmp[0])
        m, v = s["exp_avg"], s["exp_avg_sq"]
        _ema(m, d, beta1, tmp[1])
        np.multiply(d, d, out=tmp[1])
        _ema(v, tmp[1], beta2, tmp[1])
        if self.amsgrad:
            np.maximum(s["max_exp_avg_sq"], v, out=s["max_exp_avg_sq"])
            v = s["max_exp_avg_sq"]
        denom = np.sqrt(v, out=tmp[1])
        denom /= math.sqrt(1.0 - beta2**t)
        denom += self.eps
        np.divide(m, denom, out=tmp[1])
        _descend(w, tmp[1], lr / (1.0 - beta1**t), tmp[1])


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
        self.eps = _real("Adagrad", "eps", eps, 0.0, low_open=True)
        self.initial_accumulator_value = _real(
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
        d = _l2(w, g, self.weight_decay, tmp[0])
        acc = s["sum"]
        np.multiply(d, d, out=tmp[1])
        acc += tmp[1]
        std = np.sqrt(acc, out=tmp[1])
        std += self.eps
        np.divide(d, std, out=tmp[1])
        _descend(w, tmp[1], lr, tmp[1])


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
        self.alpha = _real("RMSprop", "alpha", alpha, 0.0, 1.0, high_open=True)
        self.eps = _real("RMSprop", "eps", eps, 0.0, low_open=True)
        self.momentum = _real("RMSprop", "momentum", momentum, 0.0)
        self.centered = _flag("RMSprop", "centered", centered)

    @property
    def state_names(self) -> tuple[str, ...]:
        names: tuple[str, ...] = ("square_avg",)
        if self.momentum:
            names += ("momentum_buffer",)
        if self.centered:
            names += ("grad_avg",)
        return names

    def _update(self, w, g, s, lr, t, tmp):
        d = _l2(w, g, self.weight_decay, tmp[0])
        v = s["square_avg"]
        np.multiply(d, d, out=tmp[1])
        _ema(v, tmp[1], self.alpha, tmp[1])
        if self.centered:
            ga = s["grad_avg"]
            _ema(ga, d, self.alpha, tmp[1])
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
            _momentum(buf, tmp[1], self.momentum)
            _descend(w, buf, lr, tmp[1])
        else:
            _descend(w, tmp[1], lr, tmp[1])
