"""The Models of ``AllReduceClassifier`` and ``AllReduceRegressor``: a fit's ``TrainedModel``
behind pyspark.ml's Model API; transform in the executors, persistence in ``model_io``."""

from __future__ import annotations

from typing import Any

import numpy as np
from pyspark.ml.base import PredictionModel
from pyspark.ml.classification import ProbabilisticClassificationModel
from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.ml.allreduce_params import _AllReduceParams
from allreduce_param.ml.model_io import _ModelReader, _ModelWriter
from allreduce_param.models.base import dense_for, takes_sparse
from allreduce_param.train.features import matrix_from_pandas
from allreduce_param.train.result import History, TrainedModel
from allreduce_param.train.rows import features_column, is_vector_type


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
