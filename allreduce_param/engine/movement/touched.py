"""The touched-elements sync: a gradient that is zero outside a few elements
(``vectors.SparseGradient``) put and summed as (index, value) pairs, not as dense chunks.

A step of a wide sparse model touches few rows of its first layer (at 2^24 features a
batch of 4,096 click-log rows touches 0.13 % of them), yet a dense put moves, and an owner
sums, every element. Here a put is two movements:

1. The capacities (``capacities``): every partition learns how many pairs each partition
   sends each owner, from one exact allreduce of an N x N table of counts (the caller's
   ``exchange``: ``Collectives.allreduce_exact``), so that all blocks for owner ``j`` have
   one length, known before they are fetched: ``1 + 2 K_j`` float32 words, ``K_j`` the
   most pairs any partition sends ``j``.
2. The pairs (``TouchedMoves.scatter``): owner ``j``'s as one gradient block of that
   length (``pack``): word 0 the pair count ``k`` (uint32 bits), words ``1..k`` the
   indices within ``j``'s slice (uint32 bits, increasing), words ``K+1..K+k`` their
   values, zeros after. The block travels with the gradient codec, which must be lossless.

The owner fetches its block from every peer (its own pairs it takes from the caller, as
a dense put's own chunk), checks each (``unpack``: a count, indices out of range or out of
order are a ``CorruptBlockError``), and sums them in the hosts' order into its dense slice
(``sums.sum_touched_in_order``): the bits the dense sync gives, where the weights' side,
the optimizer and everything after it are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from allreduce_param.engine.blocks.store import BlockKind
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.movements import Movements
from allreduce_param.engine.movement.sums import NonFiniteSum, sum_touched_in_order
from allreduce_param.engine.vectors import SparseGradient
from allreduce_param.errors import CorruptBlockError

#: Owner ``j``'s pairs: indices within its slice (uint32, increasing) and their values.
Pairs = tuple[np.ndarray, np.ndarray]


class BlockLengths(NamedTuple):
    """The length of the blocks for each owner, as a ``SliceLayout`` gives its slices': what
    the fetcher plans a touched block's parts by (``fetches.part_plan``)."""

    lengths: tuple[int, ...]

    @property
    def partition_num(self) -> int:
        return len(self.lengths)

    def length(self, partition_id: int) -> int:
        return self.lengths[partition_id]


def by_owner(gradient: SparseGradient, layout: SliceLayout) -> list[Pairs]:
    """``gradient``'s pairs cut at the owners' slices, indices made slice-relative."""
    starts = [layout.start(j) for j in range(layout.partition_num)]
    cuts = np.searchsorted(gradient.indices, [*starts, layout.size])
    return [
        (
            (gradient.indices[cuts[j] : cuts[j + 1]] - starts[j]).astype(np.uint32),
            gradient.values[cuts[j] : cuts[j + 1]],
        )
        for j in range(layout.partition_num)
    ]


def capacities(
    counts: list[int], partition_id: int, exchange: Callable[[np.ndarray], np.ndarray]
) -> list[int]:
    """``K_j`` for each owner ``j``: the most pairs any partition sends it, from this
    partition's ``counts`` (pairs per owner) and everyone's, through ``exchange``."""
    partitions = len(counts)
    table = np.zeros((partitions, partitions))
    table[partition_id] = counts
    everyone = np.asarray(exchange(table.ravel())).reshape(partitions, partitions)
    return [int(most) for most in everyone.max(axis=0)]


def pack(pairs: Pairs, capacity: int) -> np.ndarray:
    """One block's words (see the module): the pair count, the indices, the values."""
    indices, values = pairs
    block = np.zeros(1 + 2 * capacity, np.float32)
    words = block.view(np.uint32)
    words[0] = indices.size
    words[1 : 1 + indices.size] = indices
    block[1 + capacity : 1 + capacity + values.size] = values
    return block


def unpack(block: np.ndarray, capacity: int, slice_length: int, what: str) -> Pairs:
    """``pack``'s pairs back, checked: a count above ``capacity``, an index outside the
    slice or indices out of order are a ``CorruptBlockError`` naming ``what``."""
    words = block.view(np.uint32)
    count = int(words[0])
    if count > capacity:
        raise CorruptBlockError(
            f"{what}: it says {count} touched elements, more than its room for {capacity}"
        )
    indices, values = words[1 : 1 + count], block[1 + capacity : 1 + capacity + count]
    if count and ((indices[1:] <= indices[:-1]).any() or indices[-1] >= slice_length):
        raise CorruptBlockError(
            f"{what}: its touched indices are out of order or past the slice's "
            f"{slice_length} elements"
        )
    return indices, values


class TouchedPut(NamedTuple):
    """What a touched put leaves for the step's aggregate: the own pairs and count, and
    every owner's capacity."""

    own: Pairs
    count: float
    capacities: list[int]


class TouchedMoves:
    """One partition's touched-elements puts and sums, through its ``Movements``."""

    def __init__(self, moves: Movements) -> None:
        self._moves = moves
        self.partition_id = moves.partition_id

    def scatter(
        self,
        version: int,
        gradient: SparseGradient,
        layout: SliceLayout,
        count: float,
        exchange: Callable[[np.ndarray], np.ndarray],
    ) -> TouchedPut:
        """Learn the capacities, then publish each peer owner's pairs as ``version``; the own
        owner's are kept for ``reduce``."""
        pairs = by_owner(gradient, layout)
        room = capacities([len(indices) for indices, _ in pairs], self.partition_id, exchange)
        for owner in self._moves.scatter_order(own=False):
            self._moves.publish(
                BlockKind.GRADIENT,
                version,
                pack(pairs[owner], room[owner]),
                destination=owner,
                count=count,
            )
        return TouchedPut(pairs[self.partition_id], count, room)

    def reduce(
        self,
        version: int,
        layout: SliceLayout,
        put: TouchedPut,
        out: np.ndarray,
        divisor: Callable[[float], float | None] | None = None,
        check: NonFiniteSum | None = None,
    ) -> float:
        """Fetch the own block of ``version`` from every peer and sum every partition's pairs
        into ``out`` (the own slice), in the hosts' order; the summed counts. Every fetch is
        waited for before an error is raised, so none is left running."""
        me, moves = self.partition_id, self._moves
        lengths = BlockLengths(tuple(1 + 2 * capacity for capacity in put.capacities))
        peers = [j for j in range(moves.partition_num) if j != me]
        pending = moves.fetcher.fetch_own_chunks(
            BlockKind.GRADIENT, version, lengths, peers, at_once=True
        )
        pairs: dict[int, tuple[np.ndarray, np.ndarray, float]] = {me: (*put.own, put.count)}
        failure: BaseException | None = None
        for source in peers:
            try:
                pairs[source] = self._received(source, version, pending[source], put, layout)
            except BaseException as error:  # noqa: BLE001 - raised once every fetch is done
                failure = failure or error
        if failure is not None:
            raise failure
        groups = moves.peers.hosts.grouped(range(moves.partition_num))
        return sum_touched_in_order(pairs, groups, out, divisor, check)

    def _received(
        self, source: int, version: int, futures: list, put: TouchedPut, layout: SliceLayout
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """``source``'s block for this owner, its parts joined and unpacked: its pairs, count."""
        parts, count, rechecks = [], 0.0, []
        failure: BaseException | None = None
        for future in futures:
            try:
                _, count, values, recheck = future.result()
            except BaseException as error:  # noqa: BLE001 - the later parts fail with it
                failure = failure or error
                continue
            parts.append(np.array(values, copy=True))
            if recheck is not None:
                rechecks.append(recheck)
        if failure is not None:
            raise failure
        for recheck in rechecks:
            recheck()
        block = np.concatenate(parts) if len(parts) > 1 else parts[0]
        what = f"the touched gradient block from partition {source}, version {version}"
        indices, values = unpack(
            block, put.capacities[self.partition_id], layout.length(self.partition_id), what
        )
        return indices, values, count
