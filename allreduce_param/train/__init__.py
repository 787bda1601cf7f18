"""Training on Spark: the driver's DistriOptimizer, the task's worker loop, and their result.

The fit's settings are ``FitSettings``; those that belong together are one object each:
``NetworkSettings``, ``Checkpoints``, ``EarlyStopping``, ``Regularization``.

The names are loaded when first named (PEP 562's module ``__getattr__``): a barrier task
imports ``train.task``, and with it this package, but never the driver's side
(``train.driver``, which ``DistriOptimizer`` brings).
"""

from __future__ import annotations

import importlib

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

#: each name's module, imported when the name is first asked for
_LAZY = {
    "Checkpoints": "allreduce_param.train.checkpoint",
    "DistriOptimizer": "allreduce_param.train.driver.distri",
    "EarlyStopping": "allreduce_param.train.early_stopping",
    "FitSettings": "allreduce_param.train.settings",
    "History": "allreduce_param.train.result",
    "NetworkSettings": "allreduce_param.engine.wire.settings",
    "Regularization": "allreduce_param.train.regularisation",
    "TrainedModel": "allreduce_param.train.result",
    "TrainingError": "allreduce_param.errors",
}


def __getattr__(name: str):
    """A name of ``__all__``, imported from its module when first named and kept here."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'allreduce_param.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
