"""A gradient put of parts encoded elsewhere: the plan that says which parts a partition's
gradient is cut into and how many bytes each one's stream takes, for a caller that computes
the lossy codec's value format where the gradient lies (a GPU: ``models.device_codecs``) and
hands over only those bytes (``ConnectedParameter.put_gradients(EncodedGradient)``).

The caller does what ``Movements.publish`` does on the host for each part: adds its error
feedback residual to the part, makes the codec's stream (``Codec.encode_stream`` takes the
very bytes ``Codec.encode`` would have written after the header), and keeps as residual
what the stream's decoding lost. The engine then only writes each block's header around
its stream (and lz4-compresses it, for ``bf16-lz4``) into the store: the same blocks, so
the same bits summed.
"""

from __future__ import annotations

from dataclasses import dataclass

from allreduce_param.engine.blocks.codec import Codec
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.fetches import part_plan


@dataclass(frozen=True)
class EncodedPart:
    """One part of a gradient put: ``length`` values from ``start`` of the full vector,
    the ``part``-th of ``owner``'s chunk; its stream lies at ``payload[offset:offset+nbytes]``."""

    owner: int
    part: int
    start: int
    length: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GradientPutPlan:
    """How one partition's gradient put is cut: ``parts`` in vector order (owner by owner, each
    owner's chunk part by part), whose streams lie one after the other in a payload of
    ``payload_bytes``, encoded with ``codec`` (its name). ``refusal``: why this handle's
    puts take no pre-encoded payload (None: they do)."""

    codec: str
    size: int
    parts: tuple[EncodedPart, ...]
    payload_bytes: int
    refusal: str | None = None

    @classmethod
    def of(cls, layout: SliceLayout, codec: Codec, refusal: str | None = None) -> GradientPutPlan:
        """The plan of a put of a vector cut by ``layout`` into ``codec``'s blocks."""
        parts, offset = [], 0
        for owner, owned in enumerate(part_plan(layout)):
            base = layout.start(owner)
            for part, (start, length) in enumerate(owned):
                nbytes = codec.stream_size(length)
                parts.append(EncodedPart(owner, part, base + start, length, offset, nbytes))
                offset += nbytes
        return cls(codec.name, layout.size, tuple(parts), offset, refusal)

    @property
    def takes_payloads(self) -> bool:
        """Whether ``put_gradients(EncodedGradient)`` takes payloads made by this plan."""
        return self.refusal is None

    def parts_of(self, owner: int) -> tuple[EncodedPart, ...]:
        """``owner``'s parts, in order."""
        return tuple(part for part in self.parts if part.owner == owner)

    def owner_span(self, owner: int) -> tuple[int, int]:
        """``(offset, nbytes)``: where ``owner``'s parts' streams lie in the payload, one
        after the other (what ``EncodedStream.ready(owner, payload)`` takes)."""
        parts = self.parts_of(owner)
        return parts[0].offset, sum(part.nbytes for part in parts)

    def owner_bounds(self, owner: int) -> tuple[int, int]:
        """``(start, stop)``: the values of the vector ``owner``'s parts hold."""
        parts = self.parts_of(owner)
        return parts[0].start, parts[-1].start + parts[-1].length

    @property
    def owners(self) -> int:
        """How many owners the vector is cut for (the partitions)."""
        return self.parts[-1].owner + 1 if self.parts else 0

    @property
    def layout(self) -> SliceLayout:
        """The slices the vector is cut into, one per owner (what the plan was made of)."""
        return SliceLayout(self.size, self.owners)
