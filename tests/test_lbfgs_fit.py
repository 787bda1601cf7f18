"""``DistriOptimizer(solver="lbfgs")``: a built-in linear model fitted to the minimiser of its
own objective (the weighted mean loss plus ``regularization``'s penalty as
``train.regularisation`` defines it), checked against scipy on that objective written out
here; and the combinations it refuses, by name."""

from __future__ import annotations

import re

import numpy as np
import pytest
import scipy.optimize
import scipy.special
from conftest import run_partitions
from pyspark.ml.linalg import Vectors
from test_watchers import events

from allreduce_param import Checkpoints, DistriOptimizer, TrainedModel, models, optim
from allreduce_param.engine import AllReduceParameter
from allreduce_param.errors import ConfigurationError
from allreduce_param.models.glm import glm_parameter_size
from allreduce_param.train.driver.lbfgs_fit import glm_problem
from allreduce_param.train.regularisation import Regularization
from allreduce_param.train.settings import FitSettings
from allreduce_param.train.task.glm_solve import solve_glm


def _data(rows: int, seed: int):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, 3)) * np.array([1.0, 3.0, 0.5]) + np.array([0.0, 1.0, -2.0])
    w = rng.uniform(0.5, 2.0, rows)
    return X, w


def _minimum(X, y, w, rule: Regularization, loss: str) -> tuple[np.ndarray, float]:
    """scipy's minimiser (coefficients then intercept) and minimum of the model's objective:
    sum w_i loss_i / sum w + reg ((1 - a)/2 sum (s_j c_j)^2 + a sum s_j |c_j|), s_j the
    features' unbiased weighted stds (1 without standardization); the L1 part as c = u - v,
    u, v >= 0, so that L-BFGS-B minimises a smooth function."""
    d, total = X.shape[1], w.sum()
    mean = w @ X / total
    std = np.sqrt(w @ (X - mean) ** 2 / (total - (w @ w) / total))
    s = std if rule.standardization else np.ones(d)
    l2 = rule.reg_param * (1 - rule.elastic_net_param) * s**2
    l1 = rule.reg_param * rule.elastic_net_param * s

    def objective(z):
        c, b = z[:d] - z[d : 2 * d], z[-1]
        m = X @ c + b
        if loss == "squared":
            r = m - y
            value, dm = 0.5 * w @ r**2, w * r
        else:
            value = w @ (np.logaddexp(0.0, m) - y * m)
            dm = w * (scipy.special.expit(m) - y)
        value = value / total + 0.5 * l2 @ c**2 + l1 @ (z[:d] + z[d : 2 * d])
        gc = X.T @ dm / total + l2 * c
        grad = np.concatenate([gc + l1, -gc + l1, [dm.sum() / total]])
        return value, grad

    bounds = [(0, None)] * (2 * d) + [(None, None)]
    found = scipy.optimize.minimize(
        objective,
        np.zeros(2 * d + 1),
        jac=True,
        method="L-BFGS-B",
        bounds=bounds,
        options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 5000},
    )
    z = found.x
    return np.concatenate([z[:d] - z[d : 2 * d], [z[-1]]]), float(found.fun)


def test_squared_error_objective_is_minimised_as_scipy_finds_it():
    """LinearRegression's mean 0.5 squared error with an elastic net, on 2 partitions:
    the GlmProblem the lbfgs solver makes of it has scipy's minimiser, and its history ends
    at scipy's minimum in the label's units (Spark-free: the tasks as threads)."""
    X, w = _data(30, seed=1)
    y = X @ np.array([1.5, -0.4, 2.0]) + 3.0 + np.random.default_rng(2).normal(0, 0.5, 30)
    rule = Regularization(0.3, 0.4, standardization=True)
    settings = FitSettings(solver="lbfgs", regularization=rule, max_iter=500, tol=1e-14)
    problem = glm_problem(models.LinearRegression(3), settings, 3)
    param = AllReduceParameter(partition_num=2, size=glm_parameter_size(problem))
    cuts = np.array_split(np.arange(30), 2)

    def body(p):
        rows = cuts[p.info.partition_id]
        return solve_glm(p, X[rows], y[rows], w[rows], problem)

    solution = run_partitions(param, body)[0]
    expected, minimum = _minimum(X, y, w, rule, "squared")
    ours = np.concatenate([solution.coefficients[0], solution.intercepts])
    np.testing.assert_allclose(ours, expected, atol=1e-6)
    assert solution.objective_history[-1] * solution.objective_scale == pytest.approx(
        minimum, rel=1e-9
    )


@pytest.mark.slow
def test_lbfgs_fits_a_builtin_logistic_model_to_scipys_minimiser(spark, tmp_path):
    """One Spark fit: weighted rows, an elastic net (OWL-QN) with standardization; the
    weights are scipy's minimiser, the history one objective per iteration ending at
    scipy's minimum (TensorBoard's too), and the result predicts, saves and loads as any
    TrainedModel."""
    X, w = _data(40, seed=3)
    margin = X @ np.array([1.0, -0.7, 1.5]) + 0.5
    y = (np.random.default_rng(4).uniform(size=40) < 1 / (1 + np.exp(-margin))).astype(float)
    frame = spark.createDataFrame(
        [(Vectors.dense(x.tolist()), float(t), float(v)) for x, t, v in zip(X, y, w)],
        ["features", "label", "weight"],
    ).repartition(2)
    rule = Regularization(0.02, 0.5, standardization=True)
    model = models.LogisticRegression(3)
    trained = DistriOptimizer(
        model,
        None,
        solver="lbfgs",
        regularization=rule,
        max_iter=300,
        tol=1e-14,
        tensorboard_dir=str(tmp_path / "tb"),
        checkpoints=Checkpoints(dir=str(tmp_path / "ckpt"), every=5),
        data_in="disk",  # the rows read from row files at every pass: the same minimiser
    ).fit(frame, weight_col="weight")
    expected, minimum = _minimum(X, y, w, rule, "logistic")
    tensors = model.tensors(trained.weights)
    ours = np.concatenate([tensors["w1"][:, 0], tensors["b1"]])
    np.testing.assert_allclose(ours, expected, atol=1e-6)
    history = trained.history.epochs
    assert history[-1]["loss"] == pytest.approx(minimum, rel=1e-9)
    assert [e["epoch"] for e in history] == list(range(len(history)))
    assert history[0]["loss"] > history[-1]["loss"] and trained.epochs_done == len(history) - 1
    scalars = events(tmp_path / "tb")["epoch/loss"]  # watched as every fit
    assert [step for step, _ in scalars] == list(range(len(history)))
    np.testing.assert_allclose([v for _, v in scalars], [e["loss"] for e in history], rtol=1e-6)
    predicted = trained.predict_numpy(X.astype(np.float32))
    np.testing.assert_array_equal(predicted, (X @ expected[:3] + expected[3] > 0).astype(int))
    trained.save(tmp_path / "model")
    np.testing.assert_array_equal(TrainedModel.load(tmp_path / "model").weights, trained.weights)
    # the linear Estimators' checkpoints: complete steps (a manifest each) every 5 iterations
    steps = sorted((tmp_path / "ckpt").glob("*/step-*/manifest.json"))
    assert steps and all(int(s.parent.name.split("-")[1]) % 5 == 0 for s in steps)


@pytest.mark.parametrize(
    ("model", "settings", "named"),
    [
        (models.MLP([3, 4, 2]), {}, "MLP"),
        (
            models.LogisticRegression(3),
            {"batch_size": 64, "codec": "raw"},
            "batch_size=64, codec='raw'",
        ),
        (models.LogisticRegression(3), {"strategy": "ssp", "staleness": 2}, "staleness"),
    ],
)
def test_what_lbfgs_cannot_do_is_refused_by_name(model, settings, named):
    trainer = DistriOptimizer(model, None, solver="lbfgs", **settings)
    with pytest.raises(ConfigurationError, match=named) as refused:
        trainer.fit(None)
    assert "solver='lbfgs'" in str(refused.value)
    with pytest.raises(ConfigurationError, match="validation"):
        DistriOptimizer(models.LinearRegression(3), None, solver="lbfgs").fit(None, validation=1)
    with pytest.raises(ConfigurationError, match="pass None"):
        DistriOptimizer(models.LinearRegression(3), optim.SGD(lr=0.1), solver="lbfgs").fit(None)
    with pytest.raises(ConfigurationError, match="solver must be one of"):
        DistriOptimizer(models.LinearRegression(3), optim.SGD(lr=0.1), solver="newton")


def test_the_allreduce_estimators_refuse_minibatch_params_under_lbfgs():
    """AllReduceClassifier/Regressor(solver="lbfgs") refuse, before any Spark job, each Param
    set that only the mini-batch solver reads, by DistriOptimizer(solver="lbfgs")'s rule,
    named as the Params; with none set they take every default."""
    from allreduce_param.ml import AllReduceClassifier, AllReduceRegressor
    from allreduce_param.train.driver.lbfgs_fit import unused_settings

    assert unused_settings(AllReduceClassifier(solver="lbfgs")._settings()) == []
    with pytest.raises(ConfigurationError) as refused:
        AllReduceClassifier(solver="lbfgs", optimizer="sgd", stepSize=0.5).fit(None)
    assert str(refused.value).startswith(
        "AllReduceClassifier: solver='lbfgs' is one full-batch solve and does not use "
        "optimizer='sgd', stepSize=0.5: leave each at its default (maxIter and tol stop it)"
    )
    for params, named in [
        ({"hiddenLayers": [4]}, "hiddenLayers=[4]"),
        ({"validationIndicatorCol": "held"}, "validationIndicatorCol='held'"),
        ({"batchSize": 64, "stepSize": 0.1}, "stepSize=0.1, batchSize=64"),
    ]:
        with pytest.raises(ConfigurationError, match=re.escape(named)):
            AllReduceRegressor(solver="lbfgs", **params).fit(None)
