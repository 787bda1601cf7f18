"""Sparse feature vectors, end to end and never densified: Arrow parts to CSR, the models'
sparse-dense products, the fit on N partitions against one process, and on Spark a
HashingTF pipeline, mixed dense and sparse rows, and the driver's refusals."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp
from conftest import train_on_threads

from allreduce_param import FitSettings, InputError, models, optim
from allreduce_param.engine import AllReduceParameter
from allreduce_param.train.features import VectorParts, is_sparse
from allreduce_param.train.task.job import TrainingJob


def vector_struct(rows: list) -> pa.StructArray:
    """Rows as Spark sends a VectorUDT column through Arrow: ``("sparse", size, indices,
    values)``, ``("dense", values)`` or None."""
    kinds, sizes, indices, values = [], [], [], []
    for row in rows:
        if row is None:
            kinds.append(None), sizes.append(None), indices.append(None), values.append(None)
        elif row[0] == "sparse":
            kinds.append(0), sizes.append(row[1]), indices.append(row[2]), values.append(row[3])
        else:
            kinds.append(1), sizes.append(None), indices.append(None), values.append(row[1])
    return pa.StructArray.from_arrays(
        [
            pa.array(kinds, pa.int8()),
            pa.array(sizes, pa.int32()),
            pa.array(indices, pa.list_(pa.int32())),
            pa.array(values, pa.list_(pa.float64())),
        ],
        names=["type", "size", "indices", "values"],
        mask=pa.array([row is None for row in rows]),
    )


MIXED = [
    ("sparse", 6, [1, 4], [2.0, -1.5]),
    ("dense", [0.0, 3.0, 0.0, 0.0, 0.5, 0.0]),
    ("sparse", 6, [], []),
    ("dense", [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
]
MIXED_DENSE = np.array(
    [[0, 2, 0, 0, -1.5, 0], [0, 3, 0, 0, 0.5, 0], [0] * 6, [1] * 6], dtype=np.float32
)


def test_vector_parts_make_the_same_rows_as_csr_and_dense():
    parts = VectorParts.from_arrow(vector_struct(MIXED))
    X = parts.to_csr(6)
    assert sp.isspmatrix_csr(X) and X.dtype == np.float32
    np.testing.assert_array_equal(X.toarray(), MIXED_DENSE)
    assert X.nnz == 2 + 2 + 0 + 6  # a dense row's zeros are not stored
    np.testing.assert_array_equal(parts.to_dense(6), MIXED_DENSE)
    assert parts.size.tolist() == [6, 6, 6, 6]
    assert parts.nonzeros().tolist() == [2, 2, 0, 6]
    assert not parts.index_problems().any() and not parts.bad_values().any()
    # a slice of the batch (Arrow offsets into the children) reads the same rows
    sliced = VectorParts.from_arrow(vector_struct(MIXED).slice(1, 2))
    np.testing.assert_array_equal(sliced.to_csr(6).toarray(), MIXED_DENSE[1:3])


def test_vector_parts_flag_bad_indices_values_and_null_rows():
    rows = [
        ("sparse", 4, [0, 4], [1.0, 1.0]),  # index 4 of a size-4 vector
        ("sparse", 4, [2, 1], [1.0, 1.0]),  # out of order
        ("sparse", 4, [1, 2], [1.0]),  # one index too many
        ("sparse", 4, [3], [np.nan]),
        ("dense", [1.0, 1e39, 0.0, 0.0]),  # beyond float32: Inf once cast
        None,
        ("sparse", 4, [0, 3], [5.0, 6.0]),
    ]
    parts = VectorParts.from_arrow(vector_struct(rows))
    assert parts.index_problems().tolist() == [True, True, True, False, False, False, False]
    assert parts.row_any(parts.bad_values()).tolist() == [False] * 3 + [True, True] + [False] * 2
    assert parts.null.tolist() == [False] * 5 + [True, False]
    assert parts.size[5] == -1


def test_array_columns_read_as_dense_rows_with_null_elements_as_nan():
    column = pa.array([[1.0, None, 3.0], None, [0.0, 0.0, 2.0]], pa.list_(pa.float32()))
    parts = VectorParts.from_lists(column)
    assert parts.null.tolist() == [False, True, False]
    assert parts.value_null.tolist() == [False, True, False, False, False, False]
    assert parts.row_any(parts.bad_values()).tolist() == [True, False, False]
    assert parts.to_csr(3)[2].toarray().tolist() == [[0.0, 0.0, 2.0]]


def test_the_density_rule():
    assert is_sparse(nonzeros=30 * 1000, rows=1000, n_features=2**18)
    assert not is_sparse(nonzeros=64 * 1000, rows=1000, n_features=64)


@pytest.mark.parametrize(
    "model",
    [
        models.LinearRegression(40),
        models.LogisticRegression(40),
        models.SoftmaxRegression(40, 3),
        models.MLP([40, 16, 3]),
    ],
    ids=repr,
)
def test_models_take_csr_batches_as_they_take_dense_ones(model):
    rng = np.random.default_rng(0)
    X = sp.random(50, 40, density=0.1, format="csr", dtype=np.float32, random_state=1)
    y = rng.integers(0, model.num_classes or 2, 50).astype(np.float64)
    weights = model.init(rng)
    loss, grad, count = model.loss_and_grad(weights, X, y)
    dense_loss, dense_grad, dense_count = model.loss_and_grad(weights, X.toarray(), y)
    assert count == dense_count == 50
    np.testing.assert_allclose(loss, dense_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, dense_grad, rtol=1e-4, atol=1e-6)
    predicted, expected = model.predict(weights, X), model.predict(weights, X.toarray())
    if model.task == "classification":
        np.testing.assert_array_equal(predicted, expected)
    else:
        np.testing.assert_allclose(predicted, expected, rtol=1e-5)
    with pytest.raises(InputError, match="X has 41 features, expected 40"):
        model.loss_and_grad(weights, sp.csr_matrix((2, 41), dtype=np.float32), y[:2])


@pytest.mark.parametrize("width", [300, 2**16], ids=["scipy's product", "summed in place"])
def test_a_sparse_first_layers_gradient_is_scipys_product_either_way(width):
    from allreduce_param.models.dense_stack import IN_PLACE_ABOVE, _add_transposed_product

    rng = np.random.default_rng(2)
    columns = np.sort(rng.integers(0, width, (40, 5)), axis=1)  # repeats in a row add up
    X = sp.csr_matrix(
        (rng.standard_normal(200).astype(np.float32), columns.ravel(), np.arange(41) * 5),
        shape=(40, width),
    )
    delta = rng.standard_normal((40, 3)).astype(np.float32)
    out = np.full((width, 3), np.nan, np.float32)  # every entry written
    _add_transposed_product(X, delta, out)
    assert (width * 3 > IN_PLACE_ABOVE * X.nnz * 3) == (width == 2**16)
    np.testing.assert_array_equal(out, X.T @ delta)


def test_bsp_on_csr_partitions_equals_one_process_on_the_same_batches():
    """The trainer's exactness holds for sparse rows: three partitions of CSR rows give the
    weights of one process that trains on the very global batches (summation order aside)."""
    from test_train_loop import reference_fit

    rng = np.random.default_rng(3)
    X = sp.random(150, 300, density=0.03, format="csr", dtype=np.float32, random_state=4)
    y = np.asarray(X[:, :150].sum(axis=1)).ravel() > np.asarray(X[:, 150:].sum(axis=1)).ravel()
    y = y.astype(np.float64)
    rng.shuffle(y[:10])
    parts = [(X[:40], y[:40]), (X[40:41], y[40:41]), (X[41:], y[41:])]
    model, optimizer = models.LogisticRegression(300), optim.Adam(lr=0.05)
    param = AllReduceParameter(len(parts), model.size, codec="raw", timeout=60)
    settings = FitSettings(batch_size=30, epochs=2, seed=7, threads=None)
    job = TrainingJob(model, optimizer, param, settings, 300, False, sparse=True)
    outputs = train_on_threads(job, parts)
    for output in outputs:
        assert isinstance(output, dict), output
    expected = reference_fit(model, optimizer, parts, batch_size=30, epochs=2, seed=7)
    np.testing.assert_allclose(
        np.frombuffer(outputs[0]["weights"], np.float32), expected, rtol=2e-5, atol=2e-6
    )


class DenseOnly(models.LogisticRegression):
    """A user's model that takes only dense rows (it does not say ``takes_sparse``)."""

    takes_sparse = False

    def loss_and_grad(self, weights, X, y):
        assert isinstance(X, np.ndarray), type(X)
        return super().loss_and_grad(weights, X, y)

    def loss_and_grad_into(self, weights, X, y, out, ready=None):
        assert isinstance(X, np.ndarray), type(X)
        return super().loss_and_grad_into(weights, X, y, out, ready)


def test_a_model_without_takes_sparse_gets_dense_batches():
    X = sp.random(60, 20, density=0.2, format="csr", dtype=np.float32, random_state=2)
    y = (np.arange(60) % 2).astype(np.float64)
    model = DenseOnly(20)
    param = AllReduceParameter(2, model.size, codec="raw", timeout=60)
    job = TrainingJob(
        model,
        optim.SGD(lr=0.1),
        param,
        FitSettings(batch_size=20, epochs=1, seed=1, threads=None),
        20,
        False,
        sparse=True,
    )
    outputs = train_on_threads(job, [(X[:30], y[:30]), (X[30:], y[30:])])
    for output in outputs:
        assert isinstance(output, dict), output


# -- on Spark -------------------------------------------------------------------------------


def documents(spark, rows: int, seed: int):
    """Short documents whose words' frequencies depend on the class: ``text``, ``label``."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(3000)]
    labels = rng.integers(0, 2, rows)
    texts = []
    for label in labels:
        # each class favours its own third of the vocabulary; the last third is shared noise
        own = rng.integers(label * 1000, label * 1000 + 1000, 12)
        noise = rng.integers(2000, 3000, 8)
        texts.append(" ".join(words[i] for i in np.concatenate([own, noise])))
    return spark.createDataFrame(
        [(text, float(label)) for text, label in zip(texts, labels)], ["text", "label"]
    )


@pytest.mark.slow
def test_a_hashing_tf_pipeline_trains_on_sparse_rows_and_predicts_them(spark):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import HashingTF, Tokenizer
    from pyspark.ml.linalg import VectorUDT

    from allreduce_param.ml import AllReduceClassifier
    from allreduce_param.train.driver.data import prepare

    train, test = documents(spark, 600, seed=1), documents(spark, 200, seed=2)
    hashing = HashingTF(inputCol="words", outputCol="features", numFeatures=2**18)
    featurize = Pipeline(stages=[Tokenizer(inputCol="text", outputCol="words"), hashing])
    hashed = featurize.fit(train).transform(train).cache()
    prepared, summary = prepare(hashed, "features", "label", task="classification")
    # the vectors stay vectors: 2^18-wide rows of a few dozen non-zeros, never 1 MB arrays
    assert isinstance(prepared.schema["features"].dataType, VectorUDT)
    stored = sum(row.features.numNonzeros() for row in hashed.select("features").collect())
    assert summary.sparse and summary.nonzeros == stored and summary.n_features == 2**18
    assert summary.sample[0].shape == (1, 2**18) and summary.sample[0].nnz > 0
    # MLlib's regularisation, standardized as MLlib's default: the features' std comes from
    # the CSR rows (an allreduce of per-feature sums), never a dense copy
    classifier = AllReduceClassifier(
        hiddenLayers=[],
        stepSize=0.05,
        batchSize=64,
        maxEpochs=4,
        regParam=1e-4,
        elasticNetParam=0.5,
        showProgress=False,
    )
    model = Pipeline(stages=[*featurize.getStages(), classifier]).fit(train)
    fitted = model.stages[-1]
    assert fitted.numFeatures == 2**18 and fitted.numClasses == 2
    assert fitted.getStandardization() and fitted.getRegParam() == 1e-4
    # L1: the weights of hashed words no document holds stay exactly 0
    weights = fitted.trained.model.tensors(fitted.weights)["w1"]
    assert (weights == 0).all(axis=1).sum() > 2**18 - 3000
    out = model.transform(test).cache()
    correct = out.where("prediction = label").count()
    assert correct / out.count() > 0.9
    row = out.select("features", "rawPrediction", "prediction").first()
    np.testing.assert_allclose(
        fitted.predictRaw(row.features).toArray(), row.rawPrediction.toArray(), rtol=1e-5
    )
    # TrainedModel.predict reads the sparse column too, and agrees with the Estimator's Model
    predicted = fitted.trained.predict(out.select("features", "prediction"), "features", "again")
    assert predicted.where("again != prediction").count() == 0
    out.unpersist(), hashed.unpersist()


def sparse_rows(spark, rows: list, labels=None):
    """A DataFrame of ``features`` (the given pyspark.ml vectors, or None) and ``label``."""
    labels = labels if labels is not None else [float(i % 2) for i in range(len(rows))]
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import DoubleType, StructField, StructType

    schema = StructType(
        [StructField("features", VectorUDT(), True), StructField("label", DoubleType(), False)]
    )
    return spark.createDataFrame(list(zip(rows, labels)), schema)


@pytest.mark.slow
def test_dense_and_sparse_rows_in_one_column_train_and_predict_alike(spark):
    from pyspark.ml.linalg import Vectors

    from allreduce_param import DistriOptimizer
    from allreduce_param.train.driver.data import prepare

    rng = np.random.default_rng(5)
    width, vectors, dense = 300, [], np.zeros((120, 300), np.float32)
    for i in range(120):
        columns = np.sort(rng.choice(width, 6, replace=False))
        values = rng.standard_normal(6)
        dense[i, columns] = values
        if i % 10 == 0:  # every tenth row dense, its zeros stored
            vectors.append(Vectors.dense(dense[i].astype(np.float64)))
        else:
            vectors.append(Vectors.sparse(width, columns.tolist(), values.tolist()))
    labels = (dense[:, :150].sum(axis=1) > dense[:, 150:].sum(axis=1)).astype(float).tolist()
    df = sparse_rows(spark, vectors, labels).repartition(2)
    _, summary = prepare(df, "features", "label")
    assert summary.sparse and summary.nonzeros == 120 * 6
    trainer = DistriOptimizer(
        models.LogisticRegression(width),
        optim.Adam(lr=0.05),
        FitSettings(batch_size=40, epochs=5, seed=3, progress=False),
    )
    trained = trainer.fit(df)
    rows = trained.predict(df, "features").collect()
    X = np.asarray([row.features.toArray() for row in rows], np.float32)
    np.testing.assert_array_equal(
        [row.prediction for row in rows], trained.predict_numpy(X).astype(np.float64)
    )
    accuracy = np.mean(trained.predict_numpy(X) == np.asarray([row.label for row in rows]))
    assert accuracy > 0.8


def test_dense_data_in_a_vector_column_trains_dense(spark):
    from pyspark.ml.linalg import Vectors

    from allreduce_param.train.driver.data import prepare

    rng = np.random.default_rng(0)
    df = sparse_rows(spark, [Vectors.dense(rng.standard_normal(8)) for _ in range(20)])
    _, summary = prepare(df, "features", "label")
    assert not summary.sparse and summary.nonzeros == 20 * 8
    assert isinstance(summary.sample[0], np.ndarray) and summary.sample[0].shape == (1, 8)


def _vector_with_indices(size: int, indices: list, values: list):
    """A SparseVector holding indices its constructor would refuse (as a JVM source might)."""
    from pyspark.ml.linalg import SparseVector

    vector = SparseVector(size, [0], [1.0])
    vector.indices = np.asarray(indices, np.int32)
    vector.values = np.asarray(values, np.float64)
    return vector


BAD_COLUMNS = {
    "sizes that differ": (
        lambda V: [V.sparse(10, [1], [1.0]), V.sparse(12, [3], [1.0])],
        r"holds vectors of 10 to 12 elements \(e\.g\. row 0: 10, row 1: 12\); every row needs "
        r"the same length",
    ),
    "an index out of range": (
        lambda V: [V.sparse(10, [1], [1.0]), _vector_with_indices(10, [2, 10], [1.0, 2.0])],
        r"indices are out of range, out of order or not one per value in 1 rows \(e\.g\. row 1: "
        r"size 10, 2 indices \[2, 10\] for 2 values\)",
    ),
    "a NaN value": (
        lambda V: [V.sparse(10, [1], [1.0]), V.sparse(10, [4, 7], [1.0, float("nan")])],
        r"holds NaN, Inf or null in 1 rows \(e\.g\. row 1: NaN at element 7\)",
    ),
    "a null vector": (
        lambda V: [V.sparse(10, [1], [1.0]), V.sparse(10, [2], [1.0]), None],
        r"has 1 rows whose 'features' is null \(e\.g\. row 2\); drop them first, "
        r"e\.g\. df\.dropna\(subset=\['features'\]\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_COLUMNS))
def test_the_driver_names_bad_sparse_rows(spark, case):
    from pyspark.ml.linalg import Vectors

    from allreduce_param.train.driver.data import prepare

    rows, message = BAD_COLUMNS[case]
    df = sparse_rows(spark, rows(Vectors)).coalesce(1)
    with pytest.raises(InputError, match=message):
        prepare(df, "features", "label")


@pytest.mark.slow
def test_an_estimator_reads_the_width_of_sparse_vectors_without_metadata(spark):
    """A vector column made without ML metadata (no VectorAssembler, no HashingTF): the
    Estimator takes the width from one vector's size, never from a dense copy."""
    from pyspark.ml.linalg import Vectors

    from allreduce_param.ml import AllReduceRegressor

    vectors = [Vectors.sparse(5000, [i % 5000, (7 * i) % 5000], [1.0, 2.0]) for i in range(1, 41)]
    df = sparse_rows(spark, vectors, [float(i % 3) for i in range(40)])
    assert "ml_attr" not in df.schema["features"].metadata
    fitted = AllReduceRegressor(hiddenLayers=[], batchSize=8, maxEpochs=1, showProgress=False)
    model = fitted.fit(df)
    assert model.numFeatures == 5000 and model.weights.size == 5001
    assert model.transform(df).where("prediction IS NULL").count() == 0
