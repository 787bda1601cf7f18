"""How a partition's block server is named to its peers at the meeting: its address, the
fingerprint of the secret it serves, and its Unix socket for peers of the same host."""

from __future__ import annotations

import functools
import os
import socket
from typing import NamedTuple

from allreduce_param.engine.wire.handshake import mac


def secret_fingerprint(secret: bytes, param_id: int) -> str:
    """A short tag of a parameter's secret and id that partitions exchange at the meeting,
    so that partitions of different parameters learn it there, all of them, before any
    connects (one that connects first would see the other close). It reveals nothing that
    proves the secret: the handshake's MACs cover fresh nonces."""
    return mac(secret, b"fingerprint", str(param_id).encode())[:12].hex()


class PeerAddress(NamedTuple):
    """A partition's server as the meeting gives it: ``host``, ``port``, and where the
    server said so, its secret's ``fingerprint`` and its abstract Unix socket
    (``local_name``, for peers of the same ``local_scope``)."""

    host: str
    port: int
    fingerprint: str | None = None
    local_name: str | None = None
    scope: str | None = None


def parse_address(address) -> PeerAddress:
    """An exchanged address: ``advertised_address``'s five fields, or a bare ``(host, port)``
    (a fixed list, ``StaticRendezvous``)."""
    return PeerAddress(*address)


@functools.lru_cache(maxsize=1)
def local_scope() -> str:
    """Which abstract Unix sockets this process can reach: its machine (the kernel's boot id)
    and network namespace. Peers with the same scope meet over Unix sockets and shared
    memory, whatever host names or addresses Spark gave them; others over TCP."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return f"{socket.gethostname()}/unknown"
