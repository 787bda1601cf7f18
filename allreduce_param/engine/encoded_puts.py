"""A partition's gradient put whose lossy codec ran elsewhere (a GPU): the parts' streams,
made there, published with only their block headers written here.

The plan (``encoded.GradientPutPlan``) says which parts a put is cut into and how many
bytes each stream takes; ``put`` publishes a whole payload at once, ``stream`` owner by
owner as the bytes are made (``stream.EncodedStream``). Both keep the call order of any
put (``step.StepState``) and publish the blocks ``GradientPuts.put`` would have made of the
values, so the same bits are summed. The rest of a put (the float32 gradients, streams of
them, touched elements) is ``gradients.GradientPuts``'s, whose publishing thread and
own-chunk prefetch a stream here shares.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from allreduce_param.engine.blocks.store import BlockKind
from allreduce_param.engine.encoded import GradientPutPlan
from allreduce_param.engine.gradients import GradientPuts
from allreduce_param.engine.stream import EncodedStream
from allreduce_param.engine.vectors import byte_payload
from allreduce_param.errors import InputError

#: The calls that take encoded gradients, as the errors name them.
PUT = "put_gradients(EncodedGradient)"
STREAM = "stream_gradients(encoded=True)"


class EncodedPuts:
    """One partition's puts of pre-encoded gradients, beside its float32 ``puts`` (whose
    movements, call order, guard and publishing thread they share)."""

    def __init__(self, puts: GradientPuts) -> None:
        self._puts = puts
        self._moves = puts.moves
        self._state = puts.state
        self.partition_id = puts.partition_id
        self._plan: GradientPutPlan | None = None

    def plan(self) -> GradientPutPlan:
        """The parts a put is cut into, their streams' sizes, and why pre-encoded payloads
        are refused here (a lossless gradient codec, a host arena), if they are: the same
        plan on every call."""
        if self._plan is None:
            codec = self._moves.codecs[BlockKind.GRADIENT]
            refusal = (
                f"its gradient codec {codec.name!r} is lossless, so there is no value format "
                "to compute elsewhere (only bf16, fp16, bf16-lz4, int8 and topk take streams)"
                if not codec.takes_streams
                else "its step goes through a host arena, which takes float32 gradients"
                if self._puts.arena is not None
                else None
            )
            self._plan = GradientPutPlan.of(self._puts.layout, codec, refusal)
        return self._plan

    def put(self, payload: np.ndarray, count: float, residual: np.ndarray | None = None) -> None:
        """Publish every owner's chunk from the streams in ``payload``, laid out as
        ``plan()`` says (``residual``: refused, the encoder keeps it)."""
        if residual is not None:
            raise InputError(
                f"{PUT} on partition {self.partition_id}: residual= is for a float32 "
                "gradient; an EncodedGradient's residual is the encoder's, kept where it was "
                "encoded"
            )
        plan, version, count = self._start(PUT, count)
        byte_payload(
            payload,
            plan.payload_bytes,
            f"{PUT} on partition {self.partition_id}",
            f"info.gradient_put_plan.payload_bytes: the {len(plan.parts)} parts' {plan.codec!r} "
            "streams one after the other",
        )
        self._state.put_started(version)
        with self._puts.guard():
            for owner in self._moves.scatter_order(own=True):
                self._moves.publish_streams(
                    BlockKind.GRADIENT, version, payload, plan.parts_of(owner), owner, count
                )
        self._state.put_done()

    def stream(self, count: float, gradients=None, residual=None) -> EncodedStream:
        """An ``EncodedStream`` that publishes each owner's chunk from its encoded bytes as
        soon as they are given, on the handle's publishing thread; under BSP (flat) this
        partition's own chunk starts being fetched from every peer at once, as a float32
        stream's does. The same blocks as ``put``. ``gradients``, ``residual``: refused
        (the bytes come through the stream's ``ready``)."""
        if gradients is not None or residual is not None:
            raise InputError(
                f"{STREAM} on partition {self.partition_id}: an encoded stream takes each "
                "owner's bytes from its ready(owner, payload), not gradients= or residual="
            )
        plan, version, count = self._start(STREAM, count)
        self._state.put_started(version)
        self._puts.prefetch(version)
        spans = {owner: plan.owner_span(owner) for owner in range(plan.owners)}
        # each owner's parts with their offsets counted from its own span's start
        parts = {
            owner: tuple(
                dataclasses.replace(part, offset=part.offset - spans[owner][0])
                for part in plan.parts_of(owner)
            )
            for owner in spans
        }

        def publish(owner: int, payload: np.ndarray) -> None:
            with self._puts.guard():
                self._moves.publish_streams(
                    BlockKind.GRADIENT, version, payload, parts[owner], owner, count
                )

        def closed(error: BaseException | None) -> None:
            self._state.stream_closed()
            if error is None:
                self._state.put_done()
            else:
                self._state.fail(error)

        self._state.stream_opened()
        return EncodedStream(
            spans,
            publish,
            self._puts.publishing_thread(),
            closed,
            f"{STREAM} on partition {self.partition_id}",
        )

    def _start(self, what: str, count: float) -> tuple[GradientPutPlan, int, float]:
        """Check a put of pre-encoded parts: the plan takes them, the call order, the count;
        the plan, the put's version and the count."""
        where = f"{what} on partition {self.partition_id}"
        plan = self.plan()
        if plan.refusal is not None:
            raise InputError(
                f"{where}: this parameter takes no pre-encoded gradients: {plan.refusal}; "
                "put the float32 gradient with put_gradients (with residual=)"
            )
        version = self._state.check_put(what.partition("(")[0])
        if not float(count) >= 0:
            raise InputError(f"{where}: count={count!r}; the sample count must be a number >= 0")
        return plan, version, float(count)
