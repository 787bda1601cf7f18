"""A channel whose fetches wait without threads (``channels.Channel(idle_waits=True)``, a
background owner's): many fetches, each waiting on another peer, on one thread; every
wait ends, with its block, at its deadline, or when the partition stops."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from allreduce_param.engine.blocks.store import BlockKey, BlockKind, BlockStore
from allreduce_param.engine.movement.channels import Channel, PeerGet, StoreGet
from allreduce_param.engine.wire.blocks import BlockServer, PeerClient
from allreduce_param.engine.wire.server import AuthenticatedServer
from allreduce_param.errors import FetchTimeoutError, PeerLostError, StoreClosedError

SECRET = b"i" * 32
PARAM = 9
KEY = BlockKey(BlockKind.GRADIENT, 0, 1)
NAME = "allreduce-owner-1"


def channel_threads() -> int:
    return sum(thread.name.startswith(NAME) for thread in threading.enumerate())


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def remote_fetch(client: PeerClient, key: BlockKey, version: int, result: Future):
    """One fetch's steps, as ``movements`` writes them: yield the get, take its block."""
    try:
        served, block = yield PeerGet(client, key, version, 1 << 16, None, False, False)
        result.set_result((served, bytes(block)))
    except BaseException as error:
        result.set_exception(error)


def own_fetch(store: BlockStore, key: BlockKey, version: int, timeout: float, result: Future):
    try:
        served, block = yield StoreGet(store, key, version, timeout, False, None)
        result.set_result((served, bytes(block)))
    except BaseException as error:
        result.set_exception(error)


@pytest.fixture
def servers():
    made = []

    def make(count: int, **options):
        for peer in range(count):
            store = BlockStore()
            made.append(
                BlockServer(
                    store,
                    SECRET,
                    PARAM,
                    partition_id=2 + peer,
                    host="127.0.0.1",
                    partition_num=2 + count,
                    **options,
                )
            )
        return made

    yield make
    for server in made:
        server.close()


def clients_of(
    servers, timeout: float = 30.0, handshake_timeout: float = 10.0
) -> dict[int, PeerClient]:
    return {
        2 + index: PeerClient(
            server.address,
            SECRET,
            PARAM,
            1,
            2 + index,
            timeout,
            handshake_timeout=handshake_timeout,
        )
        for index, server in enumerate(servers)
    }


def test_one_thread_serves_fetches_that_each_wait_on_another_peer_and_takes_each_as_it_comes(
    servers,
):
    peers = servers(12)
    own = BlockStore()
    channel = Channel(clients_of(peers), 1, NAME, "owner", idle_waits=True)
    try:
        remote = {partition: Future() for partition in channel.clients}
        for partition, client in channel.clients.items():
            channel.start(remote_fetch(client, KEY, 1, remote[partition]))
        mine = Future()
        channel.start(own_fetch(own, KEY, 1, 30.0, mine))
        wait_until(
            lambda: all(peer.store.waiting == 1 for peer in peers) and own.waiting == 1,
            "every get waiting at its peer",
        )
        assert channel_threads() <= 2  # the loop and one fetch thread, whatever the peers
        # the last peer publishes first: its block comes while the others still wait
        peers[-1].store.put(KEY, 1, b"last")
        assert remote[13].result(timeout=30) == (1, b"last")
        assert not any(future.done() for partition, future in remote.items() if partition != 13)
        own.put(KEY, 1, b"own")
        assert mine.result(timeout=30) == (1, b"own")
        for index, peer in enumerate(peers[:-1]):
            peer.store.put(KEY, 1, f"peer {index}".encode())
        assert [remote[2 + index].result(timeout=30) for index in range(11)] == [
            (1, f"peer {index}".encode()) for index in range(11)
        ]
        # the connections stay: a second round, each block there already
        again = {partition: Future() for partition in channel.clients}
        for partition, client in channel.clients.items():
            channel.start(remote_fetch(client, KEY, 1, again[partition]))
        assert again[13].result(timeout=30) == (1, b"last")
        assert channel_threads() <= 2
    finally:
        channel.abort()
        channel.close()
    assert channel_threads() == 0


def test_a_peer_that_says_nothing_is_given_up_at_the_deadline_and_the_others_go_on(servers):
    """A peer that proved the secret and then never answers (a host gone without a reset):
    the wait ends at the client's deadline, the timeout plus the handshake's."""
    held = []  # the silent peer's connections: kept open, never read nor answered

    quiet = AuthenticatedServer(
        SECRET,
        PARAM,
        4,
        lambda proven: held.append(proven.sock),
        bind="127.0.0.1",
        what="a silent peer",
        pool=1,
    )
    peers = servers(1)
    clients = {
        2: PeerClient(quiet.address, SECRET, PARAM, 1, 2, timeout=0.4, handshake_timeout=0.4),
        3: clients_of(peers)[2],
    }
    channel = Channel(clients, 1, NAME, "owner", idle_waits=True)
    try:
        late, other = Future(), Future()
        started = time.monotonic()
        channel.start(remote_fetch(clients[2], KEY, 1, late))
        channel.start(remote_fetch(clients[3], KEY, 1, other))
        peers[0].store.put(KEY, 1, b"here")
        assert other.result(timeout=30) == (1, b"here")  # not queued behind the silent peer
        with pytest.raises(
            FetchTimeoutError,
            match=r"partition 2 at 127\.0\.0\.1:\d+ did not answer for "
            r"gradient block from partition 0 to partition 1, version 1 "
            r"within 0\.8 s",
        ):
            late.result(timeout=30)
        assert time.monotonic() - started >= 0.8 and len(held) == 1
        assert not clients[2].connected  # dropped: its answer, if one came, would be out of turn
    finally:
        channel.abort()
        channel.close()
        quiet.close()
        for sock in held:
            sock.close()


def test_a_wait_on_the_own_store_ends_at_its_timeout_or_when_the_store_closes():
    own = BlockStore()
    channel = Channel({}, 1, NAME, "owner", idle_waits=True)
    try:
        expired, closed = Future(), Future()
        channel.start(own_fetch(own, KEY, 3, 0.2, expired))
        channel.start(own_fetch(own, BlockKey(BlockKind.GRADIENT, 0, 2), 3, 30.0, closed))
        with pytest.raises(FetchTimeoutError, match="version 3 was not published within 0.2 s"):
            expired.result(timeout=30)
        assert not closed.done() and own.waiting == 1
        own.close("partition 1 failed: a reason")
        with pytest.raises(StoreClosedError, match="partition 1 failed: a reason"):
            closed.result(timeout=30)
    finally:
        channel.close()
    assert channel_threads() == 0


def test_aborting_the_channel_ends_every_wait_on_a_peer(servers):
    peers = servers(4)
    channel = Channel(clients_of(peers), 2, NAME, "owner", idle_waits=True)
    try:
        waiting = {partition: Future() for partition in channel.clients}
        for partition, client in channel.clients.items():
            channel.start(remote_fetch(client, KEY, 5, waiting[partition]))
        wait_until(
            lambda: all(peer.store.waiting == 1 for peer in peers), "every get waiting at its peer"
        )
        channel.abort()
        for future in waiting.values():
            with pytest.raises(PeerLostError, match="partition [2-5] at 127.0.0.1"):
                future.result(timeout=30)
        refused = Future()
        channel.start(remote_fetch(channel.clients[2], KEY, 5, refused))
        with pytest.raises(StoreClosedError, match="shutting down: no new connection"):
            refused.result(timeout=30)
    finally:
        channel.close()
    assert channel_threads() == 0
