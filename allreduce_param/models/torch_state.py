"""A ``TorchModel``'s view of its module's state: where each parameter lies in the flat
vector, which ``state_dict`` keys are parameters and which are persistent buffers, the
buffers read and checked, and the ``state_dict`` made from a flat vector. And torch itself,
imported only where a ``TorchModel`` needs it (the extra ``[torch]``)."""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError

_INIT_LOCK = threading.Lock()  # torch's random state is global to the process


def require_torch():
    """The ``torch`` module, or a ConfigurationError saying how to install it."""
    try:
        import torch
    except ImportError as error:
        raise ConfigurationError(
            "TorchModel needs PyTorch: pip install 'allreduce-param[torch]'"
        ) from error
    return torch


def fresh_parameters(module: Any, seed: int) -> np.ndarray:
    """The flat float32 parameters of a copy of ``module`` whose layers were reset
    (``reset_parameters``) from ``seed``; touches neither ``module`` nor torch's global
    random state (it runs on a copy, under a lock, with that state forked)."""
    torch = require_torch()
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = copy.deepcopy(module)
        for layer in module.modules():
            if layer is not module and hasattr(layer, "reset_parameters"):
                layer.reset_parameters()
        with torch.no_grad():
            vector = torch.nn.utils.parameters_to_vector(module.parameters())
            return vector.numpy().astype(np.float32)


class ModuleState:
    """The layout of ``module``'s state over the flat vector, read once when it is wrapped:
    its parameters (``names``, ``shapes``, in ``named_parameters`` order; ``size`` in all),
    the state_dict's parameter keys (a key -> its parameter's name; tied ones share it) and
    its persistent buffers' keys (the names ``buffers()`` gives)."""

    def __init__(self, module: Any) -> None:
        self.names = [name for name, _ in module.named_parameters()]
        self.shapes = [tuple(p.shape) for p in module.parameters()]
        self.size = int(sum(int(np.prod(shape)) for shape in self.shapes))
        by_id = {id(p): name for name, p in module.named_parameters()}
        buffer_ids = {id(b) for _, b in module.named_buffers(remove_duplicate=False)}
        entries = module.state_dict(keep_vars=True)
        self.parameter_keys = {
            key: by_id[id(value)] for key, value in entries.items() if id(value) in by_id
        }
        self.buffer_keys = [key for key, value in entries.items() if id(value) in buffer_ids]

    def ranges(self):
        """``(name, shape, start, stop)`` of each parameter in the flat vector, in order."""
        start = 0
        for name, shape in zip(self.names, self.shapes):
            stop = start + int(np.prod(shape))
            yield name, shape, start, stop
            start = stop

    def tensors(self, weights: np.ndarray, who: str) -> dict[str, np.ndarray]:
        """``state_dict key -> view`` of the flat vector's parameters (a tied parameter under
        each of its keys); ``who`` names the model in the error of a wrong length."""
        if weights.size != self.size:
            raise InputError(f"{who}: got {weights.size} weights, expected {self.size}")
        flat = np.asarray(weights).reshape(-1)
        views = {
            name: flat[start:stop].reshape(shape) for name, shape, start, stop in self.ranges()
        }
        return {key: views[name] for key, name in self.parameter_keys.items()}

    def penalized(self, start: int, stop: int) -> np.ndarray:
        """Of the flat vector's ``start:stop``, every coordinate but those of parameters whose
        name ends in ``bias`` (True: penalised)."""
        mask = np.ones(stop - start, dtype=bool)
        for name, _, first, last in self.ranges():
            if name.endswith("bias"):
                mask[max(first, start) - start : max(min(last, stop), start) - start] = False
        return mask

    def buffers_of(self, module: Any) -> dict[str, np.ndarray]:
        """``module``'s persistent buffers by state_dict key, as host copies."""
        named = dict(module.named_buffers(remove_duplicate=False))
        return {key: named[key].detach().cpu().numpy().copy() for key in self.buffer_keys}

    def checked_buffers(
        self, module: Any, buffers: Mapping[str, Any], what: str
    ) -> dict[str, np.ndarray]:
        """``buffers`` as arrays of ``module``'s buffers' dtypes; an error (``what``: the
        call, e.g. ``TorchModel(...).set_buffers``) names a missing, unexpected or
        misshapen one."""
        expected = self.buffers_of(module)
        missing, unexpected = (
            sorted(set(expected) - set(buffers)),
            sorted(set(buffers) - set(expected)),
        )
        if missing or unexpected:
            raise InputError(
                f"{what}: the buffers must be {sorted(expected)}; "
                f"missing {missing}, unexpected {unexpected}"
            )
        checked = {}
        for key, value in expected.items():
            given = np.asarray(buffers[key])
            if given.shape != value.shape:
                raise InputError(
                    f"{what}: buffer {key!r} has shape {given.shape}, the module's {value.shape}"
                )
            checked[key] = np.array(given, dtype=value.dtype)  # a 0-d one stays 0-d
        return checked

    def state_dict(
        self, module: Any, tensors: Mapping[str, np.ndarray], buffers: Mapping[str, np.ndarray]
    ) -> OrderedDict:
        """What ``module.load_state_dict`` takes: the parameters from ``tensors`` (as
        ``tensors`` gives them), the buffers from ``buffers`` (checked), other entries (extra
        state) the module's own; in the module's own order, torch tensors that share no
        memory with the inputs."""
        torch = require_torch()
        result = OrderedDict()
        for key, value in module.state_dict().items():
            if key in tensors:
                result[key] = torch.from_numpy(np.array(tensors[key], dtype=np.float32))
            elif key in buffers:
                result[key] = torch.from_numpy(np.array(buffers[key]))
            else:
                result[key] = value
        return result
