"""TorchModel: any ``torch.nn.Module`` as a model the trainer can fit (extra ``[torch]``).

The module's parameters are flattened into the one float32 vector the engine keeps in
sync. Each call builds fresh parameter tensors from that vector and runs the module
functionally (``torch.func.functional_call``), so no gradient buffers are shared.
``functional_call`` swaps a module's parameters while it runs, so every thread (sub-batches
run on threads) uses its own copy of the module.
"""

from __future__ import annotations

import copy
import functools
import threading
from typing import Any, Callable

import numpy as np

from ..errors import ConfigurationError, InputError
from ..vectors import writable_output

LOSSES = ("cross_entropy", "mse")
_INIT_LOCK = threading.Lock()  # torch's random state is global to the process


def _torch():
    try:
        import torch
    except ImportError as error:
        raise ConfigurationError(
            "TorchModel needs PyTorch: pip install 'allreduce-param[torch]'"
        ) from error
    return torch


class TorchModel:
    """Wrap ``module`` (or a no-argument factory making it) for ``DistriOptimizer``.

    ``loss``: ``"cross_entropy"`` (classification: the module outputs class scores) or
    ``"mse"`` (regression: 0.5 * squared error, as the built-in models). ``init(rng)``
    re-initialises the module's parameters with a seed drawn from ``rng``, so fits are
    reproducible.
    """

    def __init__(self, module: Any | Callable[[], Any], loss: str = "cross_entropy") -> None:
        torch = _torch()
        if loss not in LOSSES:
            raise ConfigurationError(f"TorchModel(loss={loss!r}): loss must be one of {LOSSES}")
        self.module = module() if callable(module) and not isinstance(module, torch.nn.Module) else module
        if not isinstance(self.module, torch.nn.Module):
            raise ConfigurationError(f"TorchModel needs a torch.nn.Module, got {type(self.module).__name__}")
        self.loss = loss
        self.task = "classification" if loss == "cross_entropy" else "regression"
        self._names = [name for name, _ in self.module.named_parameters()]
        self._shapes = [tuple(p.shape) for p in self.module.parameters()]
        self.size = int(sum(int(np.prod(shape)) for shape in self._shapes))
        self._per_thread = threading.local()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_per_thread"]  # thread-local copies stay where they were made
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._per_thread = threading.local()

    def _own_module(self):
        """This thread's copy of the module."""
        module = getattr(self._per_thread, "module", None)
        if module is None:
            module = self._per_thread.module = copy.deepcopy(self.module)
        return module

    def __repr__(self) -> str:
        return f"TorchModel({self.module.__class__.__name__}, loss={self.loss!r}, {self.size} parameters)"

    def init(self, rng: np.random.Generator) -> np.ndarray:
        """Fresh parameters, reproducible from ``rng``; touches neither the module nor torch's
        global random state (it runs on a copy, under a lock, with that state forked)."""
        torch = _torch()
        seed = int(rng.integers(2**62))
        with _INIT_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = copy.deepcopy(self.module)
            for layer in module.modules():
                if layer is not module and hasattr(layer, "reset_parameters"):
                    layer.reset_parameters()
            with torch.no_grad():
                return torch.nn.utils.parameters_to_vector(module.parameters()).numpy().astype(np.float32)

    def _parameters(self, weights: np.ndarray, requires_grad: bool) -> dict:
        torch = _torch()
        if weights.size != self.size:
            raise InputError(f"{self!r}: got {weights.size} weights, expected {self.size}")
        flat = torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))
        parameters, start = {}, 0
        for name, shape in zip(self._names, self._shapes):
            count = int(np.prod(shape))
            parameters[name] = flat[start:start + count].view(shape).requires_grad_(requires_grad)
            start += count
        return parameters

    def _forward(self, parameters: dict, X: np.ndarray):
        torch = _torch()
        return torch.func.functional_call(self._own_module(), parameters,
                                          (torch.from_numpy(np.asarray(X, np.float32)),))

    def loss_and_grad(self, weights: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, int]:
        grad = np.empty(self.size, dtype=np.float32)
        loss, rows = self.loss_and_grad_into(weights, X, y, grad)
        return loss, grad, rows

    def loss_and_grad_into(self, weights: np.ndarray, X: np.ndarray, y: np.ndarray, out: np.ndarray,
                           ready: Callable[[int, int], None] | None = None) -> tuple[float, int]:
        """``(loss_sum, count)``, the gradient sum written into ``out``: each parameter's part
        as autograd finishes it (a hook on the parameter), then ``ready(start, stop)`` for
        it, so that it can be sent while backward goes on (last layers first)."""
        torch = _torch()
        writable_output(out, self.size, f"{self!r}: loss_and_grad_into(out=)")
        if len(X) == 0:
            out[:] = 0
            return 0.0, 0
        parameters = self._parameters(weights, requires_grad=True)
        flat_out = torch.from_numpy(out)
        start = 0
        for tensor in parameters.values():
            stop = start + tensor.numel()
            tensor.register_hook(functools.partial(self._gradient_done, flat_out, start, stop, ready))
            start = stop
        loss = self._loss(self._forward(parameters, X), y)
        torch.autograd.grad(loss, list(parameters.values()))  # the hooks keep what it gives
        return float(loss.item()), len(X)

    @staticmethod
    def _gradient_done(flat_out, start: int, stop: int, ready, gradient) -> None:
        """Autograd's hook: one parameter's gradient is final; write it to its place, say so."""
        flat_out[start:stop].copy_(gradient.reshape(-1))
        if ready is not None:
            ready(start, stop)

    def _loss(self, output, y):
        """The summed loss of ``output`` against the labels ``y``."""
        torch = _torch()
        if self.loss == "cross_entropy":
            return torch.nn.functional.cross_entropy(output, torch.from_numpy(np.asarray(y, np.int64)), reduction="sum")
        target = torch.from_numpy(np.asarray(y, np.float32)).reshape(output.shape)
        return 0.5 * torch.sum((output - target) ** 2)

    def loss_and_predictions(self, weights: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, int]:
        """``(loss_sum, predictions, count)`` from one forward pass without gradients (evaluation)."""
        torch = _torch()
        if len(X) == 0:
            return 0.0, self.predict(weights, X), 0
        with torch.no_grad():
            output = self._forward(self._parameters(weights, requires_grad=False), X)
            return float(self._loss(output, y).item()), self._predictions(output, len(X)), len(X)

    def predict(self, weights: np.ndarray, X: np.ndarray) -> np.ndarray:
        torch = _torch()
        with torch.no_grad():
            output = self._forward(self._parameters(weights, requires_grad=False), X)
        return self._predictions(output, len(X))

    def _predictions(self, output, rows: int) -> np.ndarray:
        """Class ids (int64) or values (float32) from the module's output."""
        if self.task == "classification":
            return output.argmax(dim=1).numpy().astype(np.int64)
        return output.reshape(rows, -1).squeeze(1).numpy().astype(np.float32) if output.shape[-1] == 1 \
            else output.numpy().astype(np.float32)
