"""Relaying blocks: a hierarchical leader copies blocks as they are into its own store, for
its host (or the other hosts' leaders) to fetch from it instead of from their sources.

A block is relayed under its own key and version, never re-encoded: a block that crossed a
socket is checked (its checksum included) before it is published; one read in place (a
same-host peer's shared memory) is copied and then checked unchanged. ``movements.py``
decides what is relayed; how a block is fetched otherwise is ``fetches.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from allreduce_param.engine.blocks.codec import Codec, parse_header
from allreduce_param.engine.blocks.store import BlockKey
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.channels import Channel
from allreduce_param.engine.movement.fetches import (
    check_unchanged,
    group_by_server,
    header_and_payload,
    note_lost,
    part_plan,
    slice_holding,
)
from allreduce_param.engine.movement.peers import PeerGroup
from allreduce_param.engine.strategy import WeightRead


class Relays:
    """One partition's relaying of blocks through its ``PeerGroup``; ``codecs``: each block
    kind's codec (``movements.block_codecs``), to check what crossed a socket."""

    def __init__(self, peers: PeerGroup, codecs: dict[int, Codec]) -> None:
        self.peers = peers
        self.codecs = codecs

    def start(
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
            for server, server_blocks in group_by_server(blocks, via).items()
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
                for part, (_, length) in enumerate(plan[slice_holding(source, destination)]):
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
                    header_bytes, payload = header_and_payload(block)
                    what = key.describe(version)
                    if in_place:
                        nbytes = header_bytes.nbytes + (0 if payload is None else payload.nbytes)
                        room[: header_bytes.nbytes] = header_bytes
                        if payload is not None:
                            room[header_bytes.nbytes : nbytes] = payload
                        check_unchanged(header_bytes, parse_header(room, what), what)
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
            note_lost(peers, channel, server, error)
            raise
