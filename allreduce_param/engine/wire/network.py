"""Where the engine's servers listen, and how a connection to one proves the secret.

Two servers use this: each partition's block server (``transport.BlockServer``) and the
driver's message server (``messages.MessageServer``). Both listen where
``NetworkSettings`` says and admit only connections that prove a shared secret in the
handshake below, on one accept loop. Each then serves every proven connection with a few
threads (``AuthenticatedServer``: the loop watches the idle connections, a small pool
answers), however many connect.

Handshake (little-endian). Server: ``MAGIC`` + 16-byte nonce. Client: magic, parameter id,
own partition id, 16-byte nonce, HMAC-SHA256(secret, "client" + both nonces + ids).
Server: one status byte, then its own HMAC(secret, "server" + ...) so the client knows it
talks to a holder of the secret too. A connection that fails it reads and writes nothing
more. Both ends then share a session key, HMAC(secret, "session" + both nonces + ids),
fresh for every connection (the messages are tagged with it).

With ``NetworkSettings.encrypt`` a TCP connection is encrypted after the handshake
(``sealing.py``, its keys from the session key). Whether it is counts as one of the ids:
the MACs and the session key of a sealed connection cover ``sealing.CIPHER_NAME`` too, so
an end that encrypts and one that does not never agree; the server, seeing that the
client's MAC holds for the other choice, refuses it with its own status
(``HELLO_OTHER_SEALING``), and the client's error names the setting.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from allreduce_param.engine.wire.events import EventLoop, Timer
from allreduce_param.engine.wire.sealing import (
    CIPHER_NAME,
    SealedConnection,
    cipher_class,
    seal_proven,
)
from allreduce_param.errors import (
    AuthenticationError,
    ConfigurationError,
    NetworkError,
    ProtocolError,
)

log = logging.getLogger(__name__)

MAGIC = b"ARP1"
NONCE_SIZE = 16
MAC_SIZE = 32
_CLIENT_HELLO = struct.Struct(
    f"<4sII{NONCE_SIZE}s{MAC_SIZE}s"
)  # magic, param, partition, nonce, mac
HELLO_OK = 0
HELLO_REFUSED = 4
#: The client proved the secret, but for the other choice of encryption (no block response
#: status has this value).
HELLO_OTHER_SEALING = 6

#: Connections that may be in their handshake at once, at least; one more pushes out the
#: oldest. A server of N partitions allows 2N (``unproven_limit``): every peer's channels
#: may connect at the same moment.
MAX_UNPROVEN = 64
#: How long accepting pauses after accept() failed (e.g. out of file descriptors).
ACCEPT_PAUSE = 0.2
#: How long closing waits for each server thread before it names the late ones in the log.
CLOSE_TIMEOUT = 10.0

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
    f"encrypt (AllReduceParameter, the fit's settings) or the Spark setting "
    f"{SPARK_SETTINGS['encrypt']}; unset, it follows {' and '.join(SPARK_ENCRYPTION)} on the driver"
)
#: Per host, these environment variables (set in each machine's spark-env.sh, or a pod's
#: environment) win over the settings: where a host's address is its own.
ENVIRONMENT = {
    "bind_address": "ALLREDUCE_BIND_ADDRESS",
    "advertise_address": "ALLREDUCE_ADVERTISE_ADDRESS",
}
DEFAULT_CONNECT_TIMEOUT = 10.0
_TAKEN = (
    errno.EADDRINUSE,
    errno.EACCES,
)  # a port another process holds, or one this user may not take


def unproven_limit(partition_num: int) -> int:
    """How many connections a server of ``partition_num`` partitions lets be in their
    handshake at once: enough for every peer's worker and owner channels to connect at the
    same moment, and never fewer than ``MAX_UNPROVEN``."""
    return max(MAX_UNPROVEN, 2 * partition_num)


def parse_flag(value, where: str) -> bool | None:
    """``True``, ``False``, ``"true"`` / ``"false"`` (as Spark writes them, any case) or None."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ConfigurationError(f"{where}={value!r} must be true or false")


def mac(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``role`` and ``parts`` under ``secret``: every tag of the protocol."""
    return hmac.new(secret, role + b"".join(parts), hashlib.sha256).digest()


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


def _check_address(value, where: str, bind: bool = False) -> str | None:
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
    """

    bind_address: str | None = None
    advertise_address: str | None = None
    port_range: tuple[int, int] | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    encrypt: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "bind_address", _check_address(self.bind_address, "bind_address", bind=True)
        )
        object.__setattr__(
            self, "advertise_address", _check_address(self.advertise_address, "advertise_address")
        )
        object.__setattr__(self, "port_range", parse_port_range(self.port_range))
        timeout = self.connect_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigurationError(
                f"connect_timeout must be a positive number of seconds, got {timeout!r}"
            )
        object.__setattr__(self, "connect_timeout", float(timeout))
        if self.encrypt is not None and not isinstance(self.encrypt, bool):
            raise ConfigurationError(
                f"encrypt must be True, False or None (follow Spark), got {self.encrypt!r}"
            )
        object.__setattr__(self, "encrypt", bool(self.encrypt))
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
        return cls(**chosen)

    def addresses(self, default_bind: str, default_advertise: str | None = None) -> tuple[str, str]:
        """``(bind, advertise)`` for a server whose process Spark gives ``default_bind`` (and
        ``default_advertise`` for the others, when that differs): the host's environment
        first, then these settings, then Spark's. Where Spark's bind address is every
        interface (``spark.driver.bindAddress=0.0.0.0``), the server binds the address Spark
        tells the others instead."""
        if is_wildcard(default_bind) and default_advertise:
            default_bind = default_advertise
        bind = (
            _check_address(
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
        return 3 * self.connect_timeout

    @property
    def failure_linger(self) -> float:
        """How long a failed partition keeps telling its peers why, at most (they ask within
        a connect timeout, or have hung up)."""
        return self.connect_timeout


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


def listen(host: str, ports: tuple[int, int] | None, backlog: int, what: str) -> socket.socket:
    """A TCP listener on ``host`` at a free port of ``ports`` (None: any free one).

    NetworkError, naming ``what`` and the setting to change, when the address is not this
    host's or no port of the range is free."""
    candidates = [0] if ports is None else list(range(ports[0], ports[1] + 1))
    if (
        ports is not None and len(candidates) > 1
    ):  # start anywhere, so that servers on one host rarely collide
        start = int.from_bytes(os.urandom(2), "little") % len(candidates)
        candidates = candidates[start:] + candidates[:start]
    last_error: OSError | None = None
    for port in candidates:
        try:
            return socket.create_server((host, port), backlog=backlog)
        except OSError as error:
            last_error = error
            if error.errno not in _TAKEN:
                break
    if ports is not None and last_error is not None and last_error.errno in _TAKEN:
        raise NetworkError(
            f"{what} found no free port in {ports[0]}-{ports[1]} on {host} (all {len(candidates)} taken): widen "
            f"the range (port_range, or the Spark setting {SPARK_SETTINGS['port_range']}), allowing at least one "
            "port per task on each executor plus one for the driver, or free ports there"
        ) from last_error
    raise NetworkError(
        f"{what} cannot listen on {host}{'' if ports is None else f' in ports {ports[0]}-{ports[1]}'} "
        f"({last_error}): is {host} an address of this host? Set bind_address (the Spark setting "
        f"{SPARK_SETTINGS['bind_address']}, or {ENVIRONMENT['bind_address']} on that host) to one of its "
        "addresses"
    ) from last_error


def unix_sockets_available() -> bool:
    """Whether this platform has abstract Unix sockets (Linux): the same-host fast path."""
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``EOFError`` if the peer closes first."""
    received = 0
    total = view.nbytes
    while received < total:
        got = sock.recv_into(view[received:], total - received)
        if got == 0:
            raise EOFError(f"connection closed after {received} of {total} bytes")
        received += got


def cut(connections) -> None:
    """Shut every socket down both ways, so a thread blocked reading one wakes with its end;
    one already gone is left alone."""
    for conn in connections:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def tune(sock: socket.socket) -> None:
    """Small frames must not wait for Nagle. Socket buffer sizes are left to the kernel's
    own sizing, which did no worse than fixed ones (docs/DESIGN.md, figures)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def seals(sock, encrypt: bool) -> bool:
    """Whether a connection is encrypted (``sealing.py``): with ``encrypt`` on, one that can
    leave the host (TCP); a Unix socket never."""
    return bool(encrypt) and sock.family != socket.AF_UNIX


def _ids(param_id: int, partition_id: int, sealed: bool) -> bytes:
    """What the handshake's MACs and the session key bind besides the nonces: the parameter,
    the client's partition, and whether the connection is encrypted (and how)."""
    return struct.pack("<II", param_id, partition_id) + (CIPHER_NAME if sealed else b"")


def client_handshake(
    sock: socket.socket,
    secret: bytes,
    param_id: int,
    partition_id: int,
    server_text: str,
    refused: str,
    encrypt: bool = False,
) -> bytes:
    """Prove the secret to the server on ``sock`` and check its proof; the session key.

    With ``encrypt``, a TCP connection (``seals``) is agreed to be encrypted: the caller
    wraps it in a ``sealing.SealedConnection`` with the key. AuthenticationError (with
    ``refused`` when the server refused us), ConfigurationError when the server knows the
    secret but does not make the same choice about encryption, ProtocolError when the other
    end is no allreduce-param server; OSError and EOFError as the socket gives."""
    greeting = bytearray(len(MAGIC) + NONCE_SIZE)
    recv_exactly(sock, memoryview(greeting))
    if greeting[: len(MAGIC)] != MAGIC:
        raise ProtocolError(f"{server_text} is not an allreduce-param server")
    server_nonce = bytes(greeting[len(MAGIC) :])
    client_nonce = os.urandom(NONCE_SIZE)
    sealed = seals(sock, encrypt)
    ids = _ids(param_id, partition_id, sealed)
    sock.sendall(
        _CLIENT_HELLO.pack(
            MAGIC,
            param_id,
            partition_id,
            client_nonce,
            mac(secret, b"client", server_nonce, client_nonce, ids),
        )
    )
    status = bytearray(1)
    recv_exactly(sock, memoryview(status))
    if status[0] == HELLO_OTHER_SEALING:
        raise ConfigurationError(
            f"{server_text} refused this connection: this end {'encrypts' if sealed else 'does not encrypt'} it and "
            f"that server {'does not' if sealed else 'does'}. Both ends must make the same choice: "
            f"{ENCRYPT_SETTINGS}; every task must use the one AllReduceParameter made on the driver"
        )
    if status[0] != HELLO_OK:
        raise AuthenticationError(f"{server_text} refused this connection: {refused}")
    proof = bytearray(MAC_SIZE)
    recv_exactly(sock, memoryview(proof))
    if not hmac.compare_digest(
        bytes(proof), mac(secret, b"server", client_nonce, server_nonce, ids)
    ):
        raise AuthenticationError(f"{server_text} could not prove the secret")
    return mac(secret, b"session", server_nonce, client_nonce, ids)


class Proven(NamedTuple):
    """A connection that proved the secret: the socket (a ``sealing.SealedConnection``
    around it when both agreed to encrypt it: ``sealed``), the client's partition, where it
    came from (for messages), and the session key both ends now share."""

    sock: socket.socket | SealedConnection
    partition: int
    peer_text: str
    session_key: bytes
    sealed: bool = False


class _Unproven:
    """A connection in its handshake: what it has sent so far, and the timer that drops it
    when it has not proven the secret in time."""

    __slots__ = ("sock", "peer_text", "nonce", "hello", "timer")

    def __init__(self, sock: socket.socket, peer_text: str, nonce: bytes) -> None:
        self.sock, self.peer_text, self.nonce = sock, peer_text, nonce
        self.hello = bytearray()
        self.timer: Timer | None = None


class AuthenticatedServer:
    """Listens, admits the connections that prove ``secret`` for ``param_id`` (from a
    partition in ``0..partition_num-1``), and runs ``serve(proven)`` for each. Close it when
    done.

    ``serve(proven)`` runs on one of at most ``pool`` threads and must return soon; the
    connection is then the caller's. It asks this server to ``watch`` it (the accept loop
    selects on it and calls back on a pool thread once it has bytes to read), to ``call_at``
    a deadline, or to ``submit`` work, and says ``discard`` when it has closed it. So a
    server with many idle or waiting connections holds ``pool`` threads (and the loop's),
    not one each.

    Listens on ``bind`` at a port of ``ports`` (None: any free one; ``port``, when not 0,
    exactly there) and, with ``unix``, also on an abstract Unix socket (``local_name``),
    which peers on the same host use instead. ``advertise`` is the address the others are
    told (``address`` is what was bound).

    One thread accepts and runs every handshake at once, each connection a small state in
    a selector: a connection that has not proven the secret costs no thread, gets
    ``timeout`` seconds, and at most ``MAX_UNPROVEN`` wait at a time (a new one pushes out
    the oldest), so a flood of idle or garbage connections neither exhausts the process
    nor keeps peers out; an error from ``accept`` (out of file descriptors) pauses
    accepting briefly and never ends it. A partition id is taken from a connection only
    once it has proven the secret. The bound on connections in their handshake grows with
    ``partition_num`` (``unproven_limit``), so all peers connecting at once are admitted.
    With ``encrypt``, a TCP connection must agree to be encrypted (``Proven.sealed``); one
    that proves the secret for the other choice is refused with ``HELLO_OTHER_SEALING``.
    """

    def __init__(
        self,
        secret: bytes,
        param_id: int,
        partition_num: int,
        serve: Callable[[Proven], None],
        *,
        bind: str,
        what: str,
        port: int = 0,
        ports: tuple[int, int] | None = None,
        advertise: str | None = None,
        unix: bool = False,
        timeout: float = DEFAULT_CONNECT_TIMEOUT,
        pool: int,
        encrypt: bool = False,
        thread_name: str = "allreduce-serve",
        accept_thread_name: str = "allreduce-accept",
    ) -> None:
        self._secret = secret
        self._param_id = param_id
        self._partition_num = partition_num
        self._serve = serve
        self._what = what
        self._timeout = timeout
        self._encrypt = encrypt
        self._max_unproven = unproven_limit(partition_num)
        _check_address(
            bind, f"{what}'s bind address", bind=True
        )  # whoever chose it: never every interface
        # every peer may connect at once; the kernel caps the backlog at net.core.somaxconn
        # (4096 on Linux since 5.4, 128 before): past that, a SYN waits for the client's retry
        backlog = max(16, 2 * partition_num)
        listener = (
            _listen_exactly(bind, port, backlog, what)
            if port
            else listen(bind, ports, backlog, what)
        )
        self._listeners = [listener]
        self.address: tuple[str, int] = listener.getsockname()[:2]
        self.advertised_host = advertise or self.address[0]
        self.local_name: str | None = None
        if unix and unix_sockets_available():
            name = f"allreduce-param-{os.getpid()}-{os.urandom(8).hex()}"
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                local.bind("\0" + name)  # abstract: no file to clean up
                local.listen(backlog)
            except OSError:
                local.close()
                listener.close()
                raise
            self._listeners.append(local)
            self.local_name = name
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False
        self._unproven: dict[socket.socket, _Unproven] = {}  # oldest first
        self._loop = EventLoop(
            what, threads=pool, pool_name=thread_name, loop_name=accept_thread_name
        )
        for each in self._listeners:
            each.setblocking(False)
            self._loop.register(each, functools.partial(self._accept, each))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pool_threads(self) -> int:
        """How many threads the pool has started (0 without one)."""
        return self._loop.pool_threads

    # ---- for a pooled server: watching, deadlines, work ------------------------------------

    def watch(self, conn, on_readable: Callable[[], None]) -> bool:
        """Call ``on_readable()`` on a pool thread once ``conn`` (a proven connection, or the
        object made from it: anything with ``fileno()``) has bytes to read, or has ended;
        once, then it is no longer watched. False, and nothing is called, once the server
        is closing: the caller ends the connection."""
        return not self._closed and self._loop.watch(conn, on_readable)

    def call_at(self, deadline: float, call: Callable[[], None]) -> Timer:
        """Call ``call()`` on a pool thread at ``deadline`` (``time.monotonic()``'s clock),
        unless the returned timer is cancelled first, or the server closes first."""
        return self._loop.call_at(deadline, call)

    def submit(self, call: Callable[[], None]) -> bool:
        """Run ``call()`` on a pool thread soon; False, and nothing runs, once closing."""
        return self._loop.submit(call)

    def discard(self, sock: socket.socket) -> None:
        """A pooled connection's owner closed it: closing the server no longer cuts it."""
        with self._lock:
            self._connections.discard(sock)

    # ---- admitting: accept and handshake, on the loop's thread ---------------------------

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, peer = listener.accept()
        except BlockingIOError:
            return
        except OSError as error:  # out of file descriptors, buffers...: pause, never give up
            if self._closed:
                return
            log.warning(
                "%s: accept failed (%s); pausing new connections briefly", self._what, error
            )
            for other in self._listeners:
                self._loop.unregister(other)
            self._loop.call_at(
                time.monotonic() + ACCEPT_PAUSE, self._resume_accepting, on_loop=True
            )
            return
        if len(self._unproven) >= self._max_unproven:
            oldest = next(iter(self._unproven.values()))
            self._drop(oldest, f"more than {self._max_unproven} connections in their handshake")
        peer_text = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and peer else "a local socket"
        nonce = os.urandom(NONCE_SIZE)
        try:
            conn.setblocking(False)
            tune(conn)
            if conn.send(MAGIC + nonce) != len(MAGIC) + NONCE_SIZE:  # a fresh socket takes 20 bytes
                raise OSError("the greeting did not fit the socket buffer")
        except OSError as error:
            log.debug("connection from %s ended at once: %s", peer_text, error)
            conn.close()
            return
        pending = _Unproven(conn, peer_text, nonce)
        self._unproven[conn] = pending
        pending.timer = self._loop.call_at(
            time.monotonic() + self._timeout,
            functools.partial(self._drop, pending, f"no handshake within {self._timeout:g} s"),
            on_loop=True,
        )
        self._loop.register(conn, functools.partial(self._read_hello, pending))

    def _resume_accepting(self) -> None:
        for listener in self._listeners:
            self._loop.register(listener, functools.partial(self._accept, listener))

    def _read_hello(self, pending: _Unproven) -> None:
        try:
            chunk = pending.sock.recv(_CLIENT_HELLO.size - len(pending.hello))
        except BlockingIOError:
            return
        except OSError as error:
            self._drop(pending, str(error), quiet=True)
            return
        if not chunk:
            self._drop(pending, "closed during the handshake", quiet=True)
            return
        pending.hello += chunk
        if len(pending.hello) < _CLIENT_HELLO.size:
            return
        self._forget(pending)
        partition, reason, answer, session_key, sealed = self._check_hello(pending)
        conn = pending.sock
        if partition is None:  # said here first: the refused client hears it next
            log.warning("%s refused connection from %s: %s", self._what, pending.peer_text, reason)
        try:
            conn.setblocking(True)
            conn.settimeout(self._timeout)
            conn.sendall(answer)
            conn.settimeout(None)
        except OSError as error:
            if partition is not None:
                log.debug("connection from %s ended in its handshake: %s", pending.peer_text, error)
            partition = None
        if partition is None:
            conn.close()
            return
        # from here the connection is what serve gets: the frames travel in sealed records if agreed
        proven = seal_proven(Proven(conn, partition, pending.peer_text, session_key, sealed))
        with self._lock:
            if self._closed:
                proven.sock.close()
                return
            self._connections.add(proven.sock)
        if not self._loop.submit(functools.partial(self._serve, proven)):
            self.discard(proven.sock)
            proven.sock.close()

    def _check_hello(self, pending: _Unproven) -> tuple[int | None, str, bytes, bytes, bool]:
        """(the client's partition or None, why it was refused, the answer, the session key,
        whether the connection is encrypted)."""
        magic, param_id, partition, client_nonce, client_mac = _CLIENT_HELLO.unpack(pending.hello)
        sealed = seals(pending.sock, self._encrypt)
        ids = _ids(param_id, partition, sealed)
        expected = mac(self._secret, b"client", pending.nonce, client_nonce, ids)
        if magic != MAGIC:
            reason = f"bad magic {bytes(magic)!r}, not an allreduce-param client"
        elif not hmac.compare_digest(client_mac, expected):
            if pending.sock.family != socket.AF_UNIX and hmac.compare_digest(
                client_mac,
                mac(
                    self._secret,
                    b"client",
                    pending.nonce,
                    client_nonce,
                    _ids(param_id, partition, not sealed),
                ),
            ):
                reason = (
                    f"it proved the secret but {'does not encrypt' if sealed else 'encrypts'} its traffic, "
                    f"and this server {'does' if sealed else 'does not'}: {ENCRYPT_SETTINGS}"
                )
                return None, reason, bytes([HELLO_OTHER_SEALING]), b"", False
            reason = "it could not prove the secret"
        elif param_id != self._param_id:
            reason = (
                f"it asked for parameter {param_id}, this server serves parameter {self._param_id}"
            )
        elif not 0 <= partition < self._partition_num:
            reason = f"partition {partition} is outside 0..{self._partition_num - 1}"
        else:
            proof = mac(self._secret, b"server", client_nonce, pending.nonce, ids)
            return (
                partition,
                "",
                bytes([HELLO_OK]) + proof,
                mac(self._secret, b"session", pending.nonce, client_nonce, ids),
                sealed,
            )
        return None, reason, bytes([HELLO_REFUSED]), b"", False

    def _drop(self, pending: _Unproven, reason: str, quiet: bool = False) -> None:
        """Close a connection that never proved the secret."""
        self._forget(pending)
        (log.debug if quiet else log.info)(
            "dropped an unproven connection from %s: %s", pending.peer_text, reason
        )
        pending.sock.close()

    def _forget(self, pending: _Unproven) -> None:
        """The connection's handshake is over: its bytes and deadline are no longer watched."""
        if self._unproven.pop(pending.sock, None) is not None:
            pending.timer.cancel()
            self._loop.unregister(pending.sock)

    def close(self) -> None:
        """Stop accepting and watching, cut every connection, and wait for the threads (each
        wait bounded; one that overruns is named in the log): the pool's threads first finish
        the calls already handed to them. Connections still open are cut, not closed: their
        owner closes them."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        stopped = self._loop.stop(CLOSE_TIMEOUT)
        if stopped:  # else the loop's thread still has them: it is named below
            for pending in list(self._unproven.values()):
                self._drop(pending, "shutting down")
        for listener in self._listeners:
            listener.close()
        cut(connections)
        late = self._loop.close(CLOSE_TIMEOUT)
        if late:
            log.warning(
                "%s: %d threads still running %g s after close: %s",
                self._what,
                len(late),
                CLOSE_TIMEOUT,
                late,
            )


def _listen_exactly(host: str, port: int, backlog: int, what: str) -> socket.socket:
    """A listener at the one ``port`` a fixed address list gave."""
    try:
        return socket.create_server((host, port), backlog=backlog)
    except OSError as error:
        raise NetworkError(
            f"{what} cannot listen on {host}:{port} ({error}): that address was given for it "
            "(a fixed address list); free the port or give another"
        ) from error
