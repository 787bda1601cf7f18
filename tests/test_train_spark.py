"""DistriOptimizer.fit on real Spark DataFrames (local[4]): results, the main job's model, errors."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import pytest
from conftest import JOB_FILES, free_ports
from pyspark import cloudpickle

from allreduce_param import (
    ConfigurationError,
    DistriOptimizer,
    InputError,
    NetworkSettings,
    TrainedModel,
    TrainingError,
    models,
    optim,
)
from allreduce_param.cli import build, load_data, load_job
from allreduce_param.engine import AllReduceParameter

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def frame(spark, X, y, vectors=False):
    if vectors:
        from pyspark.ml.linalg import Vectors

        return spark.createDataFrame(
            [(Vectors.dense(row.tolist()), float(label)) for row, label in zip(X, y)],
            ["features", "label"],
        )
    return spark.createDataFrame(
        [(row.tolist(), float(label)) for row, label in zip(X, y)],
        "features array<float>, label double",
    )


def regression_data(rows=120, features=5, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, features)).astype(np.float32)
    y = X @ np.arange(1, features + 1, dtype=np.float32) + 0.5
    return X, y.astype(np.float64)


@pytest.mark.slow
def test_full_batch_bsp_equals_gradient_descent_on_all_rows(spark):
    X, y = regression_data()
    model, lr, epochs = models.LinearRegression(5), 0.1, 6
    result = DistriOptimizer(
        model, optim.SGD(lr=lr), batch_size=len(X), epochs=epochs, codec="raw", num_workers=3
    ).fit(frame(spark, X, y, vectors=True))
    weights = model.init(np.random.default_rng(0))
    for _ in range(epochs):  # one global batch of every row per epoch, wherever the rows landed
        _, grad, count = model.loss_and_grad(weights, X, y)
        weights = weights - np.float32(lr) * grad / np.float32(count)
    np.testing.assert_allclose(result.weights, weights, rtol=1e-5, atol=1e-6)
    assert len(result.history.steps) == epochs and all(
        s["samples"] == len(X) for s in result.history.steps
    )
    assert result.history.steps[-1]["loss"] < result.history.steps[0]["loss"]


@pytest.mark.slow
def test_overlap_is_a_setting_of_the_fit_that_changes_no_weight(spark):
    X, y = regression_data(rows=90)
    data = frame(spark, X, y, vectors=True)
    fits = [
        DistriOptimizer(
            models.MLP([5, 8, 1], task="regression"),
            optim.Adam(lr=0.01),
            batch_size=30,
            epochs=2,
            codec="lz4",
            num_workers=3,
            progress=False,
            overlap=overlap,
        ).fit(data)
        for overlap in (True, False)
    ]
    assert np.array_equal(fits[0].weights, fits[1].weights)
    assert fits[0].history.steps[-1]["loss"] < fits[0].history.steps[0]["loss"]


class ReportingParameter(AllReduceParameter):
    """The engine's parameter, unchanged but for its ``connect``: each task writes what its
    copy of the parameter and its handle say into ``report_dir`` (local mode: a folder the
    tasks and the test share). Shipped to the Python workers by value, as this module is."""

    report_dir: str | None = None

    def connect(self, rendezvous=None):
        handle = super().connect(rendezvous)
        try:
            with open(
                os.path.join(self.report_dir, f"partition-{handle.info.partition_id}.json"), "w"
            ) as file:
                json.dump(
                    {
                        "topology": self.topology,
                        "fetch_threads": self.fetch_threads,
                        "hierarchical": handle.info.hierarchical,
                    },
                    file,
                )
        except BaseException:
            handle.close()
            raise
        return handle


def test_topology_and_fetch_threads_reach_the_parameter_the_tasks_sync_with(
    spark, monkeypatch, tmp_path
):
    from allreduce_param.train.driver import stage

    made = []

    def making(*args, **kwargs):  # what DistriOptimizer.fit asks for, made as the engine makes it
        param = ReportingParameter(*args, **kwargs)
        param.report_dir = str(tmp_path)
        made.append(param)
        return param

    monkeypatch.setattr(stage, "AllReduceParameter", making)
    X, y = regression_data(rows=60)
    result = DistriOptimizer(
        models.LinearRegression(5),
        optim.SGD(lr=0.1),
        batch_size=30,
        epochs=2,
        codec="raw",
        num_workers=3,
        progress=False,
        topology="flat",
        fetch_threads=1,
    ).fit(frame(spark, X, y))
    assert (
        len(result.history.steps) == 4
        and result.history.steps[-1]["loss"] < result.history.steps[0]["loss"]
    )
    [param] = made
    assert (param.topology, param.fetch_threads, param.partition_num) == ("flat", 1, 3)
    reports = [json.loads((tmp_path / f"partition-{i}.json").read_text()) for i in range(3)]
    assert reports == [{"topology": "flat", "fetch_threads": 1, "hierarchical": False}] * 3


@pytest.mark.slow
def test_cached_data_is_checked_once_and_other_data_anew(spark, monkeypatch):
    """Fits on the same cached DataFrame (tuning, say) run the data checks' job once; data
    that is not cached, or other data, or data no longer cached, is checked every time."""
    from allreduce_param.train.driver import data as data_module

    checked = []
    real_prepare = data_module.prepare
    monkeypatch.setattr(
        data_module,
        "prepare",
        lambda *args, **kwargs: checked.append(1) or real_prepare(*args, **kwargs),
    )
    X, y = regression_data(rows=60)

    def fit(data, **settings):
        return DistriOptimizer(
            models.LinearRegression(5),
            optim.SGD(lr=0.1),
            batch_size=20,
            epochs=1,
            num_workers=2,
            progress=False,
            **settings,
        ).fit(data)

    cached = frame(spark, X, y, vectors=True).cache()
    first, second = fit(cached), fit(cached)
    fit(cached, seed=1)  # other trainer settings: the data's checks stand
    assert len(checked) == 1 and np.array_equal(first.weights, second.weights)
    plain = frame(spark, X, y, vectors=True)
    fit(plain), fit(plain)
    assert len(checked) == 3
    X_bad = X.copy()
    X_bad[3, 1] = np.nan
    bad = frame(spark, X_bad, y, vectors=True).cache()
    with pytest.raises(InputError, match="NaN"):
        fit(bad)
    cached.unpersist()
    fit(cached)
    assert len(checked) == 5
    bad.unpersist()


def stages_of(spark, call):
    """How many stages the Spark jobs that ``call()`` submitted ran or skipped (each counted
    once), and what it returned."""
    import uuid

    context, group = spark.sparkContext, f"stages-{uuid.uuid4().hex}"
    context.setJobGroup(group, "counting stages")
    try:
        result = call()
    finally:
        context.setLocalProperty("spark.jobGroup.id", None)
    tracker = context.statusTracker()
    return len(
        {
            stage
            for job in tracker.getJobIdsForGroup(group)
            for stage in tracker.getJobInfo(job).stageIds
        }
    ), result


@pytest.mark.slow
def test_cached_data_with_a_partition_per_worker_trains_where_it_lies(spark):
    """``as_is`` on cached data of 4 partitions with 4 workers: no placement shuffle, and
    worker k trains on partition k, which here holds rows 30k to 30k+29, as ``contiguous``
    places them: the same weights, bit for bit, in fewer stages."""
    X, y = regression_data(rows=120)
    data = frame(spark, X, y).cache()  # a local relation: 4 partitions of 30 rows, in order
    assert data.rdd.getNumPartitions() == 4

    def fit(scheme):
        return DistriOptimizer(
            models.MLP([5, 8, 1], task="regression"),
            optim.Adam(lr=0.01),
            batch_size=20,
            epochs=2,
            codec="raw",
            num_workers=4,
            progress=False,
            partition_scheme=scheme,
        ).fit(data)

    try:
        fit("as_is")  # checks the cached data once, so both fits below run the training job alone
        kept_stages, kept = stages_of(spark, lambda: fit("as_is"))
        placed_stages, placed = stages_of(spark, lambda: fit("contiguous"))
        assert np.array_equal(kept.weights, placed.weights)
        assert kept_stages < placed_stages
    finally:
        data.unpersist()


@pytest.mark.slow
def test_data_spark_will_not_read_in_a_barrier_stage_is_shuffled_instead(spark):
    """A cached coalesce has a partition per worker but a lineage Spark refuses a barrier
    stage over (SPARK-24820): ``as_is`` then places the rows as ``round_robin`` does, and
    does not offer that data's partitions again."""
    from allreduce_param.train.driver.data import prepare_once
    from allreduce_param.train.driver.partitioning import rows_in_place

    X, y = regression_data(rows=120)
    data = frame(spark, X, y).coalesce(2).cache()

    def kept():
        prepared, summary = prepare_once(data, "features", "label", task="regression")
        return rows_in_place(prepared, 2, "as_is", summary)

    def fit(scheme):
        return DistriOptimizer(
            models.MLP([5, 8, 1], task="regression"),
            optim.Adam(lr=0.01),
            batch_size=20,
            epochs=2,
            codec="raw",
            num_workers=2,
            progress=False,
            partition_scheme=scheme,
        ).fit(data)

    try:
        assert kept() is not None
        assert np.array_equal(fit("as_is").weights, fit("round_robin").weights)
        assert kept() is None
    finally:
        data.unpersist()


@pytest.mark.slow
def test_the_main_jobs_settings_reach_097_on_digits(spark):
    job = load_job(JOB_FILES / "digits.toml")
    train, test = load_data(spark, job["data"])
    model = build(models, job["model"], "model")
    trainer = DistriOptimizer(model, build(optim, job["optimizer"], "optimizer"), **job["train"])
    result = trainer.fit(train, validation=test)
    final = result.history.epochs[-1]
    assert final["val_accuracy"] >= 0.97, final
    assert final["train_accuracy"] >= final["val_accuracy"] - 0.05
    assert [e["epoch"] for e in result.history.epochs] == list(range(job["train"]["epochs"]))
    step = result.history.steps[0]
    assert {"get_s", "compute_s", "put_s", "aggregate_s", "update_s", "send_s"} <= set(step)


@pytest.mark.slow
def test_save_load_and_predict_round_trip(spark, tmp_path):
    X, y = regression_data(rows=60)
    data = frame(spark, X, y, vectors=True)
    result = DistriOptimizer(
        models.LinearRegression(5), optim.Adam(lr=0.05), batch_size=20, epochs=3, codec="raw"
    ).fit(data)
    result.save(tmp_path / "model")
    loaded = TrainedModel.load(tmp_path / "model")
    assert np.array_equal(loaded.weights, result.weights)
    assert loaded.history.epochs == result.history.epochs
    predicted = loaded.predict(data).select("prediction").collect()
    assert np.allclose(
        [row["prediction"] for row in predicted], result.predict_numpy(X), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(InputError, match="holds no saved model"):
        TrainedModel.load(tmp_path)
    assert loaded.history.phases == result.history.phases


@pytest.mark.slow
def test_predict_broadcasts_the_weights_once_per_model_and_again_when_they_change(spark):
    X, y = regression_data(rows=30)
    data = frame(spark, X, y, vectors=True)
    model = TrainedModel(models.LinearRegression(5), np.arange(6, dtype=np.float32))

    def predictions():
        return np.array(
            [row["prediction"] for row in model.predict(data).select("prediction").collect()]
        )

    first = predictions()
    held = model._broadcast[2]
    np.testing.assert_allclose(predictions(), first)
    assert model._broadcast[2] is held  # the second call reused it
    model.weights = -model.weights
    np.testing.assert_allclose(predictions(), -first, rtol=1e-6)
    assert model._broadcast[2] is not held


class Ridge:
    """A user model: linear regression with an L2 penalty, written against the protocol only."""

    task = "regression"

    def __init__(self, n_features, penalty=0.01):
        self.n_features, self.penalty = n_features, penalty

    def init(self, rng):
        return np.zeros(self.n_features + 1, np.float32)

    def loss_and_grad(self, weights, X, y):
        if X.shape[1] != self.n_features:
            raise ValueError(f"expected {self.n_features} features, got {X.shape[1]}")
        error = X @ weights[:-1] + weights[-1] - y.astype(np.float32)
        grad = np.concatenate([X.T @ error, [error.sum()]]).astype(np.float32)
        grad[:-1] += self.penalty * len(X) * weights[:-1]
        return float(0.5 * error @ error), grad, len(X)

    def predict(self, weights, X):
        return X @ weights[:-1] + weights[-1]


@pytest.mark.slow
def test_a_user_model_trains_from_an_rdd_of_numpy_pairs(spark):
    X, y = regression_data(rows=200)
    rdd = spark.sparkContext.parallelize(list(zip(X, y)), 4)
    result = DistriOptimizer(
        Ridge(5), optim.SGD(lr=0.05, momentum=0.9), batch_size=40, epochs=15
    ).fit(rdd)
    assert np.allclose(result.weights[:-1], np.arange(1, 6), atol=0.1)


def test_three_rows_on_four_workers_leave_one_partition_empty(spark):
    X, y = regression_data(rows=3)
    result = DistriOptimizer(
        models.LinearRegression(5),
        optim.SGD(lr=0.1),
        batch_size=4,
        epochs=2,
        codec="raw",
        num_workers=4,
    ).fit(frame(spark, X, y))
    assert [s["samples"] for s in result.history.steps] == [3, 3]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["as_is", "random"])
def test_with_sample_weights_each_full_batch_step_is_the_weighted_mean(spark, scheme):
    """Three workers whose rows weigh very differently ("random" also gives them uneven
    row counts): each step's gradient is the weighted mean over all rows, computed here in
    float64 from each row's own gradient."""
    X, y = regression_data()
    rng = np.random.default_rng(7)
    weight = rng.uniform(0, 3, len(X)) * (rng.random(len(X)) > 0.2)
    df = spark.createDataFrame(
        [(row.tolist(), float(label), float(w)) for row, label, w in zip(X, y, weight)],
        "features array<float>, label double, w double",
    )
    model, lr, epochs = models.LinearRegression(5), 0.1, 3
    result = DistriOptimizer(
        model,
        optim.SGD(lr=lr),
        batch_size=len(X),
        epochs=epochs,
        codec="raw",
        num_workers=3,
        partition_scheme=scheme,
    ).fit(df, weight_col="w")
    weights = model.init(np.random.default_rng(0)).astype(np.float64)
    for _ in range(epochs):
        rows = [
            model.loss_and_grad(weights.astype(np.float32), X[i : i + 1], y[i : i + 1])[1]
            for i in range(len(X))
        ]
        weights -= lr * np.average(np.asarray(rows, np.float64), axis=0, weights=weight)
    np.testing.assert_allclose(result.weights, weights, rtol=1e-4, atol=1e-5)
    assert all(s["samples"] == pytest.approx(weight.sum()) for s in result.history.steps)


def test_sample_weights_need_a_dataframe_and_a_model_that_takes_them(spark, small):
    X, y = regression_data(rows=20)
    with pytest.raises(InputError, match="weight_col='w' goes with DataFrame input"):
        fit(spark.sparkContext.parallelize(list(zip(X, y)), 2), weight_col="w")
    with pytest.raises(
        ConfigurationError, match=r"weight_col='w': the model .*Ridge.* takes no sample weights"
    ):
        fit(small, model=Ridge(5), weight_col="w")
    with pytest.raises(InputError, match=r"the training data has no column 'w' \(weight_col\)"):
        fit(small, weight_col="w")


# ---- bad input: refused before any task starts ------------------------------------------


@pytest.fixture(scope="module")
def small(spark):
    X, y = regression_data(rows=20)
    return frame(spark, X, y, vectors=True)


def fit(data, model=None, weight_col=None, **settings):
    defaults = dict(batch_size=8, epochs=1)
    defaults.update(settings)
    return DistriOptimizer(model or models.LinearRegression(5), optim.SGD(lr=0.1), **defaults).fit(
        data, weight_col=weight_col
    )


def test_a_missing_column_lists_the_columns(small):
    with pytest.raises(
        InputError,
        match=r"has no column 'pixels' \(features_col\); its columns are \['features', 'label'\]",
    ):
        DistriOptimizer(models.LinearRegression(5), optim.SGD(lr=0.1)).fit(
            small, features_col="pixels"
        )


def test_vectors_of_the_wrong_length_for_the_model(small):
    with pytest.raises(
        InputError, match="cannot take the data's feature vectors of 5 elements: .*expected 7"
    ):
        fit(small, model=models.LinearRegression(7))


def test_nan_labels_are_counted(spark):
    X, y = regression_data(rows=10)
    y[[2, 5]] = np.nan
    with pytest.raises(InputError, match="has 2 rows whose label 'label' is null or NaN"):
        fit(frame(spark, X, y))


def test_ragged_vectors_name_a_row_of_each_length(spark):
    rows = [([1.0, 2.0], 1.0)] * 3 + [([1.0], 0.0)] + [([1.0, 2.0], 1.0)] * 2
    for kind in ("double", "float"):
        ragged = spark.createDataFrame(rows, f"features array<{kind}>, label double")
        with pytest.raises(
            InputError, match=r"holds vectors of 1 to 2 elements \(e\.g\. row 3: 1, row 0: 2\)"
        ):
            fit(ragged, model=models.LinearRegression(2))


def test_a_batch_smaller_than_the_workers(small):
    with pytest.raises(InputError, match="batch_size=2 is smaller than the 3 workers"):
        fit(small, batch_size=2, num_workers=3)


def test_more_workers_than_slots_names_the_spark_settings(small):
    with pytest.raises(
        ConfigurationError, match="num_workers=9, but Spark has 4 task slots.*local\\[N\\]"
    ):
        fit(small, num_workers=9)


def test_a_string_label_says_to_index_it(spark):
    data = spark.createDataFrame([([1.0], "cat")], "features array<double>, label string")
    with pytest.raises(InputError, match="must be numeric \\(use StringIndexer"):
        fit(data, model=models.LinearRegression(1))


@pytest.mark.slow
def test_an_error_inside_a_task_comes_back_as_one_line(spark):
    class Exploding(models.LinearRegression):
        def loss_and_grad(self, weights, X, y):
            if len(X) and float(np.max(X)) > 50:
                raise FloatingPointError("the model blew up")
            return super().loss_and_grad(weights, X, y)

    X, y = regression_data(rows=40)
    # shows up in some step of the first epoch (not on the driver's check: first row)
    X[-1, 0] = 99.0
    with pytest.raises(
        TrainingError,
        match=r"^partition \d, epoch 0, step \d+: FloatingPointError: the model blew up "
        r"\(the fit ran its stage 4 times, as spark.stage.maxConsecutiveAttempts allows, and "
        r"every run failed: this is the last run's error\)$",
    ) as failure:
        DistriOptimizer(  # 2 workers: Spark runs the failing stage 4 times, each a new set of tasks
            Exploding(5), optim.SGD(lr=0.01), batch_size=8, epochs=1, num_workers=2
        ).fit(frame(spark, X, y))
    assert "org.apache.spark" in str(failure.value.__cause__)  # Spark's own report stays on it


def refuse():
    raise RuntimeError("this model cannot be rebuilt here")


class Unbuildable(models.LinearRegression):
    """Pickles on the driver; cannot be rebuilt in a task (a missing module, a wrong version...)."""

    def __reduce_ex__(self, protocol):
        return (refuse, ())


@pytest.mark.slow
def test_an_error_before_the_training_loop_names_the_python_error(spark):
    X, y = regression_data(rows=20)
    with pytest.raises(
        TrainingError,
        match=r"^a task of the fit \(partition \d\) failed outside its training loop: "
        r"RuntimeError: this model cannot be rebuilt here \(the fit ran its stage 4 times",
    ):
        DistriOptimizer(
            Unbuildable(5), optim.SGD(lr=0.1), batch_size=8, epochs=1, num_workers=2
        ).fit(frame(spark, X, y))


@pytest.mark.slow
def test_a_listener_and_the_log_see_every_step_as_it_happens(spark, tmp_path):
    X, y = regression_data(rows=64)
    events = []
    log_path = tmp_path / "fit.jsonl"
    result = DistriOptimizer(
        models.LinearRegression(5),
        optim.SGD(lr=0.05),
        batch_size=16,
        epochs=2,
        progress=False,
        log_path=str(log_path),
        listener=lambda kind, fields: events.append((kind, fields)),
    ).fit(frame(spark, X, y), validation=frame(spark, X[:8], y[:8]))
    steps = [fields for kind, fields in events if kind == "step"]
    assert sorted(steps, key=lambda s: (s["epoch"], s["step"])) == result.history.steps
    assert [fields["epoch"] for kind, fields in events if kind == "epoch"] == [0, 1]
    assert len([kind for kind, _ in events if kind == "start"]) == 4  # one per partition
    logged = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [entry["kind"] for entry in logged].count("step") == len(result.history.steps)
    assert result.history.epochs[1]["val_rmse"] < result.history.epochs[0]["val_rmse"]
    picture = result.history.plot(tmp_path / "loss.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 5000


def test_the_fits_servers_take_ports_of_the_sessions_range_and_the_listener_hears_where(spark):
    first, last = free_ports(5)
    X, y = regression_data(rows=64)
    events = []
    # a session setting, as users set it
    spark.conf.set("spark.allreduce.portRange", f"{first}-{last}")
    try:
        DistriOptimizer(
            models.LinearRegression(5),
            optim.SGD(lr=0.05),
            batch_size=16,
            epochs=1,
            progress=False,
            network=NetworkSettings(connect_timeout=5),
            listener=lambda kind, fields: events.append((kind, fields)),
        ).fit(frame(spark, X, y))
    finally:
        spark.conf.unset("spark.allreduce.portRange")
    [where] = [fields for kind, fields in events if kind == "meeting"]
    listening = [where["driver"], *where["servers"]]
    assert len(where["servers"]) == 4
    assert all(address.startswith("127.0.0.1:") for address in listening)
    assert sorted(int(address.rsplit(":", 1)[1]) for address in listening) == list(
        range(first, last + 1)
    )
    with pytest.raises(ConfigurationError, match=r"port_range='80-1'"):
        DistriOptimizer(
            models.LinearRegression(5),
            optim.SGD(lr=0.05),
            network=NetworkSettings(port_range="80-1"),
        )


def test_plotting_without_matplotlib_says_how_to_get_it(monkeypatch):
    from allreduce_param import History

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'allreduce-param\[plot\]'"):
        History(steps=[{"epoch": 0, "step": 0, "loss": 1.0, "samples": 1}]).plot("unused.png")


def test_the_history_says_where_the_fits_time_went(spark, capsys):
    from allreduce_param.train.result import PHASES

    X, y = np.random.default_rng(0).standard_normal((64, 3)).astype(np.float32), np.zeros(64)
    y[::2] = 1
    data = spark.createDataFrame(
        [(row.tolist(), float(label)) for row, label in zip(X, y)],
        "features array<float>, label double",
    )
    result = DistriOptimizer(
        models.SoftmaxRegression(3, 2),
        optim.SGD(lr=0.1),
        batch_size=16,
        epochs=2,
        num_workers=2,
        progress=False,
        verbose=True,
    ).fit(data)
    phases = result.history.phases
    assert list(phases) == list(PHASES) and all(seconds >= 0 for seconds in phases.values())
    # they add up to the fit
    assert sum(phases.values()) == pytest.approx(result.history.seconds, abs=0.05)
    assert capsys.readouterr().out.strip().endswith(result.history.phases_line())


@pytest.mark.slow
def test_a_fit_from_rows_on_disk_gives_the_bits_of_one_from_memory_and_leaves_no_file(spark):
    """Shuffled placement (order keys), weights and validation rows: written to row files in
    Spark's local directory as they arrive, the fit is the in-memory one's, bit for bit, and
    every task removes its files."""
    X, y = regression_data(rows=150)
    rng = np.random.default_rng(3)
    df = spark.createDataFrame(
        [(r.tolist(), float(label), float(w)) for r, label, w in zip(X, y, rng.uniform(1, 2, 150))],
        "features array<float>, label double, w double",
    )
    train, valid = df.randomSplit([0.8, 0.2], seed=1)
    weights = {}
    for data_in in ("memory", "disk"):
        weights[data_in] = (
            DistriOptimizer(
                models.LinearRegression(5),
                optim.Adam(lr=0.05),
                batch_size=16,
                epochs=2,
                num_workers=2,
                partition_scheme="random",
                data_in=data_in,
            )
            .fit(train, validation=valid, weight_col="w")
            .weights
        )
    np.testing.assert_array_equal(weights["disk"], weights["memory"])
    assert row_files_left(spark) == []


def _row_files() -> list[str]:
    """The fits' row files in this Python worker's local directories (``SPARK_LOCAL_DIRS``)."""
    import glob

    folders = [f for f in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if f]
    assert folders, "Spark names its local directories to the Python workers"
    return [path for f in folders for path in glob.glob(os.path.join(f, "allreduce-rows-*"))]


def row_files_left(spark) -> list[str]:
    """The row files left in the local directories of the session's Python workers, once
    the tasks of the session's latest jobs have ended: a failed fit waits for the tasks
    that reached its driver, but Spark may start one of a failed barrier stage late and
    kill it after the fit raised; what it wrote is gone when it has ended."""
    tracker = spark.sparkContext.statusTracker()
    ungrouped = sorted(tracker.getJobIdsForGroup(None))
    latest, job = ungrouped[-3:], (ungrouped[-1] + 1 if ungrouped else 0)
    while tracker.getJobInfo(job) is not None:  # the jobs since: the fits', in their own groups
        latest.append(job)
        job += 1
    infos = [tracker.getJobInfo(job) for job in latest]
    stages = [stage for info in infos if info is not None for stage in info.stageIds]

    def running() -> int:
        infos = [tracker.getStageInfo(stage) for stage in stages]
        return sum(info.numActiveTasks for info in infos if info is not None)

    deadline = time.monotonic() + 60
    while running():
        assert time.monotonic() < deadline, "a task of the latest jobs is still running after 60 s"
        time.sleep(0.05)  # polling Spark's own count of running tasks
    return spark.sparkContext.parallelize([0], 1).mapPartitions(lambda _: _row_files()).collect()


@pytest.mark.slow
def test_an_rdd_fit_from_rows_on_disk_gives_the_bits_of_one_from_memory(spark):
    """Each partition's pairs (one block) written to row files in arrival order: the epochs'
    order is the in-memory one, and so are the weights; no file is left."""
    X, y = regression_data(rows=150)
    rdd = spark.sparkContext.parallelize(list(zip(X, y)), 3)
    weights = {
        data_in: DistriOptimizer(
            Ridge(5), optim.Adam(lr=0.05), batch_size=16, epochs=2, num_workers=2, data_in=data_in
        )
        .fit(rdd)
        .weights
        for data_in in ("memory", "disk")
    }
    np.testing.assert_array_equal(weights["disk"], weights["memory"])
    assert row_files_left(spark) == []


class RowFilesSeen(Ridge):
    """Ridge that, in a task, fails its first step saying which row files it trains from."""

    def loss_and_grad(self, weights, X, y):
        from pyspark import TaskContext

        if TaskContext.get() is not None:  # not the driver's try of the model
            raise InputError(f"training from {sorted(map(os.path.basename, _row_files()))}")
        return super().loss_and_grad(weights, X, y)


@pytest.mark.slow
def test_a_failing_rdd_fit_from_disk_leaves_no_file_and_a_bad_pair_is_named(spark):
    X, y = regression_data(rows=40)
    rdd = spark.sparkContext.parallelize(list(zip(X, y)), 2)
    fit = DistriOptimizer(
        RowFilesSeen(5), optim.SGD(lr=0.1), batch_size=8, epochs=1, num_workers=2, data_in="disk"
    ).fit
    with pytest.raises(
        InputError, match=r"training from \[.*'allreduce-rows-\w+-p\d-s\d+t\d+-train"
    ):
        fit(rdd)
    assert row_files_left(spark) == []
    pairs = list(zip(X, y))
    pairs[25] = (X[25][:4], y[25])
    with pytest.raises(
        InputError,
        match=r"partition \d.*: row \d+ of this partition's RDD pairs has features of shape "
        r"\(4,\); every row's features must be a vector of 5 numbers",
    ):
        fit(spark.sparkContext.parallelize(pairs, 2))
    assert row_files_left(spark) == []
