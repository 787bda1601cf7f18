"""Encryption in transit (``sealing.py``): the records, their refusals, the handshake's
agreement, the setting, and the engine over encrypted TCP.

Everything here runs on 127.0.0.1 (sockets, a relay that changes records on the way, a
few threads as partitions) but the last test, which starts a Spark session with Spark's
own network encryption on and checks that the engine follows it. The capture of the bytes
on a link between two simulated hosts is ``test_encryption_capture.py``.
"""

from __future__ import annotations

import logging
import socket
import struct
import sys
import threading
import time

import numpy as np
import pytest
from conftest import raise_first, run_partitions

from allreduce_param import ConfigurationError, FitSettings
from allreduce_param.engine import (
    AllReduceParameter,
    AuthenticationError,
    NetworkSettings,
    ProtocolError,
)
from allreduce_param.engine.blocks.store import BlockKey, BlockKind, BlockStore
from allreduce_param.engine.wire.blocks import BlockServer, PeerClient
from allreduce_param.engine.wire.handshake import _CLIENT_HELLO, MAC_SIZE, MAGIC, NONCE_SIZE
from allreduce_param.engine.wire.messages import MessageClient, MessageServer
from allreduce_param.engine.wire.sealing import (
    RECORD_SIZE,
    TAG_SIZE,
    SealedConnection,
    direction_keys,
)
from allreduce_param.engine.wire.sockets import recv_exactly

SECRET = b"k" * 32
SESSION = b"s" * 32
_HEAD = struct.Struct("<I")


def sealed_pair(
    in_place: bool = True,
) -> tuple[SealedConnection, SealedConnection, socket.socket, socket.socket]:
    """A client and a server end over a socket pair (sealing does not care what carries it),
    and the raw sockets under them."""
    left, right = socket.socketpair()
    client = SealedConnection(left, SESSION, client=True, peer_text="the server")
    server = SealedConnection(right, SESSION, client=False, peer_text="the client")
    client._in_place = server._in_place = in_place
    return client, server, left, right


def records_of(data: bytes) -> list[bytes]:
    """Raw bytes on the wire cut into records (length, ciphertext and tag)."""
    found = []
    while data:
        (size,) = _HEAD.unpack_from(data)
        found.append(data[: _HEAD.size + size + TAG_SIZE])
        data = data[_HEAD.size + size + TAG_SIZE :]
    return found


def wire_of(send) -> bytes:
    """What ``send(client)`` puts on the wire, read raw at the other end."""
    client, _, left, right = sealed_pair()
    sender = threading.Thread(
        target=lambda: (send(client), left.shutdown(socket.SHUT_WR)), daemon=True
    )
    try:
        sender.start()  # a socket pair holds less than a long send: read meanwhile
        chunks = []
        while chunk := right.recv(1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        sender.join(30)
        left.close()
        right.close()


def open_raw(wire: bytes, wanted: int) -> bytes:
    """What a server end opens of ``wire`` (as if the client had sent it), ``wanted`` bytes."""
    client, server, left, right = sealed_pair()
    sender = threading.Thread(
        target=lambda: (left.sendall(wire), left.shutdown(socket.SHUT_WR)), daemon=True
    )
    try:
        sender.start()
        into = bytearray(wanted)
        recv_exactly(server, memoryview(into))
        return bytes(into)
    finally:
        right.close()  # a sender still sending sees its end, not a closed descriptor
        sender.join(30)
        left.close()


# ---- records --------------------------------------------------------------------------------


@pytest.mark.parametrize("in_place", [True, False], ids=["encrypt_into", "copying"])
def test_records_carry_every_length_and_a_long_send_is_cut_into_records(in_place):
    rng = np.random.default_rng(0)
    payloads = [b"x", rng.bytes(RECORD_SIZE), rng.bytes(2 * RECORD_SIZE + 5), rng.bytes(1000)]
    client, server, left, right = sealed_pair(in_place)
    try:
        sender = threading.Thread(target=lambda: [client.sendall(p) for p in payloads])
        sender.start()
        got = []
        for (
            payload
        ) in payloads:  # read in pieces that do not match the records: 7 bytes, then the rest
            into = bytearray(len(payload))
            view = memoryview(into)
            first = min(7, len(payload))
            recv_exactly(server, view[:first])
            recv_exactly(server, view[first:])
            got.append(bytes(into))
        sender.join(30)
        assert got == payloads
        client.sendall(b"back")  # and the other way, under the other key
        answer = bytearray(4)
        server.sendall(b"hiya")
        recv_exactly(client, memoryview(answer))
        assert bytes(answer) == b"hiya"
        left.shutdown(socket.SHUT_WR)
        # an end between records
        assert server.recv_into(bytearray(10)) == 4 and server.recv_into(bytearray(10)) == 0
    finally:
        left.close()
        right.close()
    wire = wire_of(lambda c: c.sendall(payloads[2]))
    assert [len(r) for r in records_of(wire)] == [4 + RECORD_SIZE + TAG_SIZE] * 2 + [
        4 + 5 + TAG_SIZE
    ]
    assert payloads[2][:64] not in wire and payloads[2][-64:] not in wire


def test_the_two_directions_have_keys_of_their_own():
    to_server, to_client = direction_keys(SESSION)
    assert len(to_server) == len(to_client) == 32 and to_server != to_client
    assert direction_keys(b"t" * 32) != (to_server, to_client)


def test_a_changed_record_is_refused_naming_the_peer():
    wire = bytearray(wire_of(lambda c: c.sendall(b"a block's bytes" * 10)))
    wire[10] ^= 1
    with pytest.raises(
        AuthenticationError, match=r"encrypted record 0 from the client failed its authentication"
    ):
        open_raw(bytes(wire), 150)


def test_a_replayed_reordered_or_dropped_record_is_refused():
    first, second = records_of(wire_of(lambda c: (c.sendall(b"one" * 20), c.sendall(b"two" * 20))))
    assert open_raw(first + second, 120) == b"one" * 20 + b"two" * 20
    for wire, number in ((first + first, 1), (second + first, 0), (second, 0)):
        with pytest.raises(
            AuthenticationError, match=f"record {number} .* changed, replayed, reordered"
        ):
            open_raw(wire, 120)


def test_a_record_sent_back_the_other_way_is_refused():
    client, server, left, right = sealed_pair()
    try:
        client.sendall(b"to the server")
        reflected = right.recv(1 << 16)
        right.sendall(reflected)  # as if the server had said it
        with pytest.raises(AuthenticationError, match="from the server failed its authentication"):
            recv_exactly(client, memoryview(bytearray(13)))
    finally:
        left.close()
        right.close()


def test_a_cut_length_or_record_is_refused_and_an_end_inside_a_record_is_an_end():
    record = wire_of(lambda c: c.sendall(b"z" * 100))
    shorter = _HEAD.pack(50) + record[_HEAD.size :]
    with pytest.raises(AuthenticationError):
        open_raw(shorter, 50)
    with pytest.raises(ProtocolError, match=f"encrypted record of {RECORD_SIZE + 1} bytes"):
        open_raw(_HEAD.pack(RECORD_SIZE + 1) + record[_HEAD.size :], 100)
    with pytest.raises(ProtocolError, match="record of 0 bytes"):
        open_raw(_HEAD.pack(0), 1)
    with pytest.raises(EOFError, match="inside an encrypted record"):
        open_raw(record[:-1], 100)
    with pytest.raises(EOFError, match="inside an encrypted record's length"):
        open_raw(record[:2], 100)


def test_a_receive_that_times_out_inside_a_record_goes_on_from_there():
    record = wire_of(lambda c: c.sendall(b"w" * 300))
    client, server, left, right = sealed_pair()
    try:
        left.sendall(record[:100])
        server.settimeout(0.05)
        into = bytearray(300)
        with pytest.raises(socket.timeout):
            server.recv_into(into)
        left.sendall(record[100:])
        server.settimeout(5)
        recv_exactly(server, memoryview(into))
        assert bytes(into) == b"w" * 300
    finally:
        left.close()
        right.close()


def test_a_sealed_connection_has_no_other_socket_call():
    client, _, left, right = sealed_pair()
    try:
        for name in ("send", "recv", "sendmsg", "recvmsg", "makefile_w"):
            assert not hasattr(client, name), name  # nothing can go out unsealed by mistake
        assert client.family == socket.AF_UNIX and client.fileno() == left.fileno()
    finally:
        left.close()
        right.close()


# ---- the handshake agrees -------------------------------------------------------------------


def block_server(encrypt: bool, **kwargs) -> BlockServer:
    store = BlockStore()
    store.put(BlockKey(BlockKind.WEIGHT, 0, 0, 0), 1, b"block bytes " * 100)
    return BlockServer(
        store,
        SECRET,
        param_id=5,
        partition_id=0,
        host="127.0.0.1",
        partition_num=2,
        encrypt=encrypt,
        **kwargs,
    )


@pytest.mark.parametrize("server_encrypts", [True, False])
def test_ends_that_differ_about_encryption_are_refused_at_once_naming_the_setting(
    server_encrypts, caplog
):
    server = block_server(server_encrypts)
    client = PeerClient(
        server.address, SECRET, 5, 1, peer_partition=0, timeout=5, encrypt=not server_encrypts
    )
    this, that = ("does not encrypt", "does") if server_encrypts else ("encrypts", "does not")
    try:
        with caplog.at_level(logging.WARNING, logger="allreduce_param.engine.wire.server"):
            with pytest.raises(
                ConfigurationError,
                match=rf"refused this connection: this end {this} it and that "
                rf"server {that}\. .*spark\.allreduce\.encrypt",
            ):
                client.fetch(BlockKey(BlockKind.WEIGHT, 0, 0, 0), 1, 4096, None)
        assert any("it proved the secret but" in record.getMessage() for record in caplog.records)
        same = PeerClient(
            server.address, SECRET, 5, 1, peer_partition=0, timeout=5, encrypt=server_encrypts
        )
        _, block = same.fetch(BlockKey(BlockKind.WEIGHT, 0, 0, 0), 1, 4096, None)
        assert (
            bytes(block[:12]) == b"block bytes "
            and isinstance(same._sock, SealedConnection) == server_encrypts
        )
        same.close()
        stranger = PeerClient(
            server.address,
            b"x" * 32,
            5,
            1,
            peer_partition=0,
            timeout=5,
            encrypt=not server_encrypts,
        )
        with pytest.raises(
            AuthenticationError, match="the secrets differ"
        ):  # not the secret: no word on encryption
            stranger.fetch(BlockKey(BlockKind.WEIGHT, 0, 0, 0), 1, 4096, None)
    finally:
        client.close()
        server.close()


def test_a_unix_socket_is_never_encrypted_whatever_the_ends_say():
    server = block_server(True, unix=True)
    client = PeerClient(
        server.address,
        SECRET,
        5,
        1,
        peer_partition=0,
        timeout=5,
        local_name=server.local_name,
        encrypt=False,
    )
    try:
        _, block = client.fetch(BlockKey(BlockKind.WEIGHT, 0, 0, 0), 1, 4096, None)
        assert bytes(block[:12]) == b"block bytes " and client._sock.family == socket.AF_UNIX
        assert not isinstance(client._sock, SealedConnection)
    finally:
        client.close()
        server.close()


def test_an_ended_encrypted_connection_is_forgotten_by_its_server():
    """The server tracks what it serves (the sealed connection, not the socket under it),
    so each one that ends is let go: a long fit's reconnects do not pile up."""
    server = block_server(True)
    try:
        for _ in range(5):
            client = PeerClient(
                server.address, SECRET, 5, 1, peer_partition=0, timeout=5, encrypt=True
            )
            _, block = client.fetch(BlockKey(BlockKind.WEIGHT, 0, 0, 0), 1, 4096, None)
            assert (
                isinstance(client._sock, SealedConnection) and bytes(block[:12]) == b"block bytes "
            )
            client.close()
        deadline = time.monotonic() + 30
        while server._server._connections or server._peers:
            assert time.monotonic() < deadline, (server._server._connections, server._peers)
            time.sleep(0.01)
    finally:
        server.close()


def test_the_message_connections_are_encrypted_and_must_agree_too():
    got, arrived = [], threading.Event()

    def on_message(message, reply):
        got.append(message)
        reply({"echo": message["n"]})
        arrived.set()

    server = MessageServer("127.0.0.1", on_message, encrypt=True)
    try:
        client = server.client()
        client.send({"n": 1, "loss": 0.25})
        assert client.receive(30) == {"echo": 1} and got == [{"n": 1, "loss": 0.25}]
        assert isinstance(client._sock, SealedConnection)
        client.close()
        import pickle

        shipped = pickle.loads(pickle.dumps(server.client()))  # as the closure carries it
        shipped.send({"n": 2})
        assert shipped.receive(30) == {"echo": 2}
        shipped.close()
        plain = MessageClient(server.address, server.secret, encrypt=False)
        with pytest.raises(
            ConfigurationError, match="this end does not encrypt it and that server does"
        ):
            plain.send({"n": 3})
    finally:
        server.close()


# ---- through a relay that changes what passes -------------------------------------------------


class Relay:
    """A TCP relay between a client and ``target``: after the handshake it forwards records
    whole, each through ``change(direction, number, record) -> [records to forward]``."""

    HANDSHAKE = {
        "up": [_CLIENT_HELLO.size],
        "down": [len(MAGIC) + NONCE_SIZE, 1 + MAC_SIZE],
    }  # as each is sent

    def __init__(self, target: tuple[str, int], change) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self._target, self._change = target, change
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        try:
            near, _ = self.listener.accept()
        except OSError:
            return
        far = socket.create_connection(self._target)
        self._sockets += [near, far]
        for direction, source, sink in (("up", near, far), ("down", far, near)):
            thread = threading.Thread(
                target=self._pump, args=(direction, source, sink), daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _pump(self, direction: str, source: socket.socket, sink: socket.socket) -> None:
        try:
            for size in self.HANDSHAKE[direction]:
                prefix = bytearray(size)
                recv_exactly(source, memoryview(prefix))
                sink.sendall(prefix)
            number = 0
            while True:
                head = bytearray(_HEAD.size)
                recv_exactly(source, memoryview(head))
                body = bytearray(_HEAD.unpack(head)[0] + TAG_SIZE)
                recv_exactly(source, memoryview(body))
                for record in self._change(direction, number, bytes(head + body)):
                    sink.sendall(record)
                number += 1
        except (OSError, EOFError):
            pass
        finally:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()
        for sock in self._sockets:
            sock.close()
        for thread in self._threads:
            thread.join(10)


def flip(record: bytes) -> list[bytes]:
    changed = bytearray(record)
    changed[-TAG_SIZE - 1] ^= 0x80  # the last byte of ciphertext
    return [bytes(changed)]


def test_a_changed_answer_fails_the_fetch_and_a_replayed_request_costs_only_its_connection(caplog):
    server = block_server(True)
    key = BlockKey(BlockKind.WEIGHT, 0, 0, 0)
    changed = Relay(
        server.address, lambda d, n, record: flip(record) if d == "down" and n == 1 else [record]
    )
    replayed = Relay(
        server.address, lambda d, n, record: [record, record] if d == "up" else [record]
    )
    try:
        client = PeerClient(
            changed.address, SECRET, 5, 1, peer_partition=0, timeout=5, encrypt=True
        )
        with pytest.raises(
            AuthenticationError,
            match=r"record 1 from partition 0 at 127\.0\.0\.1:\d+ failed its "
            r"authentication",
        ):
            client.fetch(key, 1, 4096, None)  # the answer's head is record 0, the block record 1
        assert client._sock is None  # the connection is closed
        with caplog.at_level(logging.WARNING, logger="allreduce_param.engine.wire.blocks.server"):
            repeating = PeerClient(
                replayed.address, SECRET, 5, 1, peer_partition=0, timeout=5, encrypt=True
            )
            repeating.fetch(key, 1, 4096, None)  # the server reads the request, then its copy fails
            with pytest.raises(Exception):  # noqa: B017 - the server closed the connection after the replay
                repeating.fetch(key, 1, 4096, None)
        [warning] = [
            r.getMessage()
            for r in caplog.records
            if "closed connection from partition 1" in r.getMessage()
        ]
        assert "encrypted record 1 from 127.0.0.1" in warning and "replayed" in warning
        honest = PeerClient(server.address, SECRET, 5, 1, peer_partition=0, timeout=5, encrypt=True)
        assert bytes(honest.fetch(key, 1, 4096, None)[1][:5]) == b"block"  # the server serves on
        for each in (client, repeating, honest):
            each.close()
    finally:
        changed.close()
        replayed.close()
        server.close()


# ---- the engine --------------------------------------------------------------------------------


def sync(param: AllReduceParameter) -> list:
    """Two BSP steps of known gradients; each partition's weights after them, and the kinds of
    its worker channel's connections."""

    def body(p):
        rng = np.random.default_rng(p.info.partition_id)
        p.init(np.linspace(-1, 1, param.size, dtype=np.float32))
        for _ in range(2):
            p.get_weights()
            p.put_gradients(
                rng.standard_normal(param.size).astype(np.float32),
                count=float(p.info.partition_id + 1),
            )
            p.weight_partition[:] -= p.aggregate_gradient_partition()
            p.send_weight_partition()
        kinds = {type(client._sock).__name__ for client in p._peers.worker.clients.values()}
        return p.get_weights().copy(), kinds

    return raise_first(run_partitions(param, body))


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_an_encrypted_sync_gives_the_same_bits_as_a_plain_one(codec):
    size = 3 * RECORD_SIZE // 4 + 17  # a part longer than a record, and an odd length
    plain = sync(
        AllReduceParameter(
            3, size, codec=codec, unix_sockets=False, network=NetworkSettings(encrypt=False)
        )
    )
    sealed = sync(
        AllReduceParameter(
            3, size, codec=codec, unix_sockets=False, network=NetworkSettings(encrypt=True)
        )
    )
    assert all(kinds == {"socket"} for _, kinds in plain)
    assert all(kinds == {"SealedConnection"} for _, kinds in sealed)
    for (expected, _), (weights, _) in zip(plain, sealed):
        assert np.array_equal(expected, weights) and np.array_equal(expected, plain[0][0])


def test_peers_on_one_host_keep_their_unix_sockets_under_encryption():
    # the blocks' path (a host arena has no connections to keep)
    [(_, kinds), _] = sync(
        AllReduceParameter(
            2, 1000, codec="raw", network=NetworkSettings(encrypt=True), host_arena=False
        )
    )
    assert kinds == {"socket"}


# ---- the setting ------------------------------------------------------------------------------


def test_the_setting_follows_the_argument_then_spark_allreduce_then_sparks_own_encryption():
    assert NetworkSettings.of({}).encrypt is False
    assert NetworkSettings.of({}, {"spark.network.crypto.enabled": "true"}.get).encrypt is True
    assert NetworkSettings.of({}, {"spark.ssl.enabled": "TRUE"}.get).encrypt is True
    assert NetworkSettings.of({}, {"spark.ssl.enabled": "false"}.get).encrypt is False
    assert (
        NetworkSettings.of(
            {}, {"spark.allreduce.encrypt": "false", "spark.ssl.enabled": "true"}.get
        ).encrypt
        is False
    )
    assert (
        NetworkSettings.of({"encrypt": True}, {"spark.allreduce.encrypt": "false"}.get).encrypt
        is True
    )
    assert (
        NetworkSettings.of({"encrypt": False}, {"spark.network.crypto.enabled": "true"}.get).encrypt
        is False
    )
    with pytest.raises(
        ConfigurationError, match=r"spark.allreduce.encrypt='yes' must be true or false"
    ):
        NetworkSettings.of({}, {"spark.allreduce.encrypt": "yes"}.get)
    with pytest.raises(ConfigurationError, match="encrypt must be True, False or None"):
        NetworkSettings(encrypt="on")
    with pytest.raises(ConfigurationError, match="encrypt must be True, False or None"):
        FitSettings.of_flat({"encrypt": 1})
    assert FitSettings(network=NetworkSettings(encrypt=True)).network.encrypt is True
    assert FitSettings().network.encrypt is None  # unset: the fit follows Spark's settings
    assert AllReduceParameter(2, 10, network=NetworkSettings(encrypt=True)).network.encrypt is True


def test_encryption_without_its_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(
        ConfigurationError, match=r"pip install 'cryptography>=41'.* on every executor"
    ):
        AllReduceParameter(2, 10, network=NetworkSettings(encrypt=True))
    with pytest.raises(
        ConfigurationError, match=r"^spark.network.crypto.enabled true on the driver .*pip install"
    ):
        NetworkSettings.of({}, {"spark.network.crypto.enabled": "true"}.get)
    assert AllReduceParameter(2, 10).network.encrypt is False  # off: nothing needed


def test_the_estimators_and_job_files_have_the_setting():
    from allreduce_param.ml import AllReduceClassifier

    classifier = AllReduceClassifier(encrypt=True)
    assert classifier.getEncrypt() is True
    assert (
        classifier._trainer(
            __import__("allreduce_param").models.SoftmaxRegression(4, 3)
        ).settings.network.encrypt
        is True
    )
    from allreduce_param.cli import apply_overrides

    job = apply_overrides({"train": {}}, ["train.encrypt=true"])
    assert FitSettings.of_flat(job["train"]).network.encrypt is True


# ---- Spark's own encryption turns the engine's on ----------------------------------------------

SPARK_MASTER = "local[2]"
#: Spark's RPC encryption needs its authentication (a local master makes the secret itself)
SPARK_SETTINGS = {"spark.authenticate": "true", "spark.network.crypto.enabled": "true"}


def encrypted_stage_task(param: AllReduceParameter):
    def task(_rows):
        with param.connect() as p:
            p.init(np.zeros(param.size, np.float32))
            p.put_gradients(np.full(param.size, p.info.partition_id + 1.0, np.float32), count=1.0)
            mean = p.aggregate_gradient_partition().copy()
            kinds = sorted(
                {type(client._sock).__name__ for client in p._peers.worker.clients.values()}
            )
        yield p.info.partition_id, float(mean.min()), float(mean.max()), kinds

    return task


@pytest.mark.slow
def test_the_engine_encrypts_where_the_drivers_spark_does(spark, monkeypatch):
    from allreduce_param import DistriOptimizer, models, optim
    from allreduce_param.spark.info import SparkInfo
    from allreduce_param.train.driver import meeting

    assert spark.sparkContext.getConf().get("spark.network.crypto.enabled") == "true"
    param = AllReduceParameter(2, 3 * RECORD_SIZE // 4, codec="raw", unix_sockets=False)
    assert param.network.encrypt is True
    assert FitSettings().network.resolved(SparkInfo(spark).session_setting).encrypt is True
    spark.conf.set("spark.allreduce.encrypt", "false")  # the engine's own setting wins over Spark's
    try:
        assert AllReduceParameter(2, 10).network.encrypt is False
    finally:
        spark.conf.unset("spark.allreduce.encrypt")
    assert (
        AllReduceParameter(2, 10, network=NetworkSettings(encrypt=False)).network.encrypt is False
    )

    # two Python workers, their blocks over encrypted TCP
    results = sorted(
        spark.sparkContext.parallelize(range(2), 2)
        .barrier()
        .mapPartitions(encrypted_stage_task(param))
        .collect()
    )
    assert results == [(0, 1.5, 1.5, ["SealedConnection"]), (1, 1.5, 1.5, ["SealedConnection"])]

    # a fit: its parameter and its driver's message server encrypt; the progress arrives
    made = []

    class Recorded(meeting.MessageServer):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("encrypt"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(meeting, "MessageServer", Recorded)
    rng = np.random.default_rng(0)
    rows = [(rng.standard_normal(3).astype(np.float32), float(i % 3)) for i in range(32)]
    events = []
    result = DistriOptimizer(
        models.LinearRegression(3),
        optim.SGD(lr=0.05),
        batch_size=8,
        epochs=1,
        progress=False,
        listener=lambda kind, fields: events.append(kind),
    ).fit(spark.sparkContext.parallelize(rows, 2))
    assert made == [True]
    assert events.count("step") == len(result.history.steps) == 4 and "epoch" in events


@pytest.mark.slow
def test_the_distributor_runs_where_spark_encrypts(spark):
    """The Distributor on a session whose Spark encrypts its traffic, where PySpark's
    TorchDistributor refuses: the ranks' connections and the driver's message channel
    follow it, as a fit's do."""
    pytest.importorskip("torch")
    import contextlib
    import io

    from allreduce_param.spark.info import SparkInfo
    from allreduce_param.torch import Distributor

    def sums_rank_plus_one() -> float:
        import torch
        import torch.distributed as dist

        total = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(total)
        print(f"summed {float(total)}")
        return float(total)

    # what the Distributor resolves its network with, as a fit does: encrypted
    assert NetworkSettings().resolved(SparkInfo(spark).session_setting).encrypt is True
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert Distributor(num_processes=2).run(sums_rank_plus_one) == 3.0
    lines = sorted(line for line in printed.getvalue().splitlines() if "summed" in line)
    assert lines == ["[rank 0] summed 3.0", "[rank 1] summed 3.0"]
