"""The pyspark.ml Estimators on real Spark: in Pipelines, under CrossValidator and
TrainValidationSplit, saved and loaded with Spark's own persistence."""

from __future__ import annotations

import numpy as np
import pytest
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator, RegressionEvaluator
from pyspark.ml.feature import StandardScaler, StringIndexer, VectorAssembler
from pyspark.ml.linalg import Vectors
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder, TrainValidationSplit

from allreduce_param import ConfigurationError, InputError
from allreduce_param.ml import (
    AllReduceClassificationModel,
    AllReduceClassifier,
    AllReduceRegressionModel,
    AllReduceRegressor,
)

SPARK_MASTER = "local[2]"
COLUMNS = ["a", "b", "c", "d"]


def blobs(spark, rows=600, seed=0, string_labels=False):
    """Three well separated classes in 4 columns (two of them on a large scale, for the scaler)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, rows)
    centres = np.array([[0, 0, 0, 0], [4, 4, 0, 0], [0, 4, 4, 0]], np.float64)
    X = centres[labels] + rng.standard_normal((rows, 4)) * 0.7
    X[:, 2:] *= 100.0
    names = np.array(["cat", "dog", "eel"])
    data = [
        (*map(float, row), str(names[label]) if string_labels else float(label), bool(i % 5 == 0))
        for i, (row, label) in enumerate(zip(X, labels))
    ]
    return spark.createDataFrame(data, [*COLUMNS, "label", "is_validation"])


def linear(spark, rows=500, seed=1):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, 3))
    y = X @ np.array([1.5, -2.0, 0.5]) + 3.0 + rng.standard_normal(rows) * 0.01
    return spark.createDataFrame(
        [(Vectors.dense(row), float(t)) for row, t in zip(X, y)], ["features", "label"]
    )


def pipeline(classifier):
    return Pipeline(
        stages=[
            VectorAssembler(inputCols=COLUMNS, outputCol="raw"),
            StandardScaler(inputCol="raw", outputCol="features", withMean=True),
            classifier,
        ]
    )


def accuracy(predictions):
    return MulticlassClassificationEvaluator(metricName="accuracy").evaluate(predictions)


@pytest.fixture(scope="module")
def fitted_pipeline(spark):
    """The data, the classifier and the PipelineModel of one fit, which the tests of what a
    fitted pipeline does (transform, save and load) share: a fit is seconds of the suite."""
    df = blobs(spark).cache()
    classifier = AllReduceClassifier(
        hiddenLayers=[16], stepSize=0.01, batchSize=64, maxEpochs=5, showProgress=False
    )
    yield df, classifier, pipeline(classifier).fit(df)
    df.unpersist()


@pytest.mark.slow
def test_a_pipeline_fits_and_its_model_adds_prediction_raw_prediction_and_probability(
    fitted_pipeline,
):
    df, _, model = fitted_pipeline
    fitted = model.stages[-1]
    assert isinstance(fitted, AllReduceClassificationModel)
    assert fitted.numClasses == 3 and fitted.numFeatures == 4
    assert fitted.weights.size == 4 * 16 + 16 + 16 * 3 + 3 and len(fitted.history.epochs) == 5
    out = model.transform(df)
    assert accuracy(out) > 0.95
    rows = out.select("features", "rawPrediction", "probability", "prediction").collect()
    for row in rows[:20]:
        assert abs(sum(row.probability) - 1.0) < 1e-9
        assert int(np.argmax(row.rawPrediction)) == row.prediction
        # one row at a time gives what the vectorised transform gave
        np.testing.assert_allclose(
            fitted.predictRaw(row.features).toArray(), row.rawPrediction.toArray(), rtol=1e-6
        )
        assert fitted.predict(row.features) == row.prediction
    # an empty column Param leaves that column out (set back after: the model is shared)
    fitted.setProbabilityCol("")
    try:
        assert (
            "probability"
            not in fitted.transform(
                model.stages[1].transform(model.stages[0].transform(df))
            ).columns
        )
    finally:
        fitted.setProbabilityCol("probability")


@pytest.mark.slow
def test_the_pipeline_model_saves_and_loads_with_sparks_persistence(fitted_pipeline, tmp_path):
    df, classifier, model = fitted_pipeline
    path = str(tmp_path / "model")
    model.write().overwrite().save(path)
    assert not list(tmp_path.rglob("*.pkl")) and list(tmp_path.rglob("*.parquet"))
    loaded = PipelineModel.load(path)
    fitted, again = model.stages[-1], loaded.stages[-1]
    assert isinstance(again, AllReduceClassificationModel) and again.uid == fitted.uid
    np.testing.assert_array_equal(again.weights, fitted.weights)
    assert again.getHiddenLayers() == [16] and again.getStepSize() == 0.01
    assert again.history.epochs == fitted.history.epochs
    before = [row.probability for row in model.transform(df).select("probability").collect()]
    after = [row.probability for row in loaded.transform(df).select("probability").collect()]
    assert before == after
    # the unfitted pipeline, Estimator included, saves and loads too
    pipeline(classifier).write().save(str(tmp_path / "pipeline"))
    stage = Pipeline.load(str(tmp_path / "pipeline")).getStages()[-1]
    assert isinstance(stage, AllReduceClassifier) and stage.getMaxEpochs() == 5


@pytest.mark.slow
def test_a_model_whose_weights_do_not_fit_its_metadata_is_refused(spark, fitted_pipeline, tmp_path):
    fitted = fitted_pipeline[2].stages[-1]  # 4 features, 16 hidden units, 3 classes
    fitted.save(str(tmp_path / "m"))
    spark.createDataFrame([([1.0, 2.0],)], "weights array<float>").write.mode("overwrite").parquet(
        str(tmp_path / "m" / "data")
    )
    with pytest.raises(
        InputError, match="holds 2 weights; the network its metadata describes has 131"
    ):
        AllReduceClassificationModel.load(str(tmp_path / "m"))


@pytest.mark.slow
def test_string_classes_indexed_by_string_indexer_set_the_class_count(spark):
    df = blobs(spark, rows=300, string_labels=True)
    stages = [
        StringIndexer(inputCol="label", outputCol="class"),
        VectorAssembler(inputCols=COLUMNS, outputCol="features"),
        AllReduceClassifier(labelCol="class", maxEpochs=1, batchSize=64, showProgress=False),
    ]
    fitted = Pipeline(stages=stages).fit(df).stages[-1]
    assert fitted.numClasses == 3


@pytest.mark.slow
def test_cross_validator_picks_among_step_sizes(spark):
    df = (
        VectorAssembler(inputCols=COLUMNS, outputCol="features")
        .transform(blobs(spark, rows=400))
        .cache()
    )
    classifier = AllReduceClassifier(batchSize=64, maxEpochs=2, showProgress=False)
    grid = ParamGridBuilder().addGrid(classifier.stepSize, [1e-5, 0.05]).build()
    cv = CrossValidator(
        estimator=classifier,
        estimatorParamMaps=grid,
        numFolds=2,
        seed=3,
        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
    )
    fitted = cv.fit(df)
    assert len(fitted.avgMetrics) == 2 and fitted.avgMetrics[1] > fitted.avgMetrics[0]
    assert isinstance(fitted.bestModel, AllReduceClassificationModel)
    assert fitted.bestModel.getStepSize() == 0.05
    df.unpersist()


@pytest.mark.slow
def test_the_regressor_fits_a_line_and_train_validation_split_runs_over_it(spark, tmp_path):
    df = linear(spark).cache()
    regressor = AllReduceRegressor(stepSize=0.05, batchSize=50, maxEpochs=20, showProgress=False)
    fitted = regressor.fit(df)
    assert isinstance(fitted, AllReduceRegressionModel)
    np.testing.assert_allclose(fitted.weights, [1.5, -2.0, 0.5, 3.0], atol=0.05)
    rmse = RegressionEvaluator(metricName="rmse").evaluate(fitted.transform(df))
    assert rmse < 0.1
    assert abs(fitted.predict(Vectors.dense([1.0, 1.0, 1.0])) - 3.0) < 0.15
    fitted.save(str(tmp_path / "regressor"))
    loaded = AllReduceRegressionModel.load(str(tmp_path / "regressor"))
    np.testing.assert_array_equal(loaded.weights, fitted.weights)
    tvs = TrainValidationSplit(
        estimator=regressor.copy({regressor.maxEpochs: 2}),
        trainRatio=0.75,
        seed=1,
        estimatorParamMaps=ParamGridBuilder().addGrid(regressor.hiddenLayers, [[], [4]]).build(),
        evaluator=RegressionEvaluator(metricName="rmse"),
    )
    assert len(tvs.fit(df).validationMetrics) == 2
    df.unpersist()


@pytest.mark.slow
def test_validation_rows_are_marked_by_the_indicator_column(spark):
    df = VectorAssembler(inputCols=COLUMNS, outputCol="features").transform(blobs(spark, rows=300))
    fitted = AllReduceClassifier(
        validationIndicatorCol="is_validation", maxEpochs=2, batchSize=64, showProgress=False
    ).fit(df)
    assert all("val_accuracy" in epoch for epoch in fitted.history.epochs)
    with pytest.raises(
        InputError, match="validationIndicatorCol='label' is double; it must be boolean"
    ):
        AllReduceClassifier(validationIndicatorCol="label", showProgress=False).fit(df)
    with pytest.raises(
        InputError, match="validationIndicatorCol='nope' is not a column of the data"
    ):
        AllReduceClassifier(validationIndicatorCol="nope", showProgress=False).fit(df)


@pytest.mark.slow
def test_early_stopping_keeps_the_epoch_of_the_lowest_validation_loss(spark):
    """Validation targets on another line than the training ones: the validation loss falls,
    then rises as the model fits the training line, and the fit stops there."""
    rng = np.random.default_rng(3)
    X = rng.standard_normal((400, 2))
    validation = np.arange(400) % 4 == 0
    y = np.where(validation, X @ np.array([1.0, -0.5]), X @ np.array([2.0, -1.0]))
    df = spark.createDataFrame(
        [(Vectors.dense(row), float(t), bool(v)) for row, t, v in zip(X, y, validation)],
        ["features", "label", "is_validation"],
    )
    fitted = AllReduceRegressor(
        validationIndicatorCol="is_validation",
        earlyStoppingPatience=2,
        maxEpochs=40,
        optimizer="sgd",
        stepSize=0.05,
        batchSize=32,
        showProgress=False,
    ).fit(df)
    history = fitted.history
    losses = [epoch["val_loss"] for epoch in history.epochs]
    assert history.stopped_early and history.best_epoch == int(np.argmin(losses)) > 0
    assert len(losses) == history.best_epoch + 3 < 40
    # the Model predicts with the best epoch's weights: its validation loss is the best one
    rows = fitted.transform(df.filter("is_validation")).select("label", "prediction").collect()
    squared = np.mean([(row.label - row.prediction) ** 2 for row in rows])
    # the loss is half the squared error
    assert squared / 2 == pytest.approx(losses[history.best_epoch], rel=1e-4)
    with pytest.raises(
        InputError,
        match="early_stopping_patience=2 stops on the validation loss: pass validation "
        "data.*set validationIndicatorCol",
    ):
        AllReduceRegressor(earlyStoppingPatience=2, showProgress=False).fit(df)


@pytest.mark.slow
def test_weight_col_trains_as_repeating_each_row_its_weight_times(spark):
    """Whole weights 0-3, full-batch gradient descent: the same weights as the rows repeated."""
    rng = np.random.default_rng(5)
    X = rng.standard_normal((120, 3))
    y = X @ np.array([1.5, -2.0, 0.5]) + rng.standard_normal(120)
    weight = rng.integers(0, 4, 120)
    weighted = spark.createDataFrame(
        [(Vectors.dense(row), float(t), int(w)) for row, t, w in zip(X, y, weight)],
        ["features", "label", "w"],
    )
    repeated = spark.createDataFrame(
        [(Vectors.dense(row), float(t)) for row, t, w in zip(X, y, weight) for _ in range(w)],
        ["features", "label"],
    )
    settings = dict(
        optimizer="sgd",
        stepSize=0.1,
        batchSize=1000,
        maxEpochs=4,
        numWorkers=2,
        codec="raw",
        showProgress=False,
    )
    by_weight = AllReduceRegressor(weightCol="w", **settings).fit(weighted)
    by_rows = AllReduceRegressor(**settings).fit(repeated)
    np.testing.assert_allclose(by_weight.weights, by_rows.weights, rtol=1e-5, atol=1e-6)
    assert (
        by_weight.history.steps[0]["samples"] == weight.sum() == by_rows.history.steps[0]["samples"]
    )
    bad = weighted.withColumn("w", weighted.w - 1)
    with pytest.raises(
        InputError, match=r"rows whose weight 'w' \(weightCol\) is null, NaN, negative or infinite"
    ):
        AllReduceRegressor(weightCol="w", **settings).fit(bad)


@pytest.mark.slow
def test_thresholds_choose_the_class_as_mllib_does(fitted_pipeline):
    df, _, model = fitted_pipeline
    fitted = model.stages[-1]
    features = model.stages[1].transform(model.stages[0].transform(df))
    try:  # (cleared after: the model is shared)
        # a threshold of 0: its class wins wherever it is possible
        fitted.setThresholds([1.0, 1.0, 0.0])
        predictions = fitted.transform(features).select("prediction").collect()
        assert {row.prediction for row in predictions} == {2.0}
        fitted.setThresholds([1.0, 1.0])
        with pytest.raises(
            ConfigurationError, match="thresholds has 2 values; the model has 3 classes"
        ):
            fitted.transform(features).collect()
    finally:
        fitted.clear(fitted.thresholds)


def test_bad_settings_and_labels_name_the_param(spark):
    df = VectorAssembler(inputCols=COLUMNS, outputCol="features").transform(blobs(spark, rows=100))
    with pytest.raises(InputError, match=r"the training data has no column 'w' \(weightCol\)"):
        AllReduceClassifier(weightCol="w", showProgress=False).fit(df)
    with pytest.raises(
        ConfigurationError, match="optimizer='nadam' is not one of adam, adamw, sgd"
    ):
        AllReduceClassifier(optimizer="nadam").fit(df)
    with pytest.raises(
        ConfigurationError, match="AllReduceClassifier: batchSize must be a positive whole number"
    ):
        AllReduceClassifier(batchSize=0).fit(df)
    with pytest.raises(InputError, match="no column 'feats' \\(featuresCol\\)"):
        AllReduceClassifier(featuresCol="feats").fit(df)
    halves = df.withColumn("label", df.label + 0.5)
    with pytest.raises(InputError, match="must be class ids 0, 1, 2, ... \\(the largest is 2.5\\)"):
        AllReduceClassifier(showProgress=False).fit(halves)
    strings = VectorAssembler(inputCols=COLUMNS, outputCol="features").transform(
        blobs(spark, rows=100, string_labels=True)
    )
    for estimator in (AllReduceClassifier, AllReduceRegressor):
        with pytest.raises(
            InputError,
            match=r"^the label column 'label' \(labelCol\) is string; it must be numeric "
            r"\(use StringIndexer for string classes\)",
        ):
            estimator(showProgress=False).fit(strings)
    with pytest.raises(InputError, match=r"^the data has no column 'y' \(labelCol\)"):
        AllReduceClassifier(labelCol="y", showProgress=False).fit(df)


def test_every_param_has_a_setter_and_a_getter_as_mllibs_do():
    classifier = (
        AllReduceClassifier()
        .setHiddenLayers([32, 16])
        .setOptimizer("sgd")
        .setStepSize(0.1)
        .setBatchSize(128)
        .setMaxEpochs(7)
        .setCodec("bf16")
        .setNumWorkers(2)
        .setStrategy("ssp")
        .setStaleness(3)
        .setBackupWorkers(0)
        .setSyncEvery("epoch")
        .setPartitionScheme("random")
        .setCheckpointDir("/tmp/c")
        .setCheckpointEvery(50)
        .setShowProgress(False)
        .setSeed(11)
        .setValidationIndicatorCol("v")
        .setEarlyStoppingPatience(3)
        .setEarlyStoppingMinDelta(0.01)
    )
    assert (
        classifier.getHiddenLayers(),
        classifier.getOptimizer(),
        classifier.getStepSize(),
        classifier.getBatchSize(),
        classifier.getMaxEpochs(),
        classifier.getCodec(),
        classifier.getNumWorkers(),
        classifier.getStrategy(),
        classifier.getStaleness(),
        classifier.getBackupWorkers(),
        classifier.getSyncEvery(),
        classifier.getPartitionScheme(),
        classifier.getCheckpointDir(),
        classifier.getCheckpointEvery(),
        classifier.getShowProgress(),
        classifier.getSeed(),
        classifier.getValidationIndicatorCol(),
        classifier.getEarlyStoppingPatience(),
        classifier.getEarlyStoppingMinDelta(),
    ) == (
        [32, 16],
        "sgd",
        0.1,
        128,
        7,
        "bf16",
        2,
        "ssp",
        3,
        0,
        "epoch",
        "random",
        "/tmp/c",
        50,
        False,
        11,
        "v",
        3,
        0.01,
    )
    copied = classifier.copy({classifier.maxEpochs: 2})
    assert copied.getMaxEpochs() == 2 and classifier.getMaxEpochs() == 7
    assert AllReduceRegressor().getHiddenLayers() == [] and AllReduceRegressor().getSeed() == 0


def test_topology_and_fetch_threads_params_save_load_and_are_checked_before_any_spark_job(
    spark, tmp_path
):
    from allreduce_param import FitSettings

    classifier = AllReduceClassifier(topology="flat", fetchThreads=2, maxEpochs=1)
    classifier.save(str(tmp_path / "set"))
    loaded = AllReduceClassifier.load(str(tmp_path / "set"))
    assert (loaded.getTopology(), loaded.getFetchThreads()) == ("flat", 2)
    assert loaded._settings() == FitSettings(topology="flat", fetch_threads=2, epochs=1)
    AllReduceRegressor().save(str(tmp_path / "defaults"))
    defaults = AllReduceRegressor.load(str(tmp_path / "defaults"))
    assert (defaults.getTopology(), defaults.getFetchThreads()) == ("auto", None)

    # a conflict of settings fails in fit before the data's first Spark job (the data checks)
    df = VectorAssembler(inputCols=COLUMNS, outputCol="features").transform(blobs(spark, rows=100))
    context, group = spark.sparkContext, "refused-on-the-driver"
    context.setJobGroup(group, "a fit whose settings conflict")
    try:
        with pytest.raises(
            ConfigurationError,
            match="AllReduceClassifier: topology='hierarchical' goes with "
            "strategy='bsp' and no backup workers, not with "
            "strategy='ssp'.* or set strategy='bsp'",
        ):
            AllReduceClassifier(
                topology="hierarchical", strategy="ssp", staleness=1, showProgress=False
            ).fit(df)
        assert context.statusTracker().getJobIdsForGroup(group) == []
        df.count()  # the tracker does see this group's jobs
        assert context.statusTracker().getJobIdsForGroup(group) != []
    finally:
        context.setLocalProperty("spark.jobGroup.id", None)
        context.setLocalProperty("spark.job.description", None)


# ------------------------------------------------------------------ regularisation, as MLlib's


def sparse_line(rows=300, seed=3):
    """y = 2 x0 - 1.5 x1 + 5 (+ noise); x2..x5 carry nothing (an L1 penalty zeroes them)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, 6))
    X -= X.mean(axis=0)  # centred: the intercept is the label's mean
    y = X @ np.array([2.0, -1.5, 0.0, 0.0, 0.0, 0.0]) + 5.0 + rng.standard_normal(rows) * 0.3
    return X, y


@pytest.mark.slow
def test_the_regressor_regularises_as_mllib_sharded_as_one_process(spark):
    """(a) two partitions give the one-process reference (full-batch proximal gradient
    descent, numpy); (b) an L1 penalty makes coefficients exactly 0; (c) the intercept is
    never penalised: a penalty that zeroes every weight leaves it at the label's mean; (d)
    fitIntercept=False holds it at 0."""
    from allreduce_param import models, optim

    X, y = sparse_line()
    df = spark.createDataFrame(
        [(Vectors.dense(row), float(t)) for row, t in zip(X, y)], ["features", "label"]
    ).repartition(2)
    # 100 steps: the strong penalty's intercept is within 3e-5 of the label's mean (measured)
    steps = 100
    common = dict(
        optimizer="sgd",
        stepSize=0.1,
        batchSize=len(X),  # one full-batch step an epoch
        maxEpochs=steps,
        numWorkers=2,
        codec="raw",
        standardization=False,
        elasticNetParam=1.0,
        showProgress=False,
    )
    fitted = AllReduceRegressor(regParam=0.2, **common).fit(df)
    model = models.LinearRegression(6)
    reference = model.init(np.random.default_rng(0))
    penalty, factors = optim.ElasticNet(0.2, 1.0), model.penalized().astype(np.float32)
    X32, y32 = X.astype(np.float32), y.astype(np.float32)
    for step in range(steps):
        _, grad, count = model.loss_and_grad(reference, X32, y32)
        optim.SGD(0.1).step(
            reference, grad, {}, step, grad_scale=1.0 / count, penalty=penalty, penalized=factors
        )
    np.testing.assert_allclose(fitted.weights, reference, rtol=2e-5, atol=2e-6)  # (a)
    assert (fitted.weights[2:6] == 0).all() and (np.abs(fitted.weights[:2]) > 1).all()  # (b)
    strong = AllReduceRegressor(regParam=50.0, **common).fit(df).weights
    assert (strong[:6] == 0).all() and strong[6] == pytest.approx(y.mean(), rel=1e-4)  # (c)
    without = AllReduceRegressor(regParam=0.2, fitIntercept=False, **common).fit(df).weights
    assert without[6] == 0 and (without[2:6] == 0).all()  # (d)


@pytest.mark.slow
@pytest.mark.parametrize("standardization", [False, True])
def test_the_classifier_finds_mllibs_regularised_logistic_regression(spark, standardization):
    """The same objective as MLlib's LogisticRegression (multinomial, L2, with or without
    standardization): trained long enough, the same class-score differences and intercepts."""
    from pyspark.ml.classification import LogisticRegression

    rng = np.random.default_rng(0)
    X = rng.standard_normal((400, 5)) * np.array([1.0, 2.0, 0.5, 1.0, 3.0])
    chance = 1 / (1 + np.exp(-(X @ np.array([1.5, -1.0, 0.0, 2.0, 0.0]) + 0.5)))
    y = (rng.random(400) < chance).astype(float)
    df = spark.createDataFrame(
        [(Vectors.dense(row), float(t)) for row, t in zip(X, y)], ["features", "label"]
    ).cache()
    ours = AllReduceClassifier(
        optimizer="sgd",
        stepSize=0.2,
        batchSize=400,
        maxEpochs=500,  # measured: within 1e-5 of MLlib's, with and without standardization
        regParam=0.1,
        standardization=standardization,
        showProgress=False,
    ).fit(df)
    mllib = LogisticRegression(
        family="multinomial", regParam=0.1, standardization=standardization, tol=1e-10
    ).fit(df)
    tensors = ours.trained.model.tensors(ours.weights)
    theirs = mllib.coefficientMatrix.toArray()
    # the difference of the two classes' scores is what the data identifies (the common part
    # of a feature's two weights only decays by the penalty)
    np.testing.assert_allclose(
        tensors["w1"][:, 1] - tensors["w1"][:, 0], theirs[1] - theirs[0], atol=2e-3
    )
    np.testing.assert_allclose(tensors["b1"], mllib.interceptVector.toArray(), atol=2e-3)
    df.unpersist()


@pytest.mark.slow
def test_the_estimators_warnings_name_their_params(spark):
    """A class the label metadata has but no training row holds, and a batch beyond the data:
    the fit trains, and its warnings name batchSize (the Param), not batch_size."""
    from pyspark.sql import functions as F

    df = blobs(spark, rows=60, string_labels=True)
    indexed = StringIndexer(inputCol="label", outputCol="class").fit(df).transform(df)
    two_classes = indexed.where(F.col("label") != "eel").limit(12)
    assembled = VectorAssembler(inputCols=COLUMNS, outputCol="features").transform(two_classes)
    classifier = AllReduceClassifier(
        labelCol="class", hiddenLayers=[], batchSize=64, maxEpochs=1, showProgress=False
    )
    with pytest.warns(UserWarning) as caught:
        fitted = classifier.fit(assembled)
    messages = [str(warning.message) for warning in caught]
    assert any(m.startswith("batchSize=64 is larger than the 12 training rows") for m in messages)
    assert any(
        m.startswith("the training labels hold 2 distinct classes but the model has 3")
        for m in messages
    ), messages
    assert fitted.numClasses == 3
