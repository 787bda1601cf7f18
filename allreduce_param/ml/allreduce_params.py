"""The Params ``AllReduceClassifier`` and ``AllReduceRegressor`` and their Models share, the
optimizers they name, and the dense network those Params describe."""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasStepSize, HasValidationIndicatorCol, HasWeightCol

from allreduce_param import models, optim
from allreduce_param.ml_params import FitSettingParams
from allreduce_param.train.settings import estimator_params

#: The optimizers the ``optimizer`` Param names.
OPTIMIZERS = {
    "adam": optim.Adam,
    "adamw": optim.AdamW,
    "sgd": optim.SGD,
    "rmsprop": optim.RMSprop,
    "adagrad": optim.Adagrad,
}


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


def _network(task: str, n_features: int, hidden: list[int], num_classes: int | None):
    """The dense network of an Estimator's Params: linear when ``hidden`` is empty."""
    if task == "classification":
        if not hidden:
            return models.SoftmaxRegression(n_features, num_classes)
        return models.MLP([n_features, *hidden, num_classes])
    if not hidden:
        return models.LinearRegression(n_features)
    return models.MLP([n_features, *hidden, 1], task="regression")
