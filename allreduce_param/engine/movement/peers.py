"""The peer group: one partition's server, its connections to every peer, and how they end.

A ``PeerGroup`` is what a partition needs to reach the others, made once per ``connect()``:

- the own ``BlockStore`` (where its published blocks wait for the peers), its encode
  buffers (in shared memory when same-host peers may read them in place), and the
  ``BlockServer`` that serves it;
- the address exchange (``directory.PeerDirectory``): what this partition advertises, and
  how it reads a peer's (``(host, port)``, plus a Unix socket name and the kernel scope it
  lives in; a peer in the same scope, i.e. this machine and network namespace, is reached
  over the Unix socket, and its blocks in shared memory are read in place); a bare
  ``(host, port)`` (a fixed list) is completed by asking that peer;
- the hosts (``layout.HostLayout``): which partitions share this one's scope, and whether
  the sync is hierarchical (each host's leader exchanges with the other leaders for its
  host) or flat (every partition with every other);
- the host arena (``arena``, with ``host_arena`` on): where every partition is on one host
  under plain BSP with lossless codecs, the step's weights and gradients live in one
  shared segment that partition 0 (the host's leader) makes and passes to the others over
  its Unix socket (``OP_ARENA``; ``host_arenas.py`` decides and passes it,
  ``arena_steps.py`` moves the step through it);
- ``channels.Channel``\\ s: each thread that fetches (the worker, a background owner, the
  control blocks) has connections and fetch threads of its own; a connection is made at
  its first use, so a hierarchical partition connects only to its host and, a leader, to
  the leaders;
- the end: ``close`` (say done, wait until every peer is, stop), ``fail`` (answer every
  peer with the reason for a short while, then stop), ``shutdown`` (stop at once); which
  peers are done with this partition is ``farewells.Farewells``'.

It moves no data itself: ``movements.py`` does, through the store and the channels here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from allreduce_param.engine.blocks.arena import HostArena
from allreduce_param.engine.blocks.codec import get_codec
from allreduce_param.engine.blocks.shm import (
    SharedArenas,
    arena_size,
    shared_memory_available,
)
from allreduce_param.engine.blocks.store import BlockStore
from allreduce_param.engine.layout import HostLayout
from allreduce_param.engine.movement.channels import Channel
from allreduce_param.engine.movement.directory import PeerDirectory
from allreduce_param.engine.movement.farewells import Farewells
from allreduce_param.engine.movement.host_arenas import ArenaPassing
from allreduce_param.engine.movement.rendezvous import Rendezvous
from allreduce_param.engine.spec import ParameterSpec
from allreduce_param.engine.wire.blocks import BlockServer
from allreduce_param.errors import AllReduceError

log = logging.getLogger(__name__)

#: Elements per part: blocks travel in parts of at most this many values (2 MiB of
#: float32), so that encoding, the wire and summing overlap (see ``movements.py``).
PART_LENGTH = 1 << 19

#: The most a part can take encoded, whatever the codec: what a shared send buffer holds.
LARGEST_PART = get_codec("raw").max_encoded_size(PART_LENGTH)

#: The worker channel's fetch threads unless the spec's ``fetch_threads`` says
#: otherwise (never more than the peers): how many peers it fetches from at once. Each
#: thread pulls one peer's parts back to back, so a few keep a link busy, and the rest
#: queue: under every strategy a fetch of the worker's waits only for blocks its peer
#: publishes without waiting for this partition's later work, so queued fetches are late,
#: never stuck (docs/DESIGN.md, "Moving blocks: peers, channels, movements"; the threads
#: and connections this costs as N grows: "Scaling: connections, bytes and steps").
FETCH_THREADS = 16


class PeerGroup:
    """This partition's server and its connections to the peers of one parameter.

    Starts serving, meets the peers through ``rendezvous`` (once), and makes the worker's
    channel (``fetch_threads`` fetch threads, default ``FETCH_THREADS``, at most one per
    peer) and the control channel (one thread, for small blocks while an owner's channel
    may be waiting). Everything it is configured by comes from ``spec``, made on the driver.
    """

    def __init__(self, spec: ParameterSpec, rendezvous: Rendezvous) -> None:
        self.partition_id = rendezvous.partition_id
        self.partition_num = spec.partition_num
        self.timeout = spec.timeout
        self.spec = spec
        self._closed = False
        self._farewells = Farewells(self.partition_id, spec.timeout)
        self._channels: list[Channel] = []
        strategy, network = spec.strategy, spec.network
        #: the host arena this partition's BSP step goes through, if any
        self.arena: HostArena | None = None
        # where blocks are encoded: shared memory peers on this host read in place, or bytearrays
        self.shared = (
            SharedArenas(arena_size(spec.size, spec.partition_num, LARGEST_PART))
            if spec.unix_sockets and spec.shared_memory and shared_memory_available()
            else None
        )
        self._arena_passing = ArenaPassing(spec, self.partition_id, self.shared is not None)
        self.store = BlockStore(
            keep=strategy.keep(),
            wait_for_readers=strategy.waits_for_readers(),
            reuse_at_once=strategy.read_before_next(),
            new_buffer=self._new_buffer,
        )
        host, port = rendezvous.bind_address()
        bind, advertise = network.addresses(host)
        self._server = BlockServer(
            self.store,
            spec.secret,
            spec.param_id,
            self.partition_id,
            bind,
            port,
            partition_num=self.partition_num,
            on_done=self.peer_done,
            unix=spec.unix_sockets,
            shared=self.shared,
            max_wait=spec.timeout,
            ports=network.port_range,
            advertise=advertise,
            handshake_timeout=network.connect_timeout,
            encrypt=network.encrypt,
            arena=self._arena_passing.offer if self._arena_passing.may_lead else None,
        )
        try:
            #: every peer's address, and a client of any of them
            self.directory = PeerDirectory(spec, self._server, rendezvous)
            addresses = self.directory.addresses
            self.hosts = HostLayout(
                [
                    address.scope if address.local_name is not None and spec.unix_sockets else None
                    for address in addresses
                ]
            )
            #: each host's leader exchanges for it; the others only within their host
            self.hierarchical = (
                spec.topology != "flat" and strategy.inline_owner and self.hosts.nested
            )
            #: how many fetches a channel runs at once (a background owner's also reads its own store)
            self.fetch_threads = min(spec.fetch_threads or FETCH_THREADS, self.partition_num)
            self.worker = self.channel(min(self.fetch_threads, self.partition_num - 1), "fetch")
            # small blocks (choices, signals) on connections of their own, made at first use:
            # a background owner's channel may be waiting for a straggler's gradient meanwhile
            self.control = self.channel(1, "control")
            if self._arena_passing.applies(self.hosts, addresses, self.hierarchical):
                self.arena = self._arena_passing.open(addresses, self.directory.client, self.hosts)
        except BaseException:
            self.shutdown()
            raise
        self.peers = self.worker.clients

    def channel(self, threads: int, role: str, idle_waits: bool = False) -> Channel:
        """A new set of connections to every peer (each connects on first use), with
        ``threads`` fetch threads (and ``idle_waits``: see ``Channel``); closed with the group."""
        clients = {}
        for peer in range(self.partition_num):
            if peer == self.partition_id:
                continue
            clients[peer] = self.directory.client_of(peer)
        channel = Channel(
            clients, threads, f"allreduce-{role}-{self.partition_id}", role, idle_waits
        )
        self._channels.append(channel)
        return channel

    def reads_in_place(self, channel: Channel, server: int) -> bool:
        """Whether the blocks ``server`` serves are read where they lie: the own store, or a
        peer's shared memory on this host. Such bytes never crossed a socket."""
        if server == self.partition_id:
            return True
        return self.shared is not None and channel.clients[server].local_name is not None

    def server_of(self, source: int) -> int:
        """Who serves ``source``'s weight slices and host sums to this partition: ``source``
        itself when flat or on this host; hierarchical, this host's leader for the others
        (the leader itself reads them from its own store, where it relays them)."""
        if not self.hierarchical or self.hosts.leader(source) == self.hosts.leader(
            self.partition_id
        ):
            return source
        return self.hosts.leader(self.partition_id)

    def connections(self) -> dict[str, list[int]]:
        """The peers this partition holds a connection to now, by channel (``"fetch"``, the
        worker's; ``"control"``; ``"owner"``): what its sync has needed so far."""
        return {
            channel.role: sorted(
                peer for peer, client in channel.clients.items() if client.connected
            )
            for channel in self._channels
        }

    @property
    def is_leader(self) -> bool:
        """Whether this partition exchanges with the other hosts for its host (hierarchical)."""
        return self.hierarchical and self.hosts.leader(self.partition_id) == self.partition_id

    @property
    def remote_peers(self) -> int:
        """How many peers are reached over TCP (on other hosts, or with Unix sockets off)
        rather than over a Unix socket on this host."""
        return sum(
            self.worker.clients[peer].local_name is None
            for peer in self.hosts.neighbours(self.partition_id, self.hierarchical)
        )

    def room(self, nbytes: int) -> memoryview:
        """``nbytes`` of writable memory whose contents can be published where they lie: in
        shared memory when same-host peers may read it in place; freed with the group."""
        return memoryview(bytearray(nbytes)) if self.shared is None else self.shared.buffer(nbytes)

    def _new_buffer(self):
        """Room to encode one part into: shared memory when peers may read it in place."""
        return bytearray() if self.shared is None else self.shared.buffer(LARGEST_PART)

    # ---- the end -------------------------------------------------------------------------

    def peer_done(self, partition: int) -> None:
        """``partition`` fetches nothing more from us: it said so, hung up, or is gone."""
        self._farewells.peer_done(partition)

    def close(self, join: Callable[[], None] = lambda: None) -> None:
        """Finish cleanly: tell the peers we are done, wait until they are, then stop.

        A partition that finishes first keeps serving its last blocks until every peer has
        said it fetched them (or the timeout passes), so no peer loses a block it needs.
        Hierarchical, "done" goes through the leaders: a leader waits for its host, then
        tells the other leaders and waits for them, and only then tells its host; so no
        partition stops serving before every partition anywhere is done fetching. ``join``
        is as for ``shutdown``.
        """
        if self._closed:
            return
        if self.arena is not None:
            self.arena.end(None)  # whoever still waits for us in the arena waits in vain
        try:
            me = self.partition_id
            near, far = (
                (self.hosts.mates(me), self.hosts.other_leaders(me))
                if self.hierarchical
                else (self.hosts.neighbours(me, hierarchical=False), ())
            )
            if far:
                self._wait_for(near)  # every partition of this host is done with us
                self._say_done(far)
                self._wait_for(far)  # and every other host is
            self._say_done(near)
            if not far:
                self._wait_for(near)
        finally:
            self.shutdown(join)

    def _say_done(self, partitions) -> None:
        if self.arena is not None:  # to this host's partitions, our closed arena says it
            own = self.hosts.host(self.partition_id)
            partitions = [p for p in partitions if p not in own]
        for partition in partitions:
            try:
                self.peers[partition].done()
            except AllReduceError as error:
                log.warning("partition %d: %s", self.partition_id, error)

    def fail(self, reason: str, join: Callable[[], None] = lambda: None) -> None:
        """Stop after an error, telling the peers why.

        Every fetch a peer makes is answered with ``reason`` (so its error names the root
        cause, whichever failure Spark reports first) until each peer has hung up, said it
        is done, is known to be gone, or refused us for want of our secret (then it is not
        of this parameter), or the network settings' ``failure_linger`` passes (it is only
        for a clearer message: the root cause in every peer's error); then it stops.
        """
        if self._closed:  # closed already (e.g. close() then an error): nothing left to say
            return
        if self.arena is not None:
            self.arena.end(reason)  # whoever waits for us in the arena hears why at once
        self.store.close(reason)
        neighbours = self.hosts.neighbours(self.partition_id, self.hierarchical)
        unconnected = self._unconnected(neighbours)
        for channel in self._channels:
            channel.abort()  # a connection cut is a hang-up: those peers know we are done
        goodbyes = self._farewells.part_from(unconnected, self.directory.client_of)
        try:
            self._wait_for(neighbours, min(self.timeout, self.spec.network.failure_linger))
        finally:
            for goodbye in goodbyes:
                goodbye.join()
            self.shutdown(join)

    def _unconnected(self, partitions) -> list[int]:
        """Those of ``partitions`` no channel has a connection to now (none through this
        host's arena, which tells them of our end itself)."""
        own = self.hosts.host(self.partition_id) if self.arena is not None else ()
        return [
            partition
            for partition in partitions
            if partition not in own
            and not any(channel.clients[partition].connected for channel in self._channels)
        ]

    def _wait_for(self, partitions, timeout: float | None = None) -> bool:
        """``Farewells.wait``, through this partition's host arena if it has one."""
        return self._farewells.wait(partitions, timeout, self.arena)

    @property
    def closed(self) -> bool:
        """Whether the group has stopped (closed, failed or shut down)."""
        return self._closed

    def shutdown(self, join: Callable[[], None] = lambda: None) -> None:
        """Stop at once: cut the connections, stop the server (which closes the store), then
        call ``join`` (where a thread that waits on the store ends), then stop the fetch
        threads and free the shared memory. Once."""
        if self._closed:
            return
        self._closed = True
        # whoever waits in the arena, we or a peer, stops; nothing more is offered
        self._arena_passing.stop(self.arena, f"partition {self.partition_id} was shut down")
        for channel in self._channels:
            channel.abort()
        self._server.close()
        join()
        for channel in self._channels:
            channel.close()
        self._arena_passing.close(self.arena)
        if self.shared is not None:
            self.shared.close()
