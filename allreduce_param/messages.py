"""Short authenticated messages between a Spark job's tasks and its driver.

A fit's tasks reach the driver on one connection each: first to meet (``rendezvous.
MeetingPoint``), then to report progress. Each message is a JSON object, length-prefixed
and tagged with HMAC-SHA256 under a secret the server makes, which the tasks get in their
closure; the tag covers the direction, so a message cannot be sent back as an answer. A
message that is too long or wrongly tagged closes its connection, never the server.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
from typing import Callable

from .errors import AuthenticationError, ProtocolError
from .transport import cut

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
_TAG_SIZE = 32
#: The longest message body either side accepts, in bytes.
MAX_MESSAGE = 1 << 20
#: How long a task waits for the driver to accept its connection.
CONNECT_TIMEOUT = 10.0

Reply = Callable[[dict], None]


def _tag(secret: bytes, direction: bytes, body: bytes) -> bytes:
    return hmac.new(secret, direction + body, hashlib.sha256).digest()


def _frame(secret: bytes, direction: bytes, message: dict) -> bytes:
    body = json.dumps(message).encode()
    if len(body) > MAX_MESSAGE:
        raise ValueError(f"a message of {len(body)} bytes is longer than MAX_MESSAGE ({MAX_MESSAGE})")
    return _LENGTH.pack(len(body)) + body + _tag(secret, direction, body)


def _read(stream, secret: bytes, direction: bytes) -> dict | None:
    """The next message on ``stream``; None at a clean end; ProtocolError or
    AuthenticationError for what must close the connection."""
    head = stream.read(_LENGTH.size)
    if not head:
        return None
    if len(head) < _LENGTH.size:
        raise ProtocolError("the connection closed inside a message's length")
    (length,) = _LENGTH.unpack(head)
    if length > MAX_MESSAGE:
        raise ProtocolError(f"a message of {length} bytes (at most {MAX_MESSAGE})")
    body, tag = stream.read(length), stream.read(_TAG_SIZE)
    if len(body) < length or len(tag) < _TAG_SIZE:
        raise ProtocolError("the connection closed inside a message")
    if not hmac.compare_digest(tag, _tag(secret, direction, body)):
        raise AuthenticationError("a message without the job's secret")
    try:
        message = json.loads(body)
    except ValueError as error:
        raise ProtocolError(f"a message that is not JSON ({error})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a message that is not a JSON object but {type(message).__name__}")
    return message


class MessageServer:
    """The driver's end: accepts the tasks' connections and hands each message to
    ``on_message(message, reply)``, on that connection's own thread, in the order sent;
    ``reply(answer)`` sends an answer back on the same connection. Close it when done."""

    def __init__(self, host: str, on_message: Callable[[dict, Reply], None]) -> None:
        self.secret = os.urandom(32)
        self._on_message = on_message
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._connections: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="allreduce-messages-accept")]
        self._threads[0].start()

    def client(self) -> MessageClient:
        """What a task uses to reach this server (it connects on first use)."""
        return MessageClient(self.address, self.secret)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="allreduce-messages")
            with self._lock:
                self._connections.append(conn)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        send_lock = threading.Lock()

        def reply(answer: dict) -> None:
            with send_lock:
                conn.sendall(_frame(self.secret, b"driver", answer))

        with conn, conn.makefile("rb") as stream:  # both closed on leaving, whoever holds the error
            while True:
                try:
                    message = _read(stream, self.secret, b"task")
                except (ProtocolError, AuthenticationError) as error:
                    log.warning("closed a task's connection to the driver: %s", error)
                    return
                except OSError:
                    return  # closed by the task, or by close()
                if message is None:
                    return
                try:
                    self._on_message(message, reply)
                except OSError:
                    return  # the answer could not be sent: the task is gone
                except Exception:  # a listener's bug must not stop the messages
                    log.exception("handling a task's message on the driver failed")

    def close(self) -> None:
        """Stop listening, close every connection, and wait for their threads."""
        cut([self._listener])
        self._listener.close()
        with self._lock:
            connections, threads = list(self._connections), list(self._threads)
        cut(connections)
        for thread in threads:
            thread.join()


class MessageClient:
    """A task's end of a ``MessageServer``: made on the driver, shipped in the closure
    (without its socket), connected on first use. Sends may come from several threads."""

    def __init__(self, address: tuple[str, int], secret: bytes) -> None:
        self.address = tuple(address)
        self._secret = secret
        self._sock: socket.socket | None = None
        self._stream = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"address": self.address, "_secret": self._secret}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["address"], state["_secret"])

    def _connected(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT)
            self._sock.settimeout(None)
            self._stream = self._sock.makefile("rb")
        return self._sock

    def send(self, message: dict) -> None:
        """Send one message; OSError when the driver cannot be reached."""
        frame = _frame(self._secret, b"task", message)
        with self._lock:
            self._connected().sendall(frame)

    def receive(self, timeout: float | None = None) -> dict:
        """The driver's next answer, waiting up to ``timeout`` seconds (None: no limit).

        OSError (``TimeoutError`` included) when none comes; ProtocolError or
        AuthenticationError for an answer this client must not trust.
        """
        sock = self._connected()
        sock.settimeout(timeout)
        try:
            message = _read(self._stream, self._secret, b"driver")
        finally:
            if self._sock is not None:
                self._sock.settimeout(None)
        if message is None:
            raise ConnectionError(f"the driver at {self.address[0]}:{self.address[1]} closed the connection")
        return message

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock, self._stream = None, None
