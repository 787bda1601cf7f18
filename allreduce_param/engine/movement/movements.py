"""The four movements of blocks between partitions, written once: publish, scatter, reduce, gather.

- ``publish``: encode a vector part by part into the own store, as one version of a block.
- ``scatter``: publish chunk ``j`` of a vector for owner ``j`` (a gradient, an allreduce input).
- ``reduce``: fetch the own chunk from every partition and sum it, in the hosts' order
  (``layout.HostLayout``), in fp32; hierarchical, through the hosts' leaders.
- ``gather``: fetch every owner's slice into its place in one full vector.

A block of more than ``PART_LENGTH`` elements travels as several parts (the part plan of a
``SliceLayout``, computed once): a peer fetches part k while the owner still encodes part
k+1, and the receiver sums part k while part k+1 is on the wire. Each element is still summed
in the one order. What a part's sum needs next (the divide into a mean, the check for
NaN/Inf) is done on that part while it is in cache, not in a pass of its own.

Each kind of block has one codec: weights and allreduce blocks the parameter's, gradients
the parameter's gradient codec (the same unless it says otherwise);
the small blocks (metadata, step choices, signals) raw, so they are exact whatever it is.

Hierarchical (``peers.PeerGroup.hierarchical``), a host's leader also *relays*: it copies
blocks as they are into its own store, under their own keys, for its host or the other
leaders to fetch from it (``relay``); ``fetch_blocks`` fetches a block from whoever serves
it (``peers.PeerGroup.server_of``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np

from allreduce_param.engine.blocks.codec import Codec, get_codec, parse_header
from allreduce_param.engine.blocks.store import EVERY_PARTITION, BlockKey, BlockKind, SplitBlock
from allreduce_param.engine.layout import SliceLayout, split
from allreduce_param.engine.movement.channels import (
    Channel,
    FetchSteps,
    PeerGet,
    StoreGet,
    run_through,
)
from allreduce_param.engine.movement.peers import PART_LENGTH, PeerGroup
from allreduce_param.engine.strategy import WeightRead
from allreduce_param.errors import (
    AuthenticationError,
    CorruptBlockError,
    NonFiniteGradientError,
    PeerLostError,
)

#: The block kinds that always travel raw: small, and wanted exact.
EXACT_KINDS = (BlockKind.CHOICE, BlockKind.SIGNAL, BlockKind.METADATA)


@functools.lru_cache(maxsize=64)
def part_plan(layout: SliceLayout) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``plan[j]``: the parts ``(start, length)`` of slice ``j`` of ``layout``, counted from
    the slice's start."""
    return tuple(tuple(split(layout.length(j), PART_LENGTH)) for j in range(layout.partition_num))


def _header_and_payload(block) -> tuple[memoryview, memoryview | None]:
    """A block as ``Codec.decode`` takes it: its bytes, or a split block's two parts."""
    return (block.header, block.payload) if isinstance(block, SplitBlock) else (block, None)


def _recheck(block: memoryview, header, what: str) -> None:
    """Raise if a block read in place was rewritten while it was read."""
    if not Codec.unchanged(block, header):
        raise CorruptBlockError(
            f"{what} was rewritten while it was read in place: a protocol slip (its owner "
            "reused the buffer of a version still being read)"
        )


def _add_up(values: list[np.ndarray], out: np.ndarray) -> np.ndarray:
    """``out`` = the ``values`` added in order, in fp32: the first two in one pass, not
    copied and then added."""
    if len(values) == 1:
        np.copyto(out, values[0])
    else:
        np.add(values[0], values[1], out=out)
        for more in values[2:]:
            out += more
    return out


class NonFiniteSum:
    """Finds what made a summed gradient part NaN/Inf, for a message that names it.

    ``version`` is the step; ``slice_start`` where the summed chunk begins in the full vector.
    """

    def __init__(self, version: int, slice_start: int) -> None:
        self.version = version
        self.slice_start = slice_start

    def check(
        self, target: np.ndarray, start: int, sources: list[str], parts: list[np.ndarray]
    ) -> None:
        """Raise ``NonFiniteGradientError`` if the summed part ``target`` (from ``start`` in the
        slice) holds NaN/Inf: naming the first source (``sources``: "partition 3") whose
        part does, or else saying the sum overflowed."""
        if np.isfinite(target.sum()) or np.isfinite(target).all():  # one cheap pass in cache
            return
        for source, values in zip(sources, parts):
            bad = np.flatnonzero(~np.isfinite(values))
            if bad.size:
                index = self.slice_start + start + int(bad[0])
                raise NonFiniteGradientError(
                    f"the gradient of {source} for step {self.version} holds NaN/Inf "
                    f"(first at index {index}: {values[bad[0]]}); the model diverged or the "
                    "data holds NaN. Lower the learning rate or clean the data, or pass "
                    "AllReduceParameter(allow_nonfinite=True) to let them through"
                )
        index = self.slice_start + start + int(np.flatnonzero(~np.isfinite(target))[0])
        raise NonFiniteGradientError(
            f"the gradients of step {self.version} are finite but their sum overflows float32 "
            f"(first at index {index}); the model diverged: lower the learning rate, or clip the "
            "gradients (clip_norm), or pass AllReduceParameter(allow_nonfinite=True) to let it through"
        )


class Movements:
    """One partition's movements of blocks through its ``PeerGroup``, with ``codec`` for the
    big blocks (weights, allreduce), ``gradient_codec`` (default: ``codec``) for gradients,
    and raw for the small exact ones."""

    def __init__(self, peers: PeerGroup, codec: Codec, gradient_codec: Codec | None = None) -> None:
        self.peers = peers
        self.partition_id = peers.partition_id
        self.partition_num = peers.partition_num
        raw = get_codec("raw")
        self.codecs = {kind: raw if kind in EXACT_KINDS else codec for kind in BlockKind.NAMES}
        self.codecs[BlockKind.GRADIENT] = gradient_codec or codec
        # a host sum is dense whatever its gradients were (a top-k of each does not add up to one)
        self.codecs[BlockKind.GRADIENT_HOST_SUM] = (
            codec if self.codecs[BlockKind.GRADIENT].sparse else self.codecs[BlockKind.GRADIENT]
        )
        self._host_sums: np.ndarray | None = None  # a leader's sums of its host's chunks
        self._rounded = np.empty(PART_LENGTH, dtype=np.float32)  # error feedback: a part as sent

    def publish(
        self,
        kind: int,
        version: int,
        values: np.ndarray,
        destination: int = EVERY_PARTITION,
        count: float = 0.0,
        residual: np.ndarray | None = None,
    ) -> None:
        """Encode ``values`` part by part and put each in the own store as ``version``.

        Each part is encoded into a buffer the store gives out, which no reader still uses.
        ``residual`` (as long as ``values``), for error feedback: what the codec's rounding
        lost before is added to the values first, and it is then replaced by what this
        rounding lost, so over the steps nothing is lost.
        """
        store, codec, timeout = self.peers.store, self.codecs[kind], self.peers.timeout
        for part, (start, length) in enumerate(split(values.size, PART_LENGTH)):
            key = BlockKey(kind, self.partition_id, destination, part)
            chunk = values[start : start + length]
            if residual is not None:  # the residual's room holds what is sent: values + residual
                chunk = np.add(
                    residual[start : start + length], chunk, out=residual[start : start + length]
                )
            buffer = store.reserve(key, version, timeout)
            block = codec.encode(
                chunk,
                count=count,
                out=buffer,
                ids=(kind, self.partition_id, destination, part, version),
                checksum=False,
            )  # sealed if it is ever sent
            if residual is not None:
                _, sent = codec.decode(
                    block, length, scratch=self._rounded[:length], checksum=False
                )
                chunk -= sent
            store.put(key, version, block, buffer=buffer)
            del block  # the store holds its own view; ours would pin the buffer's size

    def publish_in_place(
        self, kind: int, version: int, values: memoryview, destination: int, count: float
    ) -> None:
        """Publish the float32 bytes ``values`` where they lie, part by part, as ``version``:
        only each part's header is written (raw codec), into a buffer the store gives out.

        The caller must leave ``values`` unchanged until every reader is past this version
        (under BSP: until its next ``get_weights``). Bytes in shared memory are then read by
        same-host peers in place, and sent from there to the others.
        """
        store, codec, timeout = self.peers.store, self.codecs[kind], self.peers.timeout
        for part, (start, length) in enumerate(split(values.nbytes // 4, PART_LENGTH)):
            key = BlockKey(kind, self.partition_id, destination, part)
            buffer = store.reserve(key, version, timeout)
            header = codec.encode_header(
                length,
                count=count,
                out=buffer,
                ids=(kind, self.partition_id, destination, part, version),
            )
            store.put(
                key,
                version,
                SplitBlock(header, values[4 * start : 4 * (start + length)]),
                buffer=buffer,
            )
            del header

    def scatter(
        self,
        kind: int,
        version: int,
        vector: np.ndarray,
        layout: SliceLayout,
        count: float,
        residual: np.ndarray | None = None,
        own: bool = True,
        in_place: memoryview | None = None,
    ) -> None:
        """Publish chunk ``j`` of ``vector`` (and of ``residual``, see ``publish``) for owner
        ``j``; the peers' first, the own last, unless not ``own`` (``reduce`` then takes it
        from ``vector`` itself). ``in_place``: ``vector``'s own bytes, to publish where they
        lie (``publish_in_place``; a raw codec and no residual) rather than copied."""
        for owner in self.scatter_order(own):
            self.scatter_chunk(kind, version, vector, layout, count, owner, residual, in_place)

    def scatter_order(self, own: bool = True) -> list[int]:
        """The owners ``scatter`` publishes for, in its order: the peers' chunks first (from
        the next partition on, so that not every partition serves owner 0 first), the own
        last, unless not ``own``."""
        return [
            (self.partition_id + step) % self.partition_num
            for step in range(1, self.partition_num + (1 if own else 0))
        ]

    def scatter_chunk(
        self,
        kind: int,
        version: int,
        vector: np.ndarray,
        layout: SliceLayout,
        count: float,
        owner: int,
        residual: np.ndarray | None = None,
        in_place: memoryview | None = None,
    ) -> None:
        """Publish ``owner``'s chunk of ``vector`` as ``version``: one step of ``scatter``."""
        bounds = layout.bounds(owner)
        if in_place is not None:
            self.publish_in_place(
                kind, version, in_place[4 * bounds.start : 4 * bounds.stop], owner, count
            )
        else:
            self.publish(
                kind,
                version,
                vector[bounds],
                destination=owner,
                count=count,
                residual=None if residual is None else residual[bounds],
            )

    def fetch_own_chunks(
        self, kind: int, version: int, layout: SliceLayout, sources: list[int]
    ) -> dict[int, list[Future]]:
        """Start fetching the own chunk of ``version`` from each partition of ``sources``: what
        ``reduce`` sums. Started before the peers have published, the fetches wait for them,
        so the chunks arrive while this partition still computes."""
        return self.fetch_all(
            self.peers.worker,
            kind,
            WeightRead(version, exact=True),
            layout,
            destination=self.partition_id,
            sources=sources,
        )

    def reduce(
        self,
        kind: int,
        version: int,
        layout: SliceLayout,
        out: np.ndarray,
        divisor: Callable[[float], float | None] | None = None,
        check: NonFiniteSum | None = None,
        own: tuple[np.ndarray, float] | None = None,
        pending: dict[int, list[Future]] | None = None,
    ) -> float:
        """Sum the own chunk of ``version`` from every partition into ``out``, in the hosts'
        order (``layout.HostLayout``); returns the summed counts. ``divisor`` and ``check``
        are as for ``sum``. ``own``: this partition's chunk and count as they are, when
        ``scatter`` did not publish them (an exact codec would give the same bits).
        ``pending``: the fetches ``fetch_own_chunks`` started already; the other sources
        are fetched now. Hierarchical, the host sums are summed instead (``_sum_host``)."""
        if self.peers.hierarchical:
            return self._reduce_host_sums(kind, version, layout, out, divisor, check)
        pending = dict(pending or {})
        missing = [
            j
            for j in range(self.partition_num)
            if j not in pending and (own is None or j != self.partition_id)
        ]
        if missing:
            pending.update(self.fetch_own_chunks(kind, version, layout, missing))
        if own is not None:
            values, count = own
            pending[self.partition_id] = futures = []
            for start, length in part_plan(layout)[self.partition_id]:
                futures.append(Future())
                futures[-1].set_result((version, count, values[start : start + length], None))
        return self.sum(pending, range(self.partition_num), out, divisor, check)

    def _reduce_host_sums(
        self,
        kind: int,
        version: int,
        layout: SliceLayout,
        out: np.ndarray,
        divisor: Callable[[float], float | None] | None,
        check: NonFiniteSum | None,
    ) -> float:
        """Hierarchical ``reduce``: every host's sum of the own chunk, in host order, read
        from this host's leader (which relayed the other hosts' from their leaders); a
        leader first makes its host's sums (``_sum_host``)."""
        hosts, read = self.peers.hosts, WeightRead(version, exact=True)
        leader = hosts.leader(self.partition_id)
        if leader == self.partition_id:
            self._sum_host(kind, read, layout, check)
        pending = self.fetch_all(
            self.peers.worker,
            BlockKind.HOST_SUM[kind],
            read,
            layout,
            self.partition_id,
            sources=hosts.leaders,
            via=lambda source: leader,
        )
        names = [f"a partition of {list(members)}" for members in hosts.hosts]
        return self.sum(
            pending,
            hosts.leaders,
            out,
            divisor,
            check,
            groups=[(p,) for p in hosts.leaders],
            names=names,
        )

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
        chunks = self.fetch_blocks(
            worker, kind, read, layout, [(m, j) for m in members for j in owners]
        )
        host_sum = BlockKind.HOST_SUM[kind]
        relayed = self.relay(
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
            count = self.sum(
                {m: chunks[(m, owner)] for m in members},
                members,
                partial,
                check=None if check is None else NonFiniteSum(check.version, layout.start(owner)),
            )
            self.publish(host_sum, read.version, partial, destination=owner, count=count)
        for done in relayed:
            done.result()

    def sum(
        self,
        pending: dict[int, list[Future]],
        sources,
        out: np.ndarray,
        divisor: Callable[[float], float | None] | None = None,
        check: NonFiniteSum | None = None,
        groups: list[tuple[int, ...]] | None = None,
        names: list[str] | None = None,
    ) -> float:
        """Sum the fetched chunks of ``sources`` into ``out``; their counts.

        In ``layout.HostLayout``'s order: on each host in partition order, then the hosts'
        sums in host order (``groups``: another grouping of ``sources``, such as one host
        sum each). ``divisor(total)``, once the counts are known, gives what to divide the
        sum by (None: leave it a sum); ``check`` raises if a summed part holds NaN/Inf,
        naming the source by ``names`` (default: its partition). Both act on each part
        just after it is summed. Every part is summed before anything is raised, so no
        fetch is left running.
        """
        groups = self.peers.hosts.grouped(sources) if groups is None else groups
        order = [source for group in groups for source in group]
        group_sum = (
            np.empty(min(out.size, PART_LENGTH), np.float32)
            if any(len(g) > 1 for g in groups[1:])
            else None
        )
        names = names or [f"partition {source}" for source in order]
        total, scale, failure = 0.0, None, None
        for part, (start, length) in enumerate(split(out.size, PART_LENGTH)):
            target = out[start : start + length]
            parts = {source: pending[source][part].result() for source in order}
            if part == 0:
                total = sum(sum(parts[source][1] for source in group) for group in groups)
                value = None if divisor is None else divisor(total)
                scale = None if value is None else np.float32(value)
            for index, group in enumerate(groups):
                values = [parts[source][2] for source in group]
                if index == 0:
                    _add_up(values, target)
                elif len(values) == 1:
                    target += values[0]
                else:
                    target += _add_up(values, group_sum[:length])
            if check is not None and failure is None:
                try:
                    check.check(target, start, names, [parts[source][2] for source in order])
                except NonFiniteGradientError as error:
                    failure = error
            if scale is not None:
                target /= scale
            for _, _, _, recheck in parts.values():
                if recheck is not None:
                    recheck()
        if failure is not None:
            raise failure
        return total

    def allreduce(self, version: int, vector: np.ndarray, mean: bool) -> np.ndarray:
        """``version`` of an allreduce: every partition's ``vector`` summed (with ``mean``,
        divided by the partition count), through the codec: scatter, reduce, publish the
        reduced slice, gather."""
        layout = SliceLayout(vector.size, self.partition_num)
        self.scatter(BlockKind.REDUCE_INPUT, version, vector, layout, 1.0)
        reduced = np.empty(layout.length(self.partition_id), dtype=np.float32)
        self.reduce(
            BlockKind.REDUCE_INPUT,
            version,
            layout,
            reduced,
            divisor=(lambda total: self.partition_num) if mean else None,
        )
        self.publish(BlockKind.REDUCE_OUTPUT, version, reduced)
        out = np.empty(vector.size, dtype=np.float32)
        self.gather(BlockKind.REDUCE_OUTPUT, WeightRead(version, exact=True), layout, out)
        return out

    def allreduce_exact(self, version: int, vector: np.ndarray) -> np.ndarray:
        """``version`` of an exact allreduce: every partition's float64 ``vector`` reaches
        every partition as its bytes (raw), and is summed in partition order in float64."""
        bits = vector.view(np.float32)  # carried as its bytes: the raw codec copies, never rounds
        self.publish(BlockKind.METADATA, version, bits)
        everyone = SliceLayout(bits.size * self.partition_num, self.partition_num)
        gathered = np.empty(everyone.size, dtype=np.float32)
        self.gather(BlockKind.METADATA, WeightRead(version, exact=True), everyone, gathered)
        rows = gathered.view(np.float64).reshape(self.partition_num, vector.size)
        total = rows[0].copy()
        for row in rows[1:]:
            total += row
        return total

    def gather(self, kind: int, read: WeightRead, layout: SliceLayout, out: np.ndarray) -> int:
        """Fetch every owner's slice into its place in ``out``; the lowest version taken.

        A lossy codec decodes each part straight into its place in ``out``. Hierarchical,
        the other hosts' slices come from this host's leader, which first relays its own
        host's slices to the other leaders and theirs here.
        """
        worker, peers = self.peers.worker, self.peers
        sources = list(range(self.partition_num))
        if peers.is_leader:
            hosts, me = peers.hosts, self.partition_id
            mine = [(p, EVERY_PARTITION) for p in hosts.host(me) if p != me]
            theirs = [(p, EVERY_PARTITION) for p in sources if hosts.leader(p) != me]
            relayed = self.relay(worker, kind, read, layout, mine) + self.relay(
                worker, kind, read, layout, theirs, via=hosts.leader
            )
            pending = self.fetch_all(
                worker, kind, read, layout, EVERY_PARTITION, into=out, sources=hosts.host(me)
            )
            for done in relayed:  # then the other hosts' slices are in the own store
                done.result()
            pending.update(
                self.fetch_all(
                    worker,
                    kind,
                    read,
                    layout,
                    EVERY_PARTITION,
                    into=out,
                    sources=[p for p, _ in theirs],
                    via=peers.server_of,
                )
            )
        else:
            pending = self.fetch_all(
                worker, kind, read, layout, EVERY_PARTITION, into=out, via=peers.server_of
            )
        lowest = None
        plan = part_plan(layout)
        for owner in sources:
            base = layout.start(owner)
            for part, (start, length) in enumerate(plan[owner]):
                version, _, values, recheck = pending[owner][part].result()
                target = out[base + start : base + start + length]
                if not np.shares_memory(values, target):
                    np.copyto(target, values)
                if recheck is not None:
                    recheck()
                lowest = version if lowest is None else min(lowest, version)
        return lowest

    def fetch_all(
        self,
        channel: Channel,
        kind: int,
        read: WeightRead,
        layout: SliceLayout,
        destination: int,
        sources=None,
        follow_first: bool = False,
        into: np.ndarray | None = None,
        via: Callable[[int], int] | None = None,
    ) -> dict[int, list[Future]]:
        """Start fetching every part of block ``(kind, j, destination)`` from each partition ``j``
        of ``sources`` (default: all), as ``read`` says: each part on its own, or with
        ``follow_first`` every part in the version the first part came in. The blocks'
        lengths are ``layout``'s: slice ``j``'s for blocks for every partition, else slice
        ``destination``'s. ``via(j)``: who serves ``j``'s block (default ``j``; see
        ``fetch_blocks``).

        ``result[j][k]`` is a future of part k's ``(version, count, values, recheck)``; values
        stay valid until the channel's next fetch of the same block. A lossy codec decodes into
        ``into`` (a full vector of ``layout``, slice ``j`` at its place) when given, else into
        the channel's scratch. ``recheck``, for a block read in place (the own store, a peer's
        shared memory), raises if the block was rewritten while it was read: call it after
        using the values.
        """
        sources = range(self.partition_num) if sources is None else sources
        pending = self.fetch_blocks(
            channel,
            kind,
            read,
            layout,
            [(source, destination) for source in sources],
            follow_first,
            into,
            via,
        )
        return {source: futures for (source, _), futures in pending.items()}

    def fetch_blocks(
        self,
        channel: Channel,
        kind: int,
        read: WeightRead,
        layout: SliceLayout,
        blocks: list[tuple[int, int]],
        follow_first: bool = False,
        into: np.ndarray | None = None,
        via: Callable[[int], int] | None = None,
    ) -> dict[tuple[int, int], list[Future]]:
        """``fetch_all`` for any blocks ``(source, destination)`` of one kind, keyed by them.

        The blocks one partition serves (``via(source)``, default the source) are fetched
        in the order given by one pool thread, over its one connection; those this partition
        serves itself (with the worker's channel) are read from the own store on the calling
        thread, once the others have started.
        """
        plan = part_plan(layout)
        pending: dict[tuple[int, int], list[Future]] = {}
        by_server: dict[int, list[_Fetch]] = {}
        for server, server_blocks in _by_server(blocks, via).items():
            by_server[server] = []
            for source, destination in server_blocks:
                slice_of = _slice_of(source, destination)
                parts = plan[slice_of]
                room = None if into is None else into[layout.bounds(slice_of)]
                futures = pending[(source, destination)] = [Future() for _ in parts]
                by_server[server].append(_Fetch(source, destination, parts, futures, room))
        own = by_server.pop(self.partition_id, None) if channel is self.peers.worker else None
        for server, fetches in by_server.items():
            channel.start(self._fetch_from(channel, server, kind, read, fetches, follow_first))
        if own:
            run_through(self._fetch_from(channel, self.partition_id, kind, read, own, follow_first))
        return pending

    def _fetch_from(
        self,
        channel: Channel,
        server: int,
        kind: int,
        read: WeightRead,
        fetches: list[_Fetch],
        follow_first: bool,
    ) -> FetchSteps:
        """Fetch ``fetches`` from ``server`` in order; after a failure the rest fail with it.
        The steps of one fetch (``Channel.start``)."""
        for index, fetch in enumerate(fetches):
            error = yield from self._fetch_parts(channel, server, kind, read, fetch, follow_first)
            if error is not None:
                for later in fetches[index + 1 :]:
                    for future in later.futures:
                        future.set_exception(error)
                return

    def _fetch_parts(
        self,
        channel: Channel,
        server: int,
        kind: int,
        read: WeightRead,
        fetch: _Fetch,
        follow_first: bool,
    ) -> Generator[PeerGet | StoreGet, tuple, BaseException | None]:
        """Fetch and decode one block's parts from ``server`` in order, resolving one future per
        part; the error, if one came. Yields where it may wait (``Channel.start``).

        A failure fails this part and every later one, so the caller sees it where it waits.
        """
        peers, codec = self.peers, self.codecs[kind]
        source, destination, parts, futures, room = fetch
        sizes = [codec.max_encoded_size(length) for _, length in parts]
        local = server == self.partition_id
        in_place = peers.reads_in_place(channel, server)  # no receive buffer, no checksum
        # a block's landing: per source, and per destination too where one fetch takes several
        landing = (
            source if destination in (EVERY_PARTITION, self.partition_id) else (source, destination)
        )
        receive = None if in_place else channel.receive_buffer(landing, sum(sizes))
        if room is None:
            room = channel.scratch(landing, parts[-1][0] + parts[-1][1] if parts else 0)
        offset = 0
        for part, ((start, length), size) in enumerate(zip(parts, sizes)):
            key = BlockKey(kind, source, destination, part)
            try:
                if local:
                    version, block = yield StoreGet(
                        peers.store,
                        key,
                        read.version,
                        peers.timeout,
                        not read.exact,
                        channel.reader,
                    )
                else:
                    version, block = yield PeerGet(
                        channel.clients[server],
                        key,
                        read.version,
                        size,
                        None if receive is None else receive[offset : offset + size],
                        in_place,
                        not read.exact,
                    )
                block, payload = _header_and_payload(block)
                header, values = codec.decode(
                    block,
                    length,
                    scratch=room[start : start + length],
                    what=key.describe(version),
                    expect=(kind, source, destination, part, version),
                    checksum=not in_place,
                    payload=payload,
                )
            except BaseException as error:
                self._lost(channel, server, error)
                for future in futures[part:]:
                    future.set_exception(error)
                return error
            recheck = (
                functools.partial(_recheck, block, header, key.describe(version))
                if in_place
                else None
            )
            futures[part].set_result((version, header.count, values, recheck))
            offset += size
            if follow_first:
                read = WeightRead(version, exact=True)
        return None

    def _lost(self, channel: Channel, server: int, error: BaseException) -> None:
        """After a fetch from ``server`` failed: a peer gone, or not of this parameter, fetches
        nothing from us (a fetch we cut ourselves, failing, says nothing of the peer, which
        may still wait on us)."""
        if isinstance(error, (PeerLostError, AuthenticationError)) and not channel.aborted:
            self.peers.peer_done(server)

    def relay(
        self,
        channel: Channel,
        kind: int,
        read: WeightRead,
        layout: SliceLayout,
        blocks: list[tuple[int, int]],
        via: Callable[[int], int] | None = None,
    ) -> list[Future]:
        """Copy blocks ``(source, destination)`` of ``read.version`` (exact) as they are into the
        own store, under their own keys, for this host (or the other hosts' leaders) to fetch
        from here: from ``via(source)`` (default: the source), one pool thread per server.
        A block that crossed a socket is checked (its checksum included) before it is
        published; one read in place is copied and then checked unchanged. Returns one
        future per server, done when all its blocks are in."""
        return [
            channel.pool.submit(
                self._relay_from, channel, server, kind, read, layout, server_blocks
            )
            for server, server_blocks in _by_server(blocks, via).items()
        ]

    def _relay_from(
        self,
        channel: Channel,
        server: int,
        kind: int,
        read: WeightRead,
        layout: SliceLayout,
        blocks: list[tuple[int, int]],
    ) -> None:
        peers, codec, version = self.peers, self.codecs[kind], read.version
        client = channel.clients[server]
        in_place = peers.reads_in_place(channel, server)
        plan = part_plan(layout)
        try:
            for source, destination in blocks:
                for part, (_, length) in enumerate(plan[_slice_of(source, destination)]):
                    key = BlockKey(kind, source, destination, part)
                    size = codec.max_encoded_size(length)
                    buffer = peers.store.reserve(key, version, peers.timeout)
                    if (
                        len(buffer) < size
                    ):  # a bytearray, the first time: never while a view of it lives
                        buffer.extend(bytes(size - len(buffer)))
                    room = memoryview(buffer)[:size]
                    _, block = client.fetch(
                        key, version, size, None if in_place else room, in_place
                    )
                    header_bytes, payload = _header_and_payload(block)
                    what = key.describe(version)
                    if in_place:
                        nbytes = header_bytes.nbytes + (0 if payload is None else payload.nbytes)
                        room[: header_bytes.nbytes] = header_bytes
                        if payload is not None:
                            room[header_bytes.nbytes : nbytes] = payload
                        _recheck(header_bytes, parse_header(room, what), what)
                    else:
                        nbytes = block.nbytes
                        codec.verify(
                            room[:nbytes],
                            length,
                            what,
                            expect=(kind, source, destination, part, version),
                        )
                    peers.store.put(key, version, room[:nbytes], buffer=buffer)
                    del room, block, header_bytes, payload
        except BaseException as error:
            self._lost(channel, server, error)
            raise


def _slice_of(source: int, destination: int) -> int:
    """Whose slice block ``(source, destination)`` holds: the source's when it is for every
    partition (a weight slice), else the destination's (its chunk of a gradient)."""
    return source if destination == EVERY_PARTITION else destination


def _by_server(
    blocks: list[tuple[int, int]], via: Callable[[int], int] | None
) -> dict[int, list[tuple[int, int]]]:
    """``blocks`` ``(source, destination)`` by who serves them (``via(source)``, default the
    source), each server's in the order given."""
    by_server: dict[int, list[tuple[int, int]]] = {}
    for source, destination in blocks:
        by_server.setdefault(source if via is None else via(source), []).append(
            (source, destination)
        )
    return by_server


class _Fetch(NamedTuple):
    """One block ``fetch_blocks`` fetches: whose, for whom, its parts with a future each, and
    where a lossy codec decodes it (None: the channel's scratch)."""

    source: int
    destination: int
    parts: tuple[tuple[int, int], ...]
    futures: list[Future]
    room: np.ndarray | None
