"""The four movements of blocks between partitions, written once: publish, scatter, reduce, gather.

- ``publish``: encode a vector part by part into the own store, as one version of a block.
- ``scatter``: publish chunk ``j`` of a vector for owner ``j`` (a gradient, an allreduce input).
- ``reduce``: fetch the own chunk from every partition and sum it, in partition order, in fp32.
- ``gather``: fetch every owner's slice into its place in one full vector.

A block of more than ``PART_LENGTH`` elements travels as several parts (the part plan of a
``SliceLayout``, computed once): a peer fetches part k while the owner still encodes part
k+1, and the receiver sums part k while part k+1 is on the wire. Each element is still summed
in partition order. What a part's sum needs next (the divide into a mean, the check for
NaN/Inf) is done on that part while it is in cache, not in a pass of its own.

Each kind of block has one codec: weights and allreduce blocks the parameter's, gradients
the parameter's gradient codec (the same unless it says otherwise);
the small blocks (metadata, step choices, signals) raw, so they are exact whatever it is.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from typing import Callable

import numpy as np

from .codec import Codec, get_codec
from .errors import AuthenticationError, CorruptBlockError, NonFiniteGradientError, PeerLostError
from .layout import SliceLayout, split
from .peers import PART_LENGTH, Channel, PeerGroup
from .store import EVERY_PARTITION, BlockKey, BlockKind, SplitBlock
from .strategy import WeightRead

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
        raise CorruptBlockError(f"{what} was rewritten while it was read in place: a protocol slip (its owner "
                                "reused the buffer of a version still being read)")


class NonFiniteSum:
    """Finds what made a summed gradient part NaN/Inf, for a message that names it.

    ``version`` is the step; ``slice_start`` where the summed chunk begins in the full vector.
    """

    def __init__(self, version: int, slice_start: int) -> None:
        self.version = version
        self.slice_start = slice_start

    def check(self, target: np.ndarray, start: int, sources: list[int], parts: list[np.ndarray]) -> None:
        """Raise ``NonFiniteGradientError`` if the summed part ``target`` (from ``start`` in the
        slice) holds NaN/Inf: naming the first source partition whose part does, or else
        saying the sum overflowed."""
        if np.isfinite(target.sum()) or np.isfinite(target).all():  # one cheap pass in cache
            return
        for source, values in zip(sources, parts):
            bad = np.flatnonzero(~np.isfinite(values))
            if bad.size:
                index = self.slice_start + start + int(bad[0])
                raise NonFiniteGradientError(
                    f"the gradient of partition {source} for step {self.version} holds NaN/Inf "
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
        self._rounded = np.empty(PART_LENGTH, dtype=np.float32)  # error feedback: a part as sent

    def publish(self, kind: int, version: int, values: np.ndarray, destination: int = EVERY_PARTITION,
                count: float = 0.0, residual: np.ndarray | None = None) -> None:
        """Encode ``values`` part by part and put each in the own store as ``version``.

        Each part is encoded into a buffer the store gives out, which no reader still uses.
        ``residual`` (as long as ``values``), for error feedback: what the codec's rounding
        lost before is added to the values first, and it is then replaced by what this
        rounding lost, so over the steps nothing is lost.
        """
        store, codec, timeout = self.peers.store, self.codecs[kind], self.peers.timeout
        for part, (start, length) in enumerate(split(values.size, PART_LENGTH)):
            key = BlockKey(kind, self.partition_id, destination, part)
            chunk = values[start:start + length]
            if residual is not None:  # the residual's room holds what is sent: values + residual
                chunk = np.add(residual[start:start + length], chunk, out=residual[start:start + length])
            buffer = store.reserve(key, version, timeout)
            block = codec.encode(chunk, count=count, out=buffer,
                                 ids=(kind, self.partition_id, destination, part, version),
                                 checksum=False)  # sealed if it is ever sent
            if residual is not None:
                _, sent = codec.decode(block, length, scratch=self._rounded[:length], checksum=False)
                chunk -= sent
            store.put(key, version, block, buffer=buffer)
            del block  # the store holds its own view; ours would pin the buffer's size

    def publish_in_place(self, kind: int, version: int, values: memoryview, destination: int,
                         count: float) -> None:
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
            header = codec.encode_header(length, count=count, out=buffer,
                                         ids=(kind, self.partition_id, destination, part, version))
            store.put(key, version, SplitBlock(header, values[4 * start:4 * (start + length)]), buffer=buffer)
            del header

    def scatter(self, kind: int, version: int, vector: np.ndarray, layout: SliceLayout, count: float,
                residual: np.ndarray | None = None, own: bool = True, in_place: memoryview | None = None) -> None:
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
        return [(self.partition_id + step) % self.partition_num
                for step in range(1, self.partition_num + (1 if own else 0))]

    def scatter_chunk(self, kind: int, version: int, vector: np.ndarray, layout: SliceLayout, count: float,
                      owner: int, residual: np.ndarray | None = None, in_place: memoryview | None = None) -> None:
        """Publish ``owner``'s chunk of ``vector`` as ``version``: one step of ``scatter``."""
        bounds = layout.bounds(owner)
        if in_place is not None:
            self.publish_in_place(kind, version, in_place[4 * bounds.start:4 * bounds.stop], owner, count)
        else:
            self.publish(kind, version, vector[bounds], destination=owner, count=count,
                         residual=None if residual is None else residual[bounds])

    def fetch_own_chunks(self, kind: int, version: int, layout: SliceLayout,
                         sources: list[int]) -> dict[int, list[Future]]:
        """Start fetching the own chunk of ``version`` from each partition of ``sources``: what
        ``reduce`` sums. Started before the peers have published, the fetches wait for them,
        so the chunks arrive while this partition still computes."""
        return self.fetch_all(self.peers.worker, kind, WeightRead(version, exact=True), layout,
                              destination=self.partition_id, sources=sources)

    def reduce(self, kind: int, version: int, layout: SliceLayout, out: np.ndarray,
               divisor: Callable[[float], float | None] | None = None, check: NonFiniteSum | None = None,
               own: tuple[np.ndarray, float] | None = None,
               pending: dict[int, list[Future]] | None = None) -> float:
        """Sum the own chunk of ``version`` from every partition into ``out``, in partition
        order; returns the summed counts. ``divisor`` and ``check`` are as for ``sum``.
        ``own``: this partition's chunk and count as they are, when ``scatter`` did not
        publish them (an exact codec would give the same bits). ``pending``: the fetches
        ``fetch_own_chunks`` started already; the other sources are fetched now."""
        pending = dict(pending or {})
        missing = [j for j in range(self.partition_num)
                   if j not in pending and (own is None or j != self.partition_id)]
        if missing:
            pending.update(self.fetch_own_chunks(kind, version, layout, missing))
        if own is not None:
            values, count = own
            pending[self.partition_id] = futures = []
            for start, length in part_plan(layout)[self.partition_id]:
                futures.append(Future())
                futures[-1].set_result((version, count, values[start:start + length], None))
        return self.sum(pending, range(self.partition_num), out, divisor, check)

    @staticmethod
    def sum(pending: dict[int, list[Future]], sources, out: np.ndarray,
            divisor: Callable[[float], float | None] | None = None, check: NonFiniteSum | None = None) -> float:
        """Sum the fetched chunks of ``sources`` into ``out``, in the order given; their counts.

        ``divisor(total)``, once the counts are known, gives what to divide the sum by (None:
        leave it a sum); ``check`` raises if a summed part holds NaN/Inf. Both act on each
        part just after it is summed. Every part is summed before anything is raised, so no
        fetch is left running.
        """
        total, scale, failure = 0.0, None, None
        sources = list(sources)
        for part, (start, length) in enumerate(split(out.size, PART_LENGTH)):
            target = out[start:start + length]
            parts = [pending[source][part].result() for source in sources]
            if part == 0:
                total = sum(count for _, count, _, _ in parts)
                value = None if divisor is None else divisor(total)
                scale = None if value is None else np.float32(value)
            if len(parts) == 1:
                np.copyto(target, parts[0][2])
            else:  # the first two are added in one pass, not copied and then added
                np.add(parts[0][2], parts[1][2], out=target)
                for _, _, values, _ in parts[2:]:
                    target += values
            if check is not None and failure is None:
                try:
                    check.check(target, start, sources, [values for _, _, values, _ in parts])
                except NonFiniteGradientError as error:
                    failure = error
            if scale is not None:
                target /= scale
            for _, _, _, recheck in parts:
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
        self.reduce(BlockKind.REDUCE_INPUT, version, layout, reduced,
                    divisor=(lambda total: self.partition_num) if mean else None)
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

        A lossy codec decodes each part straight into its place in ``out``.
        """
        pending = self.fetch_all(self.peers.worker, kind, read, layout, destination=EVERY_PARTITION, into=out)
        lowest = None
        plan = part_plan(layout)
        for owner in range(self.partition_num):
            base = layout.start(owner)
            for part, (start, length) in enumerate(plan[owner]):
                version, _, values, recheck = pending[owner][part].result()
                target = out[base + start:base + start + length]
                if not np.shares_memory(values, target):
                    np.copyto(target, values)
                if recheck is not None:
                    recheck()
                lowest = version if lowest is None else min(lowest, version)
        return lowest

    def fetch_all(self, channel: Channel, kind: int, read: WeightRead, layout: SliceLayout,
                  destination: int, sources=None, follow_first: bool = False,
                  into: np.ndarray | None = None) -> dict[int, list[Future]]:
        """Start fetching every part of block ``(kind, j, destination)`` from each partition ``j``
        of ``sources`` (default: all), as ``read`` says: each part on its own, or with
        ``follow_first`` every part in the version the first part came in. The blocks'
        lengths are ``layout``'s: slice ``j``'s for blocks for every partition, else slice
        ``destination``'s.

        ``result[j][k]`` is a future of part k's ``(version, count, values, recheck)``; values
        stay valid until the channel's next fetch from ``j``. A lossy codec decodes into
        ``into`` (a full vector of ``layout``, slice ``j`` at its place) when given, else into
        the channel's scratch. ``recheck``, for a block read in place (the own store, a peer's
        shared memory), raises if the block was rewritten while it was read: call it after
        using the values. With the worker's channel the own blocks are read from the own store
        at once; otherwise, and for each peer, one pool thread fetches the parts in order.
        """
        pending: dict[int, list[Future]] = {}
        plan = part_plan(layout)
        for source in range(self.partition_num) if sources is None else sources:
            slice_of = source if destination == EVERY_PARTITION else destination
            parts = plan[slice_of]
            room = None if into is None else into[layout.bounds(slice_of)]
            futures = [Future() for _ in parts]
            arguments = (channel, source, kind, read, destination, parts, futures, follow_first, room)
            if source == self.partition_id and channel is self.peers.worker:
                self._fetch_parts(*arguments)
            else:
                channel.pool.submit(self._fetch_parts, *arguments)
            pending[source] = futures
        return pending

    def _fetch_parts(self, channel: Channel, source: int, kind: int, read: WeightRead, destination: int,
                     parts: tuple[tuple[int, int], ...], futures: list[Future], follow_first: bool,
                     room: np.ndarray | None) -> None:
        """Fetch and decode ``source``'s parts in order, resolving one future per part.

        A failure fails this part and every later one, so the caller sees it where it waits.
        """
        peers, codec = self.peers, self.codecs[kind]
        sizes = [codec.max_encoded_size(length) for _, length in parts]
        local = source == self.partition_id
        in_place = peers.reads_in_place(channel, source)  # no receive buffer, no checksum
        receive = None if in_place else channel.receive_buffer(source, sum(sizes))
        if room is None:
            room = channel.scratch(source, parts[-1][0] + parts[-1][1] if parts else 0)
        offset = 0
        for part, ((start, length), size) in enumerate(zip(parts, sizes)):
            key = BlockKey(kind, source, destination, part)
            try:
                if local:
                    version, block = peers.store.get(key, read.version, peers.timeout,
                                                     newest=not read.exact, reader=channel.reader)
                else:
                    version, block = channel.clients[source].fetch(
                        key, read.version, size, None if receive is None else receive[offset:offset + size],
                        in_place, newest=not read.exact)
                block, payload = _header_and_payload(block)
                header, values = codec.decode(
                    block, length, scratch=room[start:start + length], what=key.describe(version),
                    expect=(kind, source, destination, part, version), checksum=not in_place, payload=payload,
                )
            except BaseException as error:
                if isinstance(error, (PeerLostError, AuthenticationError)) and not channel.aborted:
                    # gone, or not of this parameter: it fetches nothing from us (a fetch we
                    # cut ourselves, failing, says nothing of the peer, which may still wait on us)
                    peers.peer_done(source)
                for future in futures[part:]:
                    future.set_exception(error)
                return
            recheck = functools.partial(_recheck, block, header, key.describe(version)) if in_place else None
            futures[part].set_result((version, header.count, values, recheck))
            offset += size
            if follow_first:
                read = WeightRead(version, exact=True)
