"""Models saved as data, never as a pickle: the kinds that save so, and how each is rebuilt.

A saved model is its kind (``KINDS``' name: the class), its ``to_config()`` (the constructor's
arguments, as JSON holds them) and, for a ``TorchModel``, its module's state as plain arrays
(``models.torch_saving``). Rebuilding calls the kind's ``from_config``, so a saved model is
checked as a new one. A model of any other class (a subclass of a built-in one included)
has no saved form here: ``TrainedModel.save`` pickles it only when the caller allows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from allreduce_param.errors import InputError
from allreduce_param.models.linear import LinearRegression, LogisticRegression, SoftmaxRegression
from allreduce_param.models.mlp import MLP
from allreduce_param.models.torch_module import TorchModel
from allreduce_param.models.torch_saving import load_state, module_for, state_arrays

#: Every kind of model that saves as data, by the name its files give.
KINDS: dict[str, type] = {
    kind.__name__: kind
    for kind in (LinearRegression, LogisticRegression, SoftmaxRegression, MLP, TorchModel)
}


@dataclass(frozen=True)
class SavedForm:
    """A model as data: its ``kind``, its ``config`` (JSON) and its ``arrays`` (a
    ``TorchModel``'s module state; none for the others)."""

    kind: str
    config: dict
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def saves_as_data(model: Any) -> bool:
    """Whether ``model`` has a saved form without pickle: its class is one of ``KINDS``."""
    return KINDS.get(type(model).__name__) is type(model)


def saved_form(model: Any) -> SavedForm | None:
    """``model`` as data, or None where its class is not one of ``KINDS``."""
    if not saves_as_data(model):
        return None
    kind = type(model).__name__
    if isinstance(model, TorchModel):
        arrays, dtypes = state_arrays(model.module)
        return SavedForm(kind, {**model.to_config(), "state_dtypes": dtypes}, arrays)
    return SavedForm(kind, model.to_config())


def rebuilt(form: SavedForm, module: Any, where: str) -> Any:
    """The model ``form`` describes. ``module``: for a ``TorchModel``, the module to load its
    state into (None: one made from the saved import path where it can be); for the others
    it must be None. ``where`` names the saved model in errors."""
    kind = KINDS.get(form.kind)
    if kind is None:
        raise InputError(
            f"{where} holds a model of kind {form.kind!r}; this version makes {', '.join(KINDS)}"
        )
    if kind is not TorchModel:
        if module is not None:
            raise InputError(
                f"{where} holds a {form.kind}, not a TorchModel: module= is for a TorchModel's "
                "module; leave it out"
            )
        return kind.from_config(form.config)
    config: Mapping = form.config
    target = module_for(str(config.get("module")), module, where)
    load_state(target, form.arrays, config.get("state_dtypes", {}), where)
    return TorchModel.from_config(config, target)
