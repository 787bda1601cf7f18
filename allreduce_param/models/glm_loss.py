"""MLlib's objectives for the quasi-Newton solver, in MLlib's scaled space.

MLlib trains every linear model in the space where each feature is divided by its std
(always, whatever ``standardization`` says) and returns coefficients in the original space.
Where there is an intercept the features are also centred by their means; a sparse row stays
sparse: the means enter through one offset per row (``x.beta/std - (mean/std).beta``), as in
MLlib's block aggregators. The objective is the weighted loss divided by the weight sum, plus
the L2 part on the coefficients (never the intercepts):

- gaussian (``LinearRegression``): 0.5 w (x.beta + offset - y/std_y)^2, the label divided by
  its std (glmnet's and MLlib's convention) and, with an intercept, centred; the intercept is
  not optimized but follows from the means; L1 and L2 strengths divided by std_y (the L2
  one not with ``label_scaled_l2=False``: DistriOptimizer's objective, times std_y^2).
- binomial (``LogisticRegression``): w (log(1 + exp(m)) - y m), m = x.beta + b.
- multinomial: w (logsumexp(m) - m_y) over K margins, no pivot class.

The L2 part is 0.5 l2 sum(beta_j^2) with ``standardization``, else 0.5 l2 sum((beta_j /
std_j)^2): the penalty on the original-space coefficients (MLlib's ``L2Regularization`` with
the features' stds); the L1 weights (for OWL-QN) follow the same rule with |beta_j| / std_j.
"""

from __future__ import annotations

import numpy as np

from allreduce_param.models.glm import GlmProblem, RowStats, glm_parameter_size


class GlmObjective:
    """The objective of ``problem`` over the rows whose statistics are ``stats``."""

    def __init__(self, problem: GlmProblem, stats: RowStats) -> None:
        self.problem = problem
        self.stats = stats
        d = problem.num_features
        self._inverse_std = stats.inverse_stds
        centred = problem.fit_intercept
        self._scaled_mean = stats.means * self._inverse_std if centred else np.zeros(d)
        self.label_scale = (
            1.0
            if problem.family != "gaussian"
            else (stats.label_std if stats.label_std > 0 else abs(stats.label_mean))
        )

    # -- the vector's parts -------------------------------------------------------------

    def split(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The coefficient matrix (rows x d, scaled space) and the optimized intercepts."""
        p = self.problem
        coefficients = x[: p.rows * p.num_features].reshape(p.rows, p.num_features)
        return coefficients, x[p.rows * p.num_features :]

    def penalty_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """The per-element L2 and L1 weights of the whole vector (0 on the intercepts)."""
        p = self.problem
        scale = 1.0 / self.label_scale if p.family == "gaussian" else 1.0
        size = glm_parameter_size(p)
        if p.standardization:
            per_feature_l2 = np.ones(p.num_features)
            per_feature_l1 = np.ones(p.num_features)
        else:
            per_feature_l2 = self._inverse_std**2
            per_feature_l1 = self._inverse_std
        l2, l1 = np.zeros(size), np.zeros(size)
        coefficients = p.rows * p.num_features
        l2_scale = scale if p.label_scaled_l2 else 1.0  # DistriOptimizer's: not by std_y
        l2[:coefficients] = np.tile(per_feature_l2, p.rows) * (p.l2 * l2_scale)
        l1[:coefficients] = np.tile(per_feature_l1, p.rows) * (p.l1 * scale)
        return l2, l1

    def initial(self) -> np.ndarray:
        """MLlib's starting point: zero coefficients; the binomial intercept at the log-odds,
        the multinomial ones at log(1 + class weight) less their mean."""
        p = self.problem
        x = np.zeros(glm_parameter_size(p))
        counts = self.stats.class_weights
        if p.fit_intercept and p.family == "binomial":
            x[-1] = np.log(counts[1] / counts[0])
        elif p.fit_intercept and p.family == "multinomial":
            raw = np.log1p(counts[: p.num_classes])
            x[-p.num_classes :] = raw - raw.mean()
        return x

    # -- the data part ------------------------------------------------------------------

    def data_loss(self, features, labels, weights, x: np.ndarray) -> tuple[float, np.ndarray]:
        """The weighted loss summed over these rows (not yet divided by the weight sum) and
        its gradient with respect to the whole vector ``x``."""
        p = self.problem
        w = np.ones(len(labels)) if weights is None else np.asarray(weights, np.float64)
        y = np.asarray(labels, np.float64)
        coefficients, intercepts = self.split(x)
        scaled = coefficients * self._inverse_std  # rows x d: x.beta/std
        margins = np.asarray(features @ scaled.T).reshape(len(y), p.rows)
        margins = margins - scaled_offsets(self._scaled_mean, coefficients)
        if intercepts.size:
            margins = margins + intercepts
        if p.family == "gaussian":
            shift = self.stats.label_mean / self.label_scale if p.fit_intercept else 0.0
            diff = margins[:, 0] + shift - y / self.label_scale
            loss = 0.5 * float(w @ diff**2)
            multipliers = (w * diff)[:, None]
        elif p.family == "binomial":
            m = margins[:, 0]
            loss = float(w @ (np.logaddexp(0.0, m) - y * m))
            multipliers = (w * (_sigmoid(m) - y))[:, None]
        else:
            top = margins.max(axis=1, keepdims=True)
            exp = np.exp(margins - top)
            total = exp.sum(axis=1, keepdims=True)
            log_norm = (np.log(total) + top)[:, 0]
            picked = margins[np.arange(len(y)), y.astype(np.int64)]
            loss = float(w @ (log_norm - picked))
            probabilities = exp / total
            probabilities[np.arange(len(y)), y.astype(np.int64)] -= 1.0
            multipliers = probabilities * w[:, None]
        del scaled, margins  # model-sized and row-sized: not kept through the gradient
        spread = np.asarray(features.T @ multipliers).T  # rows x d
        sums = multipliers.sum(axis=0)
        # the gradient written in place into one vector: (spread / std) - sums_k (mean / std)
        # per row, the same bits as the expression, without its model-sized temporaries
        grad = np.empty(x.size)
        coefficient_grad = grad[: p.rows * p.num_features].reshape(p.rows, p.num_features)
        np.multiply(spread, self._inverse_std, out=coefficient_grad)
        del spread
        centring = np.empty(p.num_features)
        for row in range(p.rows):
            np.multiply(sums[row], self._scaled_mean, out=centring)
            coefficient_grad[row] -= centring
        if intercepts.size:
            grad[p.rows * p.num_features :] = sums
        return loss, grad

    # -- back to the original space -----------------------------------------------------

    def original(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The coefficients (rows x d) and intercepts (rows) of ``x`` in the original space,
        with MLlib's centring of the multinomial ones."""
        p = self.problem
        coefficients, intercepts = self.split(x)
        scaled = coefficients * self._inverse_std
        if p.family == "gaussian":
            original = scaled * self.label_scale
            if p.fit_intercept:
                return original, np.array([self.stats.label_mean - original[0] @ self.stats.means])
            return original, np.zeros(1)
        if not p.fit_intercept:
            out_intercepts = np.zeros(p.rows)
        else:
            out_intercepts = intercepts - scaled_offsets(self._scaled_mean, coefficients)
        if p.family == "multinomial":
            if p.reg_param == 0.0:  # not identifiable: centred per feature, as glmnet
                scaled = scaled - scaled.mean(axis=0)
            if p.fit_intercept:
                out_intercepts = out_intercepts - out_intercepts.mean()
        return scaled, out_intercepts


def scaled_offsets(scaled_mean: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    """Each row's (mean/std).beta: what centring takes off every margin."""
    return coefficients @ scaled_mean


def _sigmoid(m: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-m)) without overflow."""
    out = np.empty_like(m)
    positive = m >= 0
    out[positive] = 1.0 / (1.0 + np.exp(-m[positive]))
    e = np.exp(m[~positive])
    out[~positive] = e / (1.0 + e)
    return out
