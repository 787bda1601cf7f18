"""allreduce-param: Spark-native AllReduce parameter sync for data-parallel training.

Inside one barrier ``mapPartitions`` stage each partition owns a slice of the flattened
parameter vector; gradients are reduce-scattered to the owners and weights all-gathered
back through compressed blocks that the partitions serve to each other, without the driver.

The names here are the trainer's: ``DistriOptimizer`` fits a model (``models``) with an
optimizer (``optim``) under ``FitSettings`` (its grouped settings ``Checkpoints``,
``EarlyStopping``, ``Regularization``, ``NetworkSettings``) into a ``TrainedModel`` and its ``History``;
``ml`` holds the pyspark.ml Estimators (so ``import allreduce_param`` loads no pyspark); the
errors are those a fit's caller catches (every other one is in ``allreduce_param.errors``).
The engine a loop of one's own drives (``AllReduceParameter`` and its handle) is
``allreduce_param.engine``.

Every name but the errors is loaded when first named (PEP 562's module ``__getattr__``):
a Spark task's Python worker imports this package before anything of its own, and a task
needs neither the driver's trainer nor the models it does not train. ``from allreduce_param
import DistriOptimizer`` and ``allreduce_param.models`` work as if imported here.
"""

from __future__ import annotations

import importlib

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

#: the names loaded when first named: name -> the module that holds it (a subpackage
#: stands for itself)
_LAZY = {
    "DistriOptimizer": "allreduce_param.train",
    "FitSettings": "allreduce_param.train",
    "Checkpoints": "allreduce_param.train",
    "EarlyStopping": "allreduce_param.train",
    "Regularization": "allreduce_param.train",
    "NetworkSettings": "allreduce_param.train",
    "TrainedModel": "allreduce_param.train",
    "History": "allreduce_param.train",
    "models": "allreduce_param.models",
    "optim": "allreduce_param.optim",
    "ml": "allreduce_param.ml",
}


def __getattr__(name: str):
    """A name of ``_LAZY``, imported when first named and kept as the module's attribute
    (so this runs once per name)."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'allreduce_param' has no attribute {name!r}")
    module = importlib.import_module(where)
    value = module if where.rsplit(".", 1)[-1] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
