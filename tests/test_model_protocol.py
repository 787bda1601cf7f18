"""The user-model protocol (``allreduce_param.models.base.Model``) through real fits on local
Spark: a model without ``task`` trains on the loss alone, a model with buffers gets one
merged set back, and ``TrainedModel`` exports what it holds."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from pyspark import cloudpickle

from allreduce_param import (
    ConfigurationError,
    DistriOptimizer,
    InputError,
    TrainedModel,
    models,
    optim,
)
from allreduce_param.models.base import Model, merge_buffers

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SPARK_MASTER = "local[2]"


class Centred:
    """A user model with no ``task``: least squares on features centred by their running mean.

    Its buffers are that mean of every row its training calls saw (``mean``) and how many
    rows that was (``seen``); ``predict`` reads them. No ``loss_and_predictions``, so the
    trainer's evaluation calls ``loss_and_grad`` and must put the buffers back afterwards."""

    def __init__(self, n_features: int) -> None:
        self.n_features = n_features
        self.mean = np.zeros(n_features, np.float64)
        self.seen = 0

    def init(self, rng):
        return np.zeros(self.n_features + 1, np.float32)

    def loss_and_grad(self, weights, X, y):
        if len(X):
            self.mean = (self.mean * self.seen + X.astype(np.float64).sum(axis=0)) / (
                self.seen + len(X)
            )
            self.seen += len(X)
        error = (
            (X - self.mean.astype(np.float32)) @ weights[:-1] + weights[-1] - y.astype(np.float32)
        )
        grad = np.concatenate([(X - self.mean.astype(np.float32)).T @ error, [error.sum()]]).astype(
            np.float32
        )
        return float(0.5 * error @ error), grad, len(X)

    def predict(self, weights, X):
        return (X - self.mean.astype(np.float32)) @ weights[:-1] + weights[-1]

    def buffers(self):
        return {"mean": self.mean.copy(), "seen": np.int64(self.seen)}

    def set_buffers(self, buffers):
        self.mean, self.seen = np.array(buffers["mean"], np.float64), int(buffers["seen"])


class Plain:
    """A user model with no ``task`` and no buffers: linear least squares, nothing else."""

    def __init__(self, n_features: int) -> None:
        self.n_features = n_features

    def init(self, rng):
        return np.zeros(self.n_features + 1, np.float32)

    def loss_and_grad(self, weights, X, y):
        error = X @ weights[:-1] + weights[-1] - y.astype(np.float32)
        return (
            float(0.5 * error @ error),
            np.concatenate([X.T @ error, [error.sum()]]).astype(np.float32),
            len(X),
        )

    def predict(self, weights, X):
        return X @ weights[:-1] + weights[-1]


def data(rows: int = 200, seed: int = 0):
    """Features with a mean far from zero, and labels that are no class ids (negative, fractional)."""
    rng = np.random.default_rng(seed)
    X = (rng.standard_normal((rows, 4)) + [3.0, -2.0, 0.5, 10.0]).astype(np.float32)
    y = (X @ np.array([1.0, -0.5, 2.0, 0.25], np.float32) - 7.25).astype(np.float64)
    return X, y


def in_two_halves(spark, X, y):
    """A cached DataFrame of two partitions, the first half of the rows and the second: a fit
    of two workers trains each where it lies (``partition_scheme="as_is"``)."""
    rows = [(row.tolist(), float(label)) for row, label in zip(X, y)]
    return spark.createDataFrame(
        spark.sparkContext.parallelize(rows, 2), "features array<float>, label double"
    ).cache()


@pytest.mark.slow
def test_a_model_without_task_trains_on_the_loss_alone(spark, capsys):
    X, y = data()
    train = spark.createDataFrame(
        [(r.tolist(), float(v)) for r, v in zip(X[:160], y[:160])],
        "features array<float>, label double",
    )
    valid = spark.createDataFrame(
        [(r.tolist(), float(v)) for r, v in zip(X[160:], y[160:])],
        "features array<float>, label double",
    )
    events = []
    result = DistriOptimizer(
        Plain(4),
        optim.Adam(lr=0.05),
        batch_size=32,
        epochs=30,
        num_workers=2,
        listener=lambda kind, fields: events.append((kind, fields)),
    ).fit(train, validation=valid)
    assert not hasattr(Plain(4), "task") and not isinstance(
        getattr(result.model, "task", None), str
    )
    epochs = result.history.epochs
    assert len(epochs) == 30
    assert all(set(epoch) == {"epoch", "loss", "val_loss"} for epoch in epochs[:-1]), epochs[0]
    assert set(epochs[-1]) == {"epoch", "loss", "val_loss", "train_loss"}
    assert epochs[-1]["val_loss"] < epochs[0]["val_loss"] / 5  # it learns
    # the losses reported are the model's own loss (0.5 squared error) of the final weights
    for rows, name in ((slice(0, 160), "train_loss"), (slice(160, None), "val_loss")):
        error = result.predict_numpy(X[rows]).astype(np.float64) - y[rows]
        assert epochs[-1][name] == pytest.approx(0.5 * np.mean(error**2), rel=1e-4)
    assert [fields["epoch"] for kind, fields in events if kind == "epoch"] == list(range(30))
    # the progress bar printed an epoch line with the losses and no accuracy or RMSE
    printed = capsys.readouterr()
    lines = [
        line for line in (printed.out + printed.err).splitlines() if line.startswith("epoch 29:")
    ]
    assert (
        lines and "val_loss" in lines[0] and "accuracy" not in lines[0] and "rmse" not in lines[0]
    )


def test_buffers_come_back_merged_by_rows_and_predictions_use_them(spark):
    X, y = data(rows=240, seed=1)
    model = Centred(4)
    result = DistriOptimizer(
        model,
        optim.Adam(lr=0.05),
        batch_size=40,
        epochs=3,
        num_workers=2,
        progress=False,
        partition_scheme="as_is",
    ).fit(in_two_halves(spark, X, y))
    # each partition saw its own 120 rows 3 times (never the driver's check, never an
    # evaluation): its mean is theirs; merged by rows, the mean of all 240
    np.testing.assert_allclose(
        result.buffers["mean"], X.astype(np.float64).mean(axis=0), rtol=1e-9, atol=1e-9
    )
    assert int(result.buffers["seen"]) == 3 * 120
    # the model given to the fit is as it was; predictions use the merged buffers
    assert model.seen == 0 and not model.mean.any()
    w = result.weights
    np.testing.assert_allclose(
        result.predict_numpy(X),
        (X - result.buffers["mean"].astype(np.float32)) @ w[:-1] + w[-1],
        rtol=1e-6,
    )
    assert not np.allclose(result.predict_numpy(X), model.predict(w, X))
    column = result.predict(
        spark.createDataFrame([(r.tolist(),) for r in X[:5]], "features array<float>")
    )
    np.testing.assert_allclose(
        [row["prediction"] for row in column.collect()], result.predict_numpy(X[:5]), rtol=1e-5
    )


def test_save_and_load_keep_the_buffers(tmp_path):
    model = Centred(2)
    result = TrainedModel(
        model,
        np.array([1, 2, 3], np.float32),
        buffers={"mean": np.array([0.5, -1.0]), "seen": np.int64(7)},
    )
    result.save(tmp_path / "m", allow_pickle=True)  # a model of one's own pickles, on request
    loaded = TrainedModel.load(tmp_path / "m", allow_pickle=True)
    assert sorted(loaded.buffers) == ["mean", "seen"] and int(loaded.buffers["seen"]) == 7
    np.testing.assert_array_equal(loaded.buffers["mean"], [0.5, -1.0])
    X = np.array([[1.0, 1.0], [0.0, 2.0]], np.float32)
    np.testing.assert_array_equal(loaded.predict_numpy(X), result.predict_numpy(X))
    assert not (tmp_path / "plain" / "buffers.npz").exists()
    TrainedModel(Plain(2), np.zeros(3, np.float32)).save(tmp_path / "plain", allow_pickle=True)
    assert TrainedModel.load(tmp_path / "plain", allow_pickle=True).buffers == {}


def test_merge_buffers_averages_floats_by_rows_and_takes_the_largest_counter():
    merged = merge_buffers(
        [
            ({"m": np.float32([1, 2]), "n": np.int64(3), "flag": np.bool_(False)}, 1),
            ({"m": np.float32([3, 4]), "n": np.int64(5), "flag": np.bool_(True)}, 3),
            ({"m": np.float32([100, 100]), "n": np.int64(9), "flag": np.bool_(False)}, 0),
        ]
    )
    np.testing.assert_array_equal(merged["m"], np.float32([2.5, 3.5]))
    assert merged["m"].dtype == np.float32 and int(merged["n"]) == 9 and bool(merged["flag"])
    same = np.float32([0.1, 1 / 3])
    # bit for bit
    assert np.array_equal(merge_buffers([({"m": same}, 7), ({"m": same}, 2)])["m"], same)
    with pytest.raises(InputError, match=r"copy 1's buffers \['x'\] differ from copy 0's \['m'\]"):
        merge_buffers([({"m": same}, 1), ({"x": same}, 1)])
    with pytest.raises(InputError, match=r"copy 1's buffer 'm' has shape \(3,\), copy 0's \(2,\)"):
        merge_buffers([({"m": same}, 1), ({"m": np.zeros(3)}, 1)])


def test_export_npz_writes_named_tensors_or_the_flat_vector(tmp_path):
    mlp = models.MLP([3, 4, 2])
    weights = mlp.init(np.random.default_rng(0))
    path = TrainedModel(mlp, weights).export_npz(tmp_path / "out" / "mlp.npz")
    with np.load(path) as saved:
        assert sorted(saved.files) == sorted(mlp.tensors(weights))
        for name, value in mlp.tensors(weights).items():
            np.testing.assert_array_equal(saved[name], value)
    with np.load(
        TrainedModel(Plain(2), np.arange(3, dtype=np.float32)).export_npz(tmp_path / "plain.npz")
    ) as saved:
        assert saved.files == ["weights"] and saved["weights"].tolist() == [0, 1, 2]
    with np.load(
        TrainedModel(
            Centred(2), np.zeros(3, np.float32), buffers={"mean": np.ones(2), "seen": np.int64(4)}
        ).export_npz(tmp_path / "c.npz")
    ) as saved:
        assert sorted(saved.files) == ["mean", "seen", "weights"] and int(saved["seen"]) == 4


def test_what_the_protocol_refuses_says_what_was_wrong(tmp_path):
    class Ranker(Plain):
        task = "ranking"

    class HalfBuffers(Plain):
        def buffers(self):
            return {}

    with pytest.raises(
        ConfigurationError,
        match=r"says task = 'ranking'; a task is 'classification' or "
        r"'regression', or leave it out",
    ):
        DistriOptimizer(Ranker(2), optim.SGD(lr=0.1))
    with pytest.raises(ConfigurationError, match=r"has buffers\(\) but no set_buffers\(\)"):
        DistriOptimizer(HalfBuffers(2), optim.SGD(lr=0.1))
    with pytest.raises(InputError, match=r"keeps no buffers .* but buffers \['mean'\] were given"):
        TrainedModel(Plain(2), np.zeros(3, np.float32), buffers={"mean": np.zeros(2)})
    with pytest.raises(
        ConfigurationError,
        match=r"state_dict\(\) is for a TorchModel's result; .* use "
        r"export_npz\(path\)",
    ):
        TrainedModel(Plain(2), np.zeros(3, np.float32)).state_dict()
    (tmp_path / "folder").mkdir()
    with pytest.raises(InputError, match="that is a folder; give the path of the .npz file"):
        TrainedModel(Plain(2), np.zeros(3, np.float32)).export_npz(tmp_path / "folder")


def test_the_protocol_needs_no_task():
    assert isinstance(Plain(2), Model) and isinstance(Centred(2), Model)
    assert not isinstance(object(), Model)
