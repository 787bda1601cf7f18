"""pyspark.ml Estimators over ``DistriOptimizer``: ``AllReduceClassifier``, ``AllReduceRegressor``.

A thin layer on the driver: Params in, one ``DistriOptimizer.fit``, a Model out. The
Estimators go in a ``Pipeline`` after ``VectorAssembler`` and ``StandardScaler``, run under
``CrossValidator`` and ``TrainValidationSplit``, and their Models save and load with Spark's
own persistence (``PipelineModel.save``): the Params as Spark writes them, the weights as a
Parquet array beside them (no pickle), at any path Spark writes to.

The network is a dense one: ``hiddenLayers`` widths between the features and the outputs,
``[]`` (the default) for a linear model (softmax regression for the classifier, least
squares for the regressor). Training logic lives in ``train``, not here.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import numpy as np
from pyspark.ml.base import PredictionModel, Predictor
from pyspark.ml.classification import ProbabilisticClassificationModel, ProbabilisticClassifier
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasStepSize, HasValidationIndicatorCol, HasWeightCol
from pyspark.ml.util import (
    DefaultParamsReadable,
    DefaultParamsReader,
    DefaultParamsWritable,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

from allreduce_param import models, optim
from allreduce_param.errors import AllReduceError, ConfigurationError, InputError
from allreduce_param.ml_params import FitSettingParams, FitSettingSetters
from allreduce_param.models.base import dense_for, takes_sparse
from allreduce_param.spark.arrow import float_lists
from allreduce_param.spark.info import is_connect
from allreduce_param.spark.versions import from_arrow, ml_metadata, to_arrow
from allreduce_param.train.driver.data import check_label_column
from allreduce_param.train.driver.distri import DistriOptimizer
from allreduce_param.train.features import matrix_from_pandas
from allreduce_param.train.result import History, TrainedModel
from allreduce_param.train.rows import features_column, is_vector_type
from allreduce_param.train.settings import FitSettings, estimator_params

#: The optimizers the ``optimizer`` Param names.
OPTIMIZERS = {
    "adam": optim.Adam,
    "adamw": optim.AdamW,
    "sgd": optim.SGD,
    "rmsprop": optim.RMSprop,
    "adagrad": optim.Adagrad,
}

#: ``DistriOptimizer.fit``'s arguments, as the Params that set them.
_ARGUMENT_PARAMS = {
    "features_col": "featuresCol",
    "label_col": "labelCol",
    "weight_col": "weightCol",
}
#: The fit's settings (and the optimizer's learning rate), as the Params that set them.
_SETTING_PARAMS = [(spec.name, spec.setting) for spec in estimator_params()] + [("stepSize", "lr")]
#: What ``fit(initial=...)``'s checks name, as the Estimators' Params: in any error.
_START_PARAMS = (
    ("initialModel", r"\binitial(?= holds| must|=)"),
    ("keepOptimizerState", r"\bkeep_optimizer_state(?==)"),
)


class _AllReduceParams(HasWeightCol, HasValidationIndicatorCol, HasStepSize, FitSettingParams):
    """The Params both Estimators and their Models share: the network's and the optimizer's
    here, and one per fit setting (``FitSettings``, flat as the job files name them:
    ``checkpointDir``, ``regParam``), declared in ``ml_params``."""

    hiddenLayers = Param(
        Params._dummy(),
        "hiddenLayers",
        "widths of the hidden layers, e.g. [128, 64]; [] for a linear model",
        typeConverter=TypeConverters.toListInt,
    )
    optimizer = Param(
        Params._dummy(),
        "optimizer",
        f"the optimizer: {', '.join(OPTIMIZERS)}",
        typeConverter=TypeConverters.toString,
    )

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._setDefault(
            hiddenLayers=[],
            optimizer="adam",
            stepSize=0.001,
            **{spec.name: spec.default for spec in estimator_params()},
        )

    def getHiddenLayers(self) -> list[int]:
        """The widths of the hidden layers."""
        return self.getOrDefault(self.hiddenLayers)

    def getOptimizer(self) -> str:
        """The optimizer's name."""
        return self.getOrDefault(self.optimizer)


class _AllReduceEstimator(_AllReduceParams, FitSettingSetters):
    """What both Estimators do: describe the data, build the network, fit, wrap the result.

    ``initialModel``: a Model of this Estimator's (a fit's, or ``load``'s) to continue
    training from, as MLlib's KMeans ``initialModel`` and xgboost.spark's ``xgb_model``:
    its weights, where its training stopped (the epochs are numbered on, the optimizer's
    step count goes on), and with ``keepOptimizerState=True`` (set on both fits) its
    optimizer state, so two fits of k epochs give one fit of 2k epochs' weights. It is not
    written with the Estimator (``write()`` leaves it out: save the Model itself).
    """

    _task = ""

    initialModel = Param(
        Params._dummy(),
        "initialModel",
        "a Model of this Estimator's to continue training from (its weights, and with "
        "keepOptimizerState its optimizer state); not written with the Estimator",
        typeConverter=TypeConverters.identity,
    )

    def __init__(self, **params: Any) -> None:
        super().__init__()
        self.setParams(**params)

    def setParams(self, **params: Any):
        """Set Params by name (any of ``explainParams()``'s), e.g. ``setParams(maxEpochs=5)``."""
        unknown = sorted(name for name in params if not self.hasParam(name))
        if unknown:
            raise ConfigurationError(
                f"{type(self).__name__} has no Param {', '.join(map(repr, unknown))}; "
                f"its Params are {', '.join(sorted(param.name for param in self.params))}"
            )
        return self._set(**params)

    def setHiddenLayers(self, value: list[int]):
        """Set the widths of the hidden layers."""
        return self._set(hiddenLayers=value)

    def setOptimizer(self, value: str):
        """Set the optimizer's name."""
        return self._set(optimizer=value)

    def setStepSize(self, value: float):
        """Set the optimizer's learning rate."""
        return self._set(stepSize=value)

    def setWeightCol(self, value: str):
        """Set the column of sample weights."""
        return self._set(weightCol=value)

    def setValidationIndicatorCol(self, value: str):
        """Set the boolean column that marks validation rows."""
        return self._set(validationIndicatorCol=value)

    def setInitialModel(self, value):
        """Set the Model to continue training from (``initialModel``)."""
        return self._set(initialModel=value)

    def getInitialModel(self):
        """The Model training continues from (None: from the start)."""
        return self.getOrDefault(self.initialModel) if self.isDefined(self.initialModel) else None

    def write(self) -> MLWriter:
        """A writer of the Params, ``initialModel`` left out (a Model is no JSON value)."""
        if not self.isSet(self.initialModel):
            return super().write()
        kept = self.copy()
        kept.clear(kept.initialModel)
        return kept.write()

    def _fit(self, dataset):
        settings = self._settings()  # a bad setting fails here, before the data's first Spark job
        features_col, label_col = self.getFeaturesCol(), self.getLabelCol()
        weight_col = (
            self.getWeightCol() if self.isDefined(self.weightCol) and self.getWeightCol() else None
        )
        train, validation = self._split(dataset)
        n_features, num_classes = _describe(train, features_col, label_col, self._task)
        network = _network(self._task, n_features, self.getHiddenLayers(), num_classes)
        trainer = self._trainer(network, settings)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", UserWarning)
                trained = trainer.fit(
                    train,
                    features_col=features_col,
                    label_col=label_col,
                    validation=validation,
                    weight_col=weight_col,
                    initial=self.getInitialModel(),
                )
        except InputError as error:  # the data checks name DistriOptimizer's arguments
            renamed = self._naming_params(error)
            if renamed is error:
                raise
            raise renamed from error
        finally:
            for warning in caught:  # the fit's warnings, naming this Estimator's Params
                text = str(warning.message)
                if issubclass(warning.category, UserWarning):
                    text = _param_names(text, settings=True)
                # at the caller of Estimator.fit (through pyspark's fit, which calls _fit)
                warnings.warn(text, warning.category, stacklevel=3)
        return self._copyValues(self._model_class(trained))

    def _split(self, dataset):
        """(training rows, validation rows or None), by ``validationIndicatorCol``."""
        from pyspark.sql import functions as F
        from pyspark.sql.types import BooleanType

        if not self.isDefined(self.validationIndicatorCol) or not self.getValidationIndicatorCol():
            return dataset, None
        column = self.getValidationIndicatorCol()
        if column not in dataset.columns:
            raise InputError(
                f"validationIndicatorCol={column!r} is not a column of the data; its columns "
                f"are {sorted(dataset.columns)}"
            )
        if not isinstance(dataset.schema[column].dataType, BooleanType):
            raise InputError(
                f"validationIndicatorCol={column!r} is {dataset.schema[column].dataType.simpleString()}; "
                "it must be boolean (true: a validation row)"
            )
        marked = F.coalesce(F.col(column), F.lit(False))
        return dataset.filter(~marked), dataset.filter(marked)

    def _settings(self) -> FitSettings:
        """The FitSettings these Params describe, checked (on the driver, before any Spark
        job: a conflict such as ``topology='hierarchical'`` with ``strategy='ssp'`` fails
        first); its errors name the Params."""
        try:
            return FitSettings.of_flat(
                {spec.setting: self.getOrDefault(spec.name) for spec in estimator_params()},
                where=type(self).__name__,
            )
        except ConfigurationError as error:
            raise self._naming_params(error) from error

    def _trainer(self, network, settings: FitSettings | None = None) -> DistriOptimizer:
        """The DistriOptimizer these Params describe (with ``settings``, when already made
        from them); its errors name the Params."""
        name = self.getOptimizer().lower()
        if name not in OPTIMIZERS:
            raise ConfigurationError(
                f"optimizer={self.getOptimizer()!r} is not one of {', '.join(OPTIMIZERS)}"
            )
        settings = settings or self._settings()
        try:
            return DistriOptimizer(network, OPTIMIZERS[name](lr=self.getStepSize()), settings)
        except ConfigurationError as error:
            raise self._naming_params(error) from error

    def _naming_params(self, error: AllReduceError) -> AllReduceError:
        """``error`` with what it names as ``DistriOptimizer`` writes it written as this
        Estimator's Params: the one place the Estimators rename an error's text.

        ``fit()``'s arguments where the data checks name them (``(features_col)``:
        ``(featuresCol)``) in any error; and for a bad setting (a ``ConfigurationError``)
        the settings it names (``batch_size=``, ``batch_size must``: ``batchSize``), after
        this Estimator's name. ``error`` itself where nothing needs renaming."""
        configuration = isinstance(error, ConfigurationError)
        message = _param_names(str(error), settings=configuration)
        if configuration:
            return ConfigurationError(f"{type(self).__name__}: {message}")
        return error if message == str(error) else type(error)(message)


def _param_names(message: str, settings: bool) -> str:
    """``message`` with ``fit()``'s arguments (``(features_col)``) written as the Params
    (``(featuresCol)``), and where ``settings`` the settings it names (``batch_size=``,
    ``batch_size must``) as theirs (``batchSize``)."""
    for argument, param in _ARGUMENT_PARAMS.items():
        message = message.replace(f"({argument})", f"({param})")
    for param, pattern in _START_PARAMS:
        message = re.sub(pattern, param, message)
    if settings:
        for param, setting in _SETTING_PARAMS:
            message = re.sub(rf"\b{setting}(?==| must)", param, message)
    return message


class AllReduceClassifier(
    _AllReduceEstimator, ProbabilisticClassifier, DefaultParamsReadable, DefaultParamsWritable
):
    """A classifier trained data-parallel by allreduce; labels are class ids 0..k-1 (e.g. from
    ``StringIndexer``). k comes from the label column's metadata, or else its largest value.

    The Model adds ``predictionCol``, ``rawPredictionCol`` (the class scores) and
    ``probabilityCol`` (their softmax); ``thresholds`` work as MLlib's classifiers' do.
    Params by name: ``AllReduceClassifier(hiddenLayers=[64], maxEpochs=20)``;
    ``explainParams()`` lists them all, the fit's settings (``FitSettings``) among them.
    """

    _task = "classification"

    @property
    def _model_class(self):
        return AllReduceClassificationModel


class AllReduceRegressor(
    _AllReduceEstimator, Predictor, DefaultParamsReadable, DefaultParamsWritable
):
    """A regressor trained data-parallel by allreduce (squared error); the Model adds
    ``predictionCol``."""

    _task = "regression"

    @property
    def _model_class(self):
        return AllReduceRegressionModel


class _AllReduceModel(_AllReduceParams, MLWritable, MLReadable):
    """What both Models hold: the fit's ``TrainedModel`` (network, weights, history)."""

    _task = ""

    def __init__(self, trained: TrainedModel | None = None) -> None:
        super().__init__()
        self._trained = trained

    @property
    def trained(self) -> TrainedModel:
        """The fit's result: ``weights``, ``history`` (steps, epochs, phases), ``model``."""
        if self._trained is None:
            raise InputError(
                f"{type(self).__name__} holds no weights: make it with fit() or load()"
            )
        return self._trained

    @property
    def weights(self) -> np.ndarray:
        """The trained weights, one flat float32 vector."""
        return self.trained.weights

    @property
    def history(self) -> History:
        """The fit's history."""
        return self.trained.history

    @property
    def numFeatures(self) -> int:
        """How many features a row must have."""
        return int(self.trained.n_features)

    def write(self) -> MLWriter:
        """A writer that saves the Params and the weights (Parquet) under a path."""
        return _ModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        """A reader of what ``write`` saved."""
        return _ModelReader(cls)

    def _scores(self, value) -> np.ndarray:
        model = self.trained.model
        return model.predict_raw(self.trained.weights, _row(value, model))[0].astype(np.float64)


class AllReduceClassificationModel(_AllReduceModel, ProbabilisticClassificationModel):
    """An ``AllReduceClassifier``'s fitted model."""

    _task = "classification"

    @property
    def numClasses(self) -> int:
        """How many classes the model tells apart."""
        return int(self.trained.model.num_classes)

    def predictRaw(self, value) -> Any:
        """The class scores of one feature vector."""
        from pyspark.ml.linalg import Vectors

        return Vectors.dense(self._scores(value))

    def predictProbability(self, value) -> Any:
        """The class probabilities of one feature vector."""
        from pyspark.ml.linalg import Vectors

        return Vectors.dense(_softmax(self._scores(value)[None, :])[0])

    def predict(self, value) -> float:
        """The predicted class of one feature vector."""
        return float(_classes(_softmax(self._scores(value)[None, :]), self._thresholds())[0])

    def _thresholds(self) -> np.ndarray | None:
        if not self.isDefined(self.thresholds) or not self.isSet(self.thresholds):
            return None
        thresholds = np.asarray(self.getThresholds(), np.float64)
        if len(thresholds) != self.numClasses:
            raise ConfigurationError(
                f"thresholds has {len(thresholds)} values; the model has {self.numClasses} "
                "classes, one threshold each"
            )
        if (thresholds < 0).any() or (thresholds == 0).sum() > 1:
            raise ConfigurationError("thresholds must be >= 0, with at most one of them 0")
        return thresholds

    def _transform(self, dataset):
        """``dataset`` with the prediction, raw prediction and probability columns (those
        whose Param is not empty), computed in the executors a batch of rows at a time."""
        import pandas as pd
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F

        model, thresholds = self.trained.model, self._thresholds()
        weights = self.trained.weights_broadcast(dataset.sparkSession)
        width = self.numFeatures

        features_col = self.getFeaturesCol()
        column = features_column(dataset, features_col, role="featuresCol")  # names a missing one
        vector = is_vector_type(dataset.schema[features_col].dataType)

        def scores(features) -> pd.DataFrame:
            X = dense_for(model, matrix_from_pandas(features, features_col, width))
            raw = np.asarray(model.predict_raw(weights.value, X), np.float64)
            probability = _softmax(raw)
            return pd.DataFrame(
                {
                    "raw": list(raw),
                    "probability": list(probability),
                    "prediction": _classes(probability, thresholds).astype(np.float64),
                }
            )

        # a vector column arrives as a frame of its parts (features.VectorParts)
        scores.__annotations__ = {
            "features": pd.DataFrame if vector else pd.Series,
            "return": pd.DataFrame,
        }
        kind = "raw array<double>, probability array<double>, prediction double"
        computed = "__allreduce_scores"
        out = dataset.withColumn(
            computed,
            F.pandas_udf(scores, kind)(column),
        )
        for param, field in ((self.rawPredictionCol, "raw"), (self.probabilityCol, "probability")):
            if self.getOrDefault(param):
                out = out.withColumn(
                    self.getOrDefault(param), array_to_vector(F.col(f"{computed}.{field}"))
                )
        if self.getPredictionCol():
            out = out.withColumn(self.getPredictionCol(), F.col(f"{computed}.prediction"))
        return out.drop(computed)


class AllReduceRegressionModel(_AllReduceModel, PredictionModel):
    """An ``AllReduceRegressor``'s fitted model."""

    _task = "regression"

    def predict(self, value) -> float:
        """The prediction for one feature vector."""
        return float(self._scores(value)[0])

    def _transform(self, dataset):
        """``dataset`` with ``predictionCol``, computed in the executors through Arrow."""
        if not self.getPredictionCol():
            return dataset
        return self.trained.predict(
            dataset, features_col=self.getFeaturesCol(), prediction_col=self.getPredictionCol()
        )


#: The Parquet columns of a saved Model that hold its optimizer state, by this prefix.
_STATE_PREFIX = "optimizerState_"


class _ModelWriter(MLWriter):
    """Saves a Model: Spark's metadata file of its Params (plus the network's shape), and
    its weights as one row of ``weights array<float>`` in Parquet under ``data``. Both
    are written through the session, so the path may be anywhere Spark writes, and under
    Spark Connect too (where ``overwrite()`` replaces the two folders by Spark's own
    overwrite mode: pyspark's deletes the path through the JVM, which a client lacks)."""

    def __init__(self, instance: _AllReduceModel) -> None:
        super().__init__()
        self.instance = instance

    def _handleOverwrite(self, path: str) -> None:
        if not is_connect(self.sparkSession):
            super()._handleOverwrite(path)

    def saveImpl(self, path: str) -> None:
        import pyarrow as pa

        trained = self.instance.trained
        extra = {
            "numFeatures": int(trained.n_features),
            "numClasses": getattr(trained.model, "num_classes", None),
            "epochs": trained.history.epochs,
            "stepsDone": trained.steps_done,
            "epochsDone": trained.epochs_done,
            "optimizerKind": trained.optimizer_kind,
        }
        mode = "overwrite" if self.shouldOverwrite else "error"
        metadata = DefaultParamsWriter._get_metadata_to_save(
            self.instance, self.sparkSession, extra
        )
        self.sparkSession.createDataFrame([(metadata,)], ["value"]).coalesce(1).write.mode(
            mode
        ).text(os.path.join(path, "metadata"))  # as DefaultParamsWriter.saveMetadata writes it
        # one row: the whole vector, and the optimizer's state where the fit kept it
        columns = {"weights": float_lists(np.reshape(trained.weights, (1, -1)))}
        for name, value in (trained.optimizer_state or {}).items():
            columns[f"{_STATE_PREFIX}{name}"] = float_lists(np.reshape(value, (1, -1)))
        from_arrow(self.sparkSession, pa.table(columns)).write.mode(mode).parquet(
            os.path.join(path, "data")
        )


class _ModelReader(MLReader):
    """Reads what ``_ModelWriter`` saved."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> _AllReduceModel:
        metadata = ml_metadata(self.sparkSession, path)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        table = to_arrow(self.sparkSession.read.parquet(os.path.join(path, "data")))
        weights = np.asarray(table.column("weights").combine_chunks().flatten(), np.float32)
        network = _network(
            instance._task,
            metadata["numFeatures"],
            instance.getHiddenLayers(),
            metadata["numClasses"],
        )
        if weights.size != network.size:
            raise InputError(
                f"{path} holds {weights.size} weights; the network its metadata describes has "
                f"{network.size}: the folder was changed or mixed with another model's"
            )
        history = History(epochs=metadata.get("epochs", []))
        state = {
            name[len(_STATE_PREFIX) :]: np.asarray(
                table.column(name).combine_chunks().flatten(), np.float32
            )
            for name in table.column_names
            if name.startswith(_STATE_PREFIX)
        }
        instance._trained = TrainedModel(
            network,
            weights,
            history,
            metadata["numFeatures"],
            optimizer_state=state or None,
            optimizer_kind=metadata.get("optimizerKind"),
            steps_done=metadata.get("stepsDone"),
            epochs_done=metadata.get("epochsDone"),
        )
        return instance


def _network(task: str, n_features: int, hidden: list[int], num_classes: int | None):
    """The dense network of an Estimator's Params: linear when ``hidden`` is empty."""
    if task == "classification":
        if not hidden:
            return models.SoftmaxRegression(n_features, num_classes)
        return models.MLP([n_features, *hidden, num_classes])
    if not hidden:
        return models.LinearRegression(n_features)
    return models.MLP([n_features, *hidden, 1], task="regression")


def _describe(train, features_col: str, label_col: str, task: str) -> tuple[int, int | None]:
    """(features per row, classes) of the training rows: from the columns' ML metadata
    (``VectorAssembler``, ``StringIndexer``) where it says, else from one small Spark job."""
    from pyspark.sql import functions as F

    features = features_column(train, features_col, role="featuresCol")
    vector = is_vector_type(train.schema[features_col].dataType)
    check_label_column(train, label_col, role="labelCol")
    features_meta = train.schema[features_col].metadata.get("ml_attr", {})
    n_features = features_meta.get("num_attrs")
    num_classes = None
    if task == "classification":
        label_meta = train.schema[label_col].metadata.get("ml_attr", {})
        num_classes = label_meta.get("num_vals") or (
            len(label_meta["vals"]) if "vals" in label_meta else None
        )
    if n_features is None and vector:  # a vector's size, without making it dense
        row = train.select(features).where(features.isNotNull()).first()
        if row is None:
            raise InputError("the training data has no rows with features")
        n_features = row[0].size
    if n_features is None or (task == "classification" and num_classes is None):
        width = F.lit(n_features) if n_features is not None else F.size(features)
        row = train.agg(
            F.max(label_col).alias("largest"), F.first(width, ignorenulls=True).alias("width")
        ).first()
        if row is None or row["width"] is None:
            raise InputError("the training data has no rows with features")
        n_features = n_features or int(row["width"])
        if task == "classification" and num_classes is None:
            largest = row["largest"]
            if (
                largest is None
                or not np.isfinite(largest)
                or largest < 0
                or largest != int(largest)
            ):
                raise InputError(
                    f"the labels in {label_col!r} must be class ids 0, 1, 2, ... (the largest is "
                    f"{largest!r}); index string classes with StringIndexer"
                )
            num_classes = max(_inferred_class_count(largest, label_col), 2)
    return int(n_features), (None if num_classes is None else int(num_classes))


#: The most classes a classifier infers from the largest label without the label column's
#: metadata saying how many there are (MLlib refuses more than this too): a stray label such
#: as 1e9 would otherwise make a model with a billion outputs, on the driver first.
MAX_INFERRED_CLASSES = 1000


def _inferred_class_count(largest: float, label_col: str) -> int:
    """The class count the largest label gives (largest + 1), refused over
    ``MAX_INFERRED_CLASSES`` before any model is made, naming what to do."""
    count = int(largest) + 1
    if count > MAX_INFERRED_CLASSES:
        raise InputError(
            f"the largest label in {label_col!r} (labelCol) is {largest:g}, which would make "
            f"a model of {count:,} classes; without the label column's metadata at most "
            f"{MAX_INFERRED_CLASSES:,} classes are inferred from the labels (as MLlib does). "
            "A stray label? Filter it out. Truly that many classes: index the labels with "
            "StringIndexer, or state the count in the column's metadata, e.g. "
            f"df.withColumn({label_col!r}, F.col({label_col!r}).alias({label_col!r}, "
            "metadata={'ml_attr': {'type': 'nominal', 'num_vals': N}}))"
        )
    return count


def _row(value, model=None):
    """One feature vector (a pyspark.ml Vector or a sequence of numbers) as a (1, n) float32
    matrix: CSR for a sparse vector where the model takes it (``takes_sparse``)."""
    if hasattr(value, "indices") and hasattr(value, "size") and takes_sparse(model):
        from scipy.sparse import csr_matrix

        values = np.asarray(value.values, np.float32)
        return csr_matrix(
            (values, np.asarray(value.indices), np.asarray([0, len(values)])),
            shape=(1, value.size),
        )
    array = value.toArray() if hasattr(value, "toArray") else np.asarray(value)
    return np.asarray(array, np.float32).reshape(1, -1)


def _softmax(raw: np.ndarray) -> np.ndarray:
    shifted = np.exp(raw - raw.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def _classes(probability: np.ndarray, thresholds: np.ndarray | None) -> np.ndarray:
    """The predicted classes: the most probable, or as MLlib does with thresholds, the largest
    probability / threshold (a threshold of 0 wins wherever its class has any probability)."""
    if thresholds is None:
        return probability.argmax(axis=1)
    with np.errstate(divide="ignore"):
        scaled = np.where(
            thresholds > 0, probability / np.where(thresholds > 0, thresholds, 1), np.inf
        )
    return scaled.argmax(axis=1)
