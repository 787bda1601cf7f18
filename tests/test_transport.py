"""The wire: wrong secrets and garbage frames are refused while correct traffic goes on."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import numpy as np
import pytest
from conftest import raise_first, run_partitions

from allreduce_param.engine import AllReduceParameter, AuthenticationError, ProtocolError
from allreduce_param.engine.blocks.store import BlockKey, BlockKind, BlockStore, SplitBlock
from allreduce_param.engine.wire.blocks import (
    OP_GET,
    SERVE_THREADS,
    STATUS_CLOSING,
    STATUS_OK,
    STATUS_STALE,
    STATUS_TIMEOUT,
    BlockServer,
    PeerClient,
)
from allreduce_param.engine.wire.blocks.protocol import REQUEST, RESPONSE
from allreduce_param.engine.wire.handshake import MAGIC, NONCE_SIZE, client_handshake
from allreduce_param.engine.wire.server import MAX_UNPROVEN, unproven_limit
from allreduce_param.engine.wire.sockets import recv_exactly

SECRET = b"s" * 32


def assert_connection_closed(sock: socket.socket) -> None:
    """The server closed ``sock``: reads end with EOF or a reset (after any refusal byte)."""
    sock.settimeout(30)
    data = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:  # closed with our unread garbage still in its buffer
            break
        if not chunk:
            break
        data += chunk
    assert len(data) <= 1  # at most the refusal status, never a block


def probe(address, payload: bytes) -> socket.socket:
    sock = socket.create_connection(address, timeout=30)
    greeting = b""
    while len(greeting) < len(MAGIC) + NONCE_SIZE:
        greeting += sock.recv(64)
    assert greeting.startswith(MAGIC)
    sock.sendall(payload)
    return sock


@pytest.fixture
def server():
    store = BlockStore()
    store.put(BlockKey(BlockKind.WEIGHT, 0, 0xFFFFFFFF), 0, b"w" * 1000)
    served = BlockServer(
        store, SECRET, param_id=5, partition_id=0, host="127.0.0.1", partition_num=2
    )
    yield served
    served.close()


def client(server, secret=SECRET, param_id=5, partition_id=1):
    return PeerClient(server.address, secret, param_id, partition_id, peer_partition=0, timeout=5)


KEY = BlockKey(BlockKind.WEIGHT, 0, 0xFFFFFFFF)


def test_the_right_secret_fetches_a_block(server):
    honest = client(server)
    try:
        assert (
            bytes(honest.fetch(KEY, 0, max_size=1000, into=memoryview(bytearray(1000)))[1])
            == b"w" * 1000
        )
    finally:
        honest.close()


def test_wrong_secret_reads_nothing_and_others_go_on(server, caplog):
    honest = client(server)
    intruder = client(server, secret=b"x" * 32)
    try:
        honest.fetch(KEY, 0, max_size=1000, into=memoryview(bytearray(1000)))
        with caplog.at_level(logging.WARNING, logger="allreduce_param.engine.wire.server"):
            with pytest.raises(
                AuthenticationError, match="refused this connection: the secrets differ"
            ):
                intruder.fetch(KEY, 0, max_size=1000, into=memoryview(bytearray(1000)))
        assert "could not prove the secret" in caplog.text
        assert (
            bytes(honest.fetch(KEY, 0, max_size=1000, into=memoryview(bytearray(1000)))[1])
            == b"w" * 1000
        )
    finally:
        honest.close()
        intruder.close()


def test_right_secret_for_another_parameter_is_refused(server, caplog):
    other = client(server, param_id=6)
    with caplog.at_level(logging.WARNING, logger="allreduce_param.engine.wire.server"):
        with pytest.raises(AuthenticationError):
            other.fetch(KEY, 0, max_size=1000, into=memoryview(bytearray(1000)))
    assert "it asked for parameter 6, this server serves parameter 5" in caplog.text
    other.close()


def test_a_server_that_cannot_prove_the_secret_is_not_trusted():
    store = BlockStore()
    impostor = BlockServer(
        store, b"i" * 32, param_id=5, partition_id=0, host="127.0.0.1", partition_num=2
    )
    try:
        # the impostor refuses us, as its secret differs: the client learns nothing from it
        with pytest.raises(AuthenticationError):
            client(impostor).fetch(KEY, 0, max_size=1000, into=memoryview(bytearray(1000)))
    finally:
        impostor.close()


@pytest.mark.parametrize(
    "garbage",
    [
        os.urandom(88),  # random bytes where the hello belongs
        b"\x00" * 88,  # zeros
        b"GET / HTTP/1.1\r\n\r\n" * 5,  # someone else's protocol
    ],
    ids=["random bytes", "zeros", "another protocol"],  # the same ids in every pytest-xdist worker
)
def test_garbage_hello_closes_that_connection_only(server, caplog, garbage):
    honest = client(server)
    with caplog.at_level(logging.WARNING, logger="allreduce_param.engine.wire.server"):
        sock = probe(server.address, garbage)
        assert_connection_closed(sock)
        sock.close()
    assert "refused connection from 127.0.0.1" in caplog.text
    assert (
        bytes(honest.fetch(KEY, 0, max_size=1000, into=memoryview(bytearray(1000)))[1])
        == b"w" * 1000
    )
    honest.close()


def test_a_malformed_request_after_a_good_handshake_closes_that_connection(server, caplog):
    rogue = client(server)
    rogue.fetch(KEY, 0, max_size=1000, into=memoryview(bytearray(1000)))  # authenticated
    with caplog.at_level(logging.WARNING, logger="allreduce_param.engine.wire.blocks.server"):
        rogue._sock.sendall(b"\xff" * 32)
        assert_connection_closed(rogue._sock)
    assert "malformed request frame" in caplog.text
    rogue.close()
    honest = client(server)
    assert (
        bytes(honest.fetch(KEY, 0, max_size=1000, into=memoryview(bytearray(1000)))[1])
        == b"w" * 1000
    )
    honest.close()


def test_a_block_longer_than_it_can_be_is_refused_before_it_is_read(server):
    greedy = client(server)
    with pytest.raises(
        ProtocolError,
        match=r"sent 1000 bytes for weight block from partition 0 to all, "
        r"version 0; such a block has at most 999",
    ):
        greedy.fetch(KEY, 0, max_size=999, into=memoryview(bytearray(1000)))
    greedy.close()


def test_intruders_during_a_real_run_do_not_disturb_it():
    """While partitions sync, wrong-secret clients and garbage hit a server; results stay exact."""
    size, steps = 20_000, 5
    grads = [np.full(size, i + 1, np.float32) for i in range(2)]
    attacked = threading.Event()

    def body(p):
        p.init(np.zeros(size))
        for step in range(steps):
            p.get_weights()
            p.put_gradients(grads[p.info.partition_id])
            p.weight_partition[:] -= p.aggregate_gradient_partition()
            p.send_weight_partition()
            if p.info.partition_id == 0 and step == 1:
                target = p._peers.peers[1].address
                intruder = PeerClient(target, b"x" * 32, 0, 0, 1, timeout=5)
                with pytest.raises(AuthenticationError):
                    intruder.fetch(
                        BlockKey(BlockKind.WEIGHT, 1, 0xFFFFFFFF),
                        step + 1,
                        10**6,
                        memoryview(bytearray(10**6)),
                    )
                intruder.close()
                sock = probe(target, os.urandom(200))
                assert_connection_closed(sock)
                sock.close()
                attacked.set()
        return p.get_weights()

    results = raise_first(run_partitions(AllReduceParameter(2, size, "raw", timeout=30), body))
    assert attacked.is_set()
    for weights in results:
        assert np.array_equal(weights, np.full(size, -1.5 * steps, np.float32))


def test_a_peer_on_this_host_is_reached_over_its_unix_socket():
    store = BlockStore()
    store.put(KEY, 0, b"u" * 100)
    served = BlockServer(
        store, SECRET, param_id=5, partition_id=0, host="127.0.0.1", partition_num=2, unix=True
    )
    try:
        assert served.local_name
        local = PeerClient(served.address, SECRET, 5, 1, 0, timeout=5, local_name=served.local_name)
        assert bytes(local.fetch(KEY, 0, 100, memoryview(bytearray(100)))[1]) == b"u" * 100
        assert local._sock.family == socket.AF_UNIX
        local.close()
        # a Unix socket that is not there (another network namespace): TCP instead
        elsewhere = PeerClient(
            served.address, SECRET, 5, 1, 0, timeout=5, local_name="no-such-socket"
        )
        assert bytes(elsewhere.fetch(KEY, 0, 100, memoryview(bytearray(100)))[1]) == b"u" * 100
        assert elsewhere._sock.family == socket.AF_INET
        elsewhere.close()
        # the Unix socket demands the secret as TCP does
        intruder = PeerClient(
            served.address, b"x" * 32, 5, 1, 0, timeout=5, local_name=served.local_name
        )
        with pytest.raises(AuthenticationError):
            intruder.fetch(KEY, 0, 100, memoryview(bytearray(100)))
        intruder.close()
    finally:
        served.close()


def test_a_peer_on_this_host_reads_shared_blocks_in_place():
    from allreduce_param.engine.blocks.shm import SharedArenas

    arenas = SharedArenas(arena_size=4096)
    first, second = arenas.buffer(100), arenas.buffer(100)  # two blocks in one segment
    first[:5], second[:6] = b"first", b"second"
    store = BlockStore()
    store.put(KEY, 0, first[:5])
    other = BlockKey(BlockKind.GRADIENT, 0, 1)
    store.put(other, 0, second[:6])
    served = BlockServer(
        store,
        SECRET,
        param_id=5,
        partition_id=0,
        host="127.0.0.1",
        partition_num=2,
        unix=True,
        shared=arenas,
    )
    local = PeerClient(served.address, SECRET, 5, 1, 0, timeout=5, local_name=served.local_name)
    tcp = PeerClient(served.address, SECRET, 5, 1, 0, timeout=5)
    try:
        _, view = local.fetch(KEY, 0, 100, None, shared=True)
        assert joined(view) == b"first" and len(local._shared._mappings._maps) == 1
        # at its offset
        assert joined(local.fetch(other, 0, 100, None, shared=True)[1]) == b"second"
        first[:5] = b"again"  # the owner writes its next version in place
        store.put(KEY, 1, first[:5])
        assert joined(local.fetch(KEY, 1, 100, None, shared=True)[1]) == b"again"
        # one descriptor, passed once
        assert len(local._shared._mappings._maps) == 1 and arenas.count == 1
        # over TCP no descriptor can travel: the same request gets the bytes
        assert bytes(tcp.fetch(KEY, 1, 100, memoryview(bytearray(100)), shared=True)[1]) == b"again"
        assert not tcp._shared._mappings._maps
        del view
    finally:
        local.close()
        tcp.close()
        served.close()
        arenas.close()


def joined(block) -> bytes:
    """A fetched block's bytes, read in one piece or in place as a header and a payload."""
    return (
        bytes(block.header) + bytes(block.payload)
        if isinstance(block, SplitBlock)
        else bytes(block)
    )


def test_a_block_whose_header_and_payload_lie_apart_is_served_whole():
    """A vector published where it lies (its header in one shared segment, its payload in
    another): a same-host peer reads both in place, getting both descriptors in one answer
    and again on a new connection; over TCP the two travel as one block, checksummed."""
    from allreduce_param.engine.blocks.codec import get_codec
    from allreduce_param.engine.blocks.shm import SharedArenas

    arenas = SharedArenas(arena_size=4096)
    raw = get_codec("raw")
    # the second gets its own segment
    header_room, payload_room = (
        arenas.buffer(64),
        arenas.buffer(8192),
    )
    values = np.frombuffer(payload_room, np.float32)
    values[:] = np.arange(2048, dtype=np.float32)
    ids = (BlockKind.GRADIENT, 0, 1, 0, 3)
    store = BlockStore()
    store.put(
        BlockKey(*ids[:4]),
        3,
        SplitBlock(raw.encode_header(2048, count=2.0, out=header_room, ids=ids), payload_room),
        buffer=header_room,
    )
    served = BlockServer(
        store,
        SECRET,
        param_id=5,
        partition_id=0,
        host="127.0.0.1",
        partition_num=2,
        unix=True,
        shared=arenas,
    )
    local = PeerClient(served.address, SECRET, 5, 1, 0, timeout=5, local_name=served.local_name)
    tcp = PeerClient(served.address, SECRET, 5, 1, 0, timeout=5)
    try:
        assert arenas.count == 2
        for _ in range(2):
            _, block = local.fetch(
                BlockKey(*ids[:4]), 3, raw.max_encoded_size(2048), None, shared=True
            )
            assert isinstance(block, SplitBlock) and len(local._shared._mappings._maps) == 2
            header, got = raw.decode(
                block.header, 2048, expect=ids, checksum=False, payload=block.payload
            )
            assert header.count == 2.0 and np.array_equal(got, values)
            del block, got
            local._drop()  # a new connection: the descriptors come again, and are not mapped twice
        _, block = tcp.fetch(BlockKey(*ids[:4]), 3, raw.max_encoded_size(2048), None)
        _, got = raw.decode(block, 2048, expect=ids)  # checksum verified: sealed over both pieces
        assert np.array_equal(got, values)
    finally:
        local.close()
        tcp.close()
        served.close()
        del values
        arenas.close()


def test_a_shared_answer_naming_a_segment_never_passed_is_refused():
    """A peer that points at shared memory whose descriptor it never passed on this
    connection gets a ProtocolError naming the segment, and no descriptor is left open."""
    from allreduce_param.engine.wire.blocks.protocol import SHARED_PLACE

    peer = PeerClient(("127.0.0.1", 9), SECRET, 5, 1, 0, timeout=5)
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(SHARED_PLACE.pack(99, 0, 64, 99, 64))
        with pytest.raises(
            ProtocolError, match=r"passed 0 descriptors with .*shared segments \[99\]"
        ):
            peer._shared.place(
                ours,
                128,
                "gradient block from partition 0 to partition 1, version 0",
                peer._peer_text,
            )
    finally:
        ours.close()
        theirs.close()
        peer.close()


def test_a_client_cut_off_for_shutting_down_opens_no_new_connection():
    from allreduce_param.engine import StoreClosedError

    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    shutting = PeerClient(listener.getsockname()[:2], SECRET, 5, 1, 0, timeout=5)
    try:
        shutting.abort()
        with pytest.raises(
            StoreClosedError,
            match="this partition is shutting down: no new connection to partition 0",
        ):
            shutting.fetch(KEY, 0, 100, None)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody came
    finally:
        shutting.close()
        listener.close()


# ---- serving many connections with a bounded number of threads --------------------------


def proven(server, partition: int) -> socket.socket:
    """A raw connection to ``server`` that has proven the secret as ``partition``."""
    sock = socket.create_connection(server.address, timeout=30)
    client_handshake(sock, SECRET, 5, partition, "the test's server", "refused")
    return sock


def ask(sock: socket.socket, key: BlockKey, version: int, timeout_ms: int) -> None:
    sock.sendall(
        REQUEST.pack(
            MAGIC, OP_GET, key.kind, key.source, key.destination, key.part, version, timeout_ms
        )
    )


def answer(sock: socket.socket) -> tuple[int, int, bytes]:
    """The next answer on ``sock``: status, version served, and its bytes."""
    head = bytearray(RESPONSE.size)
    recv_exactly(sock, memoryview(head))
    status, length, version = RESPONSE.unpack(head)
    body = bytearray(length)
    recv_exactly(sock, memoryview(body))
    return status, version, bytes(body)


def serving_threads(partition: int = 0) -> int:
    return sum(thread.name == f"allreduce-serve-{partition}" for thread in threading.enumerate())


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_many_gets_waiting_for_a_version_hold_a_bounded_number_of_threads_and_are_all_answered():
    connections = 150
    store, done = BlockStore(), []
    server = BlockServer(
        store,
        SECRET,
        param_id=5,
        partition_id=0,
        host="127.0.0.1",
        partition_num=200,
        on_done=done.append,
    )
    socks = [proven(server, 1 + i % 199) for i in range(connections)]
    try:
        for sock in socks:
            ask(sock, KEY, 1, 60_000)
        wait_until(
            lambda: store.waiting == connections, f"{store.waiting} of {connections} gets waiting"
        )
        assert 1 <= serving_threads() <= SERVE_THREADS and server.threads <= SERVE_THREADS
        store.put(KEY, 0, b"not yet")
        store.put(KEY, 1, b"v" * 5000)
        assert all(answer(sock) == (STATUS_OK, 1, b"v" * 5000) for sock in socks)
        for sock in socks:  # the connections stay: a second round, answered at once
            ask(sock, KEY, 1, 60_000)
        assert all(answer(sock) == (STATUS_OK, 1, b"v" * 5000) for sock in socks)
        assert serving_threads() <= SERVE_THREADS and done == []
    finally:
        for sock in socks:
            sock.close()
        server.close()
    assert serving_threads() == 0
    # each ended connection is done once
    assert sorted(done) == sorted(1 + i % 199 for i in range(connections))


def test_waiting_gets_time_out_with_the_text_and_the_max_wait_and_their_connections_go_on():
    store = BlockStore(keep=1)
    server = BlockServer(
        store, SECRET, param_id=5, partition_id=0, host="127.0.0.1", partition_num=2, max_wait=0.5
    )
    short, capped = [proven(server, 1) for _ in range(20)], [proven(server, 1) for _ in range(20)]
    try:
        for sock in short:
            ask(sock, KEY, 7, 200)
        for sock in capped:
            ask(sock, KEY, 7, 60_000)  # the server waits max_wait at most
        assert all(
            answer(sock)
            == (
                STATUS_TIMEOUT,
                0,
                b"weight block from partition 0 to all, version 7 was not "
                b"published within 0.2 s (newest there: none)",
            )
            for sock in short
        )
        assert all(
            answer(sock)
            == (
                STATUS_TIMEOUT,
                0,
                b"weight block from partition 0 to all, version 7 was not "
                b"published within 0.5 s (newest there: none)",
            )
            for sock in capped
        )
        assert store.waiting == 0 and serving_threads() <= SERVE_THREADS
        store.put(KEY, 7, b"seven")
        store.put(KEY, 8, b"eight")
        for sock in short + capped:
            ask(sock, KEY, 7, 60_000)
        for sock in short + capped:
            status, _, text = answer(sock)
            assert status == STATUS_STALE and b"version 7 is no longer kept (kept: [8])" in text
        for sock in short:
            ask(sock, KEY, 8, 200)
        assert all(answer(sock) == (STATUS_OK, 8, b"eight") for sock in short)
    finally:
        for sock in short + capped:
            sock.close()
        server.close()


def test_a_store_closed_with_a_reason_answers_every_waiting_get_with_it():
    store = BlockStore()
    server = BlockServer(
        store, SECRET, param_id=5, partition_id=0, host="127.0.0.1", partition_num=2
    )
    socks = [proven(server, 1) for _ in range(40)]
    try:
        for sock in socks:
            ask(sock, KEY, 3, 60_000)
        wait_until(lambda: store.waiting == len(socks), "the gets to wait")
        # as PeerGroup.fail does; the server stays
        store.close("partition 0 failed: ValueError: bad rows")
        for sock in socks:
            assert answer(sock) == (STATUS_CLOSING, 0, b"partition 0 failed: ValueError: bad rows")
            assert_connection_closed(sock)
    finally:
        for sock in socks:
            sock.close()
        server.close()


def test_closing_the_server_with_gets_waiting_ends_every_thread_and_every_connection():
    store, done = BlockStore(), []
    server = BlockServer(
        store,
        SECRET,
        param_id=5,
        partition_id=0,
        host="127.0.0.1",
        partition_num=101,
        on_done=done.append,
        unix=True,
    )
    socks = [proven(server, 1 + i) for i in range(100)]
    idle = proven(server, 100)  # proven, never asks
    try:
        for sock in socks:
            ask(sock, KEY, 3, 60_000)
        wait_until(lambda: store.waiting == len(socks), "the gets to wait")
        server.close()
        assert serving_threads() == 0 and not any(
            t.name == "allreduce-accept-0" for t in threading.enumerate()
        )
        assert sorted(done) == list(range(1, 101)) + [
            100
        ]  # every connection ended, the idle one too
        for sock in socks + [idle]:
            sock.settimeout(30)
            try:
                data = sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            assert data == b"" or data[0] == STATUS_CLOSING  # told it closes, or cut
    finally:
        for sock in socks + [idle]:
            sock.close()
        server.close()


@pytest.mark.slow
def test_a_reader_that_stops_reading_holds_one_thread_for_a_while_and_nobody_else():
    """A peer asks for a large block and never reads it: its answer stalls one pool thread
    until the send gives up (a slice not taken within the handshake timeout) and the
    connection is closed, while the others are answered."""
    store, done = BlockStore(), []
    store.put(KEY, 0, b"x" * (64 << 20))  # more than the socket buffers hold
    server = BlockServer(
        store,
        SECRET,
        param_id=5,
        partition_id=0,
        host="127.0.0.1",
        partition_num=3,
        handshake_timeout=2.0,
        on_done=done.append,
    )
    stuck = proven(server, 2)
    others = [proven(server, 1) for _ in range(3 * SERVE_THREADS)]
    try:
        ask(stuck, KEY, 0, 60_000)
        small = BlockKey(BlockKind.GRADIENT, 0, 1)
        store.put(small, 0, b"s" * 100)
        for _ in range(3):
            for sock in others:
                ask(sock, small, 0, 60_000)
            assert all(answer(sock) == (STATUS_OK, 0, b"s" * 100) for sock in others)
        wait_until(lambda: 2 in done, "the stuck reader's connection to end")
        assert done == [2]  # only that one
        assert_connection_closed_after_a_while(stuck)
    finally:
        for sock in others + [stuck]:
            sock.close()
        server.close()


def assert_connection_closed_after_a_while(sock: socket.socket) -> None:
    """Reading everything the server sent ends with EOF or a reset, not a hang."""
    sock.settimeout(30)
    while True:
        try:
            if not sock.recv(1 << 20):
                return
        except ConnectionResetError:
            return


def test_as_many_peers_as_twice_the_partitions_may_be_in_their_handshake_at_once():
    """A server of 100 partitions lets 150 connections wait in their handshake at once (the
    flood bound grows with the partitions): none is pushed out, each proves the secret."""
    store = BlockStore()
    store.put(KEY, 0, b"w")
    server = BlockServer(
        store, SECRET, param_id=5, partition_id=0, host="127.0.0.1", partition_num=100
    )
    waiting = [socket.create_connection(server.address, timeout=30) for _ in range(150)]
    try:
        for sock in waiting:  # every one was accepted and greeted before any answers
            assert (
                len(sock.recv(len(MAGIC) + NONCE_SIZE, socket.MSG_PEEK | socket.MSG_WAITALL)) == 20
            )
        assert unproven_limit(100) == 200 > 150 > MAX_UNPROVEN
        for i, sock in enumerate(waiting):
            client_handshake(sock, SECRET, 5, 1 + i % 99, "the test's server", "refused")
            ask(sock, KEY, 0, 1000)
            assert answer(sock) == (STATUS_OK, 0, b"w")
    finally:
        for sock in waiting:
            sock.close()
        server.close()


def test_a_peer_asked_where_it_lives_answers_only_the_secret_and_that_is_no_done():
    """``OP_ADDRESS``: what a meeting that gave only ``(host, port)`` completes its address
    with. Only a client that proves the secret hears it, and the connection, which the
    server then ends, does not count as the asker's "done" (it still has its fetches)."""
    done = []
    served = BlockServer(
        BlockStore(), SECRET, 5, 0, "127.0.0.1", partition_num=2, unix=True, on_done=done.append
    )
    try:
        asker = PeerClient(served.address, SECRET, 5, 1, 0, timeout=5)
        assert asker.ask_address() == list(served.advertised_address)
        assert not asker.connected
        assert asker.ask_address()[3] == served.local_name  # again: a connection each time
        intruder = PeerClient(served.address, b"x" * 32, 5, 1, 0, timeout=5)
        with pytest.raises(AuthenticationError):
            intruder.ask_address()
        asker.done()  # a real "done" still counts
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)  # the server hears it on its own thread
        assert done == [1]
        asker.close()
    finally:
        served.close()
