"""MLlib's normal equations (``WeightedLeastSquares``, LinearRegression's solver="normal").

One sum over all partitions of the weighted moments (the Gram matrix of the features, their
products with the label, the label's square, the weight sum) gives the whole problem; every
partition then solves the same small system the same way. MLlib's rules, kept here:

- the features and the label are scaled by their *population* weighted stds (divided by the
  weight sum, unlike the l-bfgs path's Summarizer), the label always (``standardizeLabel``);
- the L2 strength regParam * (1 - elasticNetParam) / std_y is added to the diagonal (divided
  by std_j^2 without ``standardization``); with an intercept the system is the Gram matrix of
  [features, 1], not centred;
- Cholesky when there is no L1 part, falling back to the quasi-Newton solver when the matrix
  is singular; with an L1 part the quasi-Newton solver (OWL-QN) on the quadratic, starting
  from zero coefficients and the label's mean for the intercept;
- a constant label: with an intercept (or a zero label) no training, the intercept the mean;
  without one and with regParam > 0 an error, as MLlib's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from allreduce_param.errors import InputError
from allreduce_param.models.glm import GlmProblem, GlmSolution, constant_label_answer

#: minimizes (objective, start, l1 weights) -> (x, objective history, iterations); the
#: quasi-Newton solver on one partition (optim/ is beside models/, so the caller passes it)
Minimizer = Callable[
    [Callable[[np.ndarray], tuple[float, np.ndarray]], np.ndarray, np.ndarray],
    tuple[np.ndarray, list[float], int],
]


def gram_moments(features, labels, weights) -> np.ndarray:
    """This partition's part of the sum: [weight sum, sum w y, sum w y^2, sum w x (d),
    sum w x y (d), the upper triangle of sum w x x^T (row by row)]."""
    w = np.ones(len(labels)) if weights is None else np.asarray(weights, np.float64)
    y = np.asarray(labels, np.float64)
    if hasattr(features, "tocsr"):
        csr = features.tocsr().astype(np.float64)
        gram = np.asarray((csr.T @ csr.multiply(w[:, None])).todense())
    else:
        dense = np.asarray(features, np.float64)
        gram = dense.T @ (dense * w[:, None])
    d = gram.shape[0]
    upper = gram[np.triu_indices(d)]
    wx = np.asarray(features.T @ w).ravel()
    wxy = np.asarray(features.T @ (w * y)).ravel()
    return np.concatenate([[w.sum(), w @ y, w @ (y * y)], wx, wxy, upper])


def solve_normal(problem: GlmProblem, moments: np.ndarray, minimizer: Minimizer) -> GlmSolution:
    """MLlib's WeightedLeastSquares on the summed ``gram_moments`` of all partitions;
    ``minimizer`` solves the quadratic where Cholesky does not (L1, a singular matrix)."""
    d = problem.num_features
    weight_sum, wy, wyy = moments[:3]
    if weight_sum <= 0:
        raise InputError("the weights (weightCol) sum to 0: no row counts")
    a_bar = moments[3 : 3 + d] / weight_sum
    ab_bar = moments[3 + d : 3 + 2 * d] / weight_sum
    aa_bar = np.zeros((d, d))
    aa_bar[np.triu_indices(d)] = moments[3 + 2 * d :] / weight_sum
    aa_bar = aa_bar + np.triu(aa_bar, 1).T
    b_bar, bb_bar = wy / weight_sum, wyy / weight_sum
    b_std = float(np.sqrt(max(bb_bar - b_bar * b_bar, 0.0)))
    if b_std == 0.0:
        answer = constant_label_answer(problem, b_bar)
        if answer is not None:
            return answer
        b_std = abs(b_bar)
    a_std = np.sqrt(np.maximum(np.diag(aa_bar) - a_bar**2, 0.0))
    inverse = np.zeros(d)
    np.divide(1.0, a_std, out=inverse, where=a_std != 0)
    # the scaled space
    a_bar_s = a_bar * inverse
    ab_bar_s = ab_bar * inverse / b_std
    aa_bar_s = aa_bar * np.outer(inverse, inverse)
    b_bar_s, bb_bar_s = b_bar / b_std, bb_bar / (b_std * b_std)
    regularization = problem.reg_param / b_std
    l1 = problem.elastic_net_param * regularization
    l2 = (1.0 - problem.elastic_net_param) * regularization
    diagonal = np.full(d, l2) if problem.standardization else l2 * inverse**2
    aa_bar_s[np.diag_indices(d)] += diagonal
    if problem.fit_intercept:
        aa = np.block([[aa_bar_s, a_bar_s[:, None]], [a_bar_s[None, :], np.ones((1, 1))]])
        ab = np.concatenate([ab_bar_s, [b_bar_s]])
    else:
        aa, ab = aa_bar_s, ab_bar_s
    solution, history, iterations, note = None, [0.0], 0, None
    if l1 == 0.0:
        try:
            factor = np.linalg.cholesky(aa)
            solution = np.linalg.solve(factor.T, np.linalg.solve(factor, ab))
        except np.linalg.LinAlgError:
            note = "the normal equations are singular: solved by the quasi-Newton solver"
    if solution is None:
        l1_weights = np.zeros(ab.size)
        l1_weights[:d] = l1 if problem.standardization else l1 * inverse
        start = np.zeros(ab.size)
        if problem.fit_intercept:
            start[-1] = b_bar_s

        def quadratic(x: np.ndarray) -> tuple[float, np.ndarray]:
            if problem.fit_intercept:  # the intercept follows from the coefficients, in place
                x[d] = b_bar_s - x[:d] @ a_bar_s  # (as MLlib's cost function writes it)
            product = aa @ x
            return 0.5 * bb_bar_s - ab @ x + 0.5 * x @ product, product - ab

        solution, history, iterations = minimizer(quadratic, start, l1_weights)
    coefficients = solution[:d] * b_std * inverse
    intercept = solution[d] * b_std if problem.fit_intercept else 0.0
    return GlmSolution(coefficients[None, :], np.array([intercept]), history, iterations, note)
