"""The fit's regularisation on the part of the vector one owner updates.

MLlib's meaning (``reg_param``, ``elastic_net_param``, ``fit_intercept``: the Estimators'
``regParam``, ``elasticNetParam``, ``fitIntercept``): the objective is the mean loss plus
``reg_param * ((1 - elastic_net_param) / 2 * ||w||^2 + elastic_net_param * ||w||_1)`` over
the weights, never the intercepts; ``fit_intercept=False`` holds every intercept at 0. The
model says which coordinates are intercepts (its optional ``penalized()``, see
``models.base.Model``); each owner cuts its slice out of that mask, and ``optim.ElasticNet``
applies the penalty element by element, so N owners give what one process gives.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.optim import ElasticNet
from allreduce_param.train.settings import FitSettings


def penalized_mask(model: Any, size: int) -> np.ndarray | None:
    """The model's ``penalized()`` as a boolean vector of ``size`` (None: it has none)."""
    method = getattr(model, "penalized", None)
    if not callable(method):
        return None
    mask = np.asarray(method())
    if mask.dtype != bool or mask.shape != (size,):
        raise InputError(
            f"{model!r}.penalized() must return a boolean vector of {size} elements (one per "
            f"parameter: True where the regularisation applies), got {mask.dtype} {mask.shape}"
        )
    return mask


def check_model(model: Any, settings: FitSettings, size: int) -> None:
    """On the driver, before any task: ``fit_intercept=False`` needs a model that says which
    parameters are intercepts, and its ``penalized()`` must have the vector's shape."""
    if not settings.reg_param and settings.fit_intercept:
        return
    mask = penalized_mask(model, size)
    if mask is None and not settings.fit_intercept:
        raise ConfigurationError(
            f"fit_intercept=False: the model {model!r} does not say which of its parameters "
            "are intercepts (it has no penalized()); give it one (see "
            "allreduce_param.models.base.Model), or keep fit_intercept=True"
        )


class OwnedRegularisation:
    """The regularisation of one owner's part ``part`` (a slice of the flat vector).

    ``penalty`` and ``penalized`` go to ``Optimizer.step``; ``hold`` zeroes the gradient of
    the intercepts under ``fit_intercept=False`` (every optimizer then leaves them at the 0
    ``initial`` gave them: no state, decay or threshold moves a 0 with a 0 gradient).
    """

    def __init__(self, settings: FitSettings, model: Any, size: int, part: slice) -> None:
        self.penalty: ElasticNet | None = settings.penalty()
        mask = None
        if self.penalty is not None or not settings.fit_intercept:
            mask = penalized_mask(model, size)
        own = None if mask is None else mask[part]
        self.penalized = None if self.penalty is None or own is None else own.astype(np.float32)
        self._held = None if settings.fit_intercept or own is None else ~own
        self._part = part

    @property
    def step_arguments(self) -> dict[str, Any]:
        """``Optimizer.step``'s ``penalty`` and ``penalized`` for this part."""
        return {"penalty": self.penalty, "penalized": self.penalized}

    def initial(self, weights: np.ndarray) -> np.ndarray:
        """The fit's initial whole vector, with this part's intercepts 0 under
        ``fit_intercept=False`` (every partition zeroes its own; ``init`` keeps only that)."""
        if self._held is not None:
            weights[self._part][self._held] = 0.0
        return weights

    def hold(self, gradient: np.ndarray) -> None:
        """Zero this part's intercepts' gradient, in place, under ``fit_intercept=False``."""
        if self._held is not None:
            np.copyto(gradient, 0.0, where=self._held)
