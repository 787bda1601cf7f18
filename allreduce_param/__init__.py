"""allreduce-param: Spark-native AllReduce parameter sync for data-parallel training.

Inside one barrier ``mapPartitions`` stage each partition owns a slice of the flattened
parameter vector; gradients are reduce-scattered to the owners and weights all-gathered
back through compressed blocks that the partitions serve to each other, without the driver.

The names here are the trainer's: ``DistriOptimizer`` fits a model (``models``) with an
optimizer (``optim``) under ``FitSettings`` (its grouped settings ``Checkpoints``,
``EarlyStopping``, ``Regularization``, ``NetworkSettings``) into a ``TrainedModel`` and its ``History``;
``ml`` holds the pyspark.ml Estimators (loaded when first named, so ``import
allreduce_param`` loads no pyspark); the errors are those a fit's caller catches (every
other one is in ``allreduce_param.errors``). The engine a loop of one's own drives
(``AllReduceParameter`` and its handle) is ``allreduce_param.engine``.
"""

from allreduce_param import models, optim
from allreduce_param.errors import (
    AllReduceError,
    ConfigurationError,
    DamagedCheckpointError,
    FetchTimeoutError,
    InputError,
    NetworkError,
    PeerLostError,
    TrainingError,
    UsageError,
)
from allreduce_param.spark import surroundings as _spark_surroundings
from allreduce_param.train import (
    Checkpoints,
    DistriOptimizer,
    EarlyStopping,
    FitSettings,
    History,
    NetworkSettings,
    Regularization,
    TrainedModel,
)

_spark_surroundings.install()

__version__ = "0.1.0"

__all__ = [
    "DistriOptimizer",
    "FitSettings",
    "Checkpoints",
    "EarlyStopping",
    "Regularization",
    "NetworkSettings",
    "TrainedModel",
    "History",
    "models",
    "optim",
    "ml",
    "AllReduceError",
    "TrainingError",
    "InputError",
    "ConfigurationError",
    "UsageError",
    "DamagedCheckpointError",
    "PeerLostError",
    "FetchTimeoutError",
    "NetworkError",
]


def __getattr__(name: str):
    """``allreduce_param.ml``, imported when first named: it imports pyspark, which a task or
    a loop of the engine's alone need not load."""
    if name == "ml":
        import importlib

        return importlib.import_module("allreduce_param.ml")
    raise AttributeError(f"module 'allreduce_param' has no attribute {name!r}")
