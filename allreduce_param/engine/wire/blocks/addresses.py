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
    """Which abstract Unix sockets this process can reach: its kernel (the boot id) and its
    network namespace (the namespace's inode, unique among the kernel's live namespaces).

    Peers with the same scope meet over Unix sockets and shared memory, whatever host names
    or addresses Spark or a fixed list gave them; others over TCP. Abstract sockets are
    per network namespace, so the same scope means the socket can be reached; and shared
    memory travels as ``memfd`` descriptors over that socket (``blocks/shm.py``), never by
    a name in ``/dev/shm``, so processes with different ``/dev/shm`` mounts or IPC
    namespaces (two containers of one pod) share correctly, while containers with network
    namespaces of their own are hosts of their own. Where the boot id or the namespace
    cannot be read, the scope is this process's alone (a random token): a host name is no
    proof of a shared kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return f"{socket.gethostname()}/alone-{os.getpid()}-{os.urandom(8).hex()}"
