"""The lossy gradient codecs computed with torch where the gradient lies (a GPU), so that only
their bytes are copied to the host: half of float32's for ``bf16``/``fp16``, a quarter (and a
scale per part) for ``int8``, 2 % for ``topk``.

``DeviceEncoder`` does for a partition's gradient put what ``Movements.publish`` does on the
host, part by part as the engine's ``GradientPutPlan`` cuts it: adds the error feedback
residual (kept on the device) to the part, makes the codec's stream (the bytes
``Codec.encode`` writes after the block header), and keeps as residual what decoding that
stream loses. The streams go down in one copy, and the engine writes each block's header
around its stream (``ConnectedParameter.put_gradients(EncodedGradient)``). The result is bit for bit
what the host codec makes of the same gradient and residual, which the tests check over
awkward values; what each format takes care of:

- ``bf16`` (and ``bf16-lz4``'s byte-shuffled stream, which the engine then lz4-compresses
  on the host): rounded to nearest even by integer arithmetic on the float32 bits, as
  ml_dtypes' cast does (subnormals kept, overflow to Inf); a NaN becomes the quiet NaN of
  its sign (``0x7FC0``), where torch's own cast would drop the sign.
- ``fp16``: torch's cast (IEEE round to nearest even, subnormals kept, on the CPU and in
  CUDA) with a NaN made the canonical quiet NaN of its sign (``0x7E00``); a finite value
  that rounds to Inf (|x| >= 65520) raises ``CodecOverflowError`` as the host codec does.
- ``int8``: the scale as ``ScaledInt8.scale`` computes it (the largest magnitude, divided
  by 127 in float64, rounded to float32 and up to the next float32 where that rounded
  down, capped), each value divided by it (a true float32 division, not a multiply by
  the inverse) and rounded half to even; NaN scale and zero codes for a part holding
  NaN or Inf, zero codes for a part of zeros.
- ``topk``: the k = ceil(length / 100) largest magnitudes, ties at the k-th broken towards
  the lower index, as ``TopK``'s passes choose; NaN at the first k places for a part
  holding NaN or Inf.

Nothing here waits for the device until the copy down, except ``fp16``, which looks once
per put whether any value overflowed. Torch is imported by the caller (``TorchModel``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from allreduce_param.engine.blocks.codec.topk import TopK
from allreduce_param.engine.encoded import GradientPutPlan
from allreduce_param.errors import CodecOverflowError, ConfigurationError

#: the gradient codecs whose value format runs on the device
DEVICE_CODECS = ("bf16", "fp16", "bf16-lz4", "int8", "topk")

_INT8_LARGEST_SCALE = float(np.nextafter(np.float32(np.finfo(np.float32).max) / 127, 0))
_FP16_OVERFLOW_BITS = 0x477FF000  # 65520: rounds to Inf in fp16
_F32_INF_BITS = 0x7F800000
_F32_ABS_MASK = 0x7FFFFFFF


def _le_bytes(torch, words, width: int):
    """The ``width`` low bytes of each int32 of ``words``, little-endian, as uint8."""
    return (
        torch.stack([(words >> (8 * i)) & 0xFF for i in range(width)], dim=1)
        .reshape(-1)
        .to(torch.uint8)
    )


def _bf16_bits(torch, values):
    """bfloat16 bits (int32, 16 valid bits) of float32 ``values``, as ml_dtypes rounds them."""
    bits = values.view(torch.int32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) & 0xFFFF
    nan = ((bits >> 16) & 0x8000) | 0x7FC0
    return torch.where(torch.isnan(values), nan, rounded)


def _bf16_decoded(torch, words):
    """The float32 values of bfloat16 bits: exact."""
    return (words << 16).view(torch.float32)


def bf16(torch, values, checks: list) -> tuple:
    words = _bf16_bits(torch, values)
    return _le_bytes(torch, words, 2), _bf16_decoded(torch, words)


def shuffled_bf16(torch, values, checks: list) -> tuple:
    words = _bf16_bits(torch, values)
    stream = torch.cat([(words >> 8) & 0xFF, words & 0xFF]).to(torch.uint8)
    return stream, _bf16_decoded(torch, words)


def fp16(torch, values, checks: list) -> tuple:
    magnitude = values.view(torch.int32) & _F32_ABS_MASK
    checks.append(((magnitude >= _FP16_OVERFLOW_BITS) & (magnitude < _F32_INF_BITS)).any())
    half = values.to(torch.float16)
    words = half.view(torch.int16).to(torch.int32) & 0xFFFF
    nan = ((values.view(torch.int32) >> 16) & 0x8000) | 0x7E00
    words = torch.where(torch.isnan(values), nan, words)
    return _le_bytes(torch, words, 2), half.to(torch.float32)


def int8(torch, values, checks: list) -> tuple:
    largest = values.abs().amax().double()  # NaN where any is (amax keeps a NaN)
    scale = (largest / 127).float()  # to nearest, as the host's float64 division and cast
    up = torch.nextafter(scale, torch.full_like(scale, float("inf")))
    scale = torch.where(scale.double() * 127 < largest, up, scale)
    scale = torch.clamp(scale, max=_INT8_LARGEST_SCALE)
    scale = torch.where(torch.isfinite(largest), scale, torch.full_like(scale, float("nan")))
    positive = scale > 0
    divisor = torch.where(positive, scale, torch.ones_like(scale))
    codes = torch.round(values / divisor)  # half to even, as np.rint
    codes = torch.where(positive, codes, torch.zeros_like(codes)).to(torch.int8)
    stream = torch.cat([scale.reshape(1).view(torch.uint8), codes.view(torch.uint8)])
    return stream, codes.to(torch.float32) * scale


def topk(torch, values, checks: list) -> tuple:
    n = values.numel()
    k = TopK().kept(n)
    magnitude = values.abs()
    kth = torch.topk(magnitude, k, sorted=False).values.min()
    above = magnitude > kth
    tied = magnitude == kth
    need = k - above.sum()
    keep = above | (tied & (torch.cumsum(tied, 0) <= need))  # the first ties, by index
    places = torch.where(keep, torch.cumsum(keep, 0) - 1, k)  # the unkept all go to place k
    positions = torch.arange(n, device=values.device)
    indices = torch.zeros(k + 1, dtype=torch.int64, device=values.device)
    indices = indices.scatter_(0, places, positions)[:k]
    bad = ~torch.isfinite(values).all()  # NaN or Inf: NaN at the first k places
    indices = torch.where(bad, positions[:k], indices)
    kept = torch.where(bad, torch.full((k,), float("nan"), device=values.device), values[indices])
    stream = torch.cat([_le_bytes(torch, indices.to(torch.int32), 4), kept.view(torch.uint8)])
    decoded = torch.zeros_like(values).scatter_(0, indices, kept)
    return stream, decoded


#: each device codec's format: ``(torch, part values, checks) -> (stream uint8, decoded)``
FORMATS: dict[str, Callable] = {
    "bf16": bf16,
    "fp16": fp16,
    "bf16-lz4": shuffled_bf16,
    "int8": int8,
    "topk": topk,
}


def device_refusal(codec: str, put_refusal: str | None = None) -> str | None:
    """Why a gradient put in ``codec`` cannot be encoded on the device, None if it can: the
    codec has no device format, or the parameter's put takes no pre-encoded parts
    (``put_refusal``: a ``GradientPutPlan``'s ``refusal``). The one place that decides it:
    ``DeviceEncoder``, ``TorchModel.device_encoder`` and the fit's checks
    (``train/task/device_encoding.py``, with the plan's codec alone on the driver) ask here."""
    if codec not in DEVICE_CODECS:
        return (
            f"the gradient codec {codec!r} has no device encoding (those that do: "
            f"{', '.join(DEVICE_CODECS)})"
        )
    if put_refusal is not None:
        return f"the parameter's put takes no pre-encoded parts ({put_refusal})"
    return None


class DeviceEncoder:
    """One partition's gradient puts encoded on ``device``, as ``plan`` (the engine's
    ``info.gradient_put_plan``) cuts them; holds the error feedback residual there (zeros at
    first) and a host buffer the payload lands in (pinned on a GPU).

    ``encode(gradient)`` takes the step's flat float32 gradient on the device and returns
    the payload for ``put_gradients(EncodedGradient)`` (a uint8 numpy view of the host buffer, valid
    until the next ``encode``). Streamed (``stream_gradients(encoded=True)``), the same is done
    owner by owner as backward finishes each owner's range (``transfers.EncodedCopies``):
    ``encode_owner`` encodes an owner's parts and starts copying their bytes down,
    ``owner_payload`` is where they land, ``check_owner`` raises what ``encode`` would have.
    The same parts are encoded in the same order of values either way: the same bits."""

    def __init__(self, torch: Any, device: Any, plan: GradientPutPlan) -> None:
        refusal = device_refusal(plan.codec, plan.refusal)
        if refusal is not None:
            raise ConfigurationError(f"the gradient cannot be encoded on the device: {refusal}")
        self.torch, self.device, self.plan = torch, device, plan
        self._format = FORMATS[plan.codec]
        pinned = device.type == "cuda"
        self.residual = torch.zeros(plan.size, dtype=torch.float32, device=device)
        self._payload = torch.empty(plan.payload_bytes, dtype=torch.uint8, device=device)
        self._host = torch.empty(plan.payload_bytes, dtype=torch.uint8, pin_memory=pinned)
        # each owner's parts, their first index in plan.parts, and where their bytes lie
        self._owners = [plan.parts_of(owner) for owner in range(plan.owners)]
        self._first = np.cumsum([0] + [len(parts) for parts in self._owners]).tolist()
        self._spans = [plan.owner_span(owner) for owner in range(plan.owners)]
        # fp16: whether each part overflowed, copied down with its bytes when streamed
        self._flags = (
            torch.zeros(len(plan.parts), dtype=torch.bool, pin_memory=pinned)
            if plan.codec == "fp16"
            else None
        )
        self._gradient = None  # streamed: the flat gradient on the device, made at first use

    def encode(self, gradient: Any) -> np.ndarray:
        """Add each part of ``gradient`` (flat float32, ``plan.size``, on the device) to the
        residual, encode it into the payload, keep what decoding lost as the residual; copy
        the payload down. ``CodecOverflowError`` (fp16) names the first value it cannot hold."""
        torch, plan = self.torch, self.plan
        if tuple(gradient.shape) != (plan.size,) or gradient.dtype != torch.float32:
            raise ConfigurationError(
                f"DeviceEncoder.encode: a flat float32 gradient of {plan.size} values, got "
                f"{gradient.dtype} {tuple(gradient.shape)}"
            )
        checks = self._encode_parts(gradient, plan.parts)
        if any(check is not None for check in checks):
            # one wait for the device per put
            flags = torch.stack([c for c in checks if c is not None]).cpu().numpy()
            self._raise_overflow([p for p in plan.parts if p.length], flags)
        self._host.copy_(self._payload)
        return self.payload

    @property
    def gradient(self) -> Any:
        """A flat float32 device vector of ``plan.size`` that a streamed call assembles the
        gradient in (made at the first use, the same one after)."""
        if self._gradient is None:
            torch = self.torch
            self._gradient = torch.empty(self.plan.size, dtype=torch.float32, device=self.device)
        return self._gradient

    def encode_owner(self, owner: int, gradient: Any) -> None:
        """``encode`` of ``owner``'s parts alone, from ``gradient`` (flat, final in the
        owner's range), queued on the current stream: the residual updated, the bytes (and
        fp16's overflow flags) copied into the host buffer without waiting; they are there
        (``owner_payload``) once the stream has passed this point."""
        parts, span = self._owners[owner], self._spans[owner]
        checks = self._encode_parts(gradient, parts)
        stop = span[0] + span[1]
        self._host[span[0] : stop].copy_(self._payload[span[0] : stop], non_blocking=True)
        if self._flags is not None and checks[0] is not None:  # fp16, an owner with values
            first = self._first[owner]
            flags = self._flags[first : first + len(parts)]
            flags.copy_(self.torch.stack(checks), non_blocking=True)

    @property
    def payload(self) -> np.ndarray:
        """The host buffer the payload lands in, as a uint8 numpy view (what ``encode``
        returns)."""
        return self._host.numpy()

    def owner_payload(self, owner: int) -> np.ndarray:
        """The host bytes of ``owner``'s parts (what ``EncodedStream.ready`` takes): a view of
        the host buffer, valid once ``encode_owner``'s copy landed, until the next call."""
        offset, nbytes = self._spans[owner]
        return self._host.numpy()[offset : offset + nbytes]

    def check_owner(self, owner: int) -> None:
        """Once ``encode_owner``'s copy landed: raise ``CodecOverflowError`` (fp16) for a value
        of the owner's parts that it could not hold, as ``encode`` does."""
        parts = self._owners[owner]
        if self._flags is not None and parts[0].length:
            first = self._first[owner]
            self._raise_overflow(parts, self._flags[first : first + len(parts)].numpy())

    def _encode_parts(self, gradient: Any, parts) -> list:
        """Encode ``parts`` of ``gradient`` into the payload on the device, updating the
        residual; each part's overflow check (a device bool, fp16) or None."""
        checks: list = []
        with self.torch.no_grad():
            for part in parts:
                if not part.length:
                    checks.append(None)
                    continue
                stop = part.start + part.length
                values = self.residual[part.start : stop].add_(gradient[part.start : stop])
                check: list = []
                stream, decoded = self._format(self.torch, values, check)
                self._payload[part.offset : part.offset + part.nbytes].copy_(stream)
                values.sub_(decoded)
                checks.append(check[0] if check else None)
        return checks

    def _raise_overflow(self, parts, flags: np.ndarray) -> None:
        """Raise for the first of ``parts`` (those with values) where fp16 rounded a finite
        value to Inf, as ``flags`` say."""
        if not flags.any():
            return
        part = parts[int(flags.argmax())]
        # the values as sent: the residual now holds sent - decoded, so take them again
        sent = (self.residual[part.start : part.start + part.length]).cpu().numpy()
        magnitude = sent.view(np.uint32) & _F32_ABS_MASK
        bad = int(np.argmax(magnitude >= _FP16_OVERFLOW_BITS))
        raise CodecOverflowError(
            f"fp16 cannot hold a value at index {bad} of part {part.part} of the gradient's "
            f"chunk for partition {part.owner} (largest finite fp16 is 65504): use codec "
            "'bf16' (float32's range at the same size) or scale the values down"
        )
