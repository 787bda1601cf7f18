"""Fetching blocks from the peers (and from the own store), and relaying them: how a block
gets here, written once for every movement.

A block travels in parts (``part_plan``); ``Fetcher.fetch_blocks`` starts one fetch per
serving partition on a ``channels.Channel`` (the own store's on the calling thread) and
hands back one future per part, resolved as each part is decoded, so a caller sums part
k while part k+1 is on the wire. Relaying blocks (a hierarchical leader's job) is
``relays.py``'s, with the helpers here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np

from allreduce_param.engine.blocks.codec import Codec
from allreduce_param.engine.blocks.store import EVERY_PARTITION, BlockKey, SplitBlock
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
from allreduce_param.errors import AuthenticationError, CorruptBlockError, PeerLostError

#: The longest block (in values, 512 KiB of float32) that the worker fetches on its own
#: thread where it waits for it next (``Fetcher.fetch_blocks``'s ``at_once``): below it a
#: thread hand-off costs more than the copy the caller could do meanwhile.
INLINE_LENGTH = 1 << 17


@functools.lru_cache(maxsize=64)
def part_plan(layout: SliceLayout) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``plan[j]``: the parts ``(start, length)`` of slice ``j`` of ``layout``, counted from
    the slice's start."""
    return tuple(tuple(split(layout.length(j), PART_LENGTH)) for j in range(layout.partition_num))


def header_and_payload(block) -> tuple[memoryview, memoryview | None]:
    """A block as ``Codec.decode`` takes it: its bytes, or a split block's two parts."""
    return (block.header, block.payload) if isinstance(block, SplitBlock) else (block, None)


def check_unchanged(block: memoryview, header, what: str) -> None:
    """Raise if a block read in place was rewritten while it was read."""
    if not Codec.unchanged(block, header):
        raise CorruptBlockError(
            f"{what} was rewritten while it was read in place: a protocol slip (its owner "
            "reused the buffer of a version still being read)"
        )


def note_lost(peers: PeerGroup, channel: Channel, server: int, error: BaseException) -> None:
    """After a fetch (or relay) from ``server`` failed: a peer gone, or not of this
    parameter, fetches nothing from us (a fetch we cut ourselves, failing, says nothing of
    the peer, which may still wait on us)."""
    if isinstance(error, (PeerLostError, AuthenticationError)) and not channel.aborted:
        peers.peer_done(server)


class Fetcher:
    """One partition's fetches of blocks through its ``PeerGroup``; ``codecs``: each block
    kind's codec (``movements.block_codecs``)."""

    def __init__(self, peers: PeerGroup, codecs: dict[int, Codec]) -> None:
        self.peers = peers
        self.partition_id = peers.partition_id
        self.partition_num = peers.partition_num
        self.codecs = codecs

    def fetch_own_chunks(
        self,
        kind: int,
        version: int,
        layout: SliceLayout,
        sources: list[int],
        at_once: bool = False,
    ) -> dict[int, list[Future]]:
        """Start fetching the own chunk of ``version`` from each partition of ``sources``:
        what ``Movements.reduce`` sums. Started before the peers have published, the fetches
        wait for them, so the chunks arrive while this partition still computes; with
        ``at_once`` (the caller waits for them next) as ``fetch_blocks`` says."""
        return self.fetch_all(
            self.peers.worker,
            kind,
            WeightRead(version, exact=True),
            layout,
            destination=self.partition_id,
            sources=sources,
            at_once=at_once,
        )

    def fetch_slices(
        self,
        kind: int,
        read: WeightRead,
        layout: SliceLayout,
        into: np.ndarray,
        sources=None,
        via: Callable[[int], int] | None = None,
        at_once: bool = False,
    ) -> dict[int, list[Future]]:
        """Start fetching whole slices (the blocks ``(kind, j, EVERY_PARTITION)``) of each
        partition ``j`` of ``sources`` (default: all) with the worker's channel, a lossy codec
        decoding straight into their places in ``into``: what a gather fetches. ``via`` and
        ``at_once`` as for ``fetch_all``; ``place_slices`` puts the results in place."""
        return self.fetch_all(
            self.peers.worker,
            kind,
            read,
            layout,
            EVERY_PARTITION,
            sources=sources,
            into=into,
            via=via,
            at_once=at_once,
        )

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
        at_once: bool = False,
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
            at_once,
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
        at_once: bool = False,
    ) -> dict[tuple[int, int], list[Future]]:
        """``fetch_all`` for any blocks ``(source, destination)`` of one kind, keyed by them.

        The blocks one partition serves (``via(source)``, default the source) are fetched
        in the order given by one pool thread, over its one connection; those this partition
        serves itself (with the worker's channel) are read from the own store on the calling
        thread, once the others have started. With ``at_once`` (the worker's channel, whose
        caller waits for every block next), the last server's blocks, when each is one part
        of at most ``INLINE_LENGTH`` values, are fetched on the calling thread too, after
        the own: a small vector's sync is mostly hand-offs between threads, and this saves
        two per step and phase (with one peer, all of them); a larger block stays on a pool
        thread, so the caller sums or copies the blocks it has while the others come.
        """
        plan = part_plan(layout)
        pending: dict[tuple[int, int], list[Future]] = {}
        by_server: dict[int, list[_Fetch]] = {}
        for server, server_blocks in group_by_server(blocks, via).items():
            by_server[server] = []
            for source, destination in server_blocks:
                slice_of = slice_holding(source, destination)
                parts = plan[slice_of]
                room = None if into is None else into[layout.bounds(slice_of)]
                futures = pending[(source, destination)] = [Future() for _ in parts]
                by_server[server].append(_Fetch(source, destination, parts, futures, room))
        worker = channel is self.peers.worker
        own = by_server.pop(self.partition_id, None) if worker else None
        inline = None
        if worker and at_once and by_server:
            last = next(reversed(by_server))
            if all(
                len(fetch.parts) == 1 and fetch.parts[0][1] <= INLINE_LENGTH
                for fetch in by_server[last]
            ):
                inline = last, by_server.pop(last)
        for server, fetches in by_server.items():
            channel.start(self._fetch_from(channel, server, kind, read, fetches, follow_first))
        if own:
            run_through(self._fetch_from(channel, self.partition_id, kind, read, own, follow_first))
        if inline:
            server, fetches = inline
            run_through(self._fetch_from(channel, server, kind, read, fetches, follow_first))
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
                block, payload = header_and_payload(block)
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
                note_lost(self.peers, channel, server, error)
                for future in futures[part:]:
                    future.set_exception(error)
                return error
            recheck = (
                functools.partial(check_unchanged, block, header, key.describe(version))
                if in_place
                else None
            )
            futures[part].set_result((version, header.count, values, recheck))
            offset += size
            if follow_first:
                read = WeightRead(version, exact=True)
        return None


def place_slices(
    pending: dict[int, list[Future]], layout: SliceLayout, out: np.ndarray, owners
) -> int | None:
    """Wait for the fetched slices of ``owners`` (``Fetcher.fetch_slices``) and put each part
    in its place in ``out``, unless it was decoded there; a part read in place is rechecked
    after its copy. The lowest version among them (None for no owners)."""
    lowest = None
    plan = part_plan(layout)
    for owner in owners:
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


def slice_holding(source: int, destination: int) -> int:
    """Whose slice block ``(source, destination)`` holds: the source's when it is for every
    partition (a weight slice), else the destination's (its chunk of a gradient)."""
    return source if destination == EVERY_PARTITION else destination


def group_by_server(
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
