"""``LogisticRegression`` and ``LogisticRegressionModel``: MLlib's, as drop-ins. The same Params
(``linear_params``), objective, family choice and Model attributes, solved by full-batch
L-BFGS / OWL-QN over the engine in one barrier stage (``train.driver.glm_stage``).

The Model's outputs follow MLlib's conventions: a binomial model's ``rawPrediction`` is
``[-m, m]`` for the margin ``m``, its ``probability`` ``[1 - p, p]``, and it predicts 1
where ``m`` exceeds the margin of ``threshold`` (or of ``thresholds``); a multinomial model's
raw prediction is the K margins, its probability their softmax, its prediction the largest
(with ``thresholds``, the largest probability / threshold).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pyspark.ml.classification import ProbabilisticClassificationModel, ProbabilisticClassifier
from pyspark.ml.linalg import DenseMatrix, DenseVector
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsWritable, MLReader, MLWritable

from allreduce_param.errors import ConfigurationError
from allreduce_param.ml.linear_models import (
    LinearFit,
    LinearModelParts,
    LinearModelReader,
    LinearModelWriter,
    TrainingSummary,
    add_scores,
)
from allreduce_param.ml.linear_params import (
    LinearSetters,
    LogisticRegressionParams,
    class_count,
    common_problem,
    logistic_family,
    refuse_unsupported,
    told_classes,
)


class LogisticRegression(
    ProbabilisticClassifier,
    LogisticRegressionParams,
    LinearSetters,
    DefaultParamsReadable,
    DefaultParamsWritable,
):
    """MLlib's ``LogisticRegression`` (binomial and multinomial, L2 and elastic net, with
    ``standardization`` and ``weightCol``), solved over the engine: change the import and
    nothing else. Params by name, as MLlib's: ``LogisticRegression(regParam=0.01)``.

    Refused by name when set: the bounds on coefficients and intercepts, ``maxBlockSizeInMB``
    other than 0.0. ``aggregationDepth`` is accepted and ignored (no tree towards the driver).
    """

    def __init__(self, **params: Any) -> None:
        super().__init__()
        self.setParams(**params)

    def setThreshold(self, value: float):
        """Set ``threshold`` (binomial), clearing ``thresholds``, as MLlib does."""
        self._set(threshold=value)
        self.clear(self.thresholds)
        return self

    def setThresholds(self, value: list[float]):
        """Set ``thresholds`` (one per class), clearing ``threshold``, as MLlib does."""
        self._set(thresholds=value)
        self.clear(self.threshold)
        return self

    def setFamily(self, value: str):
        """Set ``family``: "auto", "binomial" or "multinomial"."""
        return self._set(family=value)

    def setLowerBoundsOnCoefficients(self, value: Any):
        """Set ``lowerBoundsOnCoefficients`` (refused at fit: bounds are not supported)."""
        return self._set(lowerBoundsOnCoefficients=value)

    def setUpperBoundsOnCoefficients(self, value: Any):
        """Set ``upperBoundsOnCoefficients`` (refused at fit: bounds are not supported)."""
        return self._set(upperBoundsOnCoefficients=value)

    def setLowerBoundsOnIntercepts(self, value: Any):
        """Set ``lowerBoundsOnIntercepts`` (refused at fit: bounds are not supported)."""
        return self._set(lowerBoundsOnIntercepts=value)

    def setUpperBoundsOnIntercepts(self, value: Any):
        """Set ``upperBoundsOnIntercepts`` (refused at fit: bounds are not supported)."""
        return self._set(upperBoundsOnIntercepts=value)

    def _fit(self, dataset) -> LogisticRegressionModel:
        refuse_unsupported(self)
        logistic_family(self.getFamily(), 2)  # a family MLlib has not fails here, before any job
        try:
            self._checkThresholdConsistency()
        except (TypeError, ValueError) as error:
            raise ConfigurationError(f"LogisticRegression: {error}") from error
        label_col = self.getLabelCol()
        metadata = (
            dataset.schema[label_col].metadata.get("ml_attr", {})
            if label_col in dataset.columns
            else {}
        )
        family = self.getFamily()

        from allreduce_param.models.glm import GlmProblem

        def problem_for(facts) -> GlmProblem:
            # the label's metadata, else the largest label the driver found (MLlib's rule)
            classes = class_count(metadata, None, facts.largest_label, label_col)
            chosen = logistic_family(family, classes)
            return GlmProblem(
                family=chosen,
                num_features=facts.n_features,
                num_classes=2 if chosen == "binomial" else classes,
                **common_problem(self),
            )

        solution = self._solve(dataset, True, problem_for, num_classes=told_classes(metadata))
        return self._copyValues(LogisticRegressionModel(LinearFit.of_solution(solution)))


class LogisticRegressionModel(
    ProbabilisticClassificationModel, LogisticRegressionParams, MLWritable, DefaultParamsReadable
):
    """A ``LogisticRegression``'s fitted model, with MLlib's attributes: ``coefficients`` and
    ``intercept`` (binomial), ``coefficientMatrix`` and ``interceptVector`` (both families),
    ``numFeatures``, ``numClasses``, ``summary`` (``objectiveHistory``, ``totalIterations``)
    and ``hasSummary``; ``predict``, ``predictRaw``, ``predictProbability`` of one vector."""

    def __init__(self, fit: LinearFit | None = None) -> None:
        super().__init__()
        self._parts = LinearModelParts(fit)

    @property
    def _multinomial(self) -> bool:
        return self._parts.fit.coefficients.shape[0] > 1

    @property
    def coefficients(self) -> DenseVector:
        """A binomial model's coefficients (MLlib refuses it for a multinomial one)."""
        if self._multinomial:
            raise RuntimeError(
                "Multinomial models contain a matrix of coefficients, use coefficientMatrix instead."
            )
        return DenseVector(self._parts.fit.coefficients[0])

    @property
    def intercept(self) -> float:
        """A binomial model's intercept (MLlib refuses it for a multinomial one)."""
        if self._multinomial:
            raise RuntimeError(
                "Multinomial models contain a vector of intercepts, use interceptVector instead."
            )
        return float(self._parts.fit.intercepts[0])

    @property
    def coefficientMatrix(self) -> DenseMatrix:
        """The coefficients, one row per coefficient set (1 binomial, K multinomial)."""
        matrix = self._parts.fit.coefficients
        return DenseMatrix(matrix.shape[0], matrix.shape[1], matrix.ravel().tolist(), True)

    @property
    def interceptVector(self) -> DenseVector:
        """The intercepts, one per coefficient set."""
        return DenseVector(self._parts.fit.intercepts)

    @property
    def numFeatures(self) -> int:
        """How many features a row must have."""
        return self._parts.fit.num_features

    @property
    def numClasses(self) -> int:
        """2 for a binomial model, else the number of coefficient sets (MLlib's)."""
        return int(self._parts.fit.coefficients.shape[0]) if self._multinomial else 2

    @property
    def hasSummary(self) -> bool:
        """Whether a training summary exists (a fitted Model's; not a loaded one's)."""
        return self._parts.fit.summary is not None

    @property
    def summary(self) -> TrainingSummary:
        """The training summary: ``objectiveHistory``, ``totalIterations``."""
        return self._parts.summary("LogisticRegressionModel")

    def setThreshold(self, value: float):
        """Set ``threshold`` (binomial), clearing ``thresholds``, as MLlib does."""
        self._set(threshold=value)
        self.clear(self.thresholds)
        return self

    def setThresholds(self, value: list[float]):
        """Set ``thresholds`` (one per class), clearing ``threshold``, as MLlib does."""
        self._set(thresholds=value)
        self.clear(self.threshold)
        return self

    def predictRaw(self, value: Any) -> DenseVector:
        """The raw prediction of one feature vector (binomial: ``[-m, m]``)."""
        return DenseVector(
            self._scores(self._parts.fit.margins(self._parts.one_row(value)))["raw"][0]
        )

    def predictProbability(self, value: Any) -> DenseVector:
        """The class probabilities of one feature vector."""
        margins = self._parts.fit.margins(self._parts.one_row(value))
        return DenseVector(self._scores(margins)["probability"][0])

    def predict(self, value: Any) -> float:
        """The predicted class of one feature vector."""
        margins = self._parts.fit.margins(self._parts.one_row(value))
        return float(self._scores(margins)["prediction"][0])

    def write(self):
        """A writer of the Params and the coefficients (Parquet), no pickle."""
        return LinearModelWriter(self, self.numClasses)

    @classmethod
    def read(cls) -> MLReader:
        """A reader of what ``write`` saved."""
        return LinearModelReader(cls)

    def _transform(self, dataset):
        outputs = {
            self.getOrDefault(param): name
            for param, name in (
                (self.rawPredictionCol, "raw"),
                (self.probabilityCol, "probability"),
                (self.predictionCol, "prediction"),
            )
            if self.getOrDefault(param)
        }
        return add_scores(dataset, self.getFeaturesCol(), self._parts.fit, outputs, self._scorer())

    def _scores(self, margins: np.ndarray) -> dict[str, np.ndarray]:
        return self._scorer()(margins)

    def _scorer(self):
        """A function of the margins (rows, coefficient sets) to MLlib's outputs, with this
        Model's thresholds; plain data only, so it travels to the executors."""
        if not self._multinomial:
            threshold = self.getThreshold()  # from thresholds where they are set (MLlib's rule)
            return _BinomialScores(threshold)
        thresholds = None
        if self.isSet(self.thresholds):
            thresholds = np.asarray(self.getThresholds(), np.float64)
            if len(thresholds) != self.numClasses:
                raise ConfigurationError(
                    f"LogisticRegressionModel: thresholds has {len(thresholds)} values; the model "
                    f"has {self.numClasses} classes, one threshold each"
                )
        return _MultinomialScores(thresholds)


class _BinomialScores:
    """MLlib's binomial outputs of the margins: raw ``[-m, m]``, probability ``[1 - p, p]``,
    and 1.0 where ``m`` exceeds ``log(t / (1 - t))`` for the threshold ``t``."""

    def __init__(self, threshold: float) -> None:
        with np.errstate(divide="ignore"):
            self.raw_threshold = (
                -np.inf
                if threshold == 0.0
                else np.inf
                if threshold == 1.0
                else float(np.log(threshold / (1 - threshold)))
            )

    def __call__(self, margins: np.ndarray) -> dict[str, np.ndarray]:
        m = margins[:, 0]
        p = 1.0 / (1.0 + np.exp(-m))
        return {
            "raw": np.stack([-m, m], axis=1),
            "probability": np.stack([1.0 - p, p], axis=1),
            "prediction": (m > self.raw_threshold).astype(np.float64),
        }


class _MultinomialScores:
    """MLlib's multinomial outputs: raw the margins, probability their softmax, prediction
    the largest (with ``thresholds``: of probability / threshold, a 0 threshold winning)."""

    def __init__(self, thresholds: np.ndarray | None) -> None:
        self.thresholds = thresholds

    def __call__(self, margins: np.ndarray) -> dict[str, np.ndarray]:
        shifted = np.exp(margins - margins.max(axis=1, keepdims=True))
        probability = shifted / shifted.sum(axis=1, keepdims=True)
        if self.thresholds is None:
            prediction = margins.argmax(axis=1)
        else:
            t = self.thresholds
            with np.errstate(divide="ignore"):
                scaled = np.where(t > 0, probability / np.where(t > 0, t, 1), np.inf)
            prediction = scaled.argmax(axis=1)
        return {
            "raw": margins,
            "probability": probability,
            "prediction": prediction.astype(np.float64),
        }
