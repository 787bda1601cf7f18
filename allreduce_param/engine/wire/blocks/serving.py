"""What a block server reads from and writes to one proven peer's connection.

``ServedPeer`` is the connection as the server keeps it between requests; ``read_request``
reads and checks one request frame; ``send_block`` writes a block (over the socket, or,
to a same-host peer that asked for it, where it lies in shared memory, passing each
segment's descriptor once per connection) and ``send_frame`` any other answer. Which
answer a request gets is ``server.BlockServer``'s.
"""

from __future__ import annotations

import socket
from typing import NamedTuple

from allreduce_param.engine.blocks.codec import HEADER_SIZE, Codec
from allreduce_param.engine.blocks.shm import SharedArenas
from allreduce_param.engine.blocks.store import Block, BlockKey, BlockKind, SplitBlock
from allreduce_param.engine.wire.blocks.protocol import (
    FLAG_NEWEST,
    OP_GET_SHARED,
    OPS,
    REQUEST,
    RESPONSE,
    SHARED_PLACE,
    STATUS_OK,
    STATUS_SHARED,
)
from allreduce_param.engine.wire.handshake import MAGIC, Proven
from allreduce_param.engine.wire.sockets import recv_exactly
from allreduce_param.errors import ProtocolError

#: A block leaves in slices of at most this many bytes, each within the connect timeout: a
#: reader that takes nothing for that long is taken for gone, and its connection closed.
SEND_SLICE = 1 << 20


class ServedPeer:
    """A proven peer's connection, as the block server keeps it between its requests."""

    __slots__ = (
        "conn",
        "partition",
        "peer_text",
        "local",
        "fds_passed",
        "request",
        "deadline",
        "timer",
        "ended",
        "only_asked_address",
    )

    def __init__(self, proven: Proven) -> None:
        # what requests are read from and answers written to (sealed, if agreed)
        self.conn = proven.sock
        self.partition = proven.partition
        self.peer_text = proven.peer_text
        self.local = self.conn.family == socket.AF_UNIX
        self.fds_passed: set[int] = set()  # segments whose descriptor this peer already has
        # (key, version, newest, op, wait) of the get being answered
        self.request: tuple | None = None
        self.deadline = 0.0  # when that get stops waiting
        self.timer = None  # the server's timer for that deadline
        self.ended = False
        # the connection only asked where to reach us (OP_ADDRESS): its end is no "done"
        self.only_asked_address = False


class Request(NamedTuple):
    """One request frame: its op (without ``FLAG_NEWEST``), the block and version asked
    for, whether the newest at or above it will do, how long the peer would wait (ms)."""

    op: int
    key: BlockKey
    version: int
    newest: bool
    timeout_ms: int


def read_request(conn) -> Request:
    """Read one request frame from ``conn``. ``EOFError`` when the peer hung up first,
    ``OSError`` from the socket, ``AllReduceError`` from a sealed connection's record, and
    ``ProtocolError`` for a malformed frame (its first bytes in the message)."""
    request = bytearray(REQUEST.size)
    recv_exactly(conn, memoryview(request))
    magic, op, kind, source, destination, part, version, timeout_ms = REQUEST.unpack(request)
    newest, op = bool(op & FLAG_NEWEST), op & ~FLAG_NEWEST
    if magic != MAGIC or op not in OPS or kind not in BlockKind.NAMES:
        raise ProtocolError(f"malformed request frame {bytes(request[:16]).hex()}")
    return Request(op, BlockKey(kind, source, destination, part), version, newest, timeout_ms)


def send_block(
    peer: ServedPeer, op: int, version: int, block: Block, shared: SharedArenas | None
) -> None:
    """Answer ``peer``'s get (``op``) with ``version``'s ``block``: where it lies in ``shared``
    memory to a same-host peer that asked so (``OP_GET_SHARED``) and it lies there, else
    its bytes, sealed, in slices of ``SEND_SLICE``."""
    conn = peer.conn
    header, payload = (
        block if isinstance(block, SplitBlock) else (block[:HEADER_SIZE], block[HEADER_SIZE:])
    )
    places = (
        [shared.locate(header), shared.locate(payload)]
        if op == OP_GET_SHARED and peer.local and shared
        else [None]
    )
    if None in places:
        # its bytes leave this host's memory: they need their checksum
        Codec.seal(header, payload)
        conn.sendall(RESPONSE.pack(STATUS_OK, block.nbytes, version) + header)
        for start in range(0, payload.nbytes, SEND_SLICE):
            conn.sendall(payload[start : start + SEND_SLICE])
        return
    (header_segment, header_offset), (payload_segment, payload_offset) = places
    answer = RESPONSE.pack(STATUS_SHARED, block.nbytes, version) + SHARED_PLACE.pack(
        header_segment.id, header_offset, header.nbytes, payload_segment.id, payload_offset
    )
    new = {segment.id: segment.fd for segment, _ in places if segment.id not in peer.fds_passed}
    if new:  # the descriptors ride with the answer, once per connection
        socket.send_fds(conn, [answer], list(new.values()))
        peer.fds_passed.update(new)
    else:
        conn.sendall(answer)


def send_frame(conn, status: int, data: bytes, fds: list[int] | None = None) -> None:
    """Answer with ``status`` and ``data`` (an error text, an address, the arena's
    description), with ``fds`` riding along when given (over a Unix socket)."""
    frame = RESPONSE.pack(status, len(data), 0) + data
    if fds is None:
        conn.sendall(frame)
    else:
        socket.send_fds(conn, [frame], fds)
