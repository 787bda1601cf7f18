"""Training on Spark: the driver's DistriOptimizer, the task's worker loop, and their result."""

from allreduce_param.errors import TrainingError
from allreduce_param.train.driver.distri import DistriOptimizer
from allreduce_param.train.result import History, TrainedModel
from allreduce_param.train.settings import FitSettings

__all__ = ["DistriOptimizer", "FitSettings", "History", "TrainedModel", "TrainingError"]
