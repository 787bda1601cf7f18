"""Training on Spark: the driver's DistriOptimizer, the task's worker loop, and their result.

The fit's settings are ``FitSettings``; those that belong together are one object each:
``NetworkSettings``, ``Checkpoints``, ``EarlyStopping``, ``Regularization``.
"""

from allreduce_param.engine.wire.settings import NetworkSettings
from allreduce_param.errors import TrainingError
from allreduce_param.train.checkpoint import Checkpoints
from allreduce_param.train.driver.distri import DistriOptimizer
from allreduce_param.train.early_stopping import EarlyStopping
from allreduce_param.train.regularisation import Regularization
from allreduce_param.train.result import History, TrainedModel
from allreduce_param.train.settings import FitSettings

__all__ = [
    "Checkpoints",
    "DistriOptimizer",
    "EarlyStopping",
    "FitSettings",
    "History",
    "NetworkSettings",
    "Regularization",
    "TrainedModel",
    "TrainingError",
]
