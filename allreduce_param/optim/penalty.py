"""``ElasticNet``: MLlib's regularisation (``regParam``, ``elasticNetParam``) on a weight slice.

The objective is MLlib's ``LogisticRegression`` / ``LinearRegression`` one::

    mean loss + reg_param * ((1 - elastic_net_param) / 2 * ||w||_2^2 + elastic_net_param * ||w||_1)

over the *penalised* coordinates (the weights; never the intercepts). ``Optimizer.step``
applies it to the slice it updates, element by element, so a sharded fit (each owner on
its slice) equals one process bit for bit, as the updates themselves do:

- the L2 part goes through the optimizer: ``l2 * s * s * w`` is added to the (scaled)
  gradient before the update, so momentum and Adam's moments see it, as they would see the
  gradient of MLlib's objective;
- the L1 part is a proximal step after the update, a soft threshold
  ``w = sign(w) * max(|w| - lr * l1 * s, 0)`` (computed as ``w - clip(w, -t, t)``) with
  ``lr`` the step's learning rate (after the schedule). With plain SGD this is proximal
  gradient descent (ISTA), whose fixed points are exactly the minimisers of the objective:
  coefficients the L1 part outweighs become exactly 0. With an adaptive optimizer (Adam,
  Adagrad, RMSprop) the threshold uses the base learning rate, not the per-coordinate
  step, a common approximation: it still gives exact zeros, but the solution is not the
  objective's exact minimiser.

``s`` is a per-coordinate factor (``Optimizer.step(..., penalized=...)``): 0 where the
coordinate is not penalised (an intercept), 1 where it is, a feature's standard deviation
under MLlib's ``standardization`` (see ``train.regularisation``); None means 1 everywhere.
"""

from __future__ import annotations

import numpy as np

from allreduce_param.optim.settings import Config, real_setting


class ElasticNet(Config):
    """``reg_param * ((1 - elastic_net_param) / 2 * ||w||^2 + elastic_net_param * ||w||_1)``.

    ``reg_param >= 0`` (MLlib's ``regParam``); ``elastic_net_param`` in [0, 1] (MLlib's
    ``elasticNetParam``: 0 is L2 (ridge), 1 is L1 (lasso)). Checked when made: a wrong one
    is a ``ConfigurationError`` naming it. Pass it to ``Optimizer.step(..., penalty=...)``.
    """

    _fields = ("reg_param", "elastic_net_param")

    def __init__(self, reg_param: float, elastic_net_param: float = 0.0) -> None:
        self.reg_param = real_setting("ElasticNet", "reg_param", reg_param, 0.0)
        self.elastic_net_param = real_setting(
            "ElasticNet", "elastic_net_param", elastic_net_param, 0.0, 1.0
        )

    @property
    def l2(self) -> float:
        """The L2 coefficient ``reg_param * (1 - elastic_net_param)`` (of ``||w||^2 / 2``)."""
        return self.reg_param * (1.0 - self.elastic_net_param)

    @property
    def l1(self) -> float:
        """The L1 coefficient ``reg_param * elastic_net_param`` (of ``||w||_1``)."""
        return self.reg_param * self.elastic_net_param

    def add_l2_gradient(
        self, w: np.ndarray, g: np.ndarray, s: np.ndarray | None, out: np.ndarray, tmp: np.ndarray
    ) -> np.ndarray:
        """``g + l2 * s * s * w`` into ``out`` (``g`` may be ``out``), or ``g`` when l2 is 0.

        One piece: equal-length float32 arrays, ``tmp`` scratch. Computed as
        ``((w * s) * s) * l2`` (``w * l2`` without ``s``), then added: the same float32
        operations on any slice."""
        l2 = self.l2
        if l2 == 0.0:
            return g
        if s is None:
            np.multiply(w, l2, out=tmp)
        else:
            np.multiply(w, s, out=tmp)
            tmp *= s
            tmp *= l2
        np.add(g, tmp, out=out)
        return out

    def shrink(self, w: np.ndarray, lr: float, s: np.ndarray | None, tmp: list[np.ndarray]) -> None:
        """The proximal step of the L1 part, in place: ``w = sign(w) * max(|w| - lr*l1*s, 0)``.

        One piece; ``tmp``: two scratch arrays of its length. Computed as
        ``w - clip(w, -t, t)`` with ``t = lr * l1 * s``, which is the same float32 number
        (``|w| - t`` rounded, with the sign of ``w``; 0 where ``|w| <= t``) in two passes
        without ``s``. Nothing happens when l1 is 0; a coordinate with ``s == 0`` keeps its
        value."""
        threshold = lr * self.l1
        if threshold == 0.0:
            return
        if s is None:
            inner = np.clip(w, -threshold, threshold, out=tmp[0])
        else:  # minimum then maximum: faster than clip with array bounds
            bound = np.multiply(s, threshold, out=tmp[1])
            inner = np.minimum(w, bound, out=tmp[0])
            np.maximum(inner, np.negative(bound, out=bound), out=inner)
        w -= inner
