"""Shared memory between partitions on one host: blocks read in place, not copied over a socket.

A ``SharedSegment`` is an anonymous memory file (``memfd``) mapped into the owner's process.
The owner encodes a block into it; a peer on the same host receives the file descriptor
once over the Unix socket (SCM_RIGHTS), maps it, and reads every later version in place.
No kernel copies, and nothing to clean up on disk: the kernel frees the memory with the
last process that holds it, also after a crash. Linux only; elsewhere blocks travel over
the socket as before.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket

_ids = itertools.count(1)


def shared_memory_available() -> bool:
    """Whether this platform can share segments between processes (memfd and fd passing)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(socket, "recv_fds")


class SharedSegment:
    """``size`` bytes of shared memory, writable here; ``fd`` is what a peer needs to map it.

    Pages are taken only when written, so a segment sized for the largest block costs
    nothing for a small one.
    """

    def __init__(self, size: int) -> None:
        self.id = next(_ids)
        self.fd = os.memfd_create(f"allreduce-param-{self.id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        """Unmap (once no view of it is left) and close the descriptor; a second call does nothing."""
        if self.fd < 0:
            return
        try:
            self.map.close()
        except BufferError:  # a view still exists; the mapping goes when it does
            pass
        os.close(self.fd)
        self.fd = -1


class SharedMappings:
    """A peer's segments as mapped here, read-only, by segment id."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}

    def __contains__(self, segment_id: int) -> bool:
        return segment_id in self._maps

    def add(self, segment_id: int, fd: int) -> None:
        """Map the segment whose descriptor a peer passed; the descriptor is then closed."""
        try:
            self._maps[segment_id] = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def view(self, segment_id: int, length: int) -> memoryview:
        """The first ``length`` bytes of a mapped segment, read in place."""
        return memoryview(self._maps[segment_id])[:length]

    def close(self) -> None:
        for mapped in self._maps.values():
            try:
                mapped.close()
            except BufferError:
                pass
        self._maps.clear()
