"""A ``TorchModel``'s module saved as data: its ``state_dict`` as plain arrays, its class as an
import path, and back into a module, never through a pickle.

Why arrays in an ``.npz`` rather than ``torch.save`` read back with
``torch.load(weights_only=True)``: the rest of the project's files are ``.npz`` read with
``allow_pickle=False`` (checkpoints, buffers, optimizer state), which holds no code by its
format rather than by an unpickler's allow-list, and can be read without torch. numpy has no
bfloat16 (nor torch's float8 kinds): such a tensor is kept as its bits, an unsigned integer of
the same width, with its torch dtype named beside (``dtypes``).

The module to load into: the one the caller passes (``TrainedModel.load(path, module=...)``),
or else one made from the saved import path where that is meaningful: a ``torch.nn.Module``
class at module level, importable here, that takes no arguments; and whose state the saved
one fits (``load_state_dict``, strict). Anything else is an ``InputError`` saying to pass
``module=``. Importing the path runs that module's code as installed here, never code from
the saved files.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np

from allreduce_param.errors import InputError
from allreduce_param.models.torch_state import require_torch

#: Unsigned integers of each width, to hold the bits of a dtype numpy lacks.
_BITS = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def state_arrays(module: Any) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``module.state_dict()`` as host arrays by key, and the torch dtype (``"bfloat16"``)
    of each entry numpy has no dtype for, whose array holds its bits. An entry that is not a
    tensor (a module's extra state) is an ``InputError``: it saves only as a pickle."""
    torch = require_torch()
    arrays, dtypes = {}, {}
    for key, value in module.state_dict().items():
        if not isinstance(value, torch.Tensor):
            raise InputError(
                f"{type(module).__name__}'s state_dict entry {key!r} is a {type(value).__name__}, "
                "not a tensor, so the model saves only as a pickle: pass allow_pickle=True to "
                "TrainedModel.save (and to TrainedModel.load)"
            )
        tensor = value.detach().cpu().contiguous()
        try:
            arrays[key] = tensor.numpy().copy()
        except TypeError:  # bfloat16, float8: numpy has no such dtype
            bits = getattr(torch, _BITS[tensor.element_size()])
            arrays[key] = tensor.view(bits).numpy().copy()
            dtypes[key] = str(tensor.dtype).removeprefix("torch.")
    return arrays, dtypes


def load_state(
    module: Any, arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str], where: str
) -> None:
    """Load ``arrays`` (as ``state_arrays`` gave them) into ``module``, strictly: an
    ``InputError`` naming ``where`` (the saved model) if its state does not fit."""
    torch = require_torch()
    state = {}
    for key, array in arrays.items():
        tensor = torch.from_numpy(np.array(array))
        if key in dtypes:
            kind = getattr(torch, str(dtypes[key]), None)
            if not isinstance(kind, torch.dtype):
                raise InputError(f"{where}: {key!r} has the unknown torch dtype {dtypes[key]!r}")
            tensor = tensor.view(kind)
        state[key] = tensor
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as error:
        told = " ".join(str(error).split())  # torch's lines and tabs, on one line
        raise InputError(
            f"{where}: the saved state does not fit {type(module).__name__} ({told}); pass "
            "module= the module the model was trained as"
        ) from None


def module_for(path: str, given: Any, where: str) -> Any:
    """The module to load the saved state into: ``given`` (a ``torch.nn.Module``, or a
    no-argument factory making one), or else a new instance of the class ``path``
    (``"package.module:Class"``) names, where that class can be imported here and takes no
    arguments; an ``InputError`` saying to pass ``module=`` where not."""
    torch = require_torch()
    if given is not None:
        module = given() if callable(given) and not isinstance(given, torch.nn.Module) else given
        if not isinstance(module, torch.nn.Module):
            raise InputError(
                f"module= must be a torch.nn.Module (or a function making one), got "
                f"{type(module).__name__}"
            )
        return module
    cls = _module_class(path, where)
    try:
        return cls()
    except Exception as error:
        raise InputError(
            f"{where}: {path}() failed ({error}); pass module= the module to load into"
        ) from None


def _module_class(path: str, where: str) -> type:
    """The ``torch.nn.Module`` class ``path`` names, importable and made without arguments."""
    torch = require_torch()
    told = f"{where} holds a TorchModel of {path!r}"
    module_name, _, qualname = str(path).partition(":")
    if not qualname or module_name == "__main__" or "<locals>" in qualname:
        raise InputError(
            f"{told}, which cannot be imported here (a class of a script or a function): pass "
            "module= the module to load the weights into, e.g. TrainedModel.load(path, "
            "module=MyNet())"
        )
    try:
        found: Any = importlib.import_module(module_name)
        for name in qualname.split("."):
            found = getattr(found, name)
    except (ImportError, AttributeError) as error:
        raise InputError(
            f"{told}, which cannot be imported here ({error}): pass module= the module to "
            "load the weights into"
        ) from None
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        raise InputError(f"{told}, which is not a torch.nn.Module class: pass module=")
    needed = [
        name
        for name, parameter in inspect.signature(found).parameters.items()
        if parameter.default is parameter.empty
        and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    ]
    if needed:
        raise InputError(
            f"{told}, whose constructor needs {', '.join(needed)}: pass module= the module to "
            f"load the weights into, e.g. TrainedModel.load(path, module={qualname}(...))"
        )
    return found
