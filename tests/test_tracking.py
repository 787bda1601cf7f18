"""MLflow tracking against a real tracking store (SQLite in the test's folder): autologged
fits, the allreduce_param model flavor and its pyfunc, the Estimators under CrossValidator
(one child run per fit), model versions, and the ``tracking`` setting."""

from __future__ import annotations

import os

import numpy as np
import pytest

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")  # the SQLite store's

from mlflow import MlflowClient  # noqa: E402
from pyspark.ml.evaluation import RegressionEvaluator  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder  # noqa: E402
from test_watchers import events  # noqa: E402

from allreduce_param import DistriOptimizer, models, optim  # noqa: E402
from allreduce_param.integrations import mlflow as tracking  # noqa: E402
from allreduce_param.ml import AllReduceRegressor, LinearRegression  # noqa: E402

SPARK_MASTER = "local[2]"


@pytest.fixture(scope="module")
def database(tmp_path_factory):
    """One SQLite tracking store and model registry for the module's tests: a new store
    runs MLflow's schema migrations, seconds of CPU each time; the tests keep apart by
    experiment (``store``), and their registered models have names of their own."""
    before = mlflow.get_tracking_uri()
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield uri
    finally:
        mlflow.set_tracking_uri(before)


@pytest.fixture
def store(database, tmp_path, request):
    """The module's tracking store with an experiment of this test's own, active (the runs
    and logged models ``runs()`` and ``search_logged_models`` find are this test's alone),
    and autologging off after."""
    # the runs' artifacts in the test's folder too (the default is ./mlruns, in the checkout)
    mlflow.create_experiment(request.node.name, artifact_location=(tmp_path / "artifacts").as_uri())
    mlflow.set_experiment(request.node.name)
    try:
        yield database
    finally:
        tracking.autolog(disable=True)
        while mlflow.active_run() is not None:
            mlflow.end_run()


def regression(spark, rows=48, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, 3)).astype(np.float32)
    y = X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.25
    rows_ = [(Vectors.dense(x.tolist()), float(t)) for x, t in zip(X, y)]
    return X, spark.createDataFrame(rows_, ["features", "label"])


def trainer(**settings):
    return DistriOptimizer(
        models.LinearRegression(3),
        optim.SGD(lr=0.05),
        batch_size=16,
        epochs=2,
        codec="raw",
        progress=False,
        **settings,
    )


def runs(**filters):
    return mlflow.search_runs(output_format="list", **filters)


@pytest.mark.slow
def test_an_autologged_fit_logs_settings_epoch_metrics_history_and_a_model_that_predicts_alike(
    spark, store
):
    X, data = regression(spark)
    tracking.autolog()
    trained = trainer().fit(data, validation=data)
    (run,) = runs()
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["batch_size"] == "16" and params["epochs"] == "2" and params["codec"] == "raw"
    assert params["model"] == "LinearRegression" and params["learning_rate"] == "0.05"
    assert params["checkpoint_dir"] == "None" and params["tracking"] == "None"
    client = MlflowClient()
    for name in ("loss", "val_loss", "samples_per_s"):
        history = client.get_metric_history(run.info.run_id, name)
        assert [point.step for point in history] == [0, 1], name
    val = [p.value for p in client.get_metric_history(run.info.run_id, "val_loss")]
    assert val == pytest.approx([e["val_loss"] for e in trained.history.epochs])
    steps = client.get_metric_history(run.info.run_id, "step_loss")
    assert len(steps) == len(trained.history.steps)
    artifacts = {item.path for item in client.list_artifacts(run.info.run_id)}
    assert {"history.json", "loss_curve.png"} <= artifacts

    (logged,) = mlflow.search_logged_models(output_format="list")
    uri = logged.model_uri
    loaded = tracking.load_model(uri)
    assert np.array_equal(loaded.weights, trained.weights)
    pyfunc = mlflow.pyfunc.load_model(uri)
    assert [spec.name for spec in pyfunc.metadata.get_input_schema().inputs] == ["features"]
    frame = data.toPandas()
    frame["features"] = [np.asarray(v.toArray()) for v in frame["features"]]
    expected = trained.predict_numpy(X)
    np.testing.assert_allclose(pyfunc.predict(frame), expected, rtol=1e-6)
    # through spark_udf, on a column of arrays, in the executors
    from pyspark.ml.functions import vector_to_array

    predict = mlflow.pyfunc.spark_udf(spark, uri, result_type="double", env_manager="local")
    arrays = data.select(vector_to_array("features").alias("features"))
    out = [row[0] for row in arrays.select(predict("features")).collect()]
    np.testing.assert_allclose(out, expected, rtol=1e-5)


@pytest.mark.slow
def test_a_linear_estimators_fit_logs_its_params_each_iterations_objective_and_a_model(
    spark, store, tmp_path
):
    """ml.LinearRegression (MLlib's drop-in, solved by L-BFGS) is watched as every fit: its
    MLlib Params, objectiveHistory as ``loss`` by iteration, a model that predicts as it;
    with ``tensorboardDir``, the same objective as TensorBoard's ``epoch/loss``."""
    X, data = regression(spark, rows=24)
    tracking.autolog()
    estimator = LinearRegression(regParam=0.1, elasticNetParam=0.5, maxIter=30, solver="l-bfgs")
    fitted = estimator.setTensorboardDir(str(tmp_path / "tb")).fit(data)
    (run,) = runs()
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["regParam"] == "0.1" and params["maxIter"] == "30"
    assert params["model"] == "LinearRegression" and params["optimizer"] == "L-BFGS"
    history = MlflowClient().get_metric_history(run.info.run_id, "loss")
    objective = fitted.summary.objectiveHistory
    assert [point.step for point in history] == list(range(len(objective)))
    assert [point.value for point in history] == pytest.approx(objective, rel=1e-12)
    scalars = events(tmp_path / "tb")["epoch/loss"]
    assert [step for step, _ in scalars] == list(range(len(objective)))
    np.testing.assert_allclose([value for _, value in scalars], objective, rtol=1e-6)
    (logged,) = mlflow.search_logged_models(output_format="list")
    expected = X.astype(np.float64) @ fitted.coefficients.toArray() + fitted.intercept
    predicted = tracking.load_model(logged.model_uri).predict_numpy(X)
    np.testing.assert_allclose(predicted, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_an_estimator_under_cross_validator_logs_one_child_run_per_fit(spark, store):
    _, data = regression(spark, rows=40)
    tracking.autolog(log_models=False)
    regressor = AllReduceRegressor(batchSize=8, maxEpochs=2, showProgress=False, codec="raw")
    grid = ParamGridBuilder().addGrid(regressor.stepSize, [0.05]).build()
    tuning = CrossValidator(
        estimator=regressor,
        estimatorParamMaps=grid,
        evaluator=RegressionEvaluator(),
        numFolds=2,
        seed=1,
    )
    with mlflow.start_run() as parent:
        tuning.fit(data)
    children = runs(filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 3  # a fit per fold, and the best settings' on every row
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.params["epochs"] == "2" and child.data.params["batch_size"] == "8"
        assert child.data.metrics["loss"] > 0
    assert not MlflowClient().get_run(parent.info.run_id).data.params  # the fits went below


@pytest.mark.slow
def test_the_tracking_setting_overrides_autolog_and_models_become_versions(spark, store):
    _, data = regression(spark, rows=32)
    first = trainer(tracking=True).fit(data)  # no autolog: logged all the same
    assert len(runs()) == 1
    tracking.autolog(registered_model_name="regression")
    trainer(tracking=False).fit(data)  # never logged
    assert len(runs()) == 1
    trainer().fit(data, initial=first)  # a continued fit (as a micro-batch's): a version
    trainer().fit(data)
    versions = MlflowClient().search_model_versions("name = 'regression'")
    assert sorted(int(version.version) for version in versions) == [1, 2]
    continued = runs(order_by=["attributes.start_time ASC"])[1]
    steps = MlflowClient().get_metric_history(continued.info.run_id, "step_loss")
    assert steps[0].step == first.steps_done  # numbered on from the initial model's


@pytest.mark.slow
def test_each_micro_batch_of_a_streaming_fit_becomes_a_model_version(spark, store, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = tmp_path / "source"
    source.mkdir()
    for index in range(2):
        X, _ = regression(spark, rows=24, seed=index)
        y = X @ np.array([1.0, -2.0, 0.5], np.float32)
        table = pa.table(
            {
                "features": pa.array([row.tolist() for row in X], pa.list_(pa.float32())),
                "label": pa.array(y.astype(np.float64)),
            }
        )
        path = source / f"batch-{index}.parquet"
        pq.write_table(table, path)
        os.utime(path, (1_700_000_000 + index, 1_700_000_000 + index))
    tracking.autolog(registered_model_name="streamed")
    stream = (
        spark.readStream.schema("features array<float>, label double")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(source))
    )
    published = []
    query = trainer().fit_stream(
        stream,
        str(tmp_path / "published"),
        str(tmp_path / "checkpoint"),
        on_model=lambda batch_id, trained: published.append(trained.weights.copy()),
        trigger={"availableNow": True},
    )
    query.awaitTermination(300)
    assert query.exception() is None and len(published) == 2
    client = MlflowClient()
    versions = sorted(
        client.search_model_versions("name = 'streamed'"), key=lambda v: int(v.version)
    )
    assert [int(version.version) for version in versions] == [1, 2]
    for version, weights in zip(versions, published):
        loaded = tracking.load_model(f"models:/streamed/{version.version}")
        assert np.array_equal(loaded.weights, weights)


@pytest.mark.slow
def test_an_estimators_pipeline_model_logs_with_mlflow_spark_as_any_spark_model(spark, store):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StandardScaler

    _, data = regression(spark, rows=32)
    regressor = AllReduceRegressor(
        featuresCol="scaled", batchSize=8, maxEpochs=1, showProgress=False, codec="raw"
    )
    stages = [StandardScaler(inputCol="features", outputCol="scaled"), regressor]
    fitted = Pipeline(stages=stages).fit(data)
    with mlflow.start_run():
        # as docs/tracking.md: with its requirements named, MLflow does not infer them by
        # loading the model in a Python and a Spark session of their own (133 s -> 51 s here
        # on the loaded 2-core VM)
        info = mlflow.spark.log_model(fitted, "pipeline", pip_requirements=["allreduce-param"])
    loaded = mlflow.spark.load_model(info.model_uri)
    expected = [row.prediction for row in fitted.transform(data).select("prediction").collect()]
    got = [row.prediction for row in loaded.transform(data).select("prediction").collect()]
    np.testing.assert_allclose(got, expected)
