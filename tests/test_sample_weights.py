"""Sample weights on partitions run as threads: each step's gradient is the weighted mean
over its global batch, exactly, however unevenly the rows and their weights fall, through
every way a step is computed (whole, split over threads, streamed as backward runs); whole
weights train as repeated rows do; evaluation weighs the rows too."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import blobs, raise_first, train_on_threads

from allreduce_param import FitSettings, InputError, models, optim
from allreduce_param.engine import AllReduceParameter
from allreduce_param.train.result import STEP_FIELDS
from allreduce_param.train.task.compute import SubBatches, evaluate
from allreduce_param.train.task.job import TrainingJob


def uneven_parts(sizes=(7, 19, 30), features=3, seed=4) -> list:
    """(X, y, split, weight) per partition: uneven row counts, fractional weights, some 0."""
    rng = np.random.default_rng(seed)
    parts = []
    for rows in sizes:
        X = rng.standard_normal((rows, features)).astype(np.float32)
        y = X @ np.arange(1.0, features + 1) + rng.standard_normal(rows)
        weight = rng.uniform(0, 3, rows) * (rng.random(rows) > 0.2)
        parts.append((X, y, np.zeros(rows, np.int32), weight))
    return parts


def job_for(model, parts, **settings) -> TrainingJob:
    param = AllReduceParameter(len(parts), model.size, codec="raw", timeout=60)
    settings = {
        "batch_size": sum(len(part[0]) for part in parts),
        "epochs": 1,
        "seed": 2,
        "threads": None,
        "optimizer": optim.SGD(lr=0.1),
        **settings,
    }
    optimizer = settings.pop("optimizer")
    return TrainingJob(
        model,
        optimizer,
        param,
        FitSettings(**settings),
        n_features=parts[0][0].shape[1],
        has_validation=any(len(part) > 2 and (part[2] == 1).any() for part in parts),
    )


def trained(job, parts) -> tuple[np.ndarray, list]:
    outputs = raise_first(train_on_threads(job, parts))
    return np.frombuffer(outputs[0]["weights"], np.float32), outputs


@pytest.mark.parametrize(
    "how",
    [{"overlap": False}, {"overlap": True}, {"overlap": False, "threads": 2}],
    ids=["whole", "streamed", "threads"],
)
def test_one_full_batch_step_is_the_weighted_mean_of_the_row_gradients(how):
    model = models.LinearRegression(3)
    parts = uneven_parts()
    start = model.init(np.random.default_rng(2))
    weights, outputs = trained(job_for(model, parts, **how), parts)
    # the weighted mean, in float64, of each row's own gradient (computed one row at a time)
    total, weight_sum = np.zeros(model.size), 0.0
    for X, y, _, weight in parts:
        for row in range(len(X)):
            _, grad, _ = model.loss_and_grad(start, X[row : row + 1], y[row : row + 1])
            total += weight[row] * grad.astype(np.float64)
            weight_sum += weight[row]
    np.testing.assert_allclose(weights, start - 0.1 * total / weight_sum, rtol=1e-5, atol=1e-6)
    step = np.frombuffer(outputs[1]["steps"], np.float64).reshape(-1, len(STEP_FIELDS))
    # the weights' sum
    assert step[0, STEP_FIELDS.index("samples")] == pytest.approx(parts[1][3].sum())


def test_whole_weights_train_as_repeated_rows_do():
    X, y = blobs(60, 4, 3, seed=5)
    weight = np.random.default_rng(6).integers(0, 4, 60).astype(np.float64)
    weighted = [(X[i::2], y[i::2], np.zeros(30, np.int32), weight[i::2]) for i in range(2)]
    repeated = [
        (
            np.repeat(X[i::2], weight[i::2].astype(int), axis=0),
            np.repeat(y[i::2], weight[i::2].astype(int)),
        )
        for i in range(2)
    ]
    settings = {
        "batch_size": 400,
        "epochs": 6,
        "optimizer": optim.Adam(lr=0.05),
    }  # full batch: one step an epoch
    by_weight, _ = trained(job_for(models.MLP([4, 8, 3]), weighted, **settings), weighted)
    by_rows, _ = trained(job_for(models.MLP([4, 8, 3]), repeated, **settings), repeated)
    np.testing.assert_allclose(by_weight, by_rows, rtol=1e-4, atol=1e-5)


def test_evaluation_weighs_the_validation_and_training_rows():
    model = models.LinearRegression(3)
    parts = uneven_parts()
    # validation rows: the first half with weight 0 and absurd labels, which must not count
    with_validation = []
    for X, y, _, weight in parts:
        half = len(X) // 2
        split = np.zeros(len(X), np.int32)
        split[: len(X) - half] = 1
        labels, weights = y.copy(), weight.copy()
        labels[:half], weights[:half] = 1e6, 0.0
        with_validation.append((X, labels, split, weights))
    weights, outputs = trained(
        job_for(model, with_validation, batch_size=16, epochs=2), with_validation
    )
    shares = [json.loads(output["epochs"])[-1] for output in outputs]
    loss_sum, _, count = np.sum([share["val"] for share in shares], axis=0)
    X, y, w = (
        np.concatenate([part[k][part[2] == 1] for part in with_validation]) for k in (0, 1, 3)
    )
    z = X.astype(np.float64) @ weights[:3] + weights[3]
    assert count == pytest.approx(w.sum())
    assert loss_sum / count == pytest.approx(np.sum(w * 0.5 * (z - y) ** 2) / w.sum(), rel=1e-5)


def test_evaluate_weighs_the_metric_too():
    model = models.SoftmaxRegression(2, 2)
    weights = model.init(np.random.default_rng(0))
    X = np.array([[1, 0], [0, 1], [1, 1]], np.float32)
    predicted = model.predict(weights, X)
    y = predicted.astype(np.float64)
    y[2] = 1 - y[2]  # the third row is wrong
    loss_sum, correct, count = evaluate(model, weights, X, y, np.array([1.0, 2.0, 5.0]))
    assert (correct, count) == (3.0, 8.0)
    assert evaluate(model, weights, X, y)[1:] == [2.0, 3.0]


class _IntoWithoutWeights(models.LinearRegression):
    def loss_and_grad_into(self, weights, X, y, out, ready=None):
        return super().loss_and_grad_into(weights, X, y, out, ready)


class _WrongCount(models.LinearRegression):
    def loss_and_grad_into(self, weights, X, y, out, ready=None, sample_weight=None):
        loss, _ = super().loss_and_grad_into(weights, X, y, out, ready, sample_weight=sample_weight)
        return loss, len(X)


def test_a_weighted_fit_streams_only_through_a_call_that_takes_the_weights():
    assert SubBatches(models.LinearRegression(3), None, weighted=True).streams
    assert SubBatches(_IntoWithoutWeights(3), None, weighted=False).streams
    assert not SubBatches(_IntoWithoutWeights(3), None, weighted=True).streams
    parts = uneven_parts()
    outputs = train_on_threads(job_for(_WrongCount(3), parts, overlap=True), parts)
    errors = [output for output in outputs if isinstance(output, BaseException)]
    assert len(errors) == len(parts)
    for error in errors:  # a partition whose peer failed first says so, naming the peer's reason
        with pytest.raises(
            Exception,
            match=r"loss_and_grad_into gave count=\d+ for a batch of \d+ rows of weights "
            r"summing to .*it must be the sum of the sample weights",
        ):
            raise error
    assert any(isinstance(error.__cause__, InputError) for error in errors)
