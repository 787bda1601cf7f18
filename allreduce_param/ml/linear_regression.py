"""``LinearRegression`` and ``LinearRegressionModel``: MLlib's, as drop-ins. The same Params
(``linear_params``), objective (the label standardized as MLlib and glmnet do) and Model
attributes; ``solver="auto"`` chooses as MLlib does: the normal equations (one exact
allreduce of the weighted Gram matrix) up to 4096 features, else L-BFGS / OWL-QN, in one
barrier stage over the engine (``train.driver.glm_stage``).
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.base import PredictionModel, Predictor
from pyspark.ml.linalg import DenseVector
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsWritable, MLReader, MLWritable

from allreduce_param.ml.linear_models import (
    LinearFit,
    LinearModelParts,
    LinearModelReader,
    LinearModelWriter,
    TrainingSummary,
    add_scores,
)
from allreduce_param.ml.linear_params import (
    LinearRegressionParams,
    LinearSetters,
    common_problem,
    linear_solver,
    refuse_unsupported,
)


class LinearRegression(
    Predictor, LinearRegressionParams, LinearSetters, DefaultParamsReadable, DefaultParamsWritable
):
    """MLlib's ``LinearRegression`` (least squares with L2 or elastic net, ``standardization``,
    ``weightCol``, ``solver``) solved over the engine: change the import and nothing else.

    Refused by name when set: ``loss="huber"``, ``maxBlockSizeInMB`` other than 0.0, and
    ``solver="normal"`` over more than 4096 features (as MLlib). ``aggregationDepth`` and
    ``epsilon`` (the huber loss's) are accepted and mean nothing here.
    """

    def __init__(self, **params: Any) -> None:
        super().__init__()
        self._setDefault(solver="auto")
        self.setParams(**params)

    def setSolver(self, value: str):
        """Set ``solver``: "auto", "normal" or "l-bfgs"."""
        return self._set(solver=value)

    def setLoss(self, value: str):
        """Set ``loss`` (only "squaredError" is supported)."""
        return self._set(loss=value)

    def setEpsilon(self, value: float):
        """Set ``epsilon`` (the huber loss's; meaningless under "squaredError")."""
        return self._set(epsilon=value)

    def _fit(self, dataset) -> LinearRegressionModel:
        refuse_unsupported(self)
        solver = self.getSolver()
        linear_solver(solver, 1)  # a solver MLlib has not fails here, before any job

        from allreduce_param.models.glm import GlmProblem

        def problem_for(facts) -> GlmProblem:
            return GlmProblem(
                family="gaussian",
                num_features=facts.n_features,
                num_classes=1,
                solver=linear_solver(solver, facts.n_features),
                **common_problem(self),
            )

        solution = self._solve(dataset, False, problem_for)
        return self._copyValues(LinearRegressionModel(LinearFit.of_solution(solution)))


class LinearRegressionModel(
    PredictionModel, LinearRegressionParams, MLWritable, DefaultParamsReadable
):
    """A ``LinearRegression``'s fitted model, with MLlib's attributes: ``coefficients``,
    ``intercept``, ``scale`` (1.0 under squared error), ``numFeatures``, ``summary``
    (``objectiveHistory``, ``totalIterations``), ``hasSummary``; ``predict`` of one vector."""

    def __init__(self, fit: LinearFit | None = None) -> None:
        super().__init__()
        self._setDefault(solver="auto")
        self._parts = LinearModelParts(fit)

    @property
    def coefficients(self) -> DenseVector:
        """The model's coefficients."""
        return DenseVector(self._parts.fit.coefficients[0])

    @property
    def intercept(self) -> float:
        """The model's intercept (0.0 without ``fitIntercept``)."""
        return float(self._parts.fit.intercepts[0])

    @property
    def scale(self) -> float:
        """MLlib's huber scale; 1.0 under squared error, the only loss here."""
        return 1.0

    @property
    def numFeatures(self) -> int:
        """How many features a row must have."""
        return self._parts.fit.num_features

    @property
    def hasSummary(self) -> bool:
        """Whether a training summary exists (a fitted Model's; not a loaded one's)."""
        return self._parts.fit.summary is not None

    @property
    def summary(self) -> TrainingSummary:
        """The training summary: ``objectiveHistory``, ``totalIterations``."""
        return self._parts.summary("LinearRegressionModel")

    def predict(self, value: Any) -> float:
        """The prediction for one feature vector."""
        return float(self._parts.fit.margins(self._parts.one_row(value))[0, 0])

    def write(self):
        """A writer of the Params and the coefficients (Parquet), no pickle."""
        return LinearModelWriter(self, 1)

    @classmethod
    def read(cls) -> MLReader:
        """A reader of what ``write`` saved."""
        return LinearModelReader(cls)

    def _transform(self, dataset):
        if not self.getPredictionCol():
            return dataset
        outputs = {self.getPredictionCol(): "prediction"}
        return add_scores(dataset, self.getFeaturesCol(), self._parts.fit, outputs, _predictions)


def _predictions(margins) -> dict[str, Any]:
    """The predictions: each row's one margin."""
    return {"prediction": margins[:, 0]}
