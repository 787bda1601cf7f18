"""Dialer: how a ``PeerClient`` reaches its peer's ``BlockServer`` and proves the secret.

Over the peer's abstract Unix socket when it has one and this partition shares its network
namespace (faster than loopback TCP), else, or when that fails, over TCP; then the
handshake (``wire.handshake``), and over TCP with ``encrypt`` a sealed connection.
"""

from __future__ import annotations

import logging
import socket

from allreduce_param.engine.wire.blocks.client_errors import lost
from allreduce_param.engine.wire.handshake import client_handshake, seals
from allreduce_param.engine.wire.sealing import SealedConnection
from allreduce_param.engine.wire.sockets import tune
from allreduce_param.errors import AllReduceError, FetchTimeoutError

log = logging.getLogger(__name__)


class Dialer:
    """Connections to one peer's server at ``address`` (or its Unix socket ``local_name``),
    for partition ``partition_id`` of parameter ``param_id``, proven with ``secret``
    within ``handshake_timeout`` seconds; ``peer_text`` names the peer in errors."""

    def __init__(
        self,
        address: tuple[str, int],
        local_name: str | None,
        secret: bytes,
        param_id: int,
        partition_id: int,
        peer_text: str,
        handshake_timeout: float,
        encrypt: bool,
    ) -> None:
        self.address = address
        self.local_name = local_name
        self._secret = secret
        self._param_id = param_id
        self._partition_id = partition_id
        self._peer_text = peer_text
        self._handshake_timeout = handshake_timeout
        self._encrypt = encrypt

    def _open(self) -> socket.socket:
        if self.local_name:
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            local.settimeout(self._handshake_timeout)
            try:
                local.connect("\0" + self.local_name)
                return local
            except OSError as error:  # another network namespace, or gone: TCP will tell
                local.close()
                log.debug("no local socket for %s (%s), using TCP", self._peer_text, error)
        return socket.create_connection(self.address, timeout=self._handshake_timeout)

    def connect(self, what: str) -> socket.socket | SealedConnection:
        """A proven connection (blocking, no timeout), to fetch ``what`` (for errors)."""
        try:
            sock = self._open()
        except OSError as error:
            raise lost(self._peer_text, what, f"cannot be reached ({error})") from error
        try:
            tune(sock)
            key = client_handshake(
                sock,
                self._secret,
                self._param_id,
                self._partition_id,
                self._peer_text,
                "the secrets differ. Every partition must use the same AllReduceParameter "
                "object, made on the driver",
                encrypt=self._encrypt,
            )
            sock.settimeout(None)
            return (
                SealedConnection(sock, key, client=True, peer_text=self._peer_text)
                if seals(sock, self._encrypt)
                else sock
            )
        except AllReduceError:
            sock.close()
            raise
        except TimeoutError as error:
            sock.close()
            raise FetchTimeoutError(
                f"{self._peer_text} did not finish the handshake within "
                f"{self._handshake_timeout:g} s while we fetched {what}"
            ) from error
        except (OSError, EOFError) as error:
            sock.close()
            raise lost(
                self._peer_text, what, f"dropped the connection during the handshake ({error})"
            ) from error
