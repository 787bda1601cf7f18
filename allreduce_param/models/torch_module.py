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

import copy
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from allreduce_param.engine.vectors import writable_output
from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.models.base import merge_buffers, part_bounds
from allreduce_param.models.device_codecs import DeviceEncoder, device_refusal
from allreduce_param.models.devices import CudaInfo, check_device_request, choose_device, task_gpus
from allreduce_param.models.transfers import EncodedCopies, GradientCopies, Staging, run_here

LOSSES = ("cross_entropy", "mse")
PRECISIONS = ("fp32", "bf16")
_INIT_LOCK = threading.Lock()  # torch's random state is global to the process


def _where() -> tuple:
    """``(the Spark task's resources or None, whether this is a Spark driver)``; from the
    Spark layer, imported only when a device is chosen."""
    from allreduce_param.spark.gpus import on_spark_driver, task_resources

    resources = task_resources()
    return resources, resources is None and on_spark_driver()


def _torch():
    try:
        import torch
    except ImportError as error:
        raise ConfigurationError(
            "TorchModel needs PyTorch: pip install 'allreduce-param[torch]'"
        ) from error
    return torch


class _Copy:
    """One thread's copy of the module (on the model's device), how many rows it has trained
    on (whose buffer updates it holds), and on a GPU its pinned host buffers."""

    __slots__ = ("module", "rows", "staging")

    def __init__(self, module, staging: Staging | None) -> None:
        self.module, self.rows, self.staging = module, 0, staging


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
        torch = _torch()
        if loss not in LOSSES:
            raise ConfigurationError(f"TorchModel(loss={loss!r}): loss must be one of {LOSSES}")
        if precision not in PRECISIONS:
            raise ConfigurationError(
                f"TorchModel(precision={precision!r}): precision must be one of {PRECISIONS}"
            )
        if not isinstance(encode_on_device, bool) and encode_on_device != "auto":
            raise ConfigurationError(
                f"TorchModel(encode_on_device={encode_on_device!r}): it must be 'auto', True or False"
            )
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
        self.task = "classification" if loss == "cross_entropy" else "regression"
        self._names = [name for name, _ in self.module.named_parameters()]
        self._shapes = [tuple(p.shape) for p in self.module.parameters()]
        self.size = int(sum(int(np.prod(shape)) for shape in self._shapes))
        # the state_dict's entries: a parameter's key -> its name above (tied ones share it),
        # and the persistent buffers' keys (the names buffers() gives)
        by_id = {id(p): name for name, p in self.module.named_parameters()}
        buffer_ids = {id(b) for _, b in self.module.named_buffers(remove_duplicate=False)}
        entries = self.module.state_dict(keep_vars=True)
        self._parameter_keys = {
            key: by_id[id(value)] for key, value in entries.items() if id(value) in by_id
        }
        self._buffer_keys = [key for key, value in entries.items() if id(value) in buffer_ids]
        self._reset_copies()

    def _reset_copies(self) -> None:
        self._per_thread = threading.local()
        self._copies: list[_Copy] = []  # every thread's, to merge their buffers
        self._lock = threading.Lock()
        self._torch_device = None  # chosen at the first call, in the process that runs it

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        # copies and the device stay where they were made: an executor chooses its own
        for name in ("_per_thread", "_copies", "_lock", "_torch_device"):
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("encode_on_device", "auto")  # pickled before it was a setting
        self._reset_copies()

    @property
    def torch_device(self):
        """The ``torch.device`` this process runs the module on, chosen at the first call (see
        ``models.devices.choose_device``; a ConfigurationError says why a GPU is unusable)."""
        if self._torch_device is None:
            torch = _torch()
            with self._lock:
                if self._torch_device is None:
                    resources, driver = _where()
                    chosen = choose_device(
                        self.device, task_gpus(resources), CudaInfo.of_torch(torch), driver
                    )
                    self._torch_device = torch.device(chosen)
        return self._torch_device

    @property
    def uses_gpu(self) -> bool:
        """Whether this process runs the module on a GPU (choosing the device if not yet):
        the fit's ``overlap="auto"`` then streams the gradient on one host too."""
        return self.torch_device.type == "cuda"

    def _own(self) -> _Copy:
        """This thread's copy of the module, on the device."""
        own = getattr(self._per_thread, "copy", None)
        if own is None:
            device = self.torch_device
            module = copy.deepcopy(self.module).to(device)
            staging = Staging(_torch(), device, self.size) if device.type == "cuda" else None
            own = self._per_thread.copy = _Copy(module, staging)
            with self._lock:
                self._copies.append(own)
        return own

    def __repr__(self) -> str:
        extra = "".join(
            f", {name}={value!r}"
            for name, value, default in (
                ("device", self.device, "auto"),
                ("precision", self.precision, "fp32"),
                ("encode_on_device", self.encode_on_device, "auto"),
            )
            if value != default
        )
        return (
            f"TorchModel({self.module.__class__.__name__}, loss={self.loss!r}{extra}, "
            f"{self.size} parameters)"
        )

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
                return (
                    torch.nn.utils.parameters_to_vector(module.parameters())
                    .numpy()
                    .astype(np.float32)
                )

    def _parameters(self, weights: np.ndarray, requires_grad: bool) -> dict:
        """The parameters by name: views of one float32 copy of ``weights`` on the device."""
        torch = _torch()
        if weights.size != self.size:
            raise InputError(f"{self!r}: got {weights.size} weights, expected {self.size}")
        staging = self._own().staging
        if staging is None:
            flat = torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))
        else:
            flat = staging.upload(np.asarray(weights).reshape(-1))
        parameters, start = {}, 0
        for name, shape in zip(self._names, self._shapes):
            count = int(np.prod(shape))
            parameters[name] = flat[start : start + count].view(shape).requires_grad_(requires_grad)
            start += count
        return parameters

    def _forward(self, parameters: dict, X: np.ndarray, train: bool):
        """The module's output on ``X`` in train mode (this thread's copy's buffers, which
        BatchNorm updates; the rows are counted to its copy) or eval mode (``buffers()``,
        read only)."""
        torch = _torch()
        own, device = self._own(), self.torch_device
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
        torch = _torch()
        writable_output(out, self.size, f"{self!r}: loss_and_grad_into(out=)")
        if len(X) == 0:
            out[:] = 0
            return 0.0, 0
        parameters = self._parameters(weights, requires_grad=True)
        staging = self._own().staging
        copies = None
        if staging is None:  # on the CPU: each part written in place
            done = functools.partial(self._gradient_done, torch.from_numpy(out), ready=ready)
        else:  # on a GPU: each part copied down to pinned memory, then into out
            copies = GradientCopies(out, staging.down.numpy(), staging.download, ready)
            done = copies.part_done
        start = 0
        for tensor in parameters.values():
            stop = start + tensor.numel()
            tensor.register_hook(functools.partial(done, start, stop))
            start = stop
        loss = self._loss(self._forward(parameters, X, train=True), y)
        torch.autograd.grad(loss, list(parameters.values()))  # the hooks keep what it gives
        if copies is not None:
            copies.finish()
        return float(loss.item()), len(X)

    def device_encoder(self, plan) -> DeviceEncoder | None:
        """An encoder of gradient puts cut as ``plan`` (``ConnectedParameter.info.gradient_put_plan``)
        on this process's device, where ``encode_on_device`` says so and the plan can be
        encoded there (``device_codecs.device_refusal``); None where the gradient goes down
        as float32. ``encode_on_device=True`` with a codec or parameter that cannot take it
        is a ``ConfigurationError`` naming why."""
        if self.encode_on_device is False:
            return None
        refusal = device_refusal(plan.codec, plan.refusal)
        if refusal is not None:
            if self.encode_on_device is True:
                raise ConfigurationError(
                    f"{self!r}: encode_on_device=True, but {refusal}; pass a lossy "
                    "gradient_codec or encode_on_device='auto'"
                )
            return None
        if self.encode_on_device == "auto" and not self.uses_gpu:
            return None
        return DeviceEncoder(_torch(), self.torch_device, plan)

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
        torch = _torch()
        if ready is not None:
            return self._loss_and_streamed_encoding(weights, X, y, encoder, ready)
        if len(X) == 0:
            flat = torch.zeros(self.size, dtype=torch.float32, device=self.torch_device)
            return 0.0, encoder.encode(flat), 0
        parameters = self._parameters(weights, requires_grad=True)
        loss = self._loss(self._forward(parameters, X, train=True), y)
        gradients = torch.autograd.grad(loss, list(parameters.values()))
        flat = torch.cat([gradient.reshape(-1) for gradient in gradients])
        payload = encoder.encode(flat)
        return float(loss.item()), payload, len(X)

    def _loss_and_streamed_encoding(
        self, weights, X, y, encoder: DeviceEncoder, ready: Callable[[int, np.ndarray], None]
    ) -> tuple[float, np.ndarray, int]:
        """``loss_and_encoded_grad`` with ``ready``: each parameter's gradient given to
        ``EncodedCopies`` by a hook as autograd finishes it."""
        torch = _torch()
        staging = self._own().staging
        copies = EncodedCopies(encoder, run_here if staging is None else staging.aside, ready)
        try:
            if len(X) == 0:  # the residual alone goes out, as an unstreamed put sends it
                zeros = torch.zeros(self.size, dtype=torch.float32, device=self.torch_device)
                copies.part_done(0, self.size, zeros)
                loss_sum = 0.0
            else:
                parameters = self._parameters(weights, requires_grad=True)
                start = 0
                for tensor in parameters.values():
                    stop = start + tensor.numel()
                    tensor.register_hook(functools.partial(copies.part_done, start, stop))
                    start = stop
                loss = self._loss(self._forward(parameters, X, train=True), y)
                torch.autograd.grad(loss, list(parameters.values()))  # the hooks keep it
                loss_sum = float(loss.item())
            copies.finish()
        except BaseException:
            copies.abandon()
            raise
        return loss_sum, encoder.payload, len(X)

    @staticmethod
    def _gradient_done(flat_out, start: int, stop: int, gradient, ready) -> None:
        """Autograd's hook on the CPU: one parameter's gradient is final; write it to its
        place, say so."""
        flat_out[start:stop].copy_(gradient.reshape(-1))
        if ready is not None:
            ready(start, stop)

    def _loss(self, output, y):
        """The summed loss of ``output`` against the labels ``y``."""
        torch = _torch()
        if self.loss == "cross_entropy":
            return torch.nn.functional.cross_entropy(
                output, torch.from_numpy(np.asarray(y, np.int64)).to(output.device), reduction="sum"
            )
        target = torch.from_numpy(np.asarray(y, np.float32)).to(output.device).reshape(output.shape)
        return 0.5 * torch.sum((output - target) ** 2)

    def loss_and_predictions(
        self, weights: np.ndarray, X: np.ndarray, y: np.ndarray
    ) -> tuple[float, np.ndarray, int]:
        """``(loss_sum, predictions, count)`` from one forward pass without gradients, in eval
        mode (evaluation)."""
        torch = _torch()
        if len(X) == 0:
            return 0.0, self.predict(weights, X), 0
        with torch.no_grad():
            output = self._forward(self._parameters(weights, requires_grad=False), X, train=False)
            return float(self._loss(output, y).item()), self._predictions(output, len(X)), len(X)

    def predict(self, weights: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class ids (int64) or values (float32), from the module in eval mode."""
        torch = _torch()
        with torch.no_grad():
            output = self._forward(self._parameters(weights, requires_grad=False), X, train=False)
        return self._predictions(output, len(X))

    def _predictions(self, output, rows: int) -> np.ndarray:
        """Class ids (int64) or values (float32) from the module's output."""
        output = output.cpu()
        if self.task == "classification":
            return output.argmax(dim=1).numpy().astype(np.int64)
        return (
            output.reshape(rows, -1).squeeze(1).numpy().astype(np.float32)
            if output.shape[-1] == 1
            else output.numpy().astype(np.float32)
        )

    # ---- buffers and named tensors (see allreduce_param.models.base.Model) ----------------

    def _buffers_of(self, module) -> dict[str, np.ndarray]:
        named = dict(module.named_buffers(remove_duplicate=False))
        return {key: named[key].detach().cpu().numpy().copy() for key in self._buffer_keys}

    def buffers(self) -> dict[str, np.ndarray]:
        """The persistent buffers by state_dict name (copies): those of the threads' copies
        that trained, merged by ``merge_buffers`` weighted by the rows each trained on (one
        thread: its own), else the module's (as wrapped, or as ``set_buffers`` set them)."""
        with self._lock:
            trained = [(own.module, own.rows) for own in self._copies if own.rows]
        if not trained:
            return self._buffers_of(self.module)
        if len(trained) == 1:
            return self._buffers_of(trained[0][0])
        return merge_buffers([(self._buffers_of(module), rows) for module, rows in trained])

    def _checked_buffers(self, buffers: Mapping[str, Any], what: str) -> dict[str, np.ndarray]:
        """``buffers`` as arrays of the module's buffers' dtypes; an error names a missing,
        unexpected or misshapen one."""
        expected = self._buffers_of(self.module)
        missing, unexpected = (
            sorted(set(expected) - set(buffers)),
            sorted(set(buffers) - set(expected)),
        )
        if missing or unexpected:
            raise InputError(
                f"{self!r}.{what}: the buffers must be {sorted(expected)}; "
                f"missing {missing}, unexpected {unexpected}"
            )
        checked = {}
        for key, value in expected.items():
            given = np.asarray(buffers[key])
            if given.shape != value.shape:
                raise InputError(
                    f"{self!r}.{what}: buffer {key!r} has shape {given.shape}, the module's "
                    f"{value.shape}"
                )
            checked[key] = np.array(given, dtype=value.dtype)  # a 0-d one stays 0-d
        return checked

    def set_buffers(self, buffers: Mapping[str, np.ndarray]) -> None:
        """Replace the module's persistent buffers (by state_dict name, as ``buffers()``
        gives them); the threads' copies start again from them."""
        torch = _torch()
        checked = self._checked_buffers(buffers, "set_buffers")
        named = dict(self.module.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for key, value in checked.items():
                named[key].copy_(torch.from_numpy(value))
        with self._lock:
            self._per_thread, self._copies = threading.local(), []

    def tensors(self, weights: np.ndarray) -> dict[str, np.ndarray]:
        """``state_dict name -> view`` of the flat vector's parameters (a tied parameter under
        each of its names)."""
        if weights.size != self.size:
            raise InputError(f"{self!r}: got {weights.size} weights, expected {self.size}")
        views, start = {}, 0
        flat = np.asarray(weights).reshape(-1)
        for name, shape in zip(self._names, self._shapes):
            count = int(np.prod(shape))
            views[name] = flat[start : start + count].reshape(shape)
            start += count
        return {key: views[name] for key, name in self._parameter_keys.items()}

    def penalized(self, part: slice | None = None) -> np.ndarray:
        """Which coordinates the regularisation applies to: every parameter but those whose
        name ends in ``bias`` (``fc.bias``: an intercept, never penalised, held at 0 by
        ``fit_intercept=False``); a module's other unpenalised parameters (a norm layer's
        ``weight``) are penalised all the same. ``part``: only that slice of the flat vector
        (None: all of it). See ``Model``."""
        start, stop = part_bounds(part, self.size, f"{self!r}.penalized")
        mask = np.ones(stop - start, dtype=bool)
        first = 0
        for name, shape in zip(self._names, self._shapes):
            last = first + int(np.prod(shape))
            if name.endswith("bias"):
                mask[max(first, start) - start : max(min(last, stop), start) - start] = False
            first = last
        return mask

    def state_dict(
        self, weights: np.ndarray, buffers: Mapping[str, np.ndarray] | None = None
    ) -> OrderedDict:
        """What ``module.load_state_dict`` takes: the parameters from ``weights``, the buffers
        from ``buffers`` (default: ``buffers()``), other entries (extra state) the module's
        own; in the module's own order, torch tensors that share no memory with the inputs."""
        torch = _torch()
        tensors = self.tensors(weights)
        checked = self._checked_buffers(
            self.buffers() if buffers is None else buffers, "state_dict"
        )
        result = OrderedDict()
        for key, value in self.module.state_dict().items():
            if key in tensors:
                result[key] = torch.from_numpy(np.array(tensors[key], dtype=np.float32))
            elif key in checked:
                result[key] = torch.from_numpy(checked[key].copy())
            else:
                result[key] = value
        return result
