"""Training on Spark: the driver's DistriOptimizer, the task's worker loop, and their result."""

from .distri import DistriOptimizer
from .result import History, TrainedModel
from .settings import FitSettings
from ..errors import TrainingError

__all__ = ["DistriOptimizer", "FitSettings", "History", "TrainedModel", "TrainingError"]
