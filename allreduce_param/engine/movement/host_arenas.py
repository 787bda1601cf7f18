"""Whether a partition's BSP step goes through its host's arena, and how the arena is made
and passed: the host's leader (partition 0 on one host; hierarchical, each host's lowest
partition) makes it (at the first need: its own ``connect``, or a peer's ask, whichever
comes first) and its block server answers the others' ``OP_ARENA`` with it; the others ask
over their leader's Unix socket and map it. ``peers.PeerGroup`` holds one; the
arena itself is ``blocks/arena.py``'s, the step through it ``arena_steps.py``'s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from allreduce_param.engine.blocks.arena import HostArena, arena_available
from allreduce_param.engine.blocks.codec import get_codec
from allreduce_param.engine.layout import HostLayout
from allreduce_param.engine.spec import ParameterSpec
from allreduce_param.engine.wire.blocks import PeerAddress, PeerClient
from allreduce_param.errors import StoreClosedError


class ArenaPassing:
    """One partition's side of its host's arena, for the spec ``spec``; ``shared``: whether
    its peer group shares memory at all."""

    def __init__(self, spec: ParameterSpec, partition_id: int, shared: bool) -> None:
        self.spec = spec
        self.partition_id = partition_id
        self._lock = threading.Lock()
        self._made: HostArena | None = None  # a leader's, made at the first need
        self._closed = False
        #: whether the spec and platform allow an arena at all (every partition alike)
        self.possible = (
            spec.host_arena
            and spec.partition_num > 1
            and shared
            and arena_available()
            and spec.strategy.inline_owner
            and not get_codec(spec.codec).lossy
            and not get_codec(spec.gradient_codec).lossy
        )

    @property
    def may_lead(self) -> bool:
        """Whether this partition may be asked for the arena (partition 0 on one host; any
        partition may lead a host of a hierarchy, which the meeting tells only later): its
        block server answers ``OP_ARENA`` then."""
        return self.possible and (self.partition_id == 0 or self.spec.topology != "flat")

    def applies(self, hosts: HostLayout, addresses: list[PeerAddress], hierarchical: bool) -> bool:
        """Whether the step goes through an arena: every partition of a host decides alike,
        from the spec and the hosts the meeting gave (one host holds them all, or the
        hosts' leaders exchange for them: ``hierarchical``)."""
        leader = hosts.leader(self.partition_id)
        return (
            self.possible
            and (len(hosts.hosts) == 1 or hierarchical)
            and addresses[leader].local_name is not None
        )

    def _leader_arena(self) -> HostArena:
        with self._lock:
            if self._closed:
                raise StoreClosedError(f"partition {self.partition_id} is shutting down")
            if self._made is None:
                spec = self.spec
                self._made = HostArena.create(
                    spec.partition_num, spec.size, self.partition_id, spec.timeout
                )
            return self._made

    def offer(self) -> tuple[bytes, list[int]]:
        """The block server's answer to a peer's ``OP_ARENA`` (partition 0's arena)."""
        return self._leader_arena().offer()

    def open(
        self,
        addresses: list[PeerAddress],
        client: Callable[[int, PeerAddress, str], PeerClient],
        hosts: HostLayout,
    ) -> HostArena:
        """This partition's mapping of its host's arena: the leader's own, or the one asked
        of the leader over its Unix socket (``client(peer, address, local_name)`` makes the
        client); its errors name the peers by ``addresses``. The other hosts' partitions'
        words are written by this host's leader (``HostArena.writers``)."""
        leader = hosts.leader(self.partition_id)
        if self.partition_id == leader:
            arena = self._leader_arena()
        else:
            address = addresses[leader]
            asking = client(leader, address, address.local_name)
            try:
                text, fds = asking.ask_arena(self.spec.partition_num + 1)
            finally:
                asking.close()
            arena = HostArena.attach(text, fds, self.partition_id, self.spec.timeout)
        arena.map_gradients(hosts.host(self.partition_id))  # the other hosts' are never used
        arena.names = [f"partition {p} at {a.host}:{a.port}" for p, a in enumerate(addresses)]
        arena.writers = [p if hosts.leader(p) == leader else leader for p in range(len(addresses))]
        return arena

    def _arenas(self, arena: HostArena | None) -> list[HostArena]:
        return list({id(each): each for each in (arena, self._made) if each is not None}.values())

    def stop(self, arena: HostArena | None, reason: str) -> None:
        """End ``arena`` and the one this partition made, if any, with ``reason`` (unless
        ended already), so whoever waits there, this partition or a peer, stops; no arena
        is made or offered after this."""
        with self._lock:
            self._closed = True
        for each in self._arenas(arena):
            each.end(reason)

    def close(self, arena: HostArena | None) -> None:
        """Close ``arena`` and the one this partition made (after ``stop``)."""
        for each in self._arenas(arena):
            each.close()
