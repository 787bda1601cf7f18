"""Whether a fit's steps encode the gradient on the model's device (``TorchModel
(encode_on_device=)``, ``models/device_codecs.py``), and why not where they cannot: asked on
the driver before the stage (``encode_on_device=True`` is refused there, naming why) and in
each task (``gradient_path.choose_path``), from the same settings."""

from __future__ import annotations

from typing import Any

from allreduce_param.errors import ConfigurationError
from allreduce_param.models.device_codecs import device_refusal
from allreduce_param.train.settings import FitSettings, workload_shares


def device_encoding_refusal(
    settings: FitSettings, gradient_codec: str, inline_owner: bool, clip_norm: float | None
) -> str | None:
    """Why a fit with these settings cannot put the gradient encoded on the device; None if
    it can. (A model that takes sparse rows never encodes on the device: it has no
    ``device_encoder``.)"""
    refusal = device_refusal(gradient_codec)  # the put's own: the task's model asks it
    if refusal is not None:
        return refusal
    if settings.sync_every != 1:
        return (
            "it is local SGD (sync_every), which steps each partition's own copy with the "
            "float32 gradient"
        )
    if len(workload_shares(settings.threads)) > 1:
        return (
            f"its batches are split over several threads (threads={settings.threads!r}), whose "
            "gradients are summed on the host; threads=1 keeps them on the device"
        )
    if not inline_owner and clip_norm is not None:
        return (
            "each partition clips its own gradient by its norm on the host (clip_norm under a "
            "strategy with a background owner)"
        )
    return None


def check_device_encoding(model: Any, refusal: str | None) -> None:
    """Refuse ``encode_on_device=True`` where the fit cannot encode on the device."""
    if refusal is not None and getattr(model, "encode_on_device", None) is True:
        raise ConfigurationError(
            f"{model!r}: encode_on_device=True, but this fit cannot encode the gradient on "
            f"the device: {refusal}; pass encode_on_device='auto' (the host encodes it)"
        )
