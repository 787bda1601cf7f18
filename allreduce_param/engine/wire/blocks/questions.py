"""The one-off questions a ``PeerClient`` asks on a connection of its own, then ends: the
peer's address (``OP_ADDRESS``) and, of a host's leader, the host arena (``OP_ARENA``).

Each function sends the question on a fresh proven connection and reads the answer's
frame; the caller made the connection and ends it.
"""

from __future__ import annotations

import json
import os
import socket

from allreduce_param.engine.blocks.store import BlockKind
from allreduce_param.engine.wire.blocks.client_errors import answer_error
from allreduce_param.engine.wire.blocks.protocol import (
    MAX_ADDRESS_TEXT,
    OP_ADDRESS,
    OP_ARENA,
    REQUEST,
    RESPONSE,
    STATUS_OK,
)
from allreduce_param.engine.wire.handshake import MAGIC
from allreduce_param.engine.wire.sockets import recv_exactly
from allreduce_param.errors import ProtocolError


def read_address(sock, peer_text: str, what: str) -> bytes:
    """Ask ``sock``'s server where it can be reached; the answer's JSON bytes."""
    sock.sendall(REQUEST.pack(MAGIC, OP_ADDRESS, BlockKind.WEIGHT, 0, 0, 0, 0, 0))
    head = bytearray(RESPONSE.size)
    recv_exactly(sock, memoryview(head))
    status, length, _ = RESPONSE.unpack(head)
    if status != STATUS_OK or length > MAX_ADDRESS_TEXT:
        raise ProtocolError(
            f"{peer_text} answered the question of {what} with status {status} and {length} bytes"
        )
    text = bytearray(length)
    recv_exactly(sock, memoryview(text))
    return bytes(text)


def parse_address_answer(text: bytes, peer_text: str, what: str) -> list:
    """The advertised address (a list) ``read_address`` got as JSON ``text``."""
    try:
        address = json.loads(text)
    except ValueError as error:
        raise ProtocolError(
            f"{peer_text} answered the question of {what} with no JSON: {error}"
        ) from error
    if not isinstance(address, list):
        raise ProtocolError(f"{peer_text} answered the question of {what} with {address!r}")
    return address


def read_arena(
    sock: socket.socket, max_fds: int, peer_text: str, what: str
) -> tuple[bytes, list[int]]:
    """Ask ``sock``'s server (a host's leader, over its Unix socket) for the host arena:
    its description and descriptors (at most ``max_fds``), which the caller then owns.
    Descriptors received before an error are closed."""
    fds: list[int] = []
    try:
        sock.sendall(REQUEST.pack(MAGIC, OP_ARENA, BlockKind.WEIGHT, 0, 0, 0, 0, 0))
        first, fds, _, _ = socket.recv_fds(sock, RESPONSE.size + MAX_ADDRESS_TEXT, max_fds)
        if len(first) < RESPONSE.size:
            head = bytearray(RESPONSE.size)
            head[: len(first)] = first
            recv_exactly(sock, memoryview(head)[len(first) :])
            first = bytes(head)
        status, length, _ = RESPONSE.unpack(first[: RESPONSE.size])
        if status != STATUS_OK:
            raise answer_error(
                peer_text, status, length, _Prefixed(first[RESPONSE.size :], sock), what
            )
        if length > MAX_ADDRESS_TEXT:
            raise ProtocolError(f"{peer_text} answered {what} with {length} bytes")
        text = bytearray(length)
        got = first[RESPONSE.size : RESPONSE.size + length]
        text[: len(got)] = got
        recv_exactly(sock, memoryview(text)[len(got) :])
        return bytes(text), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class _Prefixed:
    """A socket to read an error text from whose first bytes came already (with descriptors)."""

    def __init__(self, first: bytes, sock: socket.socket) -> None:
        self._first = first
        self._sock = sock

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        if self._first:
            size = min(len(self._first), nbytes or len(buffer))
            buffer[:size] = self._first[:size]
            self._first = self._first[size:]
            return size
        return self._sock.recv_into(buffer, nbytes)
