"""Short authenticated messages between a Spark job's tasks and its driver.

A fit's tasks reach the driver on one connection each: first to meet (``rendezvous.
MeetingPoint``), then to report progress. The server is ``server.AuthenticatedServer``,
as the block servers' is: a connection first proves the secret the server made (the tasks
get it in their closure), in a handshake over fresh nonces. Then each message is a JSON
object, length-prefixed and tagged with HMAC-SHA256 under that connection's session key;
the tag covers the direction and the message's number on the connection, so a message
cannot be sent back as an answer, replayed, dropped or reordered unnoticed. A message
that is too long or wrongly tagged closes its connection, never the server.

With ``encrypt`` (the fit's ``NetworkSettings.encrypt``) the connections are encrypted as
the block connections are (``sealing.py``): the messages carry the fit's metrics and the
servers' addresses, and a cluster that encrypts its traffic expects all of it to be. The
tags stay: they cost little and keep this layer's guarantees whatever carries it.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

from allreduce_param.engine.wire.handshake import Proven, client_handshake, mac, seals
from allreduce_param.engine.wire.sealing import SealedConnection
from allreduce_param.engine.wire.server import AuthenticatedServer
from allreduce_param.engine.wire.settings import DEFAULT_CONNECT_TIMEOUT
from allreduce_param.engine.wire.sockets import tune
from allreduce_param.errors import AuthenticationError, ProtocolError

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
_SEQUENCE = struct.Struct("<Q")
_TAG_SIZE = 32
#: The longest message body either side accepts, in bytes.
MAX_MESSAGE = 1 << 20
#: The "parameter id" a message connection proves its secret for (its own secret is the job's).
MESSAGES_ID = 0xFFFFFFFF

Reply = Callable[[dict], None]


def _tag(key: bytes, direction: bytes, number: int, body: bytes) -> bytes:
    return mac(key, direction, _SEQUENCE.pack(number), body)


def _frame(key: bytes, direction: bytes, number: int, message: dict) -> bytes:
    body = json.dumps(message).encode()
    if len(body) > MAX_MESSAGE:
        raise ValueError(
            f"a message of {len(body)} bytes is longer than MAX_MESSAGE ({MAX_MESSAGE})"
        )
    return _LENGTH.pack(len(body)) + body + _tag(key, direction, number, body)


def _read(conn, key: bytes, direction: bytes, number: int) -> dict | None:
    """Message ``number`` from ``direction`` on ``conn`` (a socket or a sealed connection),
    read to its last byte and not one further (so the next one's bytes make the socket
    readable); None at a clean end; ProtocolError or AuthenticationError for what must
    close the connection."""
    try:
        return _read_from(conn, key, direction, number)
    except (
        EOFError
    ):  # a sealed connection that ended inside a record: as one that ended inside a message
        raise ProtocolError("the connection closed inside a message") from None


def _up_to(conn, size: int) -> bytes:
    """``size`` bytes from ``conn``, or fewer where it ends."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = conn.recv_into(view[got:], size - got)
        if count == 0:
            break
        got += count
    return bytes(buffer[:got])


def _read_from(conn, key: bytes, direction: bytes, number: int) -> dict | None:
    head = _up_to(conn, _LENGTH.size)
    if not head:
        return None
    if len(head) < _LENGTH.size:
        raise ProtocolError("the connection closed inside a message's length")
    (length,) = _LENGTH.unpack(head)
    if length > MAX_MESSAGE:
        raise ProtocolError(f"a message of {length} bytes (at most {MAX_MESSAGE})")
    body, tag = _up_to(conn, length), _up_to(conn, _TAG_SIZE)
    if len(body) < length or len(tag) < _TAG_SIZE:
        raise ProtocolError("the connection closed inside a message")
    if not hmac.compare_digest(tag, _tag(key, direction, number, body)):
        raise AuthenticationError(
            f"message {number} from the {direction.decode()} has a wrong tag (not of "
            "this connection, or replayed, reordered or changed on the way)"
        )
    try:
        message = json.loads(body)
    except ValueError as error:
        raise ProtocolError(f"a message that is not JSON ({error})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a message that is not a JSON object but {type(message).__name__}")
    return message


class _Task:
    """A task's proven connection to the message server: what it has sent so far, and how
    to answer it (from any thread: an answer may come while the next message is read)."""

    def __init__(self, proven: Proven) -> None:
        self.conn, self.key, self.peer_text = proven.sock, proven.session_key, proven.peer_text
        self.received = self.sent = 0
        self._send_lock = threading.Lock()

    def reply(self, answer: dict) -> None:
        with self._send_lock:
            self.conn.sendall(_frame(self.key, b"driver", self.sent, answer))
            self.sent += 1


class MessageServer:
    """The driver's end: accepts the tasks' connections and hands each message to
    ``on_message(message, reply)``, one at a time per connection and in the order sent;
    ``reply(answer)`` sends an answer back on the same connection, then or later, from any
    thread. Close it when done.

    However many tasks connect, it holds ``THREADS`` threads and its accept loop's (the
    loop watches the connections between messages): so ``on_message`` must not wait for
    other tasks' messages. A meeting answers later instead (``rendezvous.MeetingPoint``).

    Listens on ``host`` at a free port of ``ports`` (None: any); the tasks connect to
    ``address``: ``advertise`` (default ``host``) and that port. With ``encrypt`` the
    connections are encrypted (its clients are made so)."""

    #: The threads that read and handle the tasks' messages.
    THREADS = 4

    def __init__(
        self,
        host: str,
        on_message: Callable[[dict, Reply], None],
        *,
        advertise: str | None = None,
        ports: tuple[int, int] | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        encrypt: bool = False,
    ) -> None:
        self.secret = os.urandom(32)
        self._on_message = on_message
        self._connect_timeout = connect_timeout
        self._encrypt = encrypt
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # notified as a task's connection ends
        self._tasks: set[_Task] = set()
        # the accept loop runs from inside AuthenticatedServer's constructor: a connection
        # proven before ``_server`` is assigned waits for it (as ``BlockServer``'s do)
        self._started = threading.Event()
        self._server = AuthenticatedServer(
            self.secret,
            MESSAGES_ID,
            1,
            self._serve,
            bind=host,
            ports=ports,
            advertise=advertise,
            timeout=connect_timeout,
            encrypt=encrypt,
            what="the driver's message server",
            pool=self.THREADS,
            thread_name="allreduce-messages",
            accept_thread_name="allreduce-messages-accept",
        )
        self._started.set()
        self.bound_address: tuple[str, int] = self._server.address
        self.address: tuple[str, int] = (self._server.advertised_host, self.bound_address[1])

    def client(self) -> MessageClient:
        """What a task uses to reach this server (it connects on first use)."""
        return MessageClient(
            self.address, self.secret, self._connect_timeout, encrypt=self._encrypt
        )

    def _serve(self, proven: Proven) -> None:
        task = _Task(proven)
        if not self._started.wait(self._connect_timeout):  # the constructor failed after accepting
            task.conn.close()
            return
        task.conn.settimeout(self._connect_timeout)  # a message, once begun, comes whole
        with self._lock:
            self._tasks.add(task)
        self._await(task)

    def _await(self, task: _Task) -> None:
        if not self._server.watch(task.conn, functools.partial(self._read, task)):
            self._end(task)  # closing

    def _read(self, task: _Task) -> None:
        """The task's next messages (those its connection has), each handled before the next."""
        while True:
            try:
                message = _read(task.conn, task.key, b"task", task.received)
            except (ProtocolError, AuthenticationError) as error:
                log.warning(
                    "closed the connection of a task at %s to the driver: %s", task.peer_text, error
                )
                message = None
            except OSError:  # closed by the task, or by close(); or a message that stopped halfway
                message = None
            if message is None:
                self._end(task)
                return
            task.received += 1
            try:
                self._on_message(message, task.reply)
            except OSError:  # the answer could not be sent: the task is gone
                self._end(task)
                return
            except Exception:  # a listener's bug must not stop the messages
                log.exception("handling a task's message on the driver failed")
            if not getattr(
                task.conn, "buffered", 0
            ):  # a sealed record may hold the next one already
                break
        self._await(task)

    def _end(self, task: _Task) -> None:
        with self._lock:
            if task not in self._tasks:
                return
            self._tasks.discard(task)
            self._ended.notify_all()
        self._server.discard(task.conn)
        task.conn.close()

    def drain(self, timeout: float) -> bool:
        """Wait until every task's connection has ended, each message on it handled; at most
        ``timeout`` seconds. Whether they all ended.

        For when the tasks are done: a task closes its connection as it finishes, but what it
        sent last may still be unread here when Spark hands its result to the driver. Closing
        without draining would drop those messages (a fit's last steps, unheard by its
        listener)."""
        with self._ended:
            return self._ended.wait_for(lambda: not self._tasks, timeout)

    def close(self) -> None:
        """Stop listening, close every connection, and wait for the threads."""
        self._server.close()
        with self._lock:
            left = list(self._tasks)
        for task in left:
            self._end(task)


class MessageClient:
    """A task's end of a ``MessageServer``: made on the driver, shipped in the closure
    (without its socket), connected on first use: within ``connect_timeout`` seconds,
    which also bounds each send (a driver that stops reading cannot stall a task). Sends
    may come from several threads. ``encrypt``: the server's choice (``MessageServer.client``
    copies it)."""

    def __init__(
        self,
        address: tuple[str, int],
        secret: bytes,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        encrypt: bool = False,
    ) -> None:
        self.address = tuple(address)
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._encrypt = encrypt
        self._sock: socket.socket | SealedConnection | None = None
        self._key = b""
        self._sent = self._received = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {
            "address": self.address,
            "_secret": self._secret,
            "_connect_timeout": self._connect_timeout,
            "_encrypt": self._encrypt,
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(
            state["address"],
            state["_secret"],
            state["_connect_timeout"],
            state.get("_encrypt", False),
        )

    def _connected(self) -> socket.socket | SealedConnection:
        """The connection, opened and proven on first use; OSError when the driver cannot be
        reached, AuthenticationError or ProtocolError when what answers is not it."""
        if self._sock is None:
            host, port = self.address
            sock = socket.create_connection(self.address, timeout=self._connect_timeout)
            try:
                tune(sock)
                self._key = client_handshake(
                    sock,
                    self._secret,
                    MESSAGES_ID,
                    0,
                    f"the driver at {host}:{port}",
                    "it does not know this job's secret (a server of another job?)",
                    encrypt=self._encrypt,
                )
                if seals(sock, self._encrypt):
                    sock = SealedConnection(
                        sock, self._key, client=True, peer_text=f"the driver at {host}:{port}"
                    )
            except EOFError as error:
                sock.close()
                raise ConnectionError(
                    f"the driver at {host}:{port} closed the connection in the handshake"
                ) from error
            except BaseException:
                sock.close()
                raise
            self._sock = sock
            self._sent = self._received = 0
        return self._sock

    def connect(self) -> None:
        """Open the connection now (it stays open until ``close``): the driver's server
        counts this task as running from here until its connection ends (``drain``). OSError,
        AuthenticationError or ProtocolError as ``send``."""
        with self._lock:
            self._connected()

    def send(self, message: dict) -> None:
        """Send one message; OSError when the driver cannot be reached (or takes no more)."""
        with self._lock:
            sock = self._connected()
            sock.sendall(_frame(self._key, b"task", self._sent, message))
            self._sent += 1

    def receive(self, timeout: float | None = None) -> dict:
        """The driver's next answer, waiting up to ``timeout`` seconds (None: no limit).

        OSError (``TimeoutError`` included) when none comes; ProtocolError or
        AuthenticationError for an answer this client must not trust.
        """
        sock = self._connected()
        sock.settimeout(timeout)
        try:
            message = _read(sock, self._key, b"driver", self._received)
        finally:
            if self._sock is not None:
                self._sock.settimeout(self._connect_timeout)
        if message is None:
            raise ConnectionError(
                f"the driver at {self.address[0]}:{self.address[1]} closed the connection"
            )
        self._received += 1
        return message

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
