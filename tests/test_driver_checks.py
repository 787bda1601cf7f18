"""What the driver refuses before the fit's barrier stage starts (real Spark, local[4]).

Bad rows (NaN or Inf features, labels a classifier has no class for, weights that are no
finite number >= 0) are found by ``prepare``'s one check job; dynamic allocation and too few task slots by
``DistriOptimizer._workers``. Each refusal must come before any task of the fit runs: the
models here leave a marker file when ``loss_and_grad`` runs inside a Spark task.

The module's session is local[4]. The last tests need settings a running SparkContext
cannot take (spark.task.cpus, dynamic allocation): they stop it and start their own, so
they stay at the end of the file.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import re
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import CONF_DIR
from pyspark import cloudpickle

from allreduce_param import ConfigurationError, DistriOptimizer, InputError, models, optim
from allreduce_param.spark.session import local_spark
from allreduce_param.train import Checkpoints
from allreduce_param.train.driver.data import prepare, prepare_once

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FEATURES, CLASSES = 4, 3
#: the last tests stop the module's session: this module runs last of those sharing it (conftest)
SPARK_STOPS_SESSION = True


class Marked(models.MLP):
    """An MLP that leaves a file in ``folder`` whenever ``loss_and_grad`` runs in a Spark task."""

    def __init__(self, layers, folder, task="classification"):
        super().__init__(layers, task=task)
        self.folder = str(folder)

    def loss_and_grad(self, weights, X, y):
        from pyspark import TaskContext

        if TaskContext.get() is not None:
            Path(self.folder, f"partition-{TaskContext.get().partitionId()}").touch()
        return super().loss_and_grad(weights, X, y)


class Unsized:
    """A user's classifier that does not say how many classes it has (no ``num_classes``)."""

    task = "classification"

    def __init__(self, folder):
        self.inner = Marked([FEATURES, 8, CLASSES], folder)

    def init(self, rng):
        return self.inner.init(rng)

    def loss_and_grad(self, weights, X, y):
        return self.inner.loss_and_grad(weights, X, y)

    def predict(self, weights, X):
        return self.inner.predict(weights, X)


def blobs(rows=48, seed=0):
    """Three well-separated classes of ``FEATURES`` features; labels 0.0, 1.0, 2.0."""
    rng = np.random.default_rng(seed)
    y = np.arange(rows) % CLASSES
    X = rng.normal(0, 0.3, (rows, FEATURES)) + np.eye(CLASSES, FEATURES)[y] * 3
    return X, y.astype(np.float64)


def frame(spark, X, y, vectors=False, kind="array<double>"):
    """Rows in the order given (row i of the DataFrame is X[i], y[i]), over 4 partitions."""
    if vectors:
        from pyspark.ml.linalg import Vectors

        return spark.createDataFrame(
            [(Vectors.dense(row), float(label)) for row, label in zip(X, y)], ["features", "label"]
        )
    rows = [
        ([None if v is None else float(v) for v in row], float(label)) for row, label in zip(X, y)
    ]
    return spark.createDataFrame(rows, f"features {kind}, label double")


def weighted_frame(spark, X, y, w, kind="double"):
    """``frame``'s rows with a weight column ``w`` of Spark type ``kind`` (None: null)."""
    rows = [([float(v) for v in row], float(label), weight) for row, label, weight in zip(X, y, w)]
    return spark.createDataFrame(rows, f"features array<double>, label double, w {kind}")


def trainer(model, lr=1e-2, **settings):
    defaults = dict(batch_size=16, epochs=1, progress=False)
    defaults.update(settings)
    return DistriOptimizer(model, optim.Adam(lr=lr), **defaults)


def refused(tmp_path, fit, match):
    """``fit()`` raises InputError matching ``match``, and no task ran the model."""
    with pytest.raises(InputError, match=match) as failure:
        fit()
    assert list(tmp_path.iterdir()) == [], "a task of the fit ran before the data was refused"
    return failure.value


# ---- features --------------------------------------------------------------------------


@pytest.mark.slow
def test_nan_and_inf_in_a_vector_column_fail_on_the_driver(spark, tmp_path):
    X, y = blobs()
    X[7, 2], X[19, 0], X[40, 3] = np.nan, np.inf, -np.inf
    data = frame(spark, X, y, vectors=True)
    refused(
        tmp_path,
        lambda: trainer(Marked([FEATURES, 8, CLASSES], tmp_path)).fit(data),
        r"^the training column 'features' holds NaN, Inf or null in 3 rows \(e\.g\. row 7: NaN at "
        r"element 2\); drop or fill them before training: df\.na\.drop\(\) or pyspark\.ml\.feature\.Imputer",
    )


def test_null_and_overflowing_elements_of_an_array_column_count_too(spark, tmp_path):
    X, y = blobs()
    rows = X.astype(object)
    rows[30, 1] = None  # a null element: NaN to the task's numpy matrix
    rows[33, 0] = 1e39  # beyond float32: Inf once the column is cast to array<float>
    data = frame(spark, rows, y)
    refused(
        tmp_path,
        lambda: trainer(Marked([FEATURES, 8, CLASSES], tmp_path)).fit(data),
        r"holds NaN, Inf or null in 2 rows \(e\.g\. row 30: null at element 1\).*"
        r"a number beyond float32's \+-3\.4e38 becomes Inf too",
    )


def test_bad_validation_features_name_the_validation_data(spark, tmp_path):
    X, y = blobs()
    X_val, y_val = blobs(rows=12, seed=1)
    X_val[5, 1] = np.inf
    fit = lambda: trainer(Marked([FEATURES, 8, CLASSES], tmp_path)).fit(  # noqa: E731
        frame(spark, X, y), validation=frame(spark, X_val, y_val)
    )
    refused(
        tmp_path,
        fit,
        r"^the validation column 'features' holds NaN, Inf or null in 1 rows "
        r"\(e\.g\. row 5: Inf at element 1\)",
    )


def test_the_first_bad_row_is_counted_across_uneven_partitions(spark):
    sizes = [4, 0, 7, 2, 1]  # rows per partition; one empty
    starts = [sum(sizes[:p]) for p in range(len(sizes))]

    def rows(p):
        return [([math.nan if starts[p] + j in (12, 13) else 1.0], 0.0) for j in range(sizes[p])]

    rdd = spark.sparkContext.parallelize(range(len(sizes)), len(sizes)).flatMap(rows)
    data = spark.createDataFrame(rdd, "features array<float>, label double")
    with pytest.raises(InputError, match=r"in 2 rows \(e\.g\. row 12: NaN at element 0\)"):
        prepare(data, "features", "label")


@pytest.mark.parametrize("partitions", [2, 0])
def test_data_without_rows_is_refused_even_without_partitions(spark, partitions):
    data = spark.createDataFrame([([1.0] * FEATURES, 0.0)], "features array<float>, label double")
    empty = data.limit(0) if partitions == 0 else data.filter("label > 1").repartition(partitions)
    assert empty.rdd.getNumPartitions() == partitions
    with pytest.raises(InputError, match="the training data has no rows"):
        DistriOptimizer(
            models.MLP([FEATURES, 3, CLASSES]), optim.SGD(lr=0.1), batch_size=8, progress=False
        ).fit(empty)


def test_refusing_runs_the_check_job_only(spark, tmp_path):
    """The failing fit submits exactly the jobs of prepare's one check query: no second pass
    over the data, no placement shuffle, no barrier stage."""
    X, y = blobs()
    X[3, 0] = np.nan
    data = frame(spark, X, y)
    prepare_jobs = jobs_while(spark, lambda: prepare(data, "features", "label"))
    fit_jobs = jobs_while(
        spark, lambda: trainer(Marked([FEATURES, 8, CLASSES], tmp_path)).fit(data)
    )
    assert 0 < len(fit_jobs) == len(prepare_jobs)


def jobs_while(spark, call) -> list[int]:
    """The Spark jobs ``call()`` submitted (it must raise InputError)."""
    context, group = spark.sparkContext, f"driver-checks-{uuid.uuid4().hex}"
    context.setJobGroup(group, "driver checks")
    try:
        with pytest.raises(InputError):
            call()
    finally:
        context.setLocalProperty("spark.jobGroup.id", None)
    return list(context.statusTracker().getJobIdsForGroup(group))


# ---- labels ----------------------------------------------------------------------------


def test_labels_beyond_the_models_classes(spark, tmp_path):
    X, y = blobs(rows=60)
    y = np.arange(60) % 11.0  # 0..10 for a 10-output MLP: 5 rows of label 10, the first at row 10
    refused(
        tmp_path,
        lambda: trainer(Marked([FEATURES, 8, 10], tmp_path)).fit(frame(spark, X, y)),
        r"^the training data has 5 rows whose label 'label' is 10 or more \(e\.g\. 10 at row 10; the "
        r"largest is 10\), but the model has 10 classes \(ids 0\.\.9\): use a model with 11 outputs "
        r"\(e\.g\. MLP\(\[\.\.\., 11\]\)",
    )


def test_logistic_regression_takes_two_classes(spark, tmp_path):
    X, y = blobs()
    y_val = np.zeros(12)
    y_val[[4, 9]] = 2.0

    def fit():
        return trainer(models.LogisticRegression(FEATURES)).fit(
            frame(spark, X, (y > 0).astype(float)), validation=frame(spark, X[:12], y_val)
        )

    refused(
        tmp_path,
        fit,
        r"^the validation data has 2 rows whose label 'label' is 2 or more \(e\.g\. 2 at "
        r"row 4; the largest is 2\), but the model has 2 classes \(ids 0\.\.1\)",
    )


def test_fractional_labels(spark, tmp_path):
    X, y = blobs()
    y[[9, 25]] = [1.5, 0.25]
    refused(
        tmp_path,
        lambda: trainer(Marked([FEATURES, 8, CLASSES], tmp_path)).fit(frame(spark, X, y)),
        r"^the training data has 2 rows whose label 'label' is not a whole number \(e\.g\. 1\.5 at row 9\), "
        r"but a classification model takes class ids 0, 1, 2, \.\.\.: index the classes with "
        r"pyspark\.ml\.feature\.StringIndexer",
    )


def test_a_model_without_num_classes_gets_the_whole_number_and_sign_checks(spark, tmp_path):
    X, y = blobs()
    y[[5, 6, 44]] = -1.0
    refused(
        tmp_path,
        lambda: trainer(Unsized(tmp_path)).fit(frame(spark, X, y)),
        r"^the training data has 3 rows whose label 'label' is negative \(e\.g\. -1 at row 5\), but a "
        r"classification model takes class ids 0, 1, 2, \.\.\.: re-index",
    )
    y[[5, 6, 44]] = 7.0  # a class it may have: not the driver's to judge
    prepare(frame(spark, X, y), "features", "label", task="classification", num_classes=None)


def test_infinite_regression_targets(spark, tmp_path):
    X, y = blobs()
    y[17] = -np.inf
    model = Marked([FEATURES, 1], tmp_path, task="regression")
    refused(
        tmp_path,
        lambda: trainer(model).fit(frame(spark, X, y)),
        r"^the training data has 1 rows whose label 'label' is infinite \(e\.g\. -Inf at row 17\)",
    )
    y[17] = 0.5  # fractional targets are a regression model's own
    prepare(frame(spark, X, y), "features", "label", task="regression")


def test_the_built_in_classifiers_say_how_many_classes():
    assert models.MLP([4, 8, 10]).num_classes == 10
    assert models.SoftmaxRegression(4, 3).num_classes == 3
    assert models.LogisticRegression(4).num_classes == 2
    assert models.MLP([4, 8, 2], task="regression").num_classes is None
    assert models.LinearRegression(4).num_classes is None
    assert pickle.loads(pickle.dumps(models.MLP([4, 10]))).num_classes == 10
    with pytest.raises(AttributeError):
        models.MLP([4, 10]).num_classes = 11


# ---- weights ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, shown",
    [(None, "null"), (math.nan, "NaN"), (-0.5, "-0.5"), (math.inf, "Inf"), (-math.inf, "-Inf")],
)
def test_each_kind_of_bad_weight_is_counted_with_the_first_row(spark, bad, shown):
    X, y = blobs()
    w = [1.0] * len(y)
    for row in (9, 30, 41):
        w[row] = bad
    data = weighted_frame(spark, X, y, w)
    with pytest.raises(
        InputError,
        match=(
            r"^the training data has 3 rows whose weight 'w' \(weight_col\) is null, NaN, negative or infinite "
            rf"\(e\.g\. {re.escape(shown)} at row 9\); a weight must be a finite number >= 0: fill them, e\.g\. "
            r"df\.fillna\(1\.0, subset=\['w'\]\) for null and NaN, or filter them out"
        ),
    ):
        prepare(data, "features", "label", weight_col="w")
    prepare(data, "features", "label")  # without weight_col the column is not the fit's


def test_the_first_bad_weight_is_counted_across_uneven_partitions(spark):
    sizes = [4, 0, 7, 2, 1]  # rows per partition; one empty
    starts = [sum(sizes[:p]) for p in range(len(sizes))]
    bad = {12: -math.inf, 13: None, 5: 0.0}  # row 5's weight 0 is good

    def rows(p):
        return [([1.0], 0.0, bad.get(starts[p] + j, 2.0)) for j in range(sizes[p])]

    rdd = spark.sparkContext.parallelize(range(len(sizes)), len(sizes)).flatMap(rows)
    data = spark.createDataFrame(rdd, "features array<float>, label double, w double")
    with pytest.raises(
        InputError,
        match=r"^the training data has 2 rows whose weight 'w' \(weight_col\) is "
        r"null, NaN, negative or infinite \(e\.g\. -Inf at row 12\)",
    ):
        prepare(data, "features", "label", weight_col="w")
    with pytest.raises(
        InputError,
        match=r"^the validation data has 2 rows whose weight 'w'.*\(e\.g\. -Inf at "
        r"row 12\)",
    ):
        prepare(
            weighted_frame(spark, np.ones((10, 1)), np.zeros(10), [1.0] * 10),
            "features",
            "label",
            data,
            weight_col="w",
        )


def test_the_weight_checks_add_no_spark_job(spark):
    X, y = blobs()
    bad_features = X.copy()
    bad_features[3, 0] = np.nan
    w = [1.0] * len(y)
    w[3] = math.nan
    unweighted_jobs = jobs_while(
        spark, lambda: prepare(frame(spark, bad_features, y), "features", "label")
    )
    weighted_jobs = jobs_while(
        spark, lambda: prepare(weighted_frame(spark, X, y, w), "features", "label", weight_col="w")
    )
    assert 0 < len(weighted_jobs) == len(unweighted_jobs)


def test_a_missing_weight_column_is_named_with_the_columns_there(spark):
    X, y = blobs()
    with pytest.raises(
        InputError,
        match=r"^the training data has no column 'w' \(weight_col\); its columns are "
        r"\['features', 'label'\]$",
    ):
        prepare(frame(spark, X, y), "features", "label", weight_col="w")
    with pytest.raises(
        InputError,
        match=r"^the validation data has no column 'w' \(weight_col\); its columns "
        r"are \['features', 'label'\]$",
    ):
        prepare(
            weighted_frame(spark, X, y, [1.0] * len(y)),
            "features",
            "label",
            frame(spark, X, y),
            weight_col="w",
        )


@pytest.mark.parametrize("kind", ["string", "boolean"])
def test_a_weight_column_that_is_not_numeric_is_refused(spark, kind):
    X, y = blobs()
    weights = ["1.0"] * len(y) if kind == "string" else [True] * len(y)
    with pytest.raises(
        InputError,
        match=rf"^the training weight column 'w' \(weight_col\) is {kind}; it must be "
        r"numeric: a finite number >= 0 per row",
    ):
        prepare(weighted_frame(spark, X, y, weights, kind), "features", "label", weight_col="w")


@pytest.mark.slow
def test_weights_that_sum_to_zero_are_refused_in_training_and_in_validation(spark):
    X, y = blobs()
    zeros, ones = [0.0] * len(y), [1.0] * len(y)
    with pytest.raises(
        InputError,
        match=r"^the training data's weights in 'w' \(weight_col\) sum to 0: all its 48 "
        r"rows have weight 0, so no row counts .*at least one row needs a weight > 0$",
    ):
        prepare(weighted_frame(spark, X, y, zeros), "features", "label", weight_col="w")
    with pytest.raises(
        InputError,
        match=r"^the validation data's weights in 'w' \(weight_col\) sum to 0: all its "
        r"12 rows",
    ):
        prepare(
            weighted_frame(spark, X, y, ones),
            "features",
            "label",
            weighted_frame(spark, X[:12], y[:12], zeros[:12]),
            weight_col="w",
        )
    with pytest.raises(
        InputError,
        match=r"^the training data's weights in 'w' \(weight_col\) sum to more than a "
        r"float64 holds",
    ):
        prepare(weighted_frame(spark, X, y, [1e308] * len(y)), "features", "label", weight_col="w")


@pytest.mark.slow
def test_good_weights_become_the_weight_column(spark):
    X, y = blobs()
    X_val, y_val = blobs(rows=12, seed=1)
    w = [row % 4 for row in range(len(y))]  # whole numbers, 0 too; cast to double
    w_val = [2 * row + 1 for row in range(len(y_val))]
    prepared, summary = prepare(
        weighted_frame(spark, X, y, w, "int"),
        "features",
        "label",
        weighted_frame(spark, X_val, y_val, w_val, "bigint"),
        weight_col="w",
    )
    assert summary.weighted and summary.n_features == FEATURES
    assert prepared.dtypes == [
        ("features", "array<float>"),
        ("label", "double"),
        ("split", "int"),
        ("weight", "double"),
    ]
    rows = prepared.collect()
    assert [(row.split, row.label, row.weight) for row in rows] == [
        (0, float(label), float(weight)) for label, weight in zip(y, w)
    ] + [(1, float(label), float(weight)) for label, weight in zip(y_val, w_val)]
    # (X, y), as unweighted
    assert summary.sample[0].shape == (1, FEATURES) and len(summary.sample) == 2
    # unweighted: the three columns, as before
    plain, plain_summary = prepare(weighted_frame(spark, X, y, w, "int"), "features", "label")
    assert plain.columns == ["features", "label", "split"] and not plain_summary.weighted


def test_prepare_once_keeps_weighted_and_unweighted_checks_apart(spark):
    X, y = blobs()
    data = weighted_frame(spark, X, y, [float(row % 3) for row in range(len(y))]).cache()
    try:
        unweighted = prepare_once(data, "features", "label")
        weighted = prepare_once(data, "features", "label", weight_col="w")
        assert weighted is not unweighted
        assert weighted[1].weighted and weighted[0].columns[-1] == "weight"
        assert not unweighted[1].weighted and unweighted[0].columns == [
            "features",
            "label",
            "split",
        ]
        # each remembered under its own settings
        assert prepare_once(data, "features", "label") is unweighted
        assert prepare_once(data, "features", "label", weight_col="w") is weighted
    finally:
        data.unpersist()


# ---- data that trains, with a warning ----------------------------------------------------


def test_workers_without_rows_a_batch_beyond_the_data_and_classes_without_rows_are_warned(
    spark,
):
    """Three training rows of classes 0 and 1 for a 3-class model on 4 workers, batch 8:
    the fit runs (each is the user's call), and says what it will do with each."""
    X, y = blobs(rows=3)
    y = np.asarray([0.0, 1.0, 1.0])
    data = frame(spark, X, y).coalesce(1)
    with pytest.warns(UserWarning) as caught:
        trained = trainer(models.MLP([FEATURES, 8, CLASSES]), batch_size=8, num_workers=4).fit(data)
    messages = [str(warning.message) for warning in caught]
    assert any(
        m.startswith("1 of the 4 workers get no training rows (3 rows for 4 workers)")
        for m in messages
    ), messages
    assert any(
        m.startswith("batch_size=8 is larger than the 3 training rows: every step takes all")
        for m in messages
    ), messages
    assert any(
        m.startswith(
            "the training labels hold 2 distinct classes but the model has 3 (ids 0..2); no "
            "training row has class 2"
        )
        for m in messages
    ), messages
    assert len(trained.history.epochs) == 1


def test_data_that_fills_its_workers_and_classes_trains_without_a_warning(spark):
    import warnings

    X, y = blobs(rows=48)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer(models.MLP([FEATURES, 8, CLASSES]), num_workers=4).fit(frame(spark, X, y))


# ---- checkpoints -----------------------------------------------------------------------


def test_a_checkpoint_dir_that_cannot_be_a_folder_fails_on_the_driver(
    spark, tmp_path, tmp_path_factory
):
    blocking = tmp_path_factory.mktemp("checkpoints") / "a-file"
    blocking.write_text("not a folder")
    X, y = blobs()
    data = frame(spark, X, y)
    fit = trainer(
        Marked([FEATURES, 8, CLASSES], tmp_path), checkpoints=Checkpoints(str(blocking / "ckpt"))
    )
    with pytest.raises(ConfigurationError) as failure:
        fit.fit(data)
    message = str(failure.value)
    assert message.startswith(f"checkpoint_dir={str(blocking / 'ckpt')!r} cannot hold"), message
    assert "NotADirectoryError" in message or "FileExistsError" in message, message
    assert list(tmp_path.iterdir()) == [], "a task of the fit ran before the folder was refused"


# ---- settings that need a session of their own (last: they stop the module's) ----------


@contextlib.contextmanager
def session_with(spark, master="local[4]", **settings):
    """A session with ``settings``, after stopping ``spark``: a JVM holds one SparkContext."""
    spark.stop()
    session = local_spark(master, "allreduce-param-driver-check-settings", CONF_DIR, **settings)
    try:
        yield session
    finally:
        session.stop()


@pytest.mark.slow
def test_slots_count_spark_task_cpus_and_good_data_trains_with_dynamic_allocation_on_locally(
    spark, tmp_path
):
    """local[4] with spark.task.cpus=2 has 2 slots. Spark ignores dynamic allocation in local
    mode and runs barrier stages there, so a fit is not refused for it: the one fit of this
    module with good data (a vector column, validation) runs here, on the 2 slots."""
    settings = {"spark.task.cpus": "2", "spark.dynamicAllocation.enabled": "true"}
    X, y = blobs(rows=96)
    X_val, y_val = blobs(rows=24, seed=1)
    with session_with(spark, **settings) as session:
        data = frame(session, X, y, vectors=True)
        with pytest.raises(
            ConfigurationError,
            match=r"^num_workers=3, but Spark has 2 task slots \(the cores of "
            r"local\[4\] / spark\.task\.cpus=2\); a barrier stage",
        ):
            trainer(Marked([FEATURES, 8, CLASSES], tmp_path), num_workers=3).fit(data)
        assert list(tmp_path.iterdir()) == []
        result = trainer(Marked([FEATURES, 8, CLASSES], tmp_path), lr=0.05).fit(
            data, validation=frame(session, X_val, y_val)
        )
    assert result.history.epochs[-1]["val_accuracy"] >= 0.9
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "partition-0",
        "partition-1",
    ]  # the marker works


def test_dynamic_allocation_is_refused_where_spark_would_refuse_the_stage(spark, tmp_path):
    """Where Spark applies dynamic allocation, as on a cluster (checked by hand on
    local-cluster[1,1,1024], a slower session). In local mode Spark applies it only with
    spark.dynamicAllocation.testing=true: the same rule, Utils.isDynamicAllocationEnabled."""
    settings = {
        "spark.dynamicAllocation.enabled": "true",
        "spark.dynamicAllocation.testing": "true",
    }
    X, y = blobs()
    with session_with(spark, **settings) as session:
        data = frame(session, X, y)
        with pytest.raises(
            ConfigurationError,
            match=r"^spark\.dynamicAllocation\.enabled=true, but a barrier stage "
            r"\(the fit\) cannot run under dynamic allocation.*"
            r"spark\.dynamicAllocation\.enabled=false.*"
            r"spark\.executor\.instances=N",
        ):
            trainer(Marked([FEATURES, 8, CLASSES], tmp_path)).fit(data)
        assert list(tmp_path.iterdir()) == []
        # what the check spares the user: Spark's own refusal, once the stage is submitted
        with pytest.raises(Exception, match="BarrierJobRunWithDynamicAllocationException"):
            session.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(
                lambda rows: rows
            ).collect()
