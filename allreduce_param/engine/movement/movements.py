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
the small blocks (metadata, step choices, signals) and ``allreduce(raw=True)``'s raw, so
no codec rounds them.

Hierarchical (``peers.PeerGroup.hierarchical``), a host's leader also *relays*: it copies
blocks as they are into its own store, under their own keys, for its host or the other
leaders to fetch from it (``relays.Relays``); a block is fetched from whoever
serves it (``peers.PeerGroup.server_of``).

How a block gets here is ``fetches.py``'s (``Fetcher``); how fetched chunks are summed,
``sums.py``'s. The collectives made of these movements are in ``engine/collectives.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future

import numpy as np

from allreduce_param.engine.blocks.codec import Codec, get_codec
from allreduce_param.engine.blocks.store import EVERY_PARTITION, BlockKey, BlockKind, SplitBlock
from allreduce_param.engine.layout import SliceLayout, split
from allreduce_param.engine.movement.fetches import Fetcher, part_plan, place_slices
from allreduce_param.engine.movement.host_sums import HostSums
from allreduce_param.engine.movement.peers import PART_LENGTH, PeerGroup
from allreduce_param.engine.movement.relays import Relays
from allreduce_param.engine.movement.sums import NonFiniteSum, sum_in_order
from allreduce_param.engine.strategy import WeightRead

__all__ = ["EXACT_KINDS", "Movements", "NonFiniteSum", "block_codecs", "part_plan"]

#: The block kinds that always travel raw, whatever the parameter's codecs: the small ones,
#: wanted exact, ``allreduce(raw=True)``'s, whose sums no codec may round, and the typed
#: collectives', whose bytes are not float32 at all.
EXACT_KINDS = (
    BlockKind.CHOICE,
    BlockKind.SIGNAL,
    BlockKind.METADATA,
    BlockKind.RAW_REDUCE_INPUT,
    BlockKind.RAW_REDUCE_OUTPUT,
    BlockKind.RAW_REDUCE_INPUT_HOST_SUM,
    BlockKind.TYPED_CHUNK,
    BlockKind.TYPED_SLICE,
)


def block_codecs(codec: Codec, gradient_codec: Codec | None = None) -> dict[int, Codec]:
    """Each block kind's codec: ``codec`` for the big blocks (weights, allreduce),
    ``gradient_codec`` (default: ``codec``) for gradients, raw for the small exact ones."""
    raw = get_codec("raw")
    codecs = {kind: raw if kind in EXACT_KINDS else codec for kind in BlockKind.NAMES}
    codecs[BlockKind.GRADIENT] = gradient_codec or codec
    # a host sum is dense whatever its gradients were (a top-k of each does not add up to one)
    codecs[BlockKind.GRADIENT_HOST_SUM] = (
        codec if codecs[BlockKind.GRADIENT].sparse else codecs[BlockKind.GRADIENT]
    )
    return codecs


class Movements:
    """One partition's movements of blocks through its ``PeerGroup``, with ``codec`` for the
    big blocks (weights, allreduce), ``gradient_codec`` (default: ``codec``) for gradients,
    and raw for the small exact ones. ``fetcher`` fetches for it, and for whoever else
    reads blocks (the background owner, the collectives)."""

    def __init__(self, peers: PeerGroup, codec: Codec, gradient_codec: Codec | None = None) -> None:
        self.peers = peers
        self.partition_id = peers.partition_id
        self.partition_num = peers.partition_num
        self.codecs = block_codecs(codec, gradient_codec)
        self.fetcher = Fetcher(peers, self.codecs)
        self.relays = Relays(peers, self.codecs)  # a hierarchical leader's
        self._rounded = np.empty(PART_LENGTH, dtype=np.float32)  # error feedback: a part as sent
        #: the hierarchical reduce, through the hosts' leaders
        self.host_sums = HostSums(peers, self.fetcher, self.relays, self.publish)

    def publish(
        self,
        kind: int,
        version: int,
        values: np.ndarray,
        destination: int = EVERY_PARTITION,
        count: float = 0.0,
        residual: np.ndarray | None = None,
        source: int | None = None,
    ) -> None:
        """Encode ``values`` part by part and put each in the own store as ``version``.

        ``source``: whose block it is (default: this partition's); a host's leader publishes
        its host's weight slices from the host arena under their owners' keys, as a relay
        would have copied them.

        ``residual`` (as long as ``values``), for error feedback: what the codec's rounding
        lost before is added to the values first, and it is then replaced by what this
        rounding lost, so over the steps nothing is lost.
        """
        codec = self.codecs[kind]
        pieces = split(values.size, PART_LENGTH)

        def encode(part: int, buffer, ids: tuple) -> memoryview:
            start, length = pieces[part]
            chunk = values[start : start + length]
            if residual is not None:  # the residual's room holds what is sent: values + residual
                chunk = np.add(
                    residual[start : start + length], chunk, out=residual[start : start + length]
                )
            block = codec.encode(chunk, count=count, out=buffer, ids=ids, checksum=False)
            if residual is not None:
                _, sent = codec.decode(
                    block, length, scratch=self._rounded[:length], checksum=False
                )
                chunk -= sent
            return block

        self._publish_parts(kind, version, range(len(pieces)), destination, source, encode)

    def publish_streams(
        self,
        kind: int,
        version: int,
        payload: np.ndarray,
        parts,
        destination: int,
        count: float,
    ) -> None:
        """``publish`` of a chunk whose parts were encoded elsewhere: each of ``parts``
        (``encoded.EncodedPart``, in order) is the codec's stream at
        ``payload[offset:offset+nbytes]``, written with its header (``Codec.encode_stream``).
        The error feedback was the encoder's: nothing is added or kept here."""
        codec = self.codecs[kind]
        by_part = {given.part: given for given in parts}

        def encode(part: int, buffer, ids: tuple) -> memoryview:
            given = by_part[part]
            stream = payload[given.offset : given.offset + given.nbytes]
            return codec.encode_stream(
                stream, given.length, count=count, out=buffer, ids=ids, checksum=False
            )

        self._publish_parts(kind, version, by_part, destination, None, encode)

    def publish_in_place(
        self,
        kind: int,
        version: int,
        values: memoryview,
        destination: int,
        count: float,
        source: int | None = None,
    ) -> None:
        """Publish the float32 bytes ``values`` where they lie, part by part, as ``version``:
        only each part's header is written (raw codec), into a buffer the store gives out.

        The caller must leave ``values`` unchanged until every reader is past this version
        (under BSP: until its next ``get_weights``). Bytes in shared memory are then read by
        same-host peers in place, and sent from there to the others. ``source``: as for
        ``publish``.
        """
        codec = self.codecs[kind]
        pieces = split(values.nbytes // 4, PART_LENGTH)

        def encode(part: int, buffer, ids: tuple) -> SplitBlock:
            start, length = pieces[part]
            header = codec.encode_header(length, count=count, out=buffer, ids=ids)
            return SplitBlock(header, values[4 * start : 4 * (start + length)])

        self._publish_parts(kind, version, range(len(pieces)), destination, source, encode)

    def _publish_parts(
        self,
        kind: int,
        version: int,
        parts: Iterable[int],
        destination: int,
        source: int | None,
        encode: Callable[[int, object, tuple], object],
    ) -> None:
        """What every publish does for each of its ``parts`` (their numbers): reserve a buffer in the own
        store that no reader still uses, have ``encode(part, buffer, ids)`` write the block
        into it (``ids``: what seals it, if it is ever sent; no checksum, sealing covers
        it), and put the block as ``version``. ``source`` None: this partition's block."""
        store, timeout = self.peers.store, self.peers.timeout
        source = self.partition_id if source is None else source
        for part in parts:
            key = BlockKey(kind, source, destination, part)
            buffer = store.reserve(key, version, timeout)
            block = encode(part, buffer, (kind, source, destination, part, version))
            store.put(key, version, block, buffer=buffer)
            del block  # the store holds its own view; ours would pin the buffer's size

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
        ``pending``: the fetches ``Fetcher.fetch_own_chunks`` started already; the others
        are fetched now. Hierarchical, the host sums are summed instead (``HostSums``)."""
        if self.peers.hierarchical:
            return self.host_sums.reduce(kind, version, layout, out, divisor, check)
        pending = dict(pending or {})
        missing = [
            j
            for j in range(self.partition_num)
            if j not in pending and (own is None or j != self.partition_id)
        ]
        if missing:
            pending.update(
                self.fetcher.fetch_own_chunks(kind, version, layout, missing, at_once=True)
            )
        if own is not None:
            values, count = own
            pending[self.partition_id] = futures = []
            for start, length in part_plan(layout)[self.partition_id]:
                futures.append(Future())
                futures[-1].set_result((version, count, values[start : start + length], None))
        return self.sum(pending, range(self.partition_num), out, divisor, check)

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
        """Sum the fetched chunks of ``sources`` into ``out`` (``sums.sum_in_order``); their
        counts. In ``layout.HostLayout``'s order: on each host in partition order, then the
        hosts' sums in host order (``groups``: another grouping of ``sources``, such as one
        host sum each)."""
        groups = self.peers.hosts.grouped(sources) if groups is None else groups
        return sum_in_order(pending, groups, out, divisor, check, names)

    def gather(self, kind: int, read: WeightRead, layout: SliceLayout, out: np.ndarray) -> int:
        """Fetch every owner's slice into its place in ``out``; the lowest version taken.

        A lossy codec decodes each part straight into its place in ``out``. Hierarchical,
        the other hosts' slices come from this host's leader, which first relays its own
        host's slices to the other leaders and theirs here.
        """
        worker, peers, fetcher = self.peers.worker, self.peers, self.fetcher
        sources = list(range(self.partition_num))
        if peers.is_leader:
            hosts, me = peers.hosts, self.partition_id
            mine = [(p, EVERY_PARTITION) for p in hosts.host(me) if p != me]
            theirs = [(p, EVERY_PARTITION) for p in sources if hosts.leader(p) != me]
            relayed = self.relays.start(worker, kind, read, layout, mine) + self.relays.start(
                worker, kind, read, layout, theirs, via=hosts.leader
            )
            pending = fetcher.fetch_slices(kind, read, layout, out, sources=hosts.host(me))
            for done in relayed:  # then the other hosts' slices are in the own store
                done.result()
            pending.update(
                fetcher.fetch_slices(
                    kind, read, layout, out, sources=[p for p, _ in theirs], via=peers.server_of
                )
            )
        else:
            pending = fetcher.fetch_slices(
                kind, read, layout, out, via=peers.server_of, at_once=True
            )
        return place_slices(pending, layout, out, sources)
