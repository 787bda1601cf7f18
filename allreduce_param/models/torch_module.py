"""TorchModel: any ``torch.nn.Module`` as a model the trainer can fit (extra ``[torch]``).

The module's parameters are flattened into the one float32 vector the engine keeps in
sync. Each call builds fresh parameter tensors from that vector and runs the module
functionally (``torch.func.functional_call``), so no gradient buffers are shared.
``functional_call`` swaps a module's parameters while it runs, so every thread (sub-batches
run on threads) uses its own copy of the module.

Modes and buffers: training calls (``loss_and_grad``, ``loss_and_grad_into``) run the module
in train mode (Dropout active, BatchNorm normalising by the batch and updating its running
statistics in the calling thread's copy); ``predict`` and ``loss_and_predictions`` run it in
eval mode (no Dropout, BatchNorm normalising by the running statistics), reading the
buffers ``buffers()`` gives and changing none. The buffers are the module's persistent
ones (those in its ``state_dict``), by their state_dict names.

Devices: ``device="auto"`` runs the module on the GPU Spark assigned to the task (else the
CPU), ``"cuda"`` requires one, ``"cuda:N"``/``"cpu"`` force one (``models.devices`` says
how the choice is made). The choice is made in the process that runs the module, at its
first call; each thread's copy of the module lives there. The engine's vectors stay on the
host: the weights go up in one copy per call and the gradient comes down part by part as
backward finishes it (``models.transfers``); ``buffers()``, ``set_buffers`` and
``state_dict`` take and give host (numpy, CPU torch) values wherever the module runs.
``precision="bf16"`` runs the forward pass under ``torch.autocast`` in bfloat16 (the
parameters, their gradients and the loss stay float32).

Lossy gradient codecs on the device: with ``encode_on_device`` (``"auto"``: where the module
runs on a GPU) and a gradient codec of ``models.device_codecs.DEVICE_CODECS``, the trainer
asks ``device_encoder(plan)`` once and then each step ``loss_and_encoded_grad``: the
gradient stays on the device, the codec (and its error feedback residual) runs there, and
only the encoded bytes come down, the same bits the host would have made; streamed, owner
by owner as backward finishes each owner's range (``transfers.EncodedCopies``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from allreduce_param.engine.vectors import writable_output
from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.models.base import merge_buffers, part_bounds
from allreduce_param.models.device_codecs import DeviceEncoder
from allreduce_param.models.devices import check_device_request, check_precision_and_encoding
from allreduce_param.models.torch_copies import ThreadCopies
from allreduce_param.models.torch_gradients import (
    backward_encoded,
    backward_into,
    backward_streamed,
    device_encoder_for,
)
from allreduce_param.models.torch_heads import TorchHead
from allreduce_param.models.torch_state import ModuleState, fresh_parameters, require_torch

#: The settings ``to_config`` gives (besides the module's import path), as the constructor takes them.
SETTINGS = ("loss", "device", "precision", "encode_on_device")
#: The settings' defaults, which ``repr`` leaves out.
DEFAULTS = {"device": "auto", "precision": "fp32", "encode_on_device": "auto"}


class TorchModel:
    """Wrap ``module`` (or a no-argument factory making it) for ``DistriOptimizer``.

    ``loss``: ``"cross_entropy"`` (classification: the module outputs class scores) or
    ``"mse"`` (regression: 0.5 * squared error, as the built-in models). ``init(rng)``
    re-initialises the module's parameters with a seed drawn from ``rng``, so fits are
    reproducible (a module with Dropout draws its masks from torch's own random state,
    which is not seeded by the fit). A fit starts from the module's buffers as they are
    when it is wrapped (a fresh BatchNorm's zeros and ones); the fit's result carries the
    trained ones (``TrainedModel.buffers``), see ``allreduce_param.models.base.Model``.
    ``state_dict(weights, buffers)`` gives what ``module.load_state_dict`` takes.

    ``device``: ``"auto"`` (the task's GPU, else the CPU), ``"cuda"`` (the task's GPU,
    required), ``"cuda:N"`` or ``"cpu"``; see ``allreduce_param.models.devices``.
    ``precision``: ``"fp32"``, or ``"bf16"`` for the forward pass under ``torch.autocast``.
    ``encode_on_device``: whether a lossy gradient codec (bf16, fp16, bf16-lz4, int8, topk)
    runs on the module's device, so that only its bytes are copied to the host: ``"auto"``
    on a GPU, ``True`` wherever the module runs (the CPU too: the same torch code, which is
    how it is tested without a GPU; a fit that cannot use it is refused), ``False`` never.
    See ``models.device_codecs``; where the fit streams (``overlap``), each owner's parts
    are encoded and sent as soon as backward has finished that owner's range
    (``loss_and_encoded_grad(ready=)``), else the gradient is put after backward.
    """

    def __init__(
        self,
        module: Any | Callable[[], Any],
        loss: str = "cross_entropy",
        device: str = "auto",
        precision: str = "fp32",
        encode_on_device: str | bool = "auto",
    ) -> None:
        torch = require_torch()
        check_precision_and_encoding(precision, encode_on_device)
        self.device, self.precision = check_device_request(device), precision
        self.encode_on_device = encode_on_device
        self.module = (
            module() if callable(module) and not isinstance(module, torch.nn.Module) else module
        )
        if not isinstance(self.module, torch.nn.Module):
            raise ConfigurationError(
                f"TorchModel needs a torch.nn.Module, got {type(self.module).__name__}"
            )
        self.loss = loss
        self._build()

    def _build(self) -> None:
        """What follows from the module and the settings: the task, the state's layout, and
        the threads' copies (none yet; the device chosen at the first call)."""
        self._head = TorchHead(self.loss)
        self.task = self._head.task
        self._state = ModuleState(self.module)
        self.size = self._state.size
        self._threads = ThreadCopies(self.module, self.device, self.size)

    def __getstate__(self) -> dict:
        # the module and the settings: an executor builds the rest, and chooses its device
        return {"module": self.module, **{name: getattr(self, name) for name in SETTINGS}}

    def __setstate__(self, state: dict) -> None:
        # a setting pickled before it was one takes its default
        given = {name: state[name] for name in ("module", *SETTINGS) if name in state}
        self.__dict__.update({**DEFAULTS, **given})
        self._build()

    def to_config(self) -> dict:
        """The settings that rebuild this model around its module, as JSON holds them, and the
        module's class as ``"package.module:Class"`` (``module``): what ``TrainedModel.save``
        writes of it besides the module's state (``models.torch_saving``)."""
        kind = type(self.module)
        return {
            "module": f"{kind.__module__}:{kind.__qualname__}",
            **{name: getattr(self, name) for name in SETTINGS},
        }

    @classmethod
    def from_config(cls, config: Mapping, module: Any) -> TorchModel:
        """The model ``to_config`` described, around ``module`` (which holds the saved state:
        ``models.torch_saving`` loads it)."""
        return cls(module, **{name: config[name] for name in SETTINGS if name in config})

    @property
    def torch_device(self):
        """The ``torch.device`` this process runs the module on, chosen at the first call (see
        ``models.devices.choose_device``; a ConfigurationError says why a GPU is unusable)."""
        return self._threads.device

    @property
    def uses_gpu(self) -> bool:
        """Whether this process runs the module on a GPU (choosing the device if not yet):
        the fit's ``overlap="auto"`` then streams the gradient on one host too."""
        return self.torch_device.type == "cuda"

    def __repr__(self) -> str:
        extra = "".join(
            f", {name}={getattr(self, name)!r}"
            for name, default in DEFAULTS.items()
            if getattr(self, name) != default
        )
        return (
            f"TorchModel({self.module.__class__.__name__}, loss={self.loss!r}{extra}, "
            f"{self.size} parameters)"
        )

    def init(self, rng: np.random.Generator) -> np.ndarray:
        """Fresh parameters, reproducible from ``rng``; touches neither the module nor torch's
        global random state (it runs on a copy, under a lock, with that state forked)."""
        return fresh_parameters(self.module, int(rng.integers(2**62)))

    def _parameters(self, weights: np.ndarray, requires_grad: bool) -> dict:
        """The parameters by name: views of one float32 copy of ``weights`` on the device."""
        torch = require_torch()
        if weights.size != self.size:
            raise InputError(f"{self!r}: got {weights.size} weights, expected {self.size}")
        staging = self._threads.own().staging
        if staging is None:
            flat = torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))
        else:
            flat = staging.upload(np.asarray(weights).reshape(-1))
        return {
            name: flat[start:stop].view(shape).requires_grad_(requires_grad)
            for name, shape, start, stop in self._state.ranges()
        }

    def _forward(self, parameters: dict, X: np.ndarray, train: bool):
        """The module's output on ``X`` in train mode (this thread's copy's buffers, which
        BatchNorm updates; the rows are counted to its copy) or eval mode (``buffers()``,
        read only)."""
        torch = require_torch()
        own, device = self._threads.own(), self.torch_device
        inputs = (torch.from_numpy(np.asarray(X, np.float32)).to(device),)
        with torch.autocast(device.type, torch.bfloat16, enabled=self.precision == "bf16"):
            if train:
                own.module.train()
                output = torch.func.functional_call(own.module, parameters, inputs)
                own.rows += len(X)
                return output.float()
            own.module.eval()
            buffers = {
                key: torch.from_numpy(value).to(device) for key, value in self.buffers().items()
            }
            return torch.func.functional_call(own.module, {**parameters, **buffers}, inputs).float()

    def loss_and_grad(
        self, weights: np.ndarray, X: np.ndarray, y: np.ndarray
    ) -> tuple[float, np.ndarray, int]:
        grad = np.empty(self.size, dtype=np.float32)
        loss, rows = self.loss_and_grad_into(weights, X, y, grad)
        return loss, grad, rows

    def loss_and_grad_into(
        self,
        weights: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        out: np.ndarray,
        ready: Callable[[int, int], None] | None = None,
    ) -> tuple[float, int]:
        """``(loss_sum, count)``, the gradient sum written into ``out``: each parameter's part
        as autograd finishes it (a hook on the parameter), then ``ready(start, stop)`` for
        it, so that it can be sent while backward goes on (last layers first)."""
        writable_output(out, self.size, f"{self!r}: loss_and_grad_into(out=)")
        if len(X) == 0:
            out[:] = 0
            return 0.0, 0
        parameters = self._parameters(weights, requires_grad=True)
        staging = self._threads.own().staging
        return backward_into(parameters, self._loss_of(X, y), out, staging, ready), len(X)

    def device_encoder(self, plan) -> DeviceEncoder | None:
        """An encoder of gradient puts cut as ``plan`` (``ConnectedParameter.info.gradient_put_plan``)
        on this process's device, where ``encode_on_device`` says so and the plan can be
        encoded there (``device_codecs.device_refusal``); None where the gradient goes down
        as float32. ``encode_on_device=True`` with a codec or parameter that cannot take it
        is a ``ConfigurationError`` naming why."""
        return device_encoder_for(
            self.encode_on_device, plan, lambda: self.torch_device, repr(self)
        )

    def loss_and_encoded_grad(
        self,
        weights: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        encoder: DeviceEncoder,
        ready: Callable[[int, np.ndarray], None] | None = None,
    ) -> tuple[float, np.ndarray, int]:
        """``(loss_sum, payload, count)``: ``loss_and_grad``'s, with the gradient encoded on
        the device by ``encoder`` (``device_encoder``), for ``put_gradients(EncodedGradient)``; the
        payload is valid until the encoder's next call.

        With ``ready`` (``EncodedStream.ready``, of ``stream_gradients(encoded=True)``), each
        owner's parts are encoded as soon as backward has finished that owner's range, on
        the side stream, and ``ready(owner, bytes)`` hands their bytes over once they have
        landed on the host (``transfers.EncodedCopies``): the last layers' owners first,
        while backward goes on. The same bits as without; the payload is then all of them.
        An error in backward waits for the copies under way and hands nothing more over."""
        if ready is not None:
            parameters = self._parameters(weights, requires_grad=True) if len(X) else None
            loss_sum, payload = backward_streamed(
                parameters,
                self._loss_of(X, y),
                encoder,
                self._threads.own().staging,
                self._zeros,
                ready,
            )
            return loss_sum, payload, len(X)
        if len(X) == 0:
            return 0.0, encoder.encode(self._zeros()), 0
        parameters = self._parameters(weights, requires_grad=True)
        loss_sum, payload = backward_encoded(parameters, self._loss_of(X, y), encoder)
        return loss_sum, payload, len(X)

    def _zeros(self):
        """A zero gradient on the device."""
        torch = require_torch()
        return torch.zeros(self.size, dtype=torch.float32, device=self.torch_device)

    def _loss_of(self, X: np.ndarray, y: np.ndarray):
        """The training pass's forward on ``X`` against ``y``: the parameters -> the summed
        loss (``torch_gradients.LossOf``)."""
        return lambda parameters: self._head.loss_sum(self._forward(parameters, X, train=True), y)

    def loss_and_predictions(
        self, weights: np.ndarray, X: np.ndarray, y: np.ndarray
    ) -> tuple[float, np.ndarray, int]:
        """``(loss_sum, predictions, count)`` from one forward pass without gradients, in eval
        mode (evaluation)."""
        torch = require_torch()
        if len(X) == 0:
            return 0.0, self.predict(weights, X), 0
        with torch.no_grad():
            output = self._forward(self._parameters(weights, requires_grad=False), X, train=False)
            return (
                float(self._head.loss_sum(output, y).item()),
                self._head.predictions(output, len(X)),
                len(X),
            )

    def predict(self, weights: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class ids (int64) or values (float32), from the module in eval mode."""
        torch = require_torch()
        with torch.no_grad():
            output = self._forward(self._parameters(weights, requires_grad=False), X, train=False)
        return self._head.predictions(output, len(X))

    # ---- buffers and named tensors (see allreduce_param.models.base.Model) ----------------

    def buffers(self) -> dict[str, np.ndarray]:
        """The persistent buffers by state_dict name (copies): those of the threads' copies
        that trained, merged by ``merge_buffers`` weighted by the rows each trained on (one
        thread: its own), else the module's (as wrapped, or as ``set_buffers`` set them)."""
        trained = self._threads.trained()
        if not trained:
            return self._state.buffers_of(self.module)
        if len(trained) == 1:
            return self._state.buffers_of(trained[0][0])
        return merge_buffers([(self._state.buffers_of(module), rows) for module, rows in trained])

    def set_buffers(self, buffers: Mapping[str, np.ndarray]) -> None:
        """Replace the module's persistent buffers (by state_dict name, as ``buffers()``
        gives them); the threads' copies start again from them."""
        torch = require_torch()
        checked = self._state.checked_buffers(self.module, buffers, f"{self!r}.set_buffers")
        named = dict(self.module.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for key, value in checked.items():
                named[key].copy_(torch.from_numpy(value))
        self._threads.clear()

    def tensors(self, weights: np.ndarray) -> dict[str, np.ndarray]:
        """``state_dict name -> view`` of the flat vector's parameters (a tied parameter under
        each of its names)."""
        return self._state.tensors(weights, repr(self))

    def penalized(self, part: slice | None = None) -> np.ndarray:
        """Which coordinates the regularisation applies to: every parameter but those whose
        name ends in ``bias`` (``fc.bias``: an intercept, never penalised, held at 0 by
        ``fit_intercept=False``); a module's other unpenalised parameters (a norm layer's
        ``weight``) are penalised all the same. ``part``: only that slice of the flat vector
        (None: all of it). See ``Model``."""
        return self._state.penalized(*part_bounds(part, self.size, f"{self!r}.penalized"))

    def state_dict(
        self, weights: np.ndarray, buffers: Mapping[str, np.ndarray] | None = None
    ) -> OrderedDict:
        """What ``module.load_state_dict`` takes: the parameters from ``weights``, the buffers
        from ``buffers`` (default: ``buffers()``), other entries (extra state) the module's
        own; in the module's own order, torch tensors that share no memory with the inputs."""
        given = self.buffers() if buffers is None else buffers
        checked = self._state.checked_buffers(self.module, given, f"{self!r}.state_dict")
        return self._state.state_dict(self.module, self.tensors(weights), checked)
