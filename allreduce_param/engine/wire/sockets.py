"""What the wire does with a plain socket: read exactly, tune, cut; and whether this platform
has the abstract Unix sockets that peers on one host use instead of TCP."""

from __future__ import annotations

import socket
import sys


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
    own sizing: measured against fixed 1-16 MiB ``SO_SNDBUF``/``SO_RCVBUF``, it was at
    least as fast."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
