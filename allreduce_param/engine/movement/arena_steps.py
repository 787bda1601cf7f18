"""The BSP step through the host arena: no blocks, no requests, no copies but the sums.

Where every partition is on one host under plain BSP with a lossless codec
(``peers.PeerGroup.arena``), a step's movements read and write the host arena
(``blocks/arena.py``) instead of the block store:

- the weights: each owner's slice *is* its part of the one weight vector, updated where it
  lies (``own_slice``); ``publish_weights`` only sets its version word; ``gather`` waits
  for every slice's word and hands out the whole vector read-only, or copies it out;
- the gradients: ``put`` writes (or, for the lent ``gradient_buffer()``, finds) the
  gradient in this partition's vector of the arena and sets its word (of a vector of the
  caller's, only the peers' chunks are copied: the own chunk is summed from the caller's
  vector, as ``Movements.reduce`` sums it); ``reduce`` waits for every partition's word
  and sums the own chunk straight from their vectors with ``sums.sum_in_order``, in the
  order ``Movements.reduce`` sums, so the bits are the same.

Hierarchical (several hosts, each with its arena, made by its leader), the same arena is
what the leader fills from and publishes to, so no partition copies what the leader fetched:

- the gradients: every partition puts into the arena as above; the leader sums its host's
  chunks for every owner straight from the arena (``HostSums.host_chunks``, in the order
  ``HostSums._sum_host`` sums fetched blocks: the same bits) and exchanges the host sums
  with the other leaders as blocks; each owner then sums the H host sums from its leader
  (``Movements.reduce``);
- the weights: each owner updates its slice in the arena as above; the leader publishes
  its host's slices from the arena as blocks for the other leaders (under their owners'
  keys, as a relay would), fetches the other hosts' slices from their leaders straight
  into the arena's weight vector and sets their version words for them
  (``HostArena.writers``); every partition of the host reads the vector as above.

Why nothing is overwritten while read: a partition puts gradient t only after its
``get_weights`` of t, which waits for every owner's weights t, which each owner sends only
after its sum of gradient t-1 read every partition's vector; and an owner changes its
slice only after its sum of gradient t, which waited for every partition's put of t,
which each makes after it has done with the weights of t.
"""

from __future__ import annotations

import numpy as np

from allreduce_param.engine.blocks.arena import HostArena
from allreduce_param.engine.blocks.arena_signals import GRADIENT, WEIGHT
from allreduce_param.engine.blocks.store import EVERY_PARTITION, BlockKind
from allreduce_param.engine.layout import HostLayout, SliceLayout, split
from allreduce_param.engine.movement.fetches import part_plan, place_slices
from allreduce_param.engine.movement.movements import Movements
from allreduce_param.engine.movement.peers import PART_LENGTH
from allreduce_param.engine.movement.sums import NonFiniteSum, sum_in_order
from allreduce_param.engine.strategy import WeightRead


class _Ready:
    """A part as ``sum_in_order`` takes it (a done fetch's ``result()``), with no future."""

    __slots__ = ("_value",)

    def __init__(self, value: tuple) -> None:
        self._value = value

    def result(self) -> tuple:
        return self._value


class ArenaSteps:
    """One partition's BSP step through its host's ``arena``; with ``moves`` (hierarchical:
    its peer group's hosts exchange through their leaders) the host sums and the other
    hosts' slices travel as blocks between the leaders (see the module)."""

    @classmethod
    def of(cls, moves: Movements, layout: SliceLayout) -> ArenaSteps | None:
        """The step through the arena of ``moves``'s peer group, if it has one (else None:
        the step moves blocks)."""
        peers = moves.peers
        if peers.arena is None:
            return None
        hierarchical = moves if peers.hierarchical else None
        return cls(peers.arena, layout, peers.hosts, peers.partition_id, hierarchical)

    def __init__(
        self,
        arena: HostArena,
        layout: SliceLayout,
        hosts: HostLayout,
        partition_id: int,
        moves: Movements | None = None,
    ) -> None:
        self.arena = arena
        self.layout = layout
        self.partition_id = partition_id
        self._bounds = layout.bounds(partition_id)
        self._groups = hosts.grouped(range(layout.partition_num))
        self._parts = list(split(layout.length(partition_id), PART_LENGTH))
        self._moves = moves
        self._hosts = hosts
        self._members = hosts.host(partition_id)
        #: the other hosts' partitions, whose slices this host's leader brings
        self._remote = [
            p for p in range(layout.partition_num) if hosts.leader(p) != self._members[0]
        ]
        self._leads = moves is not None and self._members[0] == partition_id
        #: a caller's vector's own chunk, summed from where it lies (``put``), else None
        self._own_chunk: np.ndarray | None = None
        if self._leads:
            moves.host_sums.host_chunks = self._host_chunks

    def summed_slice(self) -> np.ndarray | None:
        """Where this partition's slice of the mean gradient is summed (what
        ``aggregate_gradient_partition`` returns): on one host, the own slice of its own gradient vector in the
        arena, which no peer reads, so a host holds one gradient vector per partition and no
        more; the next put overwrites it. Hierarchical (the leader sends the host sums from
        the blocks' store): None, a vector of its own."""
        if self._moves is not None:
            return None
        return self.arena.summing_view(self.partition_id, self._bounds)

    # ---- the weights ---------------------------------------------------------------------

    def own_slice(self) -> np.ndarray:
        """This partition's slice of the host's weight vector, writable: the owner's
        ``weight_partition``, updated where the peers read it."""
        return self.arena.weights[self._bounds]

    def publish_weights(self, version: int) -> None:
        """The own slice now holds ``version``: say so (nothing is copied)."""
        self.arena.publish(WEIGHT, version)

    def gather(self, version: int, out: np.ndarray | None) -> np.ndarray:
        """Wait for every slice of ``version``; the whole vector, read-only (valid until
        this partition's next put, after which the owners update it), or copied into ``out``.
        A hierarchical leader first brings the other hosts' slices (``_bring``)."""
        if self._leads:
            self._bring(version)
        self.arena.wait(WEIGHT, version)
        if out is not None:
            np.copyto(out, self.arena.weights)
            return out
        view = self.arena.weights.view()
        view.flags.writeable = False
        return view

    def _bring(self, version: int) -> None:
        """A hierarchical leader's share of the gather: its host's slices of ``version``,
        once whole in the arena, published as blocks for the other leaders (with the raw
        codec, where they lie: only headers are written, and the bytes are sent from the
        arena, sealed, as any block that leaves the host); the other hosts' fetched from
        their leaders into their places in the arena (checked as any fetch), then their
        words set for this host.

        A slice published where it lies stays unchanged while the other leaders read it:
        its owner updates it after its sum of this step's gradients, which needs every
        leader's host sum, which each makes after its own host has put, so after its own
        ``get_weights``, which read these blocks."""
        arena, moves, layout = self.arena, self._moves, self.layout
        arena.wait(WEIGHT, version, self._members)
        in_place = moves.codecs[BlockKind.WEIGHT].publishes_in_place
        for owner in self._members:
            values = arena.weights[layout.bounds(owner)]
            if in_place:
                moves.publish_in_place(
                    BlockKind.WEIGHT,
                    version,
                    memoryview(values).cast("B"),
                    EVERY_PARTITION,
                    0.0,
                    source=owner,
                )
            else:
                moves.publish(BlockKind.WEIGHT, version, values, source=owner)
        if not self._remote:
            return
        pending = moves.fetcher.fetch_slices(
            BlockKind.WEIGHT,
            WeightRead(version, exact=True),
            layout,
            arena.weights,
            sources=self._remote,
            via=self._hosts.leader,
        )
        place_slices(pending, layout, arena.weights, self._remote)
        arena.publish_for(self._remote, WEIGHT, version)

    # ---- the gradients -------------------------------------------------------------------

    def put(
        self, vector: np.ndarray, count: float, version: int, residual: np.ndarray | None
    ) -> None:
        """Make ``vector`` (and ``residual``, as ``Movements.publish`` adds it to the
        chunks it publishes: not the own, which the reduce sums as it is) this
        partition's gradient of ``version`` in the arena, and say so. Of a vector of the
        caller's (not the lent ``gradient_buffer()``), on one host, the own chunk is not
        copied: ``reduce`` sums it where it lies, so it must stay unchanged until then."""
        target = self.arena.gradient(self.partition_id)
        self._own_chunk = None
        if vector.ctypes.data != target.ctypes.data:
            if self._moves is None:
                # one host: only this partition sums its own chunk, so it stays where the
                # caller has it (unchanged until the aggregate, as put_gradients asks) and
                # only the peers' chunks are copied: S/N less to copy and to read back
                start, stop = self._bounds.start, self._bounds.stop
                np.copyto(target[:start], vector[:start])
                np.copyto(target[stop:], vector[stop:])
                self._own_chunk = vector[self._bounds]
            else:  # a hierarchical leader sums every member's chunks from the arena
                np.copyto(target, vector)
        if residual is not None:
            for owner in range(self.layout.partition_num):
                if owner != self.partition_id:
                    bounds = self.layout.bounds(owner)
                    sent = np.add(residual[bounds], target[bounds], out=target[bounds])
                    # what a lossless codec leaves of the residual: the sent less itself
                    np.subtract(sent, sent, out=residual[bounds])
        self.arena.publish(GRADIENT, version, count=count)

    def reduce(
        self,
        version: int,
        out: np.ndarray,
        divisor,
        check: NonFiniteSum | None,
    ) -> float:
        """Wait for every partition's gradient of ``version`` and sum the own chunk of each
        into ``out`` in the hosts' order (``sums.sum_in_order``); the summed counts.
        Hierarchical, the host sums are summed (``Movements.reduce``), a leader's made
        from the arena (``_host_chunks``)."""
        if self._moves is not None:
            return self._moves.reduce(
                BlockKind.GRADIENT, version, self.layout, out, divisor=divisor, check=check
            )
        arena, bounds = self.arena, self._bounds
        own_chunk, self._own_chunk = self._own_chunk, None
        arena.wait(GRADIENT, version)
        pending = {}
        for source in range(self.layout.partition_num):
            chunk, count = arena.gradient(source)[bounds], arena.count(source)
            if source == self.partition_id and own_chunk is not None:
                chunk = own_chunk
            pending[source] = [
                _Ready((version, count, chunk[start : start + length], None))
                for start, length in self._parts
            ]
        # ``out`` may be the own chunk of the own vector (``summed_slice``), a source too,
        # unless the own chunk is summed from the caller's vector
        return sum_in_order(
            pending, self._groups, out, divisor, check, out_is_a_source=own_chunk is None
        )

    def _host_chunks(self, version: int, members: tuple, owners: list) -> dict:
        """A hierarchical leader's host chunks of ``version`` (``HostSums.host_chunks``):
        once every partition of the host has put, each member's chunk for each owner, read
        in the arena, part by part as a fetch would give them."""
        arena, layout, plan = self.arena, self.layout, part_plan(self.layout)
        arena.wait(GRADIENT, version, members)
        chunks = {}
        for member in members:
            vector, count = arena.gradient(member), arena.count(member)
            for owner in owners:
                chunk = vector[layout.bounds(owner)]
                chunks[(member, owner)] = [
                    _Ready((version, count, chunk[start : start + length], None))
                    for start, length in plan[owner]
                ]
        return chunks
