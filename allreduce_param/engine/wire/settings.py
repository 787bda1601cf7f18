"""Where the engine's servers listen, and how long a connection may take: ``NetworkSettings``,
read once (on the driver) from the arguments and the Spark settings ``SPARK_SETTINGS``
names, and the parsing and checks of each setting.

This module names Spark's settings but reads none itself: the caller hands ``of`` a lookup
(the Spark layer reads them from the session), so the wire stays Spark-free.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from allreduce_param.engine.wire.sealing import cipher_class
from allreduce_param.errors import ConfigurationError

log = logging.getLogger(__name__)

#: The Spark settings the engine reads (on the driver) for what its arguments leave unset.
SPARK_SETTINGS = {
    "bind_address": "spark.allreduce.bindAddress",
    "advertise_address": "spark.allreduce.advertiseAddress",
    "port_range": "spark.allreduce.portRange",
    "connect_timeout": "spark.allreduce.connectTimeout",
    "encrypt": "spark.allreduce.encrypt",
}
#: Spark's own encryption settings: where either is "true" on the driver and ``encrypt`` is
#: unset, the engine encrypts too (a cluster that encrypts its traffic expects all of it to be).
SPARK_ENCRYPTION = ("spark.network.crypto.enabled", "spark.ssl.enabled")
#: What the encryption settings say, in every place: how to turn it on or off.
ENCRYPT_SETTINGS = (
    f"encrypt (the fit's settings; AllReduceParameter(network=NetworkSettings(encrypt=...))) or the Spark setting "
    f"{SPARK_SETTINGS['encrypt']}; unset, it follows {' and '.join(SPARK_ENCRYPTION)} on the driver"
)
#: Per host, these environment variables (set in each machine's spark-env.sh, or a pod's
#: environment) win over the settings: where a host's address is its own.
ENVIRONMENT = {
    "bind_address": "ALLREDUCE_BIND_ADDRESS",
    "advertise_address": "ALLREDUCE_ADVERTISE_ADDRESS",
}
DEFAULT_CONNECT_TIMEOUT = 10.0


def parse_flag(value, where: str) -> bool | None:
    """``True``, ``False``, ``"true"`` / ``"false"`` (as Spark writes them, any case) or None."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ConfigurationError(f"{where}={value!r} must be true or false")


def parse_port_range(value, where: str = "port_range") -> tuple[int, int] | None:
    """``"40000-40099"``, ``"40000"``, ``(40000, 40099)`` or None, as ``(first, last)``."""
    if value is None or value == "":
        return None
    try:
        if isinstance(value, str):
            first, _, last = value.strip().partition("-")
            first, last = int(first), int(last or first)
        else:
            first, last = (int(port) for port in value)
    except (TypeError, ValueError):
        first = last = None
    if first is None or not 1 <= first <= last <= 65535 or isinstance(value, bool):
        raise ConfigurationError(
            f"{where}={value!r}: write the ports the engine's servers may listen on as "
            "'FIRST-LAST' (e.g. '40000-40099', within 1-65535), or leave it unset for any free port"
        )
    return first, last


def check_address(value, where: str, bind: bool = False) -> str | None:
    """``value`` as an address to bind (``bind``) or to tell the others; None when unset."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or any(c.isspace() for c in value) or value.count(":") == 1:
        raise ConfigurationError(
            f"{where}={value!r}: give a host name or an IP address, without a port "
            "(ports come from port_range)"
        )
    if bind and is_wildcard(value):
        raise ConfigurationError(
            f"{where}={value!r}: the engine's servers listen on one address of their host, never on every "
            f"interface: give one of its addresses (where hosts differ, {ENVIRONMENT['bind_address']} on each), "
            "or leave it unset for the address Spark names for each process"
        )
    return value


def is_wildcard(address: str) -> bool:
    """Whether binding ``address`` would listen on every interface (0.0.0.0, ::)."""
    try:
        return ipaddress.ip_address(address).is_unspecified
    except ValueError:  # a host name
        return False


@dataclass(frozen=True)
class NetworkSettings:
    """Where the engine's servers listen, and how long a connection may take.

    ``bind_address``: the address servers listen on (one of the host's: never every
    interface); ``advertise_address``: the one the others connect to. Unset, each server uses the
    address Spark gives its process: a task's executor address, the driver's
    ``spark.driver.bindAddress`` / ``spark.driver.host``. The environment variables
    ``ENVIRONMENT`` names win on the host where they are set. ``port_range``: the ports
    servers may take, ``(first, last)`` (None: any free one). ``connect_timeout``: how long
    a connection and its handshake may take; the waits that follow from it (the meeting
    at the driver, a failed partition's last words) are derived here, in one place.
    ``encrypt``: whether connections over TCP (between hosts, or all of them without Unix
    sockets) are encrypted (``sealing.py``); Unix sockets and shared memory, which never
    leave the host, are not. ``of`` turns it on where it is unset and the driver's Spark
    encrypts its own traffic (``SPARK_ENCRYPTION``).

    A field left None is unset: ``resolved`` (and ``of``) fill it from its Spark setting,
    else the default (``connect_timeout`` 10 s; ``encrypt`` as Spark's own encryption), so
    a fit's ``network=NetworkSettings(port_range="40000-40099")`` still follows
    ``spark.allreduce.*`` for the rest. The engine holds resolved ones only
    (``ParameterSpec`` resolves what it is given, with no Spark setting read).
    """

    bind_address: str | None = None
    advertise_address: str | None = None
    port_range: tuple[int, int] | None = None
    connect_timeout: float | None = None
    encrypt: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "bind_address", check_address(self.bind_address, "bind_address", bind=True)
        )
        object.__setattr__(
            self, "advertise_address", check_address(self.advertise_address, "advertise_address")
        )
        object.__setattr__(self, "port_range", parse_port_range(self.port_range))
        timeout = self.connect_timeout
        if timeout is not None:
            if (
                isinstance(timeout, bool)
                or not isinstance(timeout, (int, float))
                or not timeout > 0
            ):
                raise ConfigurationError(
                    f"connect_timeout must be a positive number of seconds, got {timeout!r}"
                )
            object.__setattr__(self, "connect_timeout", float(timeout))
        if self.encrypt is not None and not isinstance(self.encrypt, bool):
            raise ConfigurationError(
                f"encrypt must be True, False or None (follow Spark), got {self.encrypt!r}"
            )
        if self.encrypt:
            cipher_class()  # missing: say what to install, here on the driver rather than in every task

    @classmethod
    def of(
        cls,
        values: Mapping[str, object],
        spark_setting: Callable[[str], str | None] = lambda name: None,
    ) -> NetworkSettings:
        """Settings from ``values`` (arguments by field name; None: unset), each unset one
        from its Spark setting (``SPARK_SETTINGS``) through ``spark_setting(name)``;
        ``encrypt``, when neither sets it, on where one of Spark's own encryption settings
        (``SPARK_ENCRYPTION``) is true."""
        chosen = {"encrypt": _encryption(values.get("encrypt"), spark_setting)}
        for name, spark_name in SPARK_SETTINGS.items():
            value = values.get(name)
            if name == "encrypt":
                continue
            if value is None:
                value = spark_setting(spark_name)
                if value is not None and name == "connect_timeout":
                    try:
                        value = float(value)
                    except ValueError:
                        raise ConfigurationError(
                            f"{spark_name}={value!r} must be a number of seconds"
                        ) from None
                where = spark_name
            else:
                where = name
            if value is not None:
                try:
                    cls(**{name: value})
                except ConfigurationError as error:
                    raise ConfigurationError(
                        str(error).replace(f"{name}=", f"{where}=", 1)
                    ) from None
                chosen[name] = value
        chosen.setdefault("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        return cls(**chosen)

    def resolved(
        self, spark_setting: Callable[[str], str | None] = lambda name: None
    ) -> NetworkSettings:
        """These settings with every unset one filled (``of``): from its Spark setting
        through ``spark_setting(name)``, else its default; each set one checked as ``of``
        checks it."""
        values = {name: getattr(self, name) for name in SPARK_SETTINGS}
        return type(self).of(values, spark_setting)

    def addresses(self, default_bind: str, default_advertise: str | None = None) -> tuple[str, str]:
        """``(bind, advertise)`` for a server whose process Spark gives ``default_bind`` (and
        ``default_advertise`` for the others, when that differs): the host's environment
        first, then these settings, then Spark's. Where Spark's bind address is every
        interface (``spark.driver.bindAddress=0.0.0.0``), the server binds the address Spark
        tells the others instead."""
        if is_wildcard(default_bind) and default_advertise:
            default_bind = default_advertise
        bind = (
            check_address(
                os.environ.get(ENVIRONMENT["bind_address"]), ENVIRONMENT["bind_address"], bind=True
            )
            or self.bind_address
            or default_bind
        )
        advertise = os.environ.get(ENVIRONMENT["advertise_address"]) or self.advertise_address
        if not advertise:  # a bind address of its own is told as itself; Spark's, as Spark tells it
            advertise = bind if bind != default_bind else (default_advertise or default_bind)
        spark_names = default_advertise or default_bind
        if is_loopback(advertise) and not is_loopback(spark_names):
            log.warning(
                "the engine's server here is told to others as %s, a loopback address, while Spark names "
                "this process %s: processes on other hosts cannot reach it. Check bind_address / "
                "advertise_address (spark.allreduce.*, %s, %s)",
                advertise,
                spark_names,
                *ENVIRONMENT.values(),
            )
        return bind, advertise

    @property
    def meeting_patience(self) -> float:
        """How long the tasks meeting at the driver wait for the last one before they meet
        through ``allGather`` instead: longer than a task takes to find the driver out of
        reach (a connect timeout), so none is left alone at either."""
        return 3 * self._connect_seconds

    @property
    def failure_linger(self) -> float:
        """How long a failed partition keeps telling its peers why, at most (they ask within
        a connect timeout, or have hung up)."""
        return self._connect_seconds

    @property
    def _connect_seconds(self) -> float:
        """``connect_timeout``, or its default where it is unset."""
        return DEFAULT_CONNECT_TIMEOUT if self.connect_timeout is None else self.connect_timeout


def _encryption(value, spark_setting: Callable[[str], str | None]) -> bool:
    """``encrypt`` as given, else as ``spark.allreduce.encrypt`` says, else on where one of
    Spark's own encryption settings is true; ConfigurationError, naming what turned it on,
    when it is on and the cipher's package is missing."""
    if value is not None:
        on, where = parse_flag(value, "encrypt"), "encrypt=True"
    else:
        spark_name = SPARK_SETTINGS["encrypt"]
        on, where = parse_flag(spark_setting(spark_name), spark_name), f"{spark_name}=true"
        if on is None:
            spark_on = [
                key for key in SPARK_ENCRYPTION if str(spark_setting(key)).strip().lower() == "true"
            ]
            on, where = (
                bool(spark_on),
                f"{' and '.join(spark_on)} true on the driver (so the engine encrypts too)",
            )
    if on:
        try:
            cipher_class()
        except ConfigurationError as error:
            raise ConfigurationError(f"{where}: {error}") from None
    return on


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP address or a host name) is this host's loopback."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name: Spark's names are resolved by the others, as they are
        return False
