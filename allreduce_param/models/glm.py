"""MLlib's generalized linear problems, Spark-free: what is solved, what comes back, the checks
of a partition's rows, and the weighted statistics of the features and the label.

``GlmProblem`` says what to solve with MLlib's Params' meanings (``regParam``,
``elasticNetParam``, ``fitIntercept``, ``standardization``, ``maxIter``, ``tol``, the
``LinearRegression`` solver); ``GlmSolution`` is MLlib's answer (coefficients in the original
feature space, intercepts, ``objectiveHistory``, ``totalIterations``). The objectives are in
``models/glm_loss.py``, the normal equations in ``models/glm_normal.py``, the solve inside a
barrier task in ``train/task/glm_solve.py``.

The statistics are MLlib's ``Summarizer``'s: weighted means, and the *unbiased* weighted
variance (the sum of weighted squared deviations over ``weightSum - sum(w^2) / weightSum``),
computed from two sums over all partitions (the first for the means, the second for the
deviations from them, so the variance does not lose digits to cancellation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from allreduce_param.errors import InputError

Family = Literal["gaussian", "binomial", "multinomial"]


@dataclass(frozen=True)
class GlmProblem:
    """A linear model's fit as MLlib's ``LinearRegression`` (gaussian) or
    ``LogisticRegression`` (binomial, multinomial) defines it, by its Params' meanings."""

    family: Family
    num_features: int
    num_classes: int = 1  # gaussian 1, binomial 1 or 2, multinomial K >= 2
    fit_intercept: bool = True
    reg_param: float = 0.0
    elastic_net_param: float = 0.0
    standardization: bool = True
    max_iter: int = 100
    tol: float = 1e-6
    history: int = 10  # L-BFGS's memory m (MLlib: 10)
    solver: Literal["l-bfgs", "normal"] = "l-bfgs"
    # gaussian: the L2 strength divided by the label's std, as MLlib and glmnet (True); False
    # is DistriOptimizer's objective, mean 0.5 (x.w + b - y)^2 + regParam's penalty on w as it is
    label_scaled_l2: bool = True

    def __post_init__(self) -> None:
        def bad(param: str, value, rule: str) -> InputError:
            return InputError(f"{param}={value!r}: {rule}")

        if self.family not in ("gaussian", "binomial", "multinomial"):
            raise bad("family", self.family, "must be 'gaussian', 'binomial' or 'multinomial'")
        if not isinstance(self.num_features, (int, np.integer)) or self.num_features < 1:
            raise bad("numFeatures", self.num_features, "the features need at least 1 column")
        expected = {"gaussian": (1, 1), "binomial": (1, 2), "multinomial": (2, 1 << 30)}
        low, high = expected[self.family]
        if not low <= self.num_classes <= high:
            raise bad(
                "numClasses",
                self.num_classes,
                f"the {self.family} family takes {low} to {min(high, 2**30)} classes"
                + (" (use family='multinomial' for more)" if self.family == "binomial" else ""),
            )
        if not (math.isfinite(self.reg_param) and self.reg_param >= 0):
            raise bad("regParam", self.reg_param, "must be a finite number >= 0")
        if not (0.0 <= self.elastic_net_param <= 1.0):
            raise bad("elasticNetParam", self.elastic_net_param, "must be in [0, 1]")
        if not isinstance(self.max_iter, (int, np.integer)) or self.max_iter < 0:
            raise bad("maxIter", self.max_iter, "must be an integer >= 0")
        if not (math.isfinite(self.tol) and self.tol >= 0):
            raise bad("tol", self.tol, "must be a finite number >= 0")
        if not isinstance(self.history, (int, np.integer)) or self.history < 1:
            raise bad("history", self.history, "L-BFGS keeps at least 1 pair (MLlib: 10)")
        if self.solver not in ("l-bfgs", "normal"):
            raise bad("solver", self.solver, "must be 'l-bfgs' or 'normal' (resolve 'auto' first)")
        if self.solver == "normal" and self.family != "gaussian":
            raise bad("solver", self.solver, "the normal equations solve the gaussian family only")
        if not self.label_scaled_l2 and self.solver == "normal":
            raise bad("solver", self.solver, "label_scaled_l2=False is solved by 'l-bfgs' only")

    @property
    def rows(self) -> int:
        """Rows of the coefficient matrix: K for multinomial, else 1."""
        return self.num_classes if self.family == "multinomial" else 1

    @property
    def l1(self) -> float:
        """MLlib's L1 strength: regParam * elasticNetParam (before the label's scaling)."""
        return self.reg_param * self.elastic_net_param

    @property
    def l2(self) -> float:
        """MLlib's L2 strength: regParam * (1 - elasticNetParam) (before the label's scaling)."""
        return self.reg_param * (1.0 - self.elastic_net_param)


@dataclass(frozen=True)
class GlmSolution:
    """MLlib's answer: coefficients (rows x num_features, the original feature space),
    intercepts (rows; zeros without an intercept), ``objectiveHistory`` (its first entry
    the objective at the start) and ``totalIterations``; ``note`` says what MLlib would have
    logged as a warning (a constant label, say), else None; ``objective_times`` the wall
    clock (``time.time()`` in partition 0's task) at which each history value was reached,
    empty where the solver did not iterate on the engine. ``objective_scale``: what the
    history multiplies by to be in the label's own units (gaussian: the label's variance,
    as MLlib's history is of the label divided by its std; else 1)."""

    coefficients: np.ndarray
    intercepts: np.ndarray
    objective_history: list[float]
    iterations: int
    note: str | None = None
    objective_times: list[float] = field(default_factory=list)
    objective_scale: float = 1.0


def constant_label_answer(problem: GlmProblem, label_mean: float) -> GlmSolution | None:
    """MLlib's LinearRegression over a constant label (the label's std is 0), whichever
    solver: with an intercept (or a label of zeros) the coefficients are zero and the
    intercept is the label, untrained; without one and with ``regParam`` > 0 a refusal (the
    label cannot be standardized); else None: the caller solves, scaling by the label
    itself."""
    if problem.fit_intercept or label_mean == 0.0:
        return GlmSolution(
            np.zeros((1, problem.num_features)),
            np.array([label_mean if problem.fit_intercept else 0.0]),
            [0.0],
            0,
            "the label is constant: the coefficients are zero"
            + (", the intercept its value" if problem.fit_intercept else ""),
        )
    if problem.reg_param > 0:
        raise InputError(
            "the label is constant and fitIntercept is false: the model cannot be "
            "regularized when the label is standardized; set regParam=0"
        )
    return None


def glm_parameter_size(problem: GlmProblem) -> int:
    """The length of the vector the solver optimizes (and the engine shards): the
    coefficients, row-major, then one intercept per row where the intercept is optimized
    (LogisticRegression with fitIntercept; LinearRegression computes its intercept from the
    means instead, as MLlib does)."""
    intercepts = problem.rows if problem.fit_intercept and problem.family != "gaussian" else 0
    return problem.rows * problem.num_features + intercepts


# -- the rows -----------------------------------------------------------------------------


def rows_problem(features, labels, weights, problem: GlmProblem) -> str | None:
    """What is wrong with a partition's rows for ``problem`` (a sentence), or None."""
    shape = getattr(features, "shape", None)
    if shape is None or len(shape) != 2:
        return "features must be a 2-D array or a scipy.sparse CSR matrix"
    if shape[1] != problem.num_features:
        return (
            f"the features have {shape[1]} columns where numFeatures is "
            f"{problem.num_features}: every row's vector must have the same size"
        )
    values = features.data if hasattr(features, "tocsr") else np.asarray(features)
    if not np.all(np.isfinite(values)):
        return "the features hold NaN or infinite values: impute or drop those rows first"
    labels = np.asarray(labels)
    if labels.shape != (shape[0],):
        return f"{labels.shape} labels for {shape[0]} rows: one label per row"
    if not np.all(np.isfinite(labels)):
        return "the labels (labelCol) hold NaN or infinite values"
    if problem.family != "gaussian":
        bad = (labels < 0) | (labels >= max(problem.num_classes, 2)) | (labels != np.round(labels))
        if problem.family == "multinomial":
            bad |= labels >= problem.num_classes
        if np.any(bad):
            return (
                f"labels must be whole numbers in [0, {problem.num_classes}) "
                f"(found {labels[bad][0]!r}): index the classes with StringIndexer"
            )
    if weights is not None:
        weights = np.asarray(weights)
        if weights.shape != (shape[0],):
            return f"{weights.shape} weights for {shape[0]} rows: one weight per row (weightCol)"
        if not np.all(np.isfinite(weights)) or np.any(weights < 0):
            return "the weights (weightCol) must be finite and >= 0"
    return None


@dataclass(frozen=True)
class RowStats:
    """The weighted statistics of all partitions' rows (MLlib's Summarizer's meanings)."""

    weight_sum: float
    count: float
    means: np.ndarray  # per feature
    stds: np.ndarray  # unbiased weighted, per feature; 0 for a constant feature
    label_mean: float
    label_std: float
    class_weights: np.ndarray  # the weighted histogram of the labels (classification)

    @property
    def inverse_stds(self) -> np.ndarray:
        """1/std, 0 where a feature is constant (it then takes no part, as in MLlib)."""
        out = np.zeros_like(self.stds)
        np.divide(1.0, self.stds, out=out, where=self.stds != 0)
        return out


def first_moments(features, labels, weights, classes: int) -> np.ndarray:
    """This partition's part of the first sum: [weight sum, sum of squared weights, count,
    sum w*y, sum w*x (d), the weighted class histogram (``classes``)]."""
    w = np.ones(len(labels)) if weights is None else np.asarray(weights, np.float64)
    y = np.asarray(labels, np.float64)
    head = [w.sum(), (w * w).sum(), float(len(y)), (w * y).sum()]
    weighted_x = np.asarray(features.T @ w).ravel()
    histogram = np.zeros(classes)
    if classes:  # (bincount of no rows gives integers)
        histogram += np.bincount(y.astype(np.int64), w, classes)
    return np.concatenate([head, weighted_x, histogram])


def second_moments(features, labels, weights, means: np.ndarray, label_mean: float) -> np.ndarray:
    """This partition's part of the second sum: [sum w (y - mean)^2, sum w (x_j - mean_j)^2
    (d)], computed without densifying sparse rows."""
    w = np.ones(len(labels)) if weights is None else np.asarray(weights, np.float64)
    y = np.asarray(labels, np.float64)
    label = float((w * (y - label_mean) ** 2).sum())
    if hasattr(features, "tocsr"):
        csr = features.tocsr()
        row_weights = np.repeat(w, np.diff(csr.indptr))
        columns = csr.indices
        deviations = np.zeros(means.size)  # (bincount of no rows gives integers)
        deviations += np.bincount(
            columns, row_weights * (csr.data - means[columns]) ** 2, means.size
        )
        present = np.bincount(columns, row_weights, means.size).astype(np.float64)
        deviations += means**2 * (w.sum() - present)
    else:
        deviations = w @ (np.asarray(features, np.float64) - means) ** 2
    return np.concatenate([[label], deviations])


def row_stats(first: np.ndarray, second: np.ndarray, num_features: int) -> RowStats:
    """The statistics from the two sums over all partitions."""
    weight_sum, square_sum, count, label_sum = first[:4]
    weighted_x = first[4 : 4 + num_features]
    histogram = first[4 + num_features :]
    denominator = weight_sum - square_sum / weight_sum

    def std(deviation):
        variance = np.where(denominator > 0, deviation / denominator, 0.0)
        return np.sqrt(np.maximum(variance, 0.0))

    return RowStats(
        weight_sum=float(weight_sum),
        count=float(count),
        means=weighted_x / weight_sum,
        stds=std(second[1:]),
        label_mean=float(label_sum / weight_sum),
        label_std=float(std(second[0])),
        class_weights=histogram,
    )
