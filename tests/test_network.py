"""Where the engine's servers listen: addresses, port ranges, timeouts, and their errors.

Everything here binds 127.0.0.1 (or every interface, and is reached on 127.0.0.1); an
address this machine does not have is only bound, never sent to."""

from __future__ import annotations

import logging
import socket
import threading

import numpy as np
import pytest
from conftest import free_ports, raise_first, run_partitions

from allreduce_param import ConfigurationError, NetworkError
from allreduce_param.engine import AllReduceParameter, NetworkSettings
from allreduce_param.engine.blocks.store import BlockStore
from allreduce_param.engine.wire.blocks import BlockServer
from allreduce_param.engine.wire.messages import MessageServer
from allreduce_param.engine.wire.server import listen
from allreduce_param.engine.wire.settings import ENVIRONMENT


@pytest.mark.parametrize(
    "given, expected",
    [
        ("40000-40099", (40000, 40099)),
        ("40000", (40000, 40000)),
        ((40000, 40001), (40000, 40001)),
        (" 41000-41000 ", (41000, 41000)),
        (None, None),
        ("", None),
    ],
)
def test_port_ranges_are_read_in_every_form(given, expected):
    assert NetworkSettings(port_range=given).port_range == expected


@pytest.mark.parametrize("given", ["40099-40000", "0-10", "40000-70000", "ports", (1, 2, 3), True])
def test_a_bad_port_range_is_named(given):
    with pytest.raises(ConfigurationError, match=r"port_range=.*'FIRST-LAST'"):
        NetworkSettings(port_range=given)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("bind_address", "127.0.0.1:4000", "without a port"),
        ("advertise_address", "a host", "without a port"),
        ("connect_timeout", 0, "connect_timeout must be a positive number"),
        ("connect_timeout", "10", "connect_timeout must be a positive number"),
    ],
)
def test_bad_addresses_and_timeouts_are_named(field, value, message):
    with pytest.raises(ConfigurationError, match=message):
        NetworkSettings(**{field: value})


def test_arguments_win_over_spark_settings_and_a_bad_spark_setting_is_named_by_its_key():
    spark = {
        "spark.allreduce.portRange": "40000-40009",
        "spark.allreduce.connectTimeout": "4",
        "spark.allreduce.bindAddress": "10.1.2.3",
    }
    settings = NetworkSettings.of({"bind_address": "127.0.0.1", "port_range": None}, spark.get)
    assert settings == NetworkSettings("127.0.0.1", None, (40000, 40009), 4.0, False)
    with pytest.raises(ConfigurationError, match=r"spark.allreduce.portRange='9-1'"):
        NetworkSettings.of({}, {"spark.allreduce.portRange": "9-1"}.get)
    with pytest.raises(
        ConfigurationError, match=r"spark.allreduce.connectTimeout='soon' must be a number"
    ):
        NetworkSettings.of({}, {"spark.allreduce.connectTimeout": "soon"}.get)
    assert NetworkSettings.of({}).meeting_patience == 30.0  # 3 connect timeouts of 10 s


def test_a_parameter_given_network_settings_uses_them_as_they_are(monkeypatch):
    """``network=``: settings resolved once on the driver; no Spark setting is read again."""
    from allreduce_param.engine import surroundings

    class NoSettings(surroundings.Standalone):
        def setting(self, name: str) -> str | None:
            raise AssertionError(f"{name} was read though network= was given")

    monkeypatch.setattr(surroundings, "_current", NoSettings())
    settings = NetworkSettings(
        "127.0.0.1", port_range=(40000, 40009), connect_timeout=4.0, encrypt=False
    )
    param = AllReduceParameter(2, 8, network=settings)
    assert param.network is settings and param.spec.network is settings
    # unset ones take their defaults, still with no Spark setting read
    partly = AllReduceParameter(2, 8, network=NetworkSettings(port_range=(40000, 40009)))
    assert partly.network == NetworkSettings(None, None, (40000, 40009), 10.0, False)
    with pytest.raises(ConfigurationError, match="network must be a NetworkSettings"):
        AllReduceParameter(2, 8, network={"bind_address": "127.0.0.1"})


def test_addresses_come_from_the_environment_then_the_settings_then_spark(monkeypatch):
    for variable in ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    assert NetworkSettings().addresses("10.0.0.5") == ("10.0.0.5", "10.0.0.5")
    # one address of its own: the others are told that one
    assert NetworkSettings(bind_address="192.0.2.1").addresses("10.0.0.5") == (
        "192.0.2.1",
        "192.0.2.1",
    )
    assert NetworkSettings("10.0.0.6", "203.0.113.9").addresses("10.0.0.5") == (
        "10.0.0.6",
        "203.0.113.9",
    )
    # the driver: Spark's bind address and host differ
    assert NetworkSettings().addresses("10.0.0.3", "10.0.0.2") == ("10.0.0.3", "10.0.0.2")
    # spark.driver.bindAddress=0.0.0.0: the driver's server binds the address Spark tells the others
    assert NetworkSettings().addresses("0.0.0.0", "10.0.0.2") == ("10.0.0.2", "10.0.0.2")
    monkeypatch.setenv(ENVIRONMENT["bind_address"], "10.0.0.7")
    monkeypatch.setenv(ENVIRONMENT["advertise_address"], "10.9.9.9")
    assert NetworkSettings(bind_address="127.0.0.1").addresses("10.0.0.5") == (
        "10.0.0.7",
        "10.9.9.9",
    )


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_no_server_binds_every_interface(monkeypatch, wildcard):
    for variable in ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(
        ConfigurationError,
        match=rf"bind_address='{wildcard}': the engine's servers listen on one "
        r"address of their host, never on every interface",
    ):
        NetworkSettings(bind_address=wildcard)
    with pytest.raises(
        ConfigurationError, match=rf"spark.allreduce.bindAddress='{wildcard}': .*never on every"
    ):
        NetworkSettings.of({}, {"spark.allreduce.bindAddress": wildcard}.get)
    monkeypatch.setenv(ENVIRONMENT["bind_address"], wildcard)
    with pytest.raises(
        ConfigurationError, match=rf"ALLREDUCE_BIND_ADDRESS='{wildcard}': .*never on every"
    ):
        NetworkSettings().addresses("10.0.0.5")
    # and whoever chose it, no server listens there
    with pytest.raises(
        ConfigurationError, match=r"partition 0's block server's bind address='.*never on every"
    ):
        BlockServer(BlockStore(), b"s" * 32, param_id=1, partition_id=0, host=wildcard)
    with pytest.raises(
        ConfigurationError, match=r"the driver's message server's bind address='.*never on every"
    ):
        MessageServer(wildcard, lambda message, reply: None)


def test_a_loopback_address_told_to_others_where_spark_names_another_is_warned_of(
    monkeypatch, caplog
):
    for variable in ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    with caplog.at_level(logging.WARNING, logger="allreduce_param.engine.wire.settings"):
        NetworkSettings().addresses("127.0.0.1")  # one machine: loopback everywhere, nothing to say
        NetworkSettings(bind_address="10.0.0.6").addresses("10.0.0.5")
        assert caplog.text == ""
        monkeypatch.setenv(ENVIRONMENT["bind_address"], "127.0.0.1")
        assert NetworkSettings().addresses("10.0.0.5") == ("127.0.0.1", "127.0.0.1")
    assert (
        "told to others as 127.0.0.1, a loopback address, while Spark names this process 10.0.0.5"
        in caplog.text
    )


def test_a_listener_takes_a_port_of_its_range_and_says_when_none_is_free():
    first, last = free_ports(3)
    taken = [listen("127.0.0.1", (first, last), 4, "test server") for _ in range(3)]
    try:
        assert sorted(sock.getsockname()[1] for sock in taken) == [first, first + 1, last]
        with pytest.raises(NetworkError) as refused:
            listen("127.0.0.1", (first, last), 4, "partition 2's block server")
    finally:
        for sock in taken:
            sock.close()
    text = str(refused.value)
    assert (
        f"partition 2's block server found no free port in {first}-{last} on 127.0.0.1 (all 3 taken)"
        in text
    )
    assert "spark.allreduce.portRange" in text and "one port per task on each executor" in text


def test_an_address_this_host_does_not_have_is_named():
    with pytest.raises(
        NetworkError,
        match=r"cannot listen on 192.0.2.77 .*is 192.0.2.77 an address of this host\? "
        r"Set bind_address \(the Spark setting spark.allreduce.bindAddress",
    ):
        # TEST-NET-1: bound, never sent to
        listen("192.0.2.77", None, 4, "partition 0's block server")


def test_partitions_serve_in_the_port_range_and_sync_exactly():
    first, last = free_ports(4)
    param = AllReduceParameter(
        3,
        1000,
        codec="raw",
        unix_sockets=False,
        network=NetworkSettings(port_range=f"{first}-{last}", connect_timeout=5),
    )
    assert param.network.port_range == (first, last) and param.network.connect_timeout == 5.0

    def body(p):
        p.init(np.zeros(1000))
        p.put_gradients(np.full(1000, p.info.partition_id + 1.0, np.float32), count=1.0)
        return p._peers._server.address, p.aggregate_gradient_partition().copy()

    results = raise_first(run_partitions(param, body))
    assert all(first <= address[1] <= last for address, _ in results)
    # (1+2+3)/3
    assert all(np.array_equal(total, np.full(total.size, 2.0, np.float32)) for _, total in results)


def test_partitions_are_reached_at_the_advertised_address_apart_from_the_bound_one():
    param = AllReduceParameter(
        2,
        100,
        codec="raw",
        unix_sockets=False,
        network=NetworkSettings(bind_address="127.0.0.1", advertise_address="localhost"),
    )

    def body(p):
        p.init(np.zeros(100))
        p.put_gradients(np.ones(100, np.float32), count=1.0)
        server = p._peers._server
        return (
            server.address[0],
            server.advertised_address[0],
            p.aggregate_gradient_partition().sum(),
        )

    results = raise_first(run_partitions(param, body))
    assert [result[:2] for result in results] == [("127.0.0.1", "localhost")] * 2
    assert sum(result[2] for result in results) == 100.0  # the mean of ones, over both slices


def test_a_partition_with_no_free_port_fails_naming_the_range():
    first, last = free_ports(1)
    param = AllReduceParameter(1, 10, network=NetworkSettings(port_range=(first, last)))
    with socket.create_server(("127.0.0.1", first)):
        [error] = run_partitions(param, lambda p: None)
    assert isinstance(error, NetworkError) and f"no free port in {first}-{last}" in str(error)


def test_the_drivers_message_server_listens_in_the_range_and_advertises_its_address():
    first, last = free_ports(2)
    got, arrived = [], threading.Event()
    server = MessageServer(
        "127.0.0.1",
        lambda message, reply: (got.append(message), arrived.set()),
        advertise="localhost",
        ports=(first, last),
    )
    try:
        assert server.bound_address[0] == "127.0.0.1" and server.address[0] == "localhost"
        assert first <= server.address[1] <= last
        client = server.client()
        client.send({"kind": "hello"})
        assert arrived.wait(30)
        client.close()
    finally:
        server.close()
    assert got == [{"kind": "hello"}]
