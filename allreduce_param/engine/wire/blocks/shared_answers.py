"""Where a peer on this host answers with a block in shared memory (``STATUS_SHARED``), the
client reads it in place: the descriptors of the peer's segments come with the answers,
each once per connection, and stay mapped for the client's life."""

from __future__ import annotations

import os
import socket

from allreduce_param.engine.blocks.shm import SharedMappings
from allreduce_param.engine.blocks.store import SplitBlock
from allreduce_param.engine.wire.blocks.protocol import RESPONSE, SHARED_PLACE
from allreduce_param.engine.wire.sockets import recv_exactly
from allreduce_param.errors import ProtocolError


class SharedAnswers:
    """One ``PeerClient``'s shared answers: the peer's segments mapped, the descriptors that
    came with the answer being read, and which segments the current connection brought
    (the server passes each descriptor once per connection)."""

    def __init__(self) -> None:
        self._mappings = SharedMappings()
        self._pending: list[int] = []  # descriptors that came with a response head
        self._passed: set[int] = set()  # segments whose descriptor this connection brought

    def receive_head(self, sock: socket.socket, shared: bool) -> tuple[int, int, int]:
        """The response's status, length and version. A shared answer may carry a descriptor with its
        first bytes, so those are read with recvmsg and the descriptor kept for the segment."""
        head = bytearray(RESPONSE.size)
        if not shared:
            recv_exactly(sock, memoryview(head))
            return RESPONSE.unpack_from(head)
        data, fds, _, _ = socket.recv_fds(sock, RESPONSE.size, 2)
        self._pending = list(fds)
        if not data:
            raise EOFError("connection closed before the response")
        head[: len(data)] = data
        recv_exactly(sock, memoryview(head)[len(data) : RESPONSE.size])
        return RESPONSE.unpack_from(head)

    def place(self, sock: socket.socket, length: int, what: str, peer_text: str) -> SplitBlock:
        """After a shared answer: views of where the block's header and payload lie (the
        descriptors of segments not seen before came with the answer's first bytes)."""
        tail = bytearray(SHARED_PLACE.size)
        recv_exactly(sock, memoryview(tail))
        header_segment, header_offset, header_length, payload_segment, payload_offset = (
            SHARED_PLACE.unpack(tail)
        )
        fds, self._pending = self._pending, []
        # the server passes each segment's descriptor once per connection, the header's first
        fresh = [
            segment
            for segment in dict.fromkeys((header_segment, payload_segment))
            if segment not in self._passed
        ]
        if len(fds) != len(fresh):
            for fd in fds:
                os.close(fd)
            raise ProtocolError(
                f"{peer_text} passed {len(fds)} descriptors with {what}, which lies in "
                f"shared segments {fresh} not passed on this connection yet"
            )
        for segment, fd in zip(fresh, fds):
            self._passed.add(segment)
            if segment in self._mappings:  # mapped from an earlier connection
                os.close(fd)
            else:
                self._mappings.add(segment, fd)
        if header_length > length:
            raise ProtocolError(
                f"{peer_text} said {what} has a {header_length}-byte header "
                f"in a {length}-byte block"
            )
        views = []
        for segment, offset, size in (
            (header_segment, header_offset, header_length),
            (payload_segment, payload_offset, length - header_length),
        ):
            view = self._mappings.view(segment, offset, size)
            if view is None:
                raise ProtocolError(
                    f"{peer_text} placed part of {what} at bytes {offset}..{offset + size} "
                    f"of shared segment {segment}, which is not that long"
                )
            views.append(view)
        return SplitBlock(*views)

    def connection_ended(self) -> None:
        """The connection closed: descriptors not yet placed are closed, and the next
        connection passes every segment's descriptor anew."""
        for fd in self._pending:
            os.close(fd)
        self._pending = []
        self._passed = set()

    def close(self) -> None:
        """Unmap the peer's segments."""
        self._mappings.close()
