"""Fits, predictions and the Estimators on Spark Connect DataFrames, against a real local
Connect server (started from the installed pyspark, on 127.0.0.1 and a free port).

The server runs in a process of its own, as a remote one would: this test process has no
Spark JVM of its own for the Connect session, so any use of ``sparkContext``, RDDs or
broadcasts on the fit's path fails here as it would for a user.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyspark
import pytest
from conftest import free_ports
from harness.spark_standalone import class_archive_options

from allreduce_param import ConfigurationError, DistriOptimizer, models, optim

pytestmark = [pytest.mark.slow, pytest.mark.spark]

CONF = Path(__file__).resolve().parents[1] / "conf" / "local" / "spark-defaults.conf"
#: what a Connect session leaves in the environment, which a server or a later classic session must not see
CONNECT_VARIABLES = (
    "SPARK_REMOTE",
    "SPARK_LOCAL_REMOTE",
    "SPARK_CONNECT_MODE_ENABLED",
    "SPARK_CONNECT_AUTHENTICATE_TOKEN",
    "SPARK_API_MODE",
)


@contextlib.contextmanager
def connect_server(log: Path, master: str = "local[2]"):
    """A Spark Connect server in its own process group; its ``sc://`` address."""
    spark_home = os.path.dirname(pyspark.__file__)
    port = free_ports(1)[0]
    env = {key: value for key, value in os.environ.items() if key not in CONNECT_VARIABLES}
    env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable, SPARK_HOME=spark_home)
    command = [
        os.path.join(spark_home, "bin", "spark-submit"),
        "--class",
        "org.apache.spark.sql.connect.service.SparkConnectServer",
        "--master",
        master,
        "--name",
        "allreduce-param connect tests",
        "--properties-file",
        str(CONF),
        "--conf",
        "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf",
        f"spark.connect.grpc.binding.port={port}",
        "spark-internal",
    ]
    archive = class_archive_options()  # the server's JVM only: it starts sooner with it
    if archive:
        command[1:1] = ["--driver-java-options", archive]
    with open(log, "w") as out:
        server = subprocess.Popen(
            command,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while True:  # ready when it accepts connections; a server that exits fails the test at once
            assert server.poll() is None, (
                f"the Connect server exited with {server.returncode}:\n{log.read_text()}"
            )
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, (
                f"the Connect server did not listen in 180 s:\n{log.read_text()}"
            )
            time.sleep(0.2)
        yield f"sc://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """A Spark Connect session on a local server (local[2]), stopped with the server."""
    from pyspark.sql import SparkSession

    with connect_server(tmp_path_factory.mktemp("connect") / "server.log") as url:
        session = SparkSession.builder.remote(url).getOrCreate()
        try:
            yield session
        finally:
            session.stop()
            for name in CONNECT_VARIABLES:  # a later classic session would take itself for a client
                os.environ.pop(name, None)


def blobs(session, rows: int = 400, seed: int = 0, **columns: np.ndarray):
    """Three separable classes in 8 features, as a Connect DataFrame made from Arrow; with
    ``columns`` (name: function of the labels array) as more columns."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, rows)
    X = (np.eye(3, 8)[labels] * 4 + rng.standard_normal((rows, 8)) * 0.5).astype(np.float32)
    features = pa.ListArray.from_arrays(
        pa.array(np.arange(rows + 1, dtype=np.int32) * 8), pa.array(X.reshape(-1))
    )
    table = {"features": features, "label": pa.array(labels.astype(np.float64))}
    table.update({name: pa.array(make(labels)) for name, make in columns.items()})
    return session.createDataFrame(pa.table(table)), X


def test_a_fit_on_a_connect_dataframe_trains_reports_progress_and_repeats_exactly(remote):
    from pyspark.sql.connect.dataframe import DataFrame as ConnectDataFrame

    df, _ = blobs(remote)
    assert isinstance(df, ConnectDataFrame)
    train, test = df.randomSplit([0.75, 0.25], seed=1)
    events = []

    def fit():
        return DistriOptimizer(
            models.MLP([8, 16, 3]),
            optim.Adam(lr=0.01),
            batch_size=32,
            epochs=3,
            seed=4,
            partition_scheme="contiguous",
            progress=False,
            listener=lambda kind, fields: events.append(kind),
        ).fit(train, validation=test)

    first = fit()
    assert first.history.epochs[-1]["val_accuracy"] > 0.9
    # the tasks reached this process (the client, not Spark's driver) with every step and epoch
    assert events.count("start") == 2 and events.count("epoch") == 3  # a start per partition
    assert events.count("step") == len(first.history.steps) > 0
    np.testing.assert_array_equal(fit().weights, first.weights)


@pytest.fixture(scope="module")
def softmax(remote):
    """A SoftmaxRegression fit on a Connect DataFrame: the data and the result, for the tests
    of what a trained model does under Connect (one fit serves them all)."""
    df, _ = blobs(remote, rows=200)
    trained = DistriOptimizer(
        models.SoftmaxRegression(8, 3), optim.Adam(lr=0.05), batch_size=40, epochs=2, progress=False
    ).fit(df)
    return df, trained


def test_predict_on_a_connect_dataframe_matches_predict_numpy(softmax):
    df, trained = softmax
    predicted = trained.predict(df).select("features", "prediction").toArrow()
    rows = np.asarray(predicted.column("features").combine_chunks().flatten(), np.float32).reshape(
        -1, 8
    )
    np.testing.assert_array_equal(
        np.asarray(predicted.column("prediction")), trained.predict_numpy(rows)
    )


def test_cached_connect_data_is_checked_once_and_trained_on_as_it_lies(remote, monkeypatch):
    import allreduce_param.train.driver.data as data
    import allreduce_param.train.driver.source as source

    checks, placements = [], []
    prepare, place = data.prepare, source.place_rows_once
    monkeypatch.setattr(
        data, "prepare", lambda *args, **kwargs: checks.append(1) or prepare(*args, **kwargs)
    )
    monkeypatch.setattr(
        source, "place_rows_once", lambda *args: placements.append(1) or place(*args)
    )
    df, _ = blobs(remote, rows=240)
    cached = df.repartition(2).cache()
    try:
        fits = [
            DistriOptimizer(
                models.SoftmaxRegression(8, 3),
                optim.SGD(lr=0.1),
                batch_size=24,
                epochs=1,
                progress=False,
            ).fit(cached)
            for _ in range(2)
        ]
        np.testing.assert_array_equal(fits[0].weights, fits[1].weights)
        assert len(checks) == 1  # the second fit reused the first one's checks
        assert not placements  # two partitions for two workers, cached: no shuffle
    finally:
        cached.unpersist()


def test_more_workers_than_the_servers_slots_are_refused_before_the_stage(remote):
    df, _ = blobs(remote, rows=60)
    with pytest.raises(ConfigurationError, match="num_workers=3, but Spark has 2 task slots"):
        DistriOptimizer(
            models.SoftmaxRegression(8, 3),
            optim.SGD(lr=0.1),
            batch_size=12,
            epochs=1,
            num_workers=3,
            progress=False,
        ).fit(df)


def sample_weight(labels: np.ndarray) -> np.ndarray:
    return labels.astype(np.int64) + 1


def held_out(labels: np.ndarray) -> np.ndarray:
    return np.arange(len(labels)) % 5 == 0


@pytest.fixture(scope="module")
def classifier(remote):
    """An AllReduceClassifier fit on a Connect DataFrame with sample weights, validation rows
    and early stopping: the data and the fitted model (one fit for the Estimator's tests)."""
    from allreduce_param.ml import AllReduceClassifier

    df, _ = blobs(remote, rows=300, w=sample_weight, is_val=held_out)
    fitted = AllReduceClassifier(
        stepSize=0.05,
        batchSize=30,
        maxEpochs=3,
        weightCol="w",
        validationIndicatorCol="is_val",
        earlyStoppingPatience=2,
        showProgress=False,
    ).fit(df)
    return df, fitted


def test_the_estimator_fits_and_transforms_connect_dataframes(classifier):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    df, fitted = classifier
    out = fitted.transform(df)
    assert {"prediction", "probability", "rawPrediction"} <= set(out.columns)
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(out) > 0.9
    # the weights and early stopping came along: an epoch's samples are the training rows' weights
    labels = np.asarray(df.select("label").toPandas()["label"])
    trained_weight = sample_weight(labels)[~held_out(labels)].sum()
    assert (
        sum(step["samples"] for step in fitted.history.steps if step["epoch"] == 0)
        == trained_weight
    )
    assert fitted.history.best_epoch is not None and "val_accuracy" in fitted.history.epochs[-1]


def test_weights_too_large_for_a_closure_are_refused_with_what_to_do(softmax, monkeypatch):
    import allreduce_param.spark.info as spark_info

    df, shared = softmax
    # a copy: a model keeps its weights' broadcast for its later calls (the shared one may
    # have predicted already), and a copy starts without one, as a fresh fit's result does
    trained = copy.copy(shared)
    # the model's 108 bytes of weights, over it
    monkeypatch.setattr(spark_info, "CLOSURE_LIMIT", 64)
    with pytest.raises(
        ConfigurationError, match="travel in each task's closure.*predict on a classic session"
    ):
        trained.predict(df)


def test_the_probe_tells_whether_a_task_reaches_this_process(remote):
    from allreduce_param.spark.info import SparkInfo

    info = SparkInfo(remote)
    with socket.create_server(("127.0.0.1", 0)) as listening:
        assert info.unreachable(listening.getsockname()[:2]) is None
    (closed, _) = free_ports(1)  # free: nothing listens there
    assert "ConnectionRefusedError" in info.unreachable(("127.0.0.1", closed), timeout=2.0)


def test_a_client_the_executors_cannot_reach_trains_without_live_progress_and_says_so(
    remote, monkeypatch
):
    from allreduce_param.spark.info import SparkInfo

    monkeypatch.setattr(SparkInfo, "client_maybe_unreachable", lambda self: True)
    monkeypatch.setattr(
        SparkInfo, "unreachable", lambda self, address, timeout=3.0: "OSError: simulated"
    )
    df, _ = blobs(remote, rows=120)
    events = []
    with pytest.warns(
        RuntimeWarning,
        match="executors cannot reach this Spark Connect client .*OSError: simulated",
    ):
        trained = DistriOptimizer(
            models.SoftmaxRegression(8, 3),
            optim.SGD(lr=0.1),
            batch_size=24,
            epochs=2,
            progress=False,
            listener=lambda kind, fields: events.append(kind),
        ).fit(df)
    assert not events  # nothing reached the listener while it ran
    # all of it at the end
    assert len(trained.history.epochs) == 2 and len(trained.history.steps) == 2 * 5


def test_the_estimators_model_saves_and_loads_under_connect(classifier, tmp_path):
    from allreduce_param.ml import AllReduceClassificationModel

    df, fitted = classifier
    fitted.write().save(str(tmp_path / "model"))
    with pytest.raises(Exception, match="already exists"):  # Spark's own refusal: nothing is lost
        fitted.write().save(str(tmp_path / "model"))
    fitted.write().overwrite().save(str(tmp_path / "model"))  # again, over it
    loaded = AllReduceClassificationModel.load(str(tmp_path / "model"))
    np.testing.assert_array_equal(loaded.weights, fitted.weights)
    assert (
        loaded.transform(df).select("prediction").toArrow()
        == fitted.transform(df).select("prediction").toArrow()
    )


def test_mllib_s_logistic_regression_fits_saves_and_loads_under_connect(remote, tmp_path):
    from allreduce_param.ml import LogisticRegression, LogisticRegressionModel

    df, _ = blobs(remote, rows=120)
    fitted = LogisticRegression(regParam=0.1, maxIter=20).fit(df)
    assert fitted.numClasses == 3 and fitted.summary.totalIterations > 0
    fitted.write().save(str(tmp_path / "linear"))
    loaded = LogisticRegressionModel.load(str(tmp_path / "linear"))
    np.testing.assert_array_equal(
        loaded.coefficientMatrix.toArray(), fitted.coefficientMatrix.toArray()
    )
    assert (
        loaded.transform(df).select("probability", "prediction").toArrow()
        == fitted.transform(df).select("probability", "prediction").toArrow()
    )


def test_a_trained_model_saves_where_fsspec_reaches_and_says_why_hadoop_is_out_of_reach(
    softmax, tmp_path
):
    from allreduce_param import TrainedModel

    _, result = softmax
    result.save(tmp_path.as_uri() + "/model")  # file://, through fsspec: no JVM needed
    np.testing.assert_array_equal(TrainedModel.load(tmp_path / "model").weights, result.weights)
    with pytest.raises(
        ConfigurationError,
        match=r"cannot save the model to 'viewfs://cluster/model': .*this process "
        r"is a Spark Connect client, with no JVM",
    ):
        result.save("viewfs://cluster/model")


def test_the_default_parallelism_of_a_master_it_cannot_read_is_counted_once(remote, monkeypatch):
    from allreduce_param.spark import info as spark_info
    from allreduce_param.spark.info import SparkInfo

    info = SparkInfo(remote)
    real_setting = SparkInfo.setting
    monkeypatch.setattr(
        SparkInfo,
        "setting",
        lambda self, key, default: (
            "spark://elsewhere:7077" if key == "spark.master" else real_setting(self, key, default)
        ),
    )
    monkeypatch.setattr(spark_info, "_PARALLELISM", {})
    assert info.default_parallelism() == 2  # the partitions of spark.range() on the local[2] server
    monkeypatch.setattr(type(remote), "range", lambda *args, **kwargs: pytest.fail("counted again"))
    assert info.default_parallelism() == 2


def test_a_pipeline_under_cross_validation_runs_on_connect(remote, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import VectorAssembler
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    from allreduce_param.ml import AllReduceClassifier

    df, X = blobs(remote, rows=200)
    labels = df.select("label").toArrow().column("label")
    columns = remote.createDataFrame(
        pa.table(
            {**{f"x{i}": pa.array(X[:, i].astype(np.float64)) for i in range(8)}, "label": labels}
        )
    )
    classifier = AllReduceClassifier(batchSize=20, maxEpochs=2, showProgress=False)
    pipeline = Pipeline(
        stages=[
            VectorAssembler(inputCols=[f"x{i}" for i in range(8)], outputCol="features"),
            classifier,
        ]
    )
    grid = ParamGridBuilder().addGrid(classifier.stepSize, [1e-5, 0.05]).build()
    fitted = CrossValidator(
        estimator=pipeline,
        estimatorParamMaps=grid,
        numFolds=2,
        seed=0,
        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
    ).fit(columns)
    assert fitted.avgMetrics[1] > fitted.avgMetrics[0]
    fitted.bestModel.write().overwrite().save(str(tmp_path / "pipeline"))
    again = PipelineModel.load(str(tmp_path / "pipeline"))
    assert (
        again.transform(columns).select("prediction").toArrow()
        == fitted.bestModel.transform(columns).select("prediction").toArrow()
    )


def test_the_distributor_runs_a_function_on_connect_ranks(remote, capsys):
    pytest.importorskip("torch")
    from allreduce_param.torch import Distributor

    def sums_ranks() -> tuple:
        import torch
        import torch.distributed as dist

        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        print(f"rank {dist.get_rank()} of {os.environ['WORLD_SIZE']} summed {float(total)}")
        return dist.get_backend(), float(total)

    assert Distributor(num_processes=2).run(sums_ranks) == ("allreduce_param", 3.0)
    printed = sorted(line for line in capsys.readouterr().out.splitlines() if "summed" in line)
    assert printed == [f"[rank {rank}] rank {rank} of 2 summed 3.0" for rank in (0, 1)]
