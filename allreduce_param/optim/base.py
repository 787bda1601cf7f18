"""``Optimizer``: the sharded update every optimizer shares (pieces, clipping scale, state)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.optim import kernels
from allreduce_param.optim.kernels import F32, workspace
from allreduce_param.optim.penalty import ElasticNet
from allreduce_param.optim.schedules import Schedule
from allreduce_param.optim.settings import Config, check_step, integer_setting, real_setting


class Optimizer(Config):
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
        self.lr = real_setting(owner, "lr", lr, 0.0)
        self.weight_decay = real_setting(owner, "weight_decay", weight_decay, 0.0)
        if schedule is not None and not isinstance(schedule, Schedule):
            raise ConfigurationError(
                f"{owner}: schedule must be a Schedule (StepLR, CosineLR, LinearWarmup) or None, "
                f"got {schedule!r}"
            )
        self.schedule = schedule
        self.clip_norm = (
            None
            if clip_norm is None
            else real_setting(owner, "clip_norm", clip_norm, 0.0, low_open=True)
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
        length = integer_setting(type(self).__name__, "length", length, 0)
        return {name: np.zeros(length, F32) for name in self.state_names}

    def lr_at(self, step: int) -> float:
        """The learning rate for 0-based ``step``: ``lr * schedule.factor(step)``."""
        step = check_step(step)
        return self.lr if self.schedule is None else self.lr * self.schedule.factor(step)

    def step(
        self,
        weights: np.ndarray,
        grad: np.ndarray,
        state: Mapping[str, np.ndarray],
        step: int,
        *,
        grad_scale: float = 1.0,
        penalty: ElasticNet | None = None,
        penalized: np.ndarray | None = None,
    ) -> None:
        """Update ``weights`` in place from ``grad``, and ``state`` with it.

        ``grad`` is the already averaged (and clipped) gradient of the same slice; it is
        not modified. ``step`` is 0-based (Adam's bias correction uses ``step + 1``).
        ``grad_scale`` multiplies the gradient first, e.g. by ``clip_scale(...)``, saving
        the trainer a separate pass: the result equals scaling ``grad`` in float32 first.
        All arrays are 1-D float32 of one length; ``state`` is what ``init_state`` made.

        ``penalty`` (an ``ElasticNet``, MLlib's ``regParam``/``elasticNetParam``): its L2
        part is added to the scaled gradient before the update, its L1 part is a proximal
        step (soft threshold by ``lr_at(step) * l1``) after it; see ``optim.penalty``.
        ``penalized``: the slice's per-element factor of the penalty (float32: 0 for a
        coordinate not penalised, an intercept; 1 for a weight), None: 1 everywhere.
        """
        n = self._check_arrays(weights, grad, state)
        step = check_step(step)
        lr = self.lr_at(step)
        scale = real_setting(type(self).__name__, "grad_scale", grad_scale)
        self._check_penalty(penalty, penalized, n)
        names = self.state_names
        for start in range(0, n, kernels.PIECE):
            stop = min(start + kernels.PIECE, n)
            tmp = workspace(stop - start)
            w, g = weights[start:stop], grad[start:stop]
            s = None if penalized is None else penalized[start:stop]
            if scale != 1.0:
                g = np.multiply(g, scale, out=tmp[3])
            if penalty is not None:
                g = penalty.add_l2_gradient(w, g, s, tmp[3], tmp[0])
            piece_state = {name: state[name][start:stop] for name in names}
            self._update(w, g, piece_state, lr, step + 1, tmp)
            if penalty is not None:
                penalty.shrink(w, lr, s, tmp)

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

    def _check_penalty(
        self, penalty: ElasticNet | None, penalized: np.ndarray | None, n: int
    ) -> None:
        owner = type(self).__name__
        if penalty is not None and not isinstance(penalty, ElasticNet):
            raise InputError(
                f"{owner}.step: penalty must be an ElasticNet or None, got {penalty!r}"
            )
        if penalized is not None and (
            not isinstance(penalized, np.ndarray)
            or penalized.dtype != F32
            or penalized.shape != (n,)
        ):
            raise InputError(
                f"{owner}.step: penalized must be None or float32 of shape ({n},) (one factor "
                f"per weight), got {getattr(penalized, 'dtype', type(penalized).__name__)} "
                f"{getattr(penalized, 'shape', '')}"
            )

    def _check_arrays(
        self, weights: np.ndarray, grad: np.ndarray, state: Mapping[str, np.ndarray]
    ) -> int:
        owner = type(self).__name__
        for what, a in (("weights", weights), ("grad", grad)):
            if not isinstance(a, np.ndarray) or a.dtype != F32 or a.ndim != 1:
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
            if not isinstance(a, np.ndarray) or a.dtype != F32 or a.shape != (n,):
                raise InputError(
                    f"{owner}.step: state[{name!r}] must be float32 of shape ({n},), got "
                    f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}"
                )
            if not a.flags.writeable:
                raise InputError(f"{owner}.step: state[{name!r}] is read-only")
        return n
