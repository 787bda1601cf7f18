"""Fuzzing (a bounded number of cases per run) of what strangers and broken peers can send:
handshakes, request frames, answers, and blocks. Nothing crashes a server, nothing makes a
reader allocate past what the block can be, and honest traffic carries on after each case."""

from __future__ import annotations

import os
import socket
import struct
import threading
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allreduce_param import AllReduceError
from allreduce_param.engine import CorruptBlockError
from allreduce_param.engine.blocks.codec import CODECS, HEADER_SIZE, get_codec
from allreduce_param.engine.blocks.store import BlockKey, BlockKind, BlockStore
from allreduce_param.engine.wire.blocks import OP_GET, STATUS_OK, BlockServer, PeerClient
from allreduce_param.engine.wire.blocks.protocol import REQUEST
from allreduce_param.engine.wire.handshake import _CLIENT_HELLO, MAGIC, NONCE_SIZE, mac

SECRET = b"f" * 32
KEY = BlockKey(BlockKind.WEIGHT, 0, 0xFFFFFFFF)
CASES = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
VALUES = np.arange(1000, dtype=np.float32)


@pytest.fixture(scope="module")
def server():
    store = BlockStore()
    store.put(KEY, 0, get_codec("raw").encode(VALUES, ids=(KEY.kind, 0, KEY.destination, 0, 0)))
    served = BlockServer(
        store, SECRET, param_id=5, partition_id=0, host="127.0.0.1", partition_num=2, max_wait=0.05
    )
    yield served
    served.close()


def honest_fetch_works(server) -> None:
    client = PeerClient(server.address, SECRET, 5, 1, peer_partition=0, timeout=5)
    try:
        version, block = client.fetch(KEY, 0, get_codec("raw").max_encoded_size(1000), None)
        _, values = get_codec("raw").decode(
            block, 1000, expect=(KEY.kind, 0, KEY.destination, 0, 0)
        )
        assert version == 0 and np.array_equal(values, VALUES)
    finally:
        client.close()


def send_and_drain(sock: socket.socket, data: bytes) -> bytes:
    """Send ``data``, say we are done sending, and read whatever comes back until it closes."""
    sock.settimeout(10)
    received = b""
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(65536):
            received += chunk
    except OSError:
        pass
    sock.close()
    return received


@CASES
@given(hello=st.binary(max_size=120))
def test_any_handshake_bytes_leave_the_server_serving(server, hello):
    sock = socket.create_connection(server.address, timeout=10)
    greeting = sock.recv(len(MAGIC) + NONCE_SIZE)
    assert greeting.startswith(MAGIC)
    answer = send_and_drain(sock, hello)
    assert len(answer) <= 1 + 32  # a refusal, or an honest answer to an honest hello: never a block
    honest_fetch_works(server)


def authenticated(server) -> socket.socket:
    sock = socket.create_connection(server.address, timeout=10)
    greeting = b""
    while len(greeting) < len(MAGIC) + NONCE_SIZE:
        greeting += sock.recv(64)
    nonce = os.urandom(NONCE_SIZE)
    ids = struct.pack("<II", 5, 1)
    sock.sendall(
        _CLIENT_HELLO.pack(
            MAGIC, 5, 1, nonce, mac(SECRET, b"client", greeting[len(MAGIC) :], nonce, ids)
        )
    )
    assert sock.recv(1) == bytes([STATUS_OK])
    sock.recv(32)
    return sock


@CASES
@given(frames=st.binary(max_size=200), valid_first=st.booleans())
def test_any_request_frames_from_a_proven_peer_leave_the_server_serving(
    server, frames, valid_first
):
    sock = authenticated(server)
    if valid_first:  # a good request, then the garbage on the same connection
        frames = (
            REQUEST.pack(MAGIC, OP_GET, KEY.kind, KEY.source, KEY.destination, 0, 0, 1000) + frames
        )
    send_and_drain(sock, frames)
    honest_fetch_works(server)


class FakeServer:
    """Does an honest handshake, then answers the first request with the given bytes."""

    def __init__(self, answer: bytes) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.answer = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(10)
            nonce = os.urandom(NONCE_SIZE)
            conn.sendall(MAGIC + nonce)
            hello = b""
            while len(hello) < _CLIENT_HELLO.size:
                hello += conn.recv(_CLIENT_HELLO.size - len(hello))
            _, param_id, partition, client_nonce, _ = _CLIENT_HELLO.unpack(hello)
            ids = struct.pack("<II", param_id, partition)
            conn.sendall(bytes([STATUS_OK]) + mac(SECRET, b"server", client_nonce, nonce, ids))
            request = b""
            while len(request) < REQUEST.size:
                request += conn.recv(REQUEST.size - len(request))
            try:
                conn.sendall(self.answer)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        self.thread.join(10)


@CASES
@given(
    answer=st.one_of(
        st.binary(max_size=100),
        st.tuples(
            st.integers(0, 255),
            st.integers(0, 2**64 - 1),
            st.integers(0, 2**64 - 1),
            st.binary(max_size=64),
        ).map(lambda t: struct.pack("<BQQ", *t[:3]) + t[3]),
    )
)
def test_any_answer_to_a_fetch_is_an_error_of_ours_and_allocates_no_more_than_the_block_can_be(
    answer,
):
    fake = FakeServer(answer)
    client = PeerClient(fake.listener.getsockname()[:2], SECRET, 5, 1, peer_partition=0, timeout=2)
    most = get_codec("raw").max_encoded_size(1000)
    tracemalloc.start()
    try:
        client.fetch(KEY, 0, most, None)
    except AllReduceError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        client.close()
        fake.close()
    # an answer's claimed length is checked before anything is allocated
    assert peak < most + (1 << 20)


@CASES
@given(codec=st.sampled_from(CODECS), data=st.binary(max_size=600), length=st.integers(0, 300))
def test_any_bytes_decode_to_a_corrupt_block_error_or_to_the_declared_length(codec, data, length):
    try:
        header, values = get_codec(codec).decode(data, length)
    except CorruptBlockError:
        return
    assert values.shape == (length,) and header.length == length


@CASES
@given(
    codec=st.sampled_from(CODECS),
    position=st.integers(0, HEADER_SIZE + 4 * 64 - 1),
    flip=st.integers(1, 255),
)
def test_any_changed_byte_of_a_block_is_found(codec, position, flip):
    values = np.linspace(-2, 2, 64, dtype=np.float32)
    block = bytearray(get_codec(codec).encode(values, ids=(2, 1, 0, 0, 3)))
    position %= len(block)
    block[position] ^= flip
    with pytest.raises(CorruptBlockError):
        get_codec(codec).decode(bytes(block), 64, expect=(2, 1, 0, 0, 3))
