"""solve_glm side by side with MLlib's own LinearRegression and LogisticRegression, run live
on the shared Spark session: the same coefficients, objective and iteration count on the same
rows and Params (the solver follows Breeze's rules step by step, so they agree to rounding).

Where OWL-QN crawls along an ill-conditioned valley (WeightedLeastSquaresSuite's problem
without an intercept and with an L1 part) the summation order of 2 partitions against MLlib's
can change when the stopping rule fires by one iteration; those cases are left out here (the
R references of test_glm_solve.py cover them at a tight tol). Each MLlib fit runs a Spark job
per iteration, so two cases only: the binomial family's objective is checked against scipy in
test_glm_solve.py (it matched MLlib to 1e-15 when this was written)."""

from __future__ import annotations

import numpy as np
import pytest
from test_glm_solve import A, B, W, blob_rows, fit

from allreduce_param.models.glm import GlmProblem

pytestmark = pytest.mark.slow

CASES = [
    # family, our Params and MLlib's (the same values under their names)
    ("gaussian", dict(reg_param=0.1, elastic_net_param=0.5, solver="l-bfgs")),
    ("multinomial", dict(reg_param=0.02, elastic_net_param=0.5)),
]

MLLIB_NAMES = {
    "reg_param": "regParam",
    "elastic_net_param": "elasticNetParam",
    "fit_intercept": "fitIntercept",
    "standardization": "standardization",
    "solver": "solver",
}


def mllib_fit(spark, family: str, settings: dict, X, y, w):
    """MLlib's model's (coefficients, intercepts, objectiveHistory, totalIterations)."""
    from pyspark.ml.classification import LogisticRegression
    from pyspark.ml.linalg import Vectors
    from pyspark.ml.regression import LinearRegression

    frame = spark.createDataFrame(
        [(float(label), float(weight), Vectors.dense(row.tolist())) for label, weight, row in zip(y, w, X)],
        ["label", "w", "features"],
    )  # fmt: skip
    params = {MLLIB_NAMES[name]: value for name, value in settings.items()}
    if family == "gaussian":
        model = LinearRegression(weightCol="w", **params).fit(frame)
        coefficients, intercepts = model.coefficients.toArray()[None, :], [model.intercept]
    else:
        model = LogisticRegression(weightCol="w", family=family, **params).fit(frame)
        coefficients = model.coefficientMatrix.toArray()
        intercepts = model.interceptVector.toArray()
    summary = model.summary
    return coefficients, np.asarray(intercepts), summary.objectiveHistory, summary.totalIterations


@pytest.mark.parametrize(("family", "settings"), CASES)
def test_solve_glm_gives_mllibs_answer_on_the_same_rows(spark, family, settings):
    if family == "gaussian":
        X, y, w = A, B, W
    else:
        X, y, w = blob_rows(family)
    classes = {"gaussian": 1, "binomial": 2, "multinomial": 3}[family]
    problem = GlmProblem(family, X.shape[1], num_classes=classes, **settings)
    ours = fit(problem, X, y, w, parts=2)[0]
    coefficients, intercepts, history, iterations = mllib_fit(spark, family, settings, X, y, w)
    scale = max(1.0, np.abs(coefficients).max())
    np.testing.assert_allclose(ours.coefficients, coefficients, atol=1e-6 * scale)
    np.testing.assert_allclose(ours.intercepts, intercepts, atol=1e-6 * scale)
    np.testing.assert_allclose(ours.objective_history[-1], history[-1], rtol=1e-9)
    assert ours.iterations == iterations
