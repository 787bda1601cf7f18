"""``allreduce_param.ml.LogisticRegression`` and ``LinearRegression`` against MLlib's own, on the
same data and Params (coefficients and objective), against R on the weighted 4-row problem of
Spark's ``WeightedLeastSquaresSuite``; their Params, refusals, outputs and persistence."""

from __future__ import annotations

import time

import numpy as np
import pytest
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml import classification as mllib_classification
from pyspark.ml import regression as mllib_regression
from pyspark.ml.feature import VectorAssembler
from pyspark.ml.linalg import Matrices, Vectors

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.ml import (
    LinearRegression,
    LinearRegressionModel,
    LogisticRegression,
    LogisticRegressionModel,
)
from allreduce_param.ml.linear_models import LinearFit

pytestmark = pytest.mark.spark


def _frame(spark, X, y, w=None, partitions=2):
    rows = [
        (Vectors.dense(x.tolist()), float(label), 1.0 if w is None else float(w[i]))
        for i, (x, label) in enumerate(zip(X, y))
    ]
    return spark.createDataFrame(rows, ["features", "label", "weight"]).repartition(partitions)


def _classes_data(classes: int, rows: int = 120, seed: int = 3):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, 3)) * np.array([1.0, 3.0, 0.5]) + np.array([0.0, 1.0, -2.0])
    margins = X @ rng.normal(size=(3, classes)) + rng.normal(size=rows)[:, None]
    y = margins.argmax(axis=1) if classes > 2 else (margins[:, 0] > 0).astype(float)
    return X, y, rng.uniform(0.5, 2.0, rows)


def _relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-12))


def _pair(spark, ours_class, theirs_class, frame, **params):
    ours = ours_class(**params).fit(frame)
    theirs = theirs_class(**params).fit(frame)
    return ours, theirs


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [  # (plain L2 under standardization: the constant-feature test below)
        {"regParam": 0.05, "standardization": False, "weightCol": "weight"},
        {"regParam": 0.02, "elasticNetParam": 0.5, "weightCol": "weight"},
    ],
)
def test_binomial_as_mllib(spark, params):
    X, y, w = _classes_data(2)
    frame = _frame(spark, X, y, w).cache()
    ours, theirs = _pair(
        spark,
        LogisticRegression,
        mllib_classification.LogisticRegression,
        frame,
        tol=1e-10,
        **params,
    )
    assert ours.numClasses == theirs.numClasses == 2
    assert ours.numFeatures == theirs.numFeatures == 3
    coefficients = np.append(ours.coefficients.toArray(), ours.intercept)
    expected = np.append(theirs.coefficients.toArray(), theirs.intercept)
    assert _relative(coefficients, expected) < 1e-3
    assert ours.summary.objectiveHistory[-1] == pytest.approx(
        theirs.summary.objectiveHistory[-1], rel=1e-6
    )


@pytest.mark.slow
def test_multinomial_as_mllib(spark):
    X, y, w = _classes_data(3)
    frame = _frame(spark, X, y, w).cache()
    started = time.time()
    ours, theirs = _pair(
        spark,
        LogisticRegression,
        mllib_classification.LogisticRegression,
        frame,
        regParam=0.02,
        elasticNetParam=0.3,
        weightCol="weight",
        tol=1e-10,
    )
    assert ours.numClasses == theirs.numClasses == 3
    assert ours.coefficientMatrix.toArray().shape == (3, 3)
    coefficients = np.append(ours.coefficientMatrix.toArray(), ours.interceptVector.toArray())
    expected = np.append(theirs.coefficientMatrix.toArray(), theirs.interceptVector.toArray())
    assert _relative(coefficients, expected) < 1e-3
    assert ours.summary.objectiveHistory[-1] == pytest.approx(
        theirs.summary.objectiveHistory[-1], rel=1e-6
    )
    # when each value was reached, on partition 0's clock (the driver's, in local mode)
    times = ours.summary.objectiveTimes
    assert len(times) == len(ours.summary.objectiveHistory)
    assert started <= times[0] and times == sorted(times) and times[-1] <= time.time()
    with pytest.raises(RuntimeError, match="coefficientMatrix"):
        ours.coefficients  # noqa: B018 (MLlib refuses it for a multinomial model)
    # the outputs as MLlib's transform gives them
    theirs_rows = theirs.transform(frame).orderBy("label", "weight").collect()
    ours_rows = ours.transform(frame).orderBy("label", "weight").collect()
    for column in ("rawPrediction", "probability"):
        np.testing.assert_allclose(
            [row[column].toArray() for row in ours_rows],
            [row[column].toArray() for row in theirs_rows],
            rtol=1e-2,
            atol=1e-3,
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        {"regParam": 0.1, "solver": "l-bfgs"},
        {"regParam": 0.1, "elasticNetParam": 0.5, "weightCol": "weight", "solver": "l-bfgs"},
        {"regParam": 0.1, "standardization": False, "weightCol": "weight"},
    ],
)
def test_linear_as_mllib(spark, params):
    rng = np.random.default_rng(5)
    X = rng.normal(size=(150, 4)) * np.array([1.0, 2.0, 0.3, 5.0])
    y = X @ np.array([1.0, -2.0, 0.5, 0.1]) + 3.0 + rng.normal(size=150)
    frame = _frame(spark, X, y, rng.uniform(0.5, 2.0, 150)).cache()
    ours, theirs = _pair(
        spark, LinearRegression, mllib_regression.LinearRegression, frame, tol=1e-10, **params
    )
    coefficients = np.append(ours.coefficients.toArray(), ours.intercept)
    expected = np.append(theirs.coefficients.toArray(), theirs.intercept)
    assert _relative(coefficients, expected) < 1e-3
    if params.get("solver") == "l-bfgs":  # MLlib's normal equations keep no history
        assert ours.summary.objectiveHistory[-1] == pytest.approx(
            theirs.summary.objectiveHistory[-1], rel=1e-6
        )


@pytest.mark.slow
def test_one_class_and_constant_features_as_mllib(spark):
    """MLlib's special cases: a label with one value (binomial: zero coefficients and an
    infinite intercept) and a constant feature (its coefficient 0 under standardization)."""
    X, y, _ = _classes_data(2, rows=40)
    X[:, 1] = 2.0
    one_class = _frame(spark, X, np.ones(len(y)))
    ours, theirs = _pair(
        spark, LogisticRegression, mllib_classification.LogisticRegression, one_class
    )
    np.testing.assert_array_equal(ours.coefficients.toArray(), theirs.coefficients.toArray())
    assert ours.intercept == theirs.intercept == np.inf
    y = (X[:, 0] + np.random.default_rng(1).normal(size=len(X)) > 0).astype(float)
    assert 0 < y.sum() < len(y)
    constant = _frame(spark, X, y)
    ours, theirs = _pair(
        spark,
        LogisticRegression,
        mllib_classification.LogisticRegression,
        constant,
        regParam=0.01,
        tol=1e-10,
    )
    assert ours.coefficients[1] == theirs.coefficients[1] == 0.0
    coefficients = np.append(ours.coefficients.toArray(), ours.intercept)
    expected = np.append(theirs.coefficients.toArray(), theirs.intercept)
    assert _relative(coefficients, expected) < 1e-3


#: Spark's WeightedLeastSquaresSuite: its 4 weighted rows and R's coefficients (intercept first).
_WLS_ROWS = [(17.0, 1.0, [0.0, 5.0]), (19.0, 2.0, [1.0, 7.0]), (23.0, 3.0, [2.0, 11.0])]
_WLS_ROWS.append((29.0, 4.0, [3.0, 13.0]))


@pytest.mark.slow
@pytest.mark.parametrize(
    "params, expected",
    [  # lm, then glmnet's ridge and elastic-net grids (standardizeLabel, as LinearRegression)
        ({"fitIntercept": True, "regParam": 0.0}, [18.08, 6.08, -0.60]),
        ({"fitIntercept": False, "regParam": 0.0, "solver": "l-bfgs"}, [0.0, -3.727121, 3.009983]),
        ({"fitIntercept": True, "regParam": 1.0}, [13.1860638, 2.1761382, 0.6213134]),
        (
            {"fitIntercept": False, "regParam": 0.1, "standardization": False},
            [0.0, -3.307532, 2.924206],
        ),
        (
            {
                "fitIntercept": True,
                "regParam": 0.1,
                "elasticNetParam": 0.5,
                "standardization": False,
            },
            [13.6953934007661, 3.3336271417751, 0.349745414969587],
        ),
    ],
)
def test_weighted_least_squares_as_r(spark, params, expected):
    frame = spark.createDataFrame(
        [(Vectors.dense(x), label, weight) for label, weight, x in _WLS_ROWS],
        ["features", "label", "weight"],
    ).repartition(2)
    model = LinearRegression(weightCol="weight", tol=1e-12, maxIter=1000, **params).fit(frame)
    found = [model.intercept, *model.coefficients.toArray()]
    np.testing.assert_allclose(found, expected, atol=1e-4)


def test_params_are_mllib_s(spark):
    """The same Param names, defaults and documentation as pyspark.ml's own, but for the
    ones documented as meaning something else here."""
    pairs = [
        (LogisticRegression(), mllib_classification.LogisticRegression()),
        (LinearRegression(), mllib_regression.LinearRegression()),
    ]
    for ours, theirs in pairs:
        names = {param.name for param in theirs.params}
        assert names <= {param.name for param in ours.params}
        for name in names:
            assert ours.hasDefault(name) == theirs.hasDefault(name), name
            if theirs.hasDefault(name):
                assert ours.getOrDefault(name) == theirs.getOrDefault(name), name
            if name not in ("aggregationDepth", "maxBlockSizeInMB"):
                assert ours.getParam(name).doc == theirs.getParam(name).doc, name
    assert "ignored" in LogisticRegression().explainParam("aggregationDepth")


def test_the_projects_fit_params_are_the_other_estimators(spark, tmp_path):
    """checkpointDir, checkpointEvery, checkpointKeep and dataIn, with the other Estimators'
    defaults and meanings, and resumeFrom (fit(resume_from=)'s), checked before any job
    with errors naming the Param."""
    for stage in (LogisticRegression(), LinearRegression()):
        assert stage.getCheckpointDir() is None and stage.getCheckpointKeep() == 2
        assert stage.getDataIn() == "auto" and stage.getResumeFrom() is None
        assert stage.fit_options() == {"checkpoints": None, "data_in": "auto", "resume_from": None}
    nothing = str(tmp_path / "nothing")
    with pytest.raises(InputError, match=f"LinearRegression: resumeFrom='{nothing}' holds no"):
        LinearRegression().setResumeFrom(nothing).fit(_frame(spark, np.eye(3), [0.0, 1.0, 1.0]))
    options = LinearRegression(checkpointDir=str(tmp_path), checkpointEvery=5).fit_options()
    assert (options["checkpoints"].dir, options["checkpoints"].every) == (str(tmp_path), 5)
    with pytest.raises(ConfigurationError, match="LinearRegression: checkpointEvery must be"):
        LinearRegression(checkpointDir=str(tmp_path), checkpointEvery=0).fit_options()
    with pytest.raises(ConfigurationError, match="dataIn must be 'memory', 'disk' or 'auto'"):
        LogisticRegression().setDataIn("tape").fit_options()


@pytest.mark.slow
def test_unsupported_params_are_refused_by_name(spark):
    frame = _frame(spark, np.eye(3), [0.0, 1.0, 1.0])
    bounds = LogisticRegression(lowerBoundsOnCoefficients=Matrices.dense(1, 3, [0.0] * 3))
    for stage, name in [
        (
            LogisticRegression().setUpperBoundsOnIntercepts(Vectors.dense([1.0])),
            "upperBoundsOnIntercepts",
        ),
        (LinearRegression(loss="huber"), "loss='huber'"),
        (LinearRegression(maxBlockSizeInMB=1.0), "maxBlockSizeInMB=1.0"),
        (LogisticRegression(family="poisson"), "family='poisson'"),
    ]:
        with pytest.raises(ConfigurationError, match=name):
            stage.fit(frame)
    with pytest.raises(ConfigurationError, match="lowerBoundsOnCoefficients is set"):
        bounds.fit(frame)
    with pytest.raises(ConfigurationError, match="has no Param 'learningRate'"):
        LinearRegression(learningRate=0.1)
    with pytest.raises(InputError, match="binomial.*3"):
        LogisticRegression(family="binomial").fit(_frame(spark, np.eye(3), [0.0, 1.0, 2.0]))
    # refused by the stage's checks, in the check job's words (the row: the frame's order)
    fractional = _frame(spark, np.eye(3), [0.0, 1.5, 1.0])
    row = [r["label"] for r in fractional.collect()].index(1.5)
    with pytest.raises(
        InputError,
        match=rf"1 rows whose label 'label' is not a whole number \(e\.g\. 1\.5 at row {row}\)",
    ):
        LogisticRegression().fit(fractional)
    # a stray label is refused before a model of a billion classes is made, as MLlib does
    with pytest.raises(InputError, match=r"1,000,000,001 classes.*at most 1,000"):
        LogisticRegression().fit(_frame(spark, np.eye(3), [0.0, 1e9, 1.0]))


@pytest.mark.slow
def test_model_outputs_and_pipeline_persistence_as_mllib(spark, tmp_path):
    """A Model holding MLlib's own coefficients transforms as MLlib's Model does (binomial,
    with a threshold; multinomial, with thresholds), and saves and loads in a Pipeline."""
    X, y, _ = _classes_data(3, rows=40)
    frame = spark.createDataFrame(
        [(*map(float, x), float(label)) for x, label in zip(X, y)], ["a", "b", "c", "label"]
    )
    assembled = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(frame)
    theirs = mllib_classification.LogisticRegression(regParam=0.1, maxIter=20).fit(assembled)
    fit = LinearFit(theirs.coefficientMatrix.toArray(), theirs.interceptVector.toArray())
    ours = LogisticRegressionModel(fit).setThresholds([0.5, 0.2, 0.3])
    theirs.setThresholds([0.5, 0.2, 0.3])
    columns = ["rawPrediction", "probability", "prediction"]

    def outputs(model, data):
        rows = model.transform(data).select(*columns).collect()
        return [np.asarray([np.asarray(row[c]).ravel() for row in rows]) for c in columns]

    for found, expected in zip(outputs(ours, assembled), outputs(theirs, assembled)):
        np.testing.assert_allclose(found, expected, rtol=1e-9, atol=1e-12)
    one = assembled.first()["features"]
    assert ours.predict(one) == theirs.predict(one)
    np.testing.assert_allclose(ours.predictProbability(one), theirs.predictProbability(one))

    binary = assembled.withColumn("label", (assembled["label"] > 0).cast("double"))
    theirs = mllib_classification.LogisticRegression(maxIter=20, threshold=0.3).fit(binary)
    ours = LogisticRegressionModel(
        LinearFit(theirs.coefficientMatrix.toArray(), theirs.interceptVector.toArray())
    ).setThreshold(0.3)
    for found, expected in zip(outputs(ours, binary), outputs(theirs, binary)):
        np.testing.assert_allclose(found, expected, rtol=1e-9, atol=1e-12)
    assert not ours.hasSummary
    with pytest.raises(RuntimeError, match="No training summary"):
        ours.summary  # noqa: B018

    assembler = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features")
    regression = LinearRegressionModel(LinearFit(np.array([[1.0, -2.0, 0.5]]), np.array([3.0])))
    pipeline = PipelineModel([assembler, ours, regression.setPredictionCol("value")])
    pipeline.save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    assert [type(stage) for stage in loaded.stages[1:]] == [
        LogisticRegressionModel,
        LinearRegressionModel,
    ]
    assert loaded.stages[1].getThreshold() == 0.3
    np.testing.assert_array_equal(
        loaded.stages[1].coefficientMatrix.toArray(), ours.coefficientMatrix.toArray()
    )
    before = pipeline.transform(frame).select("probability", "prediction", "value").collect()
    after = loaded.transform(frame).select("probability", "prediction", "value").collect()
    assert before == after
    expected = X @ np.array([1.0, -2.0, 0.5]) + 3.0
    np.testing.assert_allclose([row["value"] for row in after], expected, rtol=1e-12)
    # an Estimator saves and loads with its Params, in a Pipeline too
    estimator = Pipeline(stages=[assembler, LogisticRegression(regParam=0.3, family="binomial")])
    estimator.save(str(tmp_path / "estimator"))
    stage = Pipeline.load(str(tmp_path / "estimator")).getStages()[1]
    assert isinstance(stage, LogisticRegression)
    assert (stage.getRegParam(), stage.getFamily()) == (0.3, "binomial")
