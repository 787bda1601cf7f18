"""The fit's regularisation: ``Regularization`` as the user sets it, and its work on the part
of the vector one owner updates.

MLlib's meaning (``reg_param``, ``elastic_net_param``, ``fit_intercept``,
``standardization``: the Estimators' ``regParam``, ``elasticNetParam``, ``fitIntercept``,
``standardization``): the objective is the mean loss plus
``reg_param * ((1 - elastic_net_param) / 2 * ||w||^2 + elastic_net_param * ||w||_1)`` over
the weights, never the intercepts; ``fit_intercept=False`` holds every intercept at 0.

The model says which coordinates are intercepts (its optional ``penalized()``) and, for
``standardization``, which weights multiply which feature (``penalty_factors(std)``, see
``models.base.Model``). Each owner cuts its slice out of those, and ``optim.ElasticNet``
applies the penalty element by element, so N owners give what one process gives.

Standardization, as MLlib's: each first-layer weight of feature ``j`` is penalised as if
the feature were scaled to unit standard deviation: the L1 part by ``std_j``, the L2 part
by ``std_j^2``. ``std_j`` is the (sample-weighted, unbiased) standard deviation over every
partition's training rows, learnt at the start of the fit with two allreduces of one value
per feature (``feature_std``); a feature of std 0 (a constant column) keeps its weights at
0, as MLlib gives such a feature coefficient 0.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.models.base import is_sparse_matrix, takes_part
from allreduce_param.optim import ElasticNet

ROWS_AT_ONCE = 4096  # dense rows per float64 pass of ``local_moments``
#: A feature whose std is at most this times its mean's magnitude counts as constant (std 0).
CONSTANT = 1e-6


@dataclass(frozen=True)
class Regularization:
    """The fit's penalty, as MLlib's (``FitSettings(regularization=...)``).

    ``reg_param``: its strength, >= 0 (0: none); the objective is the mean loss +
    ``reg_param * ((1 - elastic_net_param) / 2 * sum(w^2) + elastic_net_param * sum(abs(w)))``
    over the weights, never the intercepts. ``elastic_net_param``: the L1 share, in [0, 1]
    (0 is L2, ridge, through the optimizer; 1 is L1, lasso, a proximal step after each
    update). ``standardization``: penalise each first-layer weight in proportion to its
    feature's standard deviation over the training rows (the L1 part by std, the L2 part by
    std^2), MLlib's penalty on the coefficients of standardized features; it only matters
    with a penalty. ``fit_intercept`` is no part of it (a setting of its own, as MLlib's
    ``fitIntercept``: it holds the intercepts at 0 with or without a penalty). Checked when
    made, naming the setting as the job files do.
    """

    reg_param: float = 0.0
    elastic_net_param: float = 0.0
    standardization: bool = True

    def __post_init__(self) -> None:
        for name, allowed in (("reg_param", ">= 0"), ("elastic_net_param", "in [0, 1]")):
            value = getattr(self, name)
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            ok = ok and math.isfinite(value) and value >= 0 and (name == "reg_param" or value <= 1)
            if not ok:
                raise ConfigurationError(f"{name} must be a finite number {allowed}, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.standardization, bool):
            raise ConfigurationError(
                f"standardization must be True or False, got {self.standardization!r}"
            )

    def penalty(self) -> ElasticNet | None:
        """The penalty of ``reg_param`` and ``elastic_net_param`` (None: none)."""
        if self.reg_param == 0.0:
            return None
        return ElasticNet(self.reg_param, self.elastic_net_param)

    @property
    def standardizes(self) -> bool:
        """Whether the penalty is scaled by each feature's standard deviation
        (``standardization``, which only matters with a penalty)."""
        return self.standardization and self.reg_param > 0


def check_fit_intercept(value: Any) -> None:
    """A ConfigurationError naming ``fit_intercept`` unless it is True or False."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"fit_intercept must be True or False, got {value!r}")


def penalized_mask(model: Any, size: int, part: slice | None = None) -> np.ndarray | None:
    """The model's ``penalized()`` as a boolean vector of ``size`` (None: it has none), or
    its slice ``part`` alone: built as that slice where the model's takes ``part=``, else
    cut from the whole vector."""
    method = getattr(model, "penalized", None)
    if not callable(method):
        return None
    whole = part is None or not takes_part(method)
    mask = np.asarray(method() if whole else method(part=part))
    expected = size if whole else part.stop - part.start
    if mask.dtype != bool or mask.shape != (expected,):
        raise InputError(
            f"{model!r}.penalized({'' if whole else 'part=' + repr(part)}) must return a "
            f"boolean vector of {expected} elements (one per parameter: True where the "
            f"regularisation applies), got {mask.dtype} {mask.shape}"
        )
    return mask if part is None or not whole else mask[part].copy()  # not the whole one


def penalty_factors(model: Any, std: np.ndarray, size: int, part: slice) -> np.ndarray:
    """The model's ``penalty_factors(std)`` of slice ``part`` (float32): built as that slice
    where the model's takes ``part=``, else cut from the whole vector."""
    method = model.penalty_factors
    whole = not takes_part(method)
    factors = np.asarray(method(std) if whole else method(std, part=part), np.float32)
    expected = size if whole else part.stop - part.start
    if factors.shape != (expected,):
        raise InputError(
            f"{model!r}.penalty_factors must return one float32 factor per parameter "
            f"({expected} of them), got shape {factors.shape}"
        )
    return factors[part].copy() if whole else factors  # not a view of the whole one


def check_model(model: Any, rule: Regularization, fit_intercept: bool, size: int) -> None:
    """On the driver, before any task: the model can take the fit's regularisation ``rule``
    and its ``fit_intercept``."""
    if not rule.reg_param and fit_intercept:
        return
    mask = penalized_mask(model, size)
    if mask is None and not fit_intercept:
        raise ConfigurationError(
            f"fit_intercept=False: the model {model!r} does not say which of its parameters "
            "are intercepts (it has no penalized()); give it one (see "
            "allreduce_param.models.base.Model), or keep fit_intercept=True"
        )
    if rule.standardizes and not callable(getattr(model, "penalty_factors", None)):
        raise ConfigurationError(
            f"standardization=True with reg_param={rule.reg_param!r}: the model {model!r} "
            "does not say which weights multiply which feature (it has no penalty_factors(), "
            "see allreduce_param.models.base.Model), so its penalty cannot be standardized as "
            "MLlib's; set standardization=False to penalise the weights as they are"
        )


def local_moments(X: Any, weight: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, float, float]:
    """``(sum w*x, sum w*x^2)`` per feature (float64) and ``(sum w, sum w^2)`` over the rows
    of ``X`` (a float32 array, or a scipy.sparse matrix), ``w`` the sample weights or 1."""
    rows, features = X.shape
    w = np.ones(rows) if weight is None else np.asarray(weight, np.float64)
    if is_sparse_matrix(X):  # scipy.sparse: no densifying
        wide = X.astype(np.float64)  # a copy of the non-zeros only
        first = np.asarray(wide.T @ w, np.float64).reshape(features)
        second = np.asarray(wide.multiply(wide).T @ w, np.float64).reshape(features)
    else:
        first, second = np.zeros(features), np.zeros(features)
        for start in range(0, rows, ROWS_AT_ONCE):
            part = np.asarray(X[start : start + ROWS_AT_ONCE], np.float64)
            share = w[start : start + ROWS_AT_ONCE]
            first += share @ part
            np.multiply(part, part, out=part)
            second += share @ part
    return first, second, float(w.sum()), float(np.dot(w, w))


def feature_std(
    p: Any, X: Any = None, weight: np.ndarray | None = None, moments: tuple | None = None
) -> np.ndarray:
    """Each feature's standard deviation over every partition's rows (float32), as MLlib's
    summarizer gives it: weighted, unbiased (``sum w (x - mean)^2 / (W - sum w^2 / W)``).

    Every partition calls it at once (``p``: its ``ConnectedParameter``): one exact
    allreduce of the weight sums, then the per-feature sums and the sums of squared
    deviations from the global mean, each one raw allreduce of one value per feature
    (float32 sums, never the codec's rounding: a fit with a lossy codec standardizes as a
    raw one does). All partitions get the same bits. A
    std at most ``CONSTANT`` times the mean's magnitude, below what float32 sums resolve,
    is 0: a constant feature's, as MLlib finds it. ``moments``: this partition's
    ``local_moments``, where the caller summed them itself (rows read from a file in
    blocks), instead of ``X`` and ``weight``."""
    first, second, total_weight, squared_weights = moments or local_moments(X, weight)
    own_weight = total_weight
    total_weight, squared_weights = (
        float(v) for v in p.collectives.allreduce_exact([total_weight, squared_weights])
    )
    features = first.shape[0]
    if not total_weight > 0:
        return np.zeros(features, np.float32)
    mean = np.asarray(p.collectives.allreduce(first.astype(np.float32), raw=True), np.float64)
    mean /= total_weight
    # this partition's sum w (x - mean)^2 = second + mean * own * (mean - 2 * first / own),
    # in place: three float64 vectors at most (a 2**24-feature fit: 384 MiB for a moment)
    if own_weight > 0:  # else no rows here: second is 0 already
        first *= -2.0 / own_weight
        first += mean
        first *= own_weight
        first *= mean
        second += first
        np.maximum(second, 0.0, out=second)
    del first
    spread = np.asarray(p.collectives.allreduce(second.astype(np.float32), raw=True), np.float64)
    del second
    denominator = total_weight - squared_weights / total_weight
    if not denominator > 0:  # a single row (or one row's weight): no spread to measure
        return np.zeros(features, np.float32)
    std = np.sqrt(spread / denominator).astype(np.float32)
    # the sums travel as float32, so a constant feature's mean is off by float32 rounding and
    # its std comes out near 1e-7 * |mean| instead of 0: a spread below that resolution is 0
    std[std <= CONSTANT * np.abs(mean)] = 0.0
    return std


class OwnedRegularisation:
    """The regularisation ``rule`` (with ``fit_intercept``) of one owner's part ``part`` (a
    slice of the flat vector).

    ``step_arguments`` go to ``Optimizer.step``; ``hold`` zeroes the gradient of the
    coordinates held at 0 (the intercepts under ``fit_intercept=False``; under
    standardization the weights of a feature of std 0), which every optimizer then leaves
    at the 0 ``initial`` gave them: no state, decay or threshold moves a 0 with a 0 gradient.
    ``std``: each feature's standard deviation (``feature_std``), when the fit standardizes.
    ``clips_whole``: the partition clips the whole gradient it puts by its own norm (SSP,
    ASP, backup workers: ``hold_whole``), which must leave the held coordinates out, as
    BSP's clip of the owners' held slices does.
    """

    def __init__(
        self,
        rule: Regularization,
        fit_intercept: bool,
        model: Any,
        size: int,
        part: slice,
        std: np.ndarray | None = None,
        clips_whole: bool = False,
    ) -> None:
        self.penalty: ElasticNet | None = rule.penalty()
        # the arrays are built for this part alone (where the model can), or for the whole
        # vector where a partition also holds the whole gradient (clips_whole)
        built = slice(0, size) if clips_whole else part
        mask = None
        if self.penalty is not None or not fit_intercept:
            mask = penalized_mask(model, size, built)
        factors = None
        if self.penalty is not None and rule.standardizes:
            factors = penalty_factors(model, std, size, built)
        own = slice(part.start - built.start, part.stop - built.start)  # the part in them
        self.penalized: np.ndarray | None = None
        if factors is not None:
            self.penalized = factors if built == part else factors[own].copy()
        elif self.penalty is not None and mask is not None:
            self.penalized = mask[own].astype(np.float32)
        self._held = _held(
            fit_intercept,
            None if mask is None else mask[own],
            None if factors is None else factors[own],
        )
        self._held_whole = _held(fit_intercept, mask, factors) if clips_whole else None
        self._part, self._size = part, size

    @property
    def step_arguments(self) -> dict[str, Any]:
        """``Optimizer.step``'s ``penalty`` and ``penalized`` for this part."""
        return {"penalty": self.penalty, "penalized": self.penalized}

    def initial(self, weights: np.ndarray, own: slice) -> np.ndarray:
        """The weights a fit starts from, the whole vector or this partition's slice ``own``
        of it alone (a checkpoint's part), with the held coordinates of this part that they
        hold set to 0: an earlier fit's intercepts, or a constant feature's weights, do not
        come along into a fit that holds them (MLlib's ``initialModel`` under
        ``fitIntercept=false`` gives its intercept no say either). Every partition zeroes
        what it holds of its part; ``ConnectedParameter.init`` keeps its own slice."""
        if self._held is None:
            return weights
        covered = slice(0, self._size) if weights.size == self._size else own
        start = max(self._part.start, covered.start)
        stop = min(self._part.stop, covered.stop)
        if start < stop:
            held = self._held[start - self._part.start : stop - self._part.start]
            weights[start - covered.start : stop - covered.start][held] = 0.0
        return weights

    def initial_state(self, state: dict[str, np.ndarray], fresh: dict[str, np.ndarray]) -> None:
        """An earlier fit's optimizer ``state`` of this part (each array as long as it), with
        the held coordinates' values set to a fresh state's (``fresh``: the optimizer's
        ``init_state(1)``), in place: a momentum or Adam moment carried over would move an
        intercept the fit holds at 0, though its gradient is 0."""
        if self._held is None:
            return
        for name, values in state.items():
            np.copyto(values, fresh[name][0], where=self._held)

    def hold(self, gradient: np.ndarray) -> None:
        """Zero the held coordinates' gradient of this part, in place."""
        if self._held is not None:
            np.copyto(gradient, 0.0, where=self._held)

    def hold_whole(self, gradient: np.ndarray) -> None:
        """Zero the held coordinates' gradient of the whole vector, in place (made with
        ``clips_whole``): before a partition clips the gradient it puts by its own norm."""
        if self._held_whole is not None:
            np.copyto(gradient, 0.0, where=self._held_whole)


def _held(
    fit_intercept: bool, penalized: np.ndarray | None, factors: np.ndarray | None
) -> np.ndarray | None:
    """Which coordinates of a part (or the whole vector) are held at 0, given the model's
    ``penalized`` mask and standardized penalty ``factors`` of the same coordinates: the
    intercepts under ``fit_intercept=False``, the weights of a feature of std 0 (factor 0);
    None where none is."""
    held = None if fit_intercept or penalized is None else ~penalized
    if factors is not None:
        constant = (factors == 0) if penalized is None else (factors == 0) & penalized
        held = constant if held is None else held | constant
    return held if held is not None and held.any() else None
