"""Where a ``TorchModel``'s gradient goes as backward makes it.

Each training pass makes the parameters (views of one flat vector, on the device), hooks
each so that autograd hands its gradient over as soon as it is final (the last layers
first), then runs forward and backward. The gradient then goes, part by part:

- into the caller's float32 vector: written in place on the CPU, or on a GPU copied down
  through pinned memory (``transfers.GradientCopies``), with ``ready(start, stop)`` after
  each part, so the engine sends it while backward goes on (``backward_into``);
- encoded on the device by a ``device_codecs.DeviceEncoder``, whole after backward
  (``backward_encoded``), or owner by owner as backward finishes each owner's range, only
  the bytes coming down (``backward_streamed``, ``transfers.EncodedCopies``).

``loss_of(parameters)`` runs the module's forward pass in train mode and gives the summed
loss; the model (``torch_module.TorchModel``) makes the parameters and knows the loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from allreduce_param.errors import ConfigurationError
from allreduce_param.models.device_codecs import DeviceEncoder, device_refusal
from allreduce_param.models.torch_state import require_torch
from allreduce_param.models.transfers import EncodedCopies, GradientCopies, Staging, run_here

#: The forward pass of a training call: the parameters (by name) -> the summed loss.
LossOf = Callable[[dict], Any]


def device_encoder_for(
    setting: str | bool, plan: Any, device_of: Callable[[], Any], who: str
) -> DeviceEncoder | None:
    """An encoder of gradient puts cut as ``plan`` on the device ``device_of()`` where
    ``setting`` (``TorchModel``'s ``encode_on_device``) says so and the plan can be encoded
    there (``device_codecs.device_refusal``); None where the gradient goes down as float32.
    ``True`` with a codec or parameter that cannot take it is a ``ConfigurationError``
    naming why (``who``: the model)."""
    if setting is False:
        return None
    refusal = device_refusal(plan.codec, plan.refusal)
    if refusal is not None:
        if setting is True:
            raise ConfigurationError(
                f"{who}: encode_on_device=True, but {refusal}; pass a lossy "
                "gradient_codec or encode_on_device='auto'"
            )
        return None
    if setting == "auto" and device_of().type != "cuda":
        return None
    return DeviceEncoder(require_torch(), device_of(), plan)


def hook_parts(parameters: dict, done: Callable[..., None]) -> None:
    """``done(start, stop, gradient)`` as autograd finishes each parameter's gradient (its
    ``start:stop`` in the flat vector), by a hook on the parameter."""
    start = 0
    for tensor in parameters.values():
        stop = start + tensor.numel()
        tensor.register_hook(functools.partial(done, start, stop))
        start = stop


def _written(flat_out, start: int, stop: int, gradient, ready) -> None:
    """Autograd's hook on the CPU: one parameter's gradient is final; write it to its
    place, say so."""
    flat_out[start:stop].copy_(gradient.reshape(-1))
    if ready is not None:
        ready(start, stop)


def backward_into(
    parameters: dict,
    loss_of: LossOf,
    out: np.ndarray,
    staging: Staging | None,
    ready: Callable[[int, int], None] | None,
) -> float:
    """The summed loss; the gradient written into ``out`` part by part, ``ready(start,
    stop)`` after each (``staging``: the GPU copy's pinned buffers; None on the CPU)."""
    torch = require_torch()
    copies = None
    if staging is None:  # on the CPU: each part written in place
        done = functools.partial(_written, torch.from_numpy(out), ready=ready)
    else:  # on a GPU: each part copied down to pinned memory, then into out
        copies = GradientCopies(out, staging.down.numpy(), staging.download, ready)
        done = copies.part_done
    hook_parts(parameters, done)
    loss = loss_of(parameters)
    torch.autograd.grad(loss, list(parameters.values()))  # the hooks keep what it gives
    if copies is not None:
        copies.finish()
    return float(loss.item())


def backward_encoded(
    parameters: dict, loss_of: LossOf, encoder: DeviceEncoder
) -> tuple[float, np.ndarray]:
    """``(loss_sum, payload)``: the whole gradient encoded on the device after backward."""
    torch = require_torch()
    loss = loss_of(parameters)
    gradients = torch.autograd.grad(loss, list(parameters.values()))
    flat = torch.cat([gradient.reshape(-1) for gradient in gradients])
    return float(loss.item()), encoder.encode(flat)


def backward_streamed(
    parameters: dict | None,
    loss_of: LossOf,
    encoder: DeviceEncoder,
    staging: Staging | None,
    zeros: Callable[[], Any],
    ready: Callable[[int, np.ndarray], None],
) -> tuple[float, np.ndarray]:
    """``(loss_sum, payload)``: each parameter's gradient given to ``EncodedCopies`` by a
    hook as autograd finishes it, ``ready(owner, bytes)`` as each owner's bytes land.
    ``parameters`` None: no rows, and ``zeros()`` (a zero gradient on the device) goes out
    with the residual, as an unstreamed put sends it. An error in backward waits for the
    copies under way and hands nothing more over."""
    torch = require_torch()
    copies = EncodedCopies(encoder, run_here if staging is None else staging.aside, ready)
    try:
        if parameters is None:
            flat = zeros()
            copies.part_done(0, flat.numel(), flat)
            loss_sum = 0.0
        else:
            hook_parts(parameters, copies.part_done)
            loss = loss_of(parameters)
            torch.autograd.grad(loss, list(parameters.values()))  # the hooks keep it
            loss_sum = float(loss.item())
        copies.finish()
    except BaseException:
        copies.abandon()
        raise
    return loss_sum, encoder.payload
