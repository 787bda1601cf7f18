"""MLlib's linear models solved over the engine (``train/task/glm_solve.py``): R's references
from Apache Spark's own ``WeightedLeastSquaresSuite``, scipy on MLlib's documented objective,
and the same answer from 1 and 3 partitions, dense and CSR rows, with empty partitions.

Each fit runs its partitions as threads of this process with real handles (``LocalRendezvous``
over 127.0.0.1 sockets), no Spark."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.optimize
import scipy.sparse
import scipy.special
from conftest import run_partitions

from allreduce_param.engine import AllReduceParameter
from allreduce_param.errors import InputError
from allreduce_param.models.glm import GlmProblem, glm_parameter_size
from allreduce_param.train.task.glm_solve import solve_glm

# WeightedLeastSquaresSuite's problem: A, b, w (R: A <- matrix(c(0, 1, 2, 3, 5, 7, 11, 13), 4, 2))
A = np.array([[0.0, 5.0], [1.0, 7.0], [2.0, 11.0], [3.0, 13.0]])
B = np.array([17.0, 19.0, 23.0, 29.0])
W = np.array([1.0, 2.0, 3.0, 4.0])


def fit(problem: GlmProblem, X=A, y=B, w=W, parts: int = 1, cuts=None):
    """Every partition's solution: the rows cut in ``parts`` consecutive runs (or ``cuts``,
    lists of row indices, some possibly empty)."""
    param = AllReduceParameter(partition_num=parts, size=glm_parameter_size(problem))
    cuts = cuts if cuts is not None else np.array_split(np.arange(len(y)), parts)

    def body(p):
        rows = np.asarray(cuts[p.info.partition_id], np.int64)
        return solve_glm(p, X[rows], y[rows], None if w is None else w[rows], problem)

    results = run_partitions(param, body)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def as_row(solution) -> np.ndarray:
    """R's order: intercept, then the coefficients."""
    return np.concatenate([solution.intercepts, solution.coefficients[0]])


def gaussian(**settings) -> GlmProblem:
    return GlmProblem("gaussian", 2, **settings)


# -- R's references -----------------------------------------------------------------------

LM = {False: [0.0, -3.727121, 3.009983], True: [18.08, 6.08, -0.60]}


@pytest.mark.parametrize("solver", ["normal", "l-bfgs"])
@pytest.mark.parametrize("standardization", [False, True])
@pytest.mark.parametrize("fit_intercept", [False, True])
def test_weighted_least_squares_match_r_lm(fit_intercept, standardization, solver):
    problem = gaussian(fit_intercept=fit_intercept, standardization=standardization, solver=solver)
    (solution,) = fit(problem)
    np.testing.assert_allclose(as_row(solution), LM[fit_intercept], atol=1e-4)
    assert len(solution.objective_history) == solution.iterations + 1


# glmnet(A, b, weights=w, intercept, lambda, standardize, alpha=0): intercept, lambda, standardize
RIDGE = {
    (False, 0.1, False): [0.0, -3.307532, 2.924206],
    (False, 0.1, True): [0.0, -2.914790, 2.840627],
    (False, 1.0, False): [0.0, -1.526575, 2.558158],
    (False, 1.0, True): [0.0, 0.06984238, 2.20488344],
    (True, 0.1, False): [13.5356178, 3.2714044, 0.3770744],
    (True, 0.1, True): [14.064629, 3.565802, 0.269593],
    (True, 1.0, False): [10.1238013, 0.9708569, 1.1475466],
    (True, 1.0, True): [13.1860638, 2.1761382, 0.6213134],
}


def test_normal_equations_match_glmnet_ridge():
    for (fit_intercept, reg, standardization), expected in RIDGE.items():
        problem = gaussian(
            fit_intercept=fit_intercept, reg_param=reg, standardization=standardization,
            solver="normal",
        )  # fmt: skip
        (solution,) = fit(problem)
        np.testing.assert_allclose(as_row(solution), expected, atol=1e-4, err_msg=str(problem))


# glmnet with alpha: for intercept, lambda (0.1, 0.5, 1.0), standardize, alpha (0.1, 0.5, 1.0)
ELASTIC_NET = [
    [0, -3.2928206726474, 2.92118822588649],
    [0, -3.23085414359003, 2.90848366035008],
    [0, -3.14558628299477, 2.89101408157209],
    [0, -2.91924558816421, 2.84172398097327],
    [0, -2.93832343383477, 2.84636891947663],
    [0, -2.96539689593024, 2.85283836322185],
    [0, -2.13785756976542, 2.68446351346705],
    [0, -1.68009377560774, 2.59084422793154],
    [0, -0.819463123385533, 2.41514053108346],
    [0, -0.960837488151064, 2.43010130999756],
    [0, -0.618792151647599, 2.36349074148962],
    [0, 0, 2.24081114726441],
    [0, -1.34657309253953, 2.52129296638512],
    [0, -0.368045602821844, 2.32123616258871],
    [0, 0, 2.24440619621343],
    [0, 0, 2.21981559944924],
    [0, 0, 2.22369447413621],
    [0, 0, 2.22861024633605],
    [13.5631591827557, 3.28115132060568, 0.372551747695477],
    [13.6953934007661, 3.3336271417751, 0.349745414969587],
    [13.960027608754, 3.46001702257532, 0.29999407173994],
    [14.2389889013085, 3.65899196445023, 0.234906458633754],
    [15.2374079667397, 4.21196428071551, 0.0325637953681963],
    [15.4, 4.3, 0],
    [10.4423647474653, 1.24606545153166, 1.06399080283378],
    [8.95807177856822, 0.193847088148233, 1.4090609658784],
    [8.86567164179104, 0, 1.45522388059702],
    [13.0430927453034, 2.49271514356687, 0.574180477650271],
    [13.8144287399675, 2.72202744354555, 0.455915035859752],
    [16.2, 3.9, 0],
    [9.89047681835741, 0.757469417613661, 1.21101772561685],
    [9.07222551185964, 0, 1.43536293155196],
    [9.51243781094527, 0, 1.39303482587065],
    [13.3677796362763, 2.17212164262107, 0.604613180623227],
    [14.2554457236073, 2.22851848830683, 0.508415124978748],
    [17.2, 3.4, 0],
]


@pytest.mark.slow
def test_normal_equations_with_l1_match_glmnet_elastic_net():
    grid = [
        (fit_intercept, reg, standardization, alpha)
        for fit_intercept in (False, True)
        for reg in (0.1, 0.5, 1.0)
        for standardization in (False, True)
        for alpha in (0.1, 0.5, 1.0)
    ]
    for (fit_intercept, reg, standardization, alpha), expected in zip(grid, ELASTIC_NET):
        problem = gaussian(
            fit_intercept=fit_intercept, reg_param=reg, standardization=standardization,
            elastic_net_param=alpha, solver="normal", tol=1e-10,
        )  # fmt: skip
        (solution,) = fit(problem)
        np.testing.assert_allclose(as_row(solution), expected, atol=1e-4, err_msg=str(problem))


@pytest.mark.parametrize("solver", ["normal", "l-bfgs"])
def test_a_constant_label_gives_r_lm_answers_and_mllib_special_cases(solver):
    constant = np.full(4, 17.0)
    (through_origin,) = fit(gaussian(fit_intercept=False, solver=solver), y=constant)
    np.testing.assert_allclose(as_row(through_origin), [0.0, -9.221298, 3.394343], atol=1e-4)
    (with_intercept,) = fit(gaussian(solver=solver), y=constant)
    assert as_row(with_intercept).tolist() == [17.0, 0.0, 0.0]
    assert with_intercept.objective_history == [0.0] and with_intercept.note
    (zero,) = fit(gaussian(fit_intercept=False, solver=solver), y=np.zeros(4))
    assert as_row(zero).tolist() == [0.0, 0.0, 0.0] and zero.objective_history == [0.0]
    with pytest.raises(InputError, match="regParam"):
        fit(gaussian(fit_intercept=False, reg_param=0.1, solver=solver), y=constant)


# glmnet on A with a constant first column: intercept, standardize, (lambda, alpha)
CONSTANT_FEATURE = {
    (False, False): [[0, 0, 2.253012], [0, 0, 2.250857], [0, 0, 2.249784], [0, 0, 2.248709]],
    (False, True): [[0, 0, 2.253012], [0, 0, 2.235802], [0, 0, 2.238297], [0, 0, 2.240811]],
    (True, False): [
        [8.218905, 0, 1.517413],
        [8.434286, 0, 1.496703],
        [8.648497, 0, 1.476106],
        [8.865672, 0, 1.455224],
    ],
    (True, True): [
        [8.218905, 0, 1.517413],
        [9.798771, 0, 1.365503],
        [9.919095, 0, 1.353933],
        [10.052804, 0, 1.341077],
    ],
}


def test_a_constant_feature_gets_no_coefficient_as_in_glmnet():
    constant_column = A.copy()
    constant_column[:, 0] = 1.0
    for (fit_intercept, standardization), rows in CONSTANT_FEATURE.items():
        for (reg, alpha), expected in zip([(0.0, 0.0), (0.5, 0.0), (0.5, 0.5), (0.5, 1.0)], rows):
            problem = gaussian(
                fit_intercept=fit_intercept, standardization=standardization, reg_param=reg,
                elastic_net_param=alpha, solver="normal", tol=1e-9,
            )  # fmt: skip
            (solution,) = fit(problem, X=constant_column)
            np.testing.assert_allclose(as_row(solution), expected, atol=1e-4, err_msg=str(problem))


# -- MLlib's objective, minimized by scipy --------------------------------------------------


def blob_rows(family: str, rows: int = 60, features: int = 4, seed: int = 3):
    """Correlated features of different scales, labels from a noisy linear model, weights."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, features)) @ rng.standard_normal((features, features))
    X = X * np.array([1.0, 10.0, 0.1, 3.0])[:features] + np.arange(features)
    margin = X @ rng.standard_normal(features) + 0.5 * rng.standard_normal(rows)
    if family == "gaussian":
        y = margin + 3.0
    elif family == "binomial":
        y = (margin > np.median(margin)).astype(float)
    else:
        y = np.digitize(margin, np.quantile(margin, [1 / 3, 2 / 3])).astype(float)
    return X, y, rng.uniform(0.5, 2.0, rows)


def mllib_objective(problem: GlmProblem, X, y, w):
    """MLlib's documented objective in the ORIGINAL space, written out independently of the
    package: (1/sum w) sum w loss(x.beta + b, y) + L2 on beta scaled by the features' std
    (``standardization``) or not; for LinearRegression the loss and the penalty strength are
    divided by the label's std (the unbiased weighted stds, as MLlib's Summarizer's)."""
    weight_sum = w.sum()
    unbiased = weight_sum - (w * w).sum() / weight_sum

    def std(v):
        mean = w @ v / weight_sum
        return np.sqrt(w @ (v - mean) ** 2 / unbiased)

    stds = np.array([std(X[:, j]) for j in range(X.shape[1])])
    y_std = std(y) if problem.family == "gaussian" else 1.0
    rows, d = problem.rows, problem.num_features

    def value_and_gradient(params):
        beta = params[: rows * d].reshape(rows, d)
        b = params[rows * d :] if problem.fit_intercept else np.zeros(rows)
        margins = X @ beta.T + b
        if problem.family == "gaussian":
            losses = 0.5 * ((margins[:, 0] - y) / y_std) ** 2
            slopes = ((margins[:, 0] - y) / y_std**2)[:, None]
        elif problem.family == "binomial":
            losses = np.logaddexp(0, margins[:, 0]) - y * margins[:, 0]
            slopes = (scipy.special.expit(margins[:, 0]) - y)[:, None]
        else:
            picked = margins[np.arange(len(y)), y.astype(int)]
            losses = scipy.special.logsumexp(margins, axis=1) - picked
            slopes = scipy.special.softmax(margins, axis=1)
            slopes[np.arange(len(y)), y.astype(int)] -= 1.0
        factor = stds / y_std if problem.standardization else np.full(d, 1.0 / y_std)
        strength = problem.l2 / y_std
        value = w @ losses / weight_sum + strength * 0.5 * np.sum((beta * factor) ** 2)
        weighted = slopes * w[:, None] / weight_sum
        gradient = [(weighted.T @ X + strength * beta * factor**2).ravel()]
        if problem.fit_intercept:
            gradient.append(weighted.sum(axis=0))
        return value, np.concatenate(gradient)

    return value_and_gradient


@pytest.mark.parametrize("standardization", [True, False])
@pytest.mark.parametrize(
    "family", ["gaussian", "binomial", pytest.param("multinomial", marks=pytest.mark.slow)]
)
def test_the_solver_reaches_the_minimum_of_mllibs_objective(family, standardization):
    X, y, w = blob_rows(family)
    problem = GlmProblem(
        family, 4, num_classes={"gaussian": 1, "binomial": 2}.get(family, 3), reg_param=0.05,
        standardization=standardization, tol=1e-10, max_iter=500,
    )  # fmt: skip
    solutions = fit(problem, X, y, w, parts=3)
    objective = mllib_objective(problem, X, y, w)
    start = np.zeros(problem.rows * 5)
    reference = scipy.optimize.minimize(
        objective, start, jac=True, method="L-BFGS-B",
        options={"ftol": 1e-15, "gtol": 1e-10, "maxiter": 5000},
    ).x  # fmt: skip
    ours = np.concatenate([solutions[0].coefficients.ravel(), solutions[0].intercepts])
    if family == "multinomial":  # the intercepts are defined up to a constant: MLlib centres them
        reference[-3:] -= reference[-3:].mean()
    assert objective(ours)[0] <= objective(reference)[0] + 1e-9
    np.testing.assert_allclose(ours, reference, atol=2e-4 * max(1.0, np.abs(reference).max()))
    assert all(np.array_equal(s.coefficients, solutions[0].coefficients) for s in solutions)
    history = solutions[0].objective_history
    assert len(history) == solutions[0].iterations + 1 and history[-1] < history[0]


def test_dense_and_sparse_rows_on_1_or_3_partitions_with_an_empty_one_agree():
    X, y, w = blob_rows("binomial", rows=40)
    X[np.abs(X) < 1.0] = 0.0  # some zeros for the sparse rows to leave out
    problem = GlmProblem(
        "binomial", 4, num_classes=2, reg_param=0.02, elastic_net_param=0.5, tol=1e-9
    )
    (dense,) = fit(problem, X, y, w)
    sparse = fit(problem, scipy.sparse.csr_matrix(X), y, w, parts=3,
                 cuts=[np.arange(0, 25), [], np.arange(25, 40)])  # fmt: skip
    for solution in sparse:
        np.testing.assert_allclose(solution.coefficients, dense.coefficients, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(solution.intercepts, dense.intercepts, rtol=1e-6)
    assert abs(sparse[0].iterations - dense.iterations) <= 1
    assert np.count_nonzero(dense.coefficients) < 4  # the L1 part set some to zero


def test_a_label_with_one_class_gives_mllibs_infinite_intercept():
    X, _, w = blob_rows("binomial", rows=10)
    (binomial,) = fit(GlmProblem("binomial", 4, num_classes=2), X, np.ones(10), w)
    assert binomial.intercepts.tolist() == [np.inf] and not binomial.coefficients.any()
    assert binomial.objective_history == [0.0] and binomial.iterations == 0  # as MLlib's summary
    (multinomial,) = fit(GlmProblem("multinomial", 4, num_classes=3), X, np.full(10, 2.0), w)
    assert multinomial.intercepts.tolist() == [0.0, 0.0, np.inf] and multinomial.note


def test_multinomial_without_regularization_centres_coefficients_and_intercepts():
    X, y, w = blob_rows("multinomial", rows=30)
    (solution,) = fit(GlmProblem("multinomial", 4, num_classes=3, max_iter=30), X, y, w)
    np.testing.assert_allclose(solution.coefficients.sum(axis=0), 0.0, atol=1e-9)
    assert abs(solution.intercepts.sum()) < 1e-9


# -- bad input ------------------------------------------------------------------------------


def partition_errors(problem: GlmProblem, parts: list, size: int | None = None) -> list:
    """Each partition's error (or result) for its (features, labels) in ``parts``."""
    param = AllReduceParameter(partition_num=len(parts), size=size or glm_parameter_size(problem))
    return run_partitions(
        param, lambda p: solve_glm(p, *parts[p.info.partition_id], None, problem), timeout=30
    )


def test_bad_rows_fail_every_partition_at_once_naming_what_is_wrong():
    problem = GlmProblem("binomial", 2, num_classes=2)
    good = (A[:2], np.array([0.0, 1.0]))
    with_nan = (np.array([[np.nan, 1.0]]), np.array([1.0]))
    errors = partition_errors(problem, [good, with_nan])
    assert isinstance(errors[1], InputError) and "NaN" in str(errors[1])
    assert "other partition" in str(errors[0]) or "NaN" in str(errors[0])  # or it stopped first
    (wrong_width,) = partition_errors(problem, [(np.ones((2, 3)), np.zeros(2))])
    assert isinstance(wrong_width, InputError) and "numFeatures is 2" in str(wrong_width)
    (wrong_label,) = partition_errors(problem, [(A[:2], np.array([0.0, 2.0]))])
    assert isinstance(wrong_label, InputError) and "StringIndexer" in str(wrong_label)
    (no_rows,) = partition_errors(problem, [(np.zeros((0, 2)), np.zeros(0))])
    assert isinstance(no_rows, InputError) and "no rows" in str(no_rows)
    (wrong_size,) = partition_errors(problem, [good], size=7)
    assert isinstance(wrong_size, InputError) and "glm_parameter_size" in str(wrong_size)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"reg_param": -1.0}, "regParam"),
        ({"elastic_net_param": 1.5}, "elasticNetParam"),
        ({"max_iter": -1}, "maxIter"),
        ({"tol": float("nan")}, "tol"),
        ({"num_classes": 3}, "multinomial"),
        ({"solver": "normal"}, "gaussian family only"),
    ],
)
def test_a_problem_with_bad_settings_is_refused_naming_mllibs_param(settings, named):
    with pytest.raises(InputError, match=named):
        GlmProblem("binomial", 2, **{"num_classes": 2, **settings})


# -- checkpoints ------------------------------------------------------------------------------


def test_a_run_resumed_from_an_iterations_state_ends_as_the_whole_run():
    X, y, w = blob_rows("binomial", rows=40)
    problem = GlmProblem("binomial", 4, num_classes=2, reg_param=0.01, elastic_net_param=0.3)
    whole = fit(problem, X, y, w, parts=2)
    kept: dict = {}
    cuts = np.array_split(np.arange(40), 2)
    param = AllReduceParameter(partition_num=2, size=glm_parameter_size(problem))

    def first_run(p):
        i = p.info.partition_id

        def keep(arrays):  # the third iteration's state, as a checkpoint would hold it
            if arrays["flags"][0] == 3:
                kept[i] = {name: array.copy() for name, array in arrays.items()}

        return solve_glm(p, X[cuts[i]], y[cuts[i]], w[cuts[i]], problem, on_iteration=keep)

    run_partitions(param, first_run)
    assert sorted(kept) == [0, 1] and kept[0]["steps"].shape[0] == 3  # each its own slices

    def resumed(p):
        i = p.info.partition_id
        return solve_glm(p, X[cuts[i]], y[cuts[i]], w[cuts[i]], problem, resume=kept[i])

    again = run_partitions(AllReduceParameter(partition_num=2, size=param.size), resumed)
    for solution in again:
        assert np.array_equal(solution.coefficients, whole[0].coefficients)
        assert np.array_equal(solution.intercepts, whole[0].intercepts)
        assert solution.objective_history == whole[0].objective_history
        assert solution.iterations == whole[0].iterations > 3
