"""HostSums: a hierarchical reduce, each host's sum of every owner's chunk made once, by its leader.

Hierarchical (``peers.PeerGroup.hierarchical``), a host's leader fetches its host's chunks
for every owner, sums them in partition order and publishes each sum for its owner (the
other hosts' first, for their leaders to fetch), while the other hosts' sums for this host's
owners are relayed into its own store (``relays.Relays``); every partition then sums the
hosts' sums of its own chunk, in host order (``layout.HostLayout``), read from its leader.
Each element is still summed in the one order, so every partition ends with the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from allreduce_param.engine.blocks.store import BlockKind
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.fetches import Fetcher
from allreduce_param.engine.movement.peers import PeerGroup
from allreduce_param.engine.movement.relays import Relays
from allreduce_param.engine.movement.sums import NonFiniteSum, sum_in_order
from allreduce_param.engine.strategy import WeightRead


class HostSums:
    """One partition's share of hierarchical reduces through its ``PeerGroup``: ``fetcher``
    and ``relays`` move the blocks, ``publish(kind, version, values, destination=,
    count=)`` (``Movements.publish``) publishes a leader's sums."""

    def __init__(
        self,
        peers: PeerGroup,
        fetcher: Fetcher,
        relays: Relays,
        publish: Callable[..., None],
    ) -> None:
        self.peers = peers
        self.partition_id = peers.partition_id
        self.partition_num = peers.partition_num
        self._fetcher = fetcher
        self._relays = relays
        self._publish = publish
        self._host_sums: np.ndarray | None = None  # a leader's sums of its host's chunks
        #: hierarchical through a host arena (``arena_steps.ArenaSteps``): a leader's source of
        #: its host's gradient chunks, ``host_chunks(version, members, owners)``, instead of
        #: fetching blocks (the same parts, summed in the same order)
        self.host_chunks: Callable[[int, tuple, list], dict] | None = None

    def reduce(
        self,
        kind: int,
        version: int,
        layout: SliceLayout,
        out: np.ndarray,
        divisor: Callable[[float], float | None] | None,
        check: NonFiniteSum | None,
    ) -> float:
        """The hierarchical ``Movements.reduce``: every host's sum of the own chunk, in host
        order, read from this host's leader (which relayed the other hosts' from their
        leaders); a leader first makes its host's sums (``_sum_host``)."""
        hosts, read = self.peers.hosts, WeightRead(version, exact=True)
        leader = hosts.leader(self.partition_id)
        if leader == self.partition_id:
            self._sum_host(kind, read, layout, check)
        pending = self._fetcher.fetch_all(
            self.peers.worker,
            BlockKind.HOST_SUM[kind],
            read,
            layout,
            self.partition_id,
            sources=hosts.leaders,
            via=lambda source: leader,
        )
        names = [f"a partition of {list(members)}" for members in hosts.hosts]
        return sum_in_order(pending, [(p,) for p in hosts.leaders], out, divisor, check, names)

    def _sum_host(
        self, kind: int, read: WeightRead, layout: SliceLayout, check: NonFiniteSum | None
    ) -> None:
        """A leader's share of a hierarchical reduce: for every owner, the sum of its chunk over
        this host's partitions, published for the owner (the other hosts' first, for their
        leaders to fetch); meanwhile the other hosts' sums for this host's owners are relayed
        here. Returns once both are in the own store."""
        hosts, worker, me = self.peers.hosts, self.peers.worker, self.partition_id
        members = hosts.host(me)
        owners = [j for j in range(self.partition_num) if hosts.leader(j) != me] + list(members)
        if kind == BlockKind.GRADIENT and self.host_chunks is not None:
            chunks = self.host_chunks(read.version, members, owners)
        else:
            chunks = self._fetcher.fetch_blocks(
                worker, kind, read, layout, [(m, j) for m in members for j in owners]
            )
        host_sum = BlockKind.HOST_SUM[kind]
        relayed = self._relays.start(
            worker,
            host_sum,
            read,
            layout,
            [(leader, j) for leader in hosts.leaders if leader != me for j in members],
        )
        sums = self._host_sums
        if sums is None or sums.size != layout.size:
            sums = self._host_sums = np.empty(layout.size, dtype=np.float32)
        for owner in owners:
            partial = sums[layout.bounds(owner)]
            count = sum_in_order(
                {m: chunks[(m, owner)] for m in members},
                hosts.grouped(members),
                partial,
                check=None if check is None else NonFiniteSum(check.version, layout.start(owner)),
            )
            self._publish(host_sum, read.version, partial, destination=owner, count=count)
        for done in relayed:
            done.result()
