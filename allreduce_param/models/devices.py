"""Which device a ``TorchModel`` runs on: the GPU Spark assigned to the task, or the CPU.

The choice is a pure function of what was asked (``TorchModel(device=...)``), the GPU
addresses Spark assigned to the task (``TaskContext.resources()["gpu"].addresses``; None
outside a Spark task) and what this process's PyTorch can reach (``CudaInfo``), so it is
tested without Spark and without a GPU. ``TorchModel`` makes the choice lazily, in the
process that runs the module (an executor's Python worker), never on the driver.

What may be asked:

- ``"auto"``: in a Spark task, the first GPU Spark assigned to it, else the CPU; outside
  Spark (plain processes, a notebook), ``cuda:0`` where CUDA is available, else the CPU.
- ``"cuda"``: the same, but a GPU is required: a task with no GPU assigned, or a process
  with no CUDA, is an error saying what to set. On a Spark driver (the fit's checks run the
  model on a row there, and a ``TrainedModel`` may predict there) the GPUs are the
  executors': the driver's own ``cuda:0`` where it has one, else its CPU.
- ``"cuda:N"``: that GPU, whatever Spark assigned (an error when it does not exist).
- ``"cpu"``: the CPU.

Spark's addresses are what the resource discovery script printed, usually the GPUs'
indices on the machine. Where the executor's ``CUDA_VISIBLE_DEVICES`` narrows what CUDA
sees (YARN's and Kubernetes' GPU isolation do), an address is looked up there and its
position is the CUDA index. Several tasks may share one GPU (a fractional
``spark.task.resource.gpu.amount``): each gets the same address, and each its own module
copy on it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from allreduce_param.errors import ConfigurationError

#: What ``TorchModel(device=...)`` takes besides ``cuda:N``.
DEVICE_CHOICES = ("auto", "cuda", "cpu")

#: What a session must set for its tasks to be assigned GPUs, named by every refusal.
GPU_SETTINGS_HINT = (
    "the fit's gpus_per_task setting (the Estimators' gpusPerTask), or the session's "
    "spark.task.resource.gpu.amount, with spark.executor.resource.gpu.amount and "
    "spark.executor.resource.gpu.discoveryScript (spark.worker.resource.gpu.* on a "
    "standalone cluster)"
)


@dataclass(frozen=True)
class CudaInfo:
    """What this process's PyTorch can reach: whether the build has CUDA, how many GPUs it
    sees, its version string (for messages) and ``CUDA_VISIBLE_DEVICES``."""

    built: bool
    count: int
    torch_version: str
    visible: str | None = None

    @classmethod
    def of_torch(cls, torch) -> CudaInfo:
        """This process's: ``torch.backends.cuda.is_built()``, ``torch.cuda.device_count()``."""
        built = bool(torch.backends.cuda.is_built())
        count = int(torch.cuda.device_count()) if built and torch.cuda.is_available() else 0
        return cls(built, count, str(torch.__version__), os.environ.get("CUDA_VISIBLE_DEVICES"))


def check_device_request(device: object) -> str:
    """``device`` if it is one of ``DEVICE_CHOICES`` or ``cuda:N``, else a ConfigurationError."""
    if isinstance(device, str) and (
        device in DEVICE_CHOICES or (device.startswith("cuda:") and device[5:].isdigit())
    ):
        return device
    raise ConfigurationError(
        f"TorchModel(device={device!r}): the device must be 'auto', 'cuda', 'cuda:N' "
        "(N a GPU index) or 'cpu'"
    )


#: ``TorchModel``'s ``precision`` choices: float32, or the forward pass under bfloat16 autocast.
PRECISIONS = ("fp32", "bf16")


def check_precision_and_encoding(precision: object, encode_on_device: object) -> None:
    """A ConfigurationError where ``TorchModel``'s ``precision`` is not one of ``PRECISIONS``
    or its ``encode_on_device`` not ``"auto"``, True or False."""
    if precision not in PRECISIONS:
        raise ConfigurationError(
            f"TorchModel(precision={precision!r}): precision must be one of {PRECISIONS}"
        )
    if not isinstance(encode_on_device, bool) and encode_on_device != "auto":
        raise ConfigurationError(
            f"TorchModel(encode_on_device={encode_on_device!r}): it must be 'auto', True or False"
        )


def choose_device(
    request: str, assigned: Sequence[str] | None, cuda: CudaInfo, driver: bool = False
) -> str:
    """The torch device (``"cpu"`` or ``"cuda:N"``) for ``request``, given the task's assigned
    GPU addresses (None: not in a Spark task; empty: a task with none), ``cuda``, and
    whether this process is a Spark driver."""
    request = check_device_request(request)
    if request == "cpu":
        return "cpu"
    if request.startswith("cuda:"):
        index = int(request[5:])
        _require_cuda(cuda, f"TorchModel(device={request!r})")
        if index >= cuda.count:
            raise ConfigurationError(
                f"TorchModel(device={request!r}): this process sees {cuda.count} GPU(s) "
                f"(cuda:0 to cuda:{cuda.count - 1}; CUDA_VISIBLE_DEVICES={cuda.visible!r})"
            )
        return request
    if assigned is None:  # outside Spark: the process's first GPU, if any
        if cuda.count:
            return "cuda:0"
        if request == "cuda" and not driver:
            _require_cuda(cuda, "TorchModel(device='cuda')")
        return "cpu"
    if not assigned:
        if request == "cuda":
            raise ConfigurationError(
                "TorchModel(device='cuda'): Spark assigned this task no GPU; set "
                + GPU_SETTINGS_HINT
                + ". Spark's local mode (local[N]) assigns no GPUs: there, use "
                "device='cuda:0'"
            )
        return "cpu"
    where = f"TorchModel(device={request!r}) in a task Spark assigned GPU {', '.join(assigned)}"
    _require_cuda(cuda, where)
    return f"cuda:{cuda_index(assigned[0], cuda, where)}"


def cuda_index(address: str, cuda: CudaInfo, where: str) -> int:
    """The CUDA index of Spark's GPU ``address``: its position in ``CUDA_VISIBLE_DEVICES``
    when that is set and lists it, else the address itself; checked against the count."""
    visible = [item.strip() for item in (cuda.visible or "").split(",") if item.strip()]
    if address in visible:
        index = visible.index(address)
    elif address.isdigit():
        index = int(address)
    else:
        raise ConfigurationError(
            f"{where}: address {address!r} is no GPU index and not in CUDA_VISIBLE_DEVICES="
            f"{cuda.visible!r}; the discovery script must print the GPUs' indices"
        )
    if index >= cuda.count:
        raise ConfigurationError(
            f"{where}: address {address!r} is CUDA index {index}, but this process sees "
            f"{cuda.count} GPU(s) (CUDA_VISIBLE_DEVICES={cuda.visible!r}); the discovery "
            "script's addresses must be the GPUs this executor can use"
        )
    return index


def _require_cuda(cuda: CudaInfo, what: str) -> None:
    """A ConfigurationError when this process cannot use CUDA, naming why."""
    if not cuda.built:
        raise ConfigurationError(
            f"{what}: this PyTorch build ({cuda.torch_version}) has no CUDA: install a CUDA "
            "build of torch on the executors (https://pytorch.org/get-started), or use "
            "device='cpu'"
        )
    if cuda.count == 0:
        raise ConfigurationError(
            f"{what}: PyTorch {cuda.torch_version} sees no GPU in this process "
            f"(torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES={cuda.visible!r}): "
            "check the NVIDIA driver, or use device='cpu'"
        )


def task_gpus(resources: Mapping[str, object] | None) -> list[str] | None:
    """The GPU addresses in a task's ``TaskContext.resources()`` mapping (name -> an object
    with ``addresses``); None for no mapping (not in a Spark task)."""
    if resources is None:
        return None
    gpu = resources.get("gpu")
    return [str(address) for address in getattr(gpu, "addresses", None) or []]
