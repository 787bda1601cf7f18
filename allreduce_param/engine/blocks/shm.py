"""Shared memory between partitions on one host: blocks read in place, not copied over a socket.

A ``SharedSegment`` is an anonymous memory file (``memfd``) mapped into the owner's process.
``SharedArenas`` carves the buffers blocks are encoded into out of a few large segments,
so the descriptors a partition holds do not grow with the model. A peer on the same host
receives a segment's descriptor once over the Unix socket (SCM_RIGHTS), maps it, and reads
every later block in it in place, at the offset the owner names. No kernel copies, and
nothing to clean up on disk: the kernel frees the memory with the last process that holds
it, also after a crash. Linux only; elsewhere blocks travel over the socket as before.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket

import numpy as np

_ids = itertools.count(1)


def shared_memory_available() -> bool:
    """Whether this platform can share segments between processes (memfd and fd passing)."""
    return (
        hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(socket, "recv_fds")
    )


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


def address(buffer) -> int:
    """Where ``buffer`` (a bytes-like object) starts in this process's memory."""
    return np.frombuffer(buffer, np.uint8).ctypes.data


#: The most one shared segment of blocks holds.
LARGEST_ARENA = 256 << 20


def arena_size(floats: int, partitions: int, part_bytes: int) -> int:
    """The segment size for a parameter of ``floats`` float32s over ``partitions``, whose
    blocks are encoded into buffers of ``part_bytes`` each (one per part, whatever the
    part's length): room for about two encoded copies of the vector (a partition's gradient
    chunks for every owner, its slice, the allreduce blocks) plus a part buffer for each
    owner and one more, at most 256 MiB, in whole pages. Every segment is mapped by its
    partition and by each same-host peer that reads from it, and each mapping counts
    against a limit on the Python worker's address space (``spark.executor.pyspark.memory``),
    pages written or not: a small model's partitions need not map 256 MiB each."""
    buffers = -(-8 * floats // part_bytes) + partitions + 1
    page = mmap.PAGESIZE
    return min(LARGEST_ARENA, -(-buffers * part_bytes // page) * page)


class SharedArenas:
    """Buffers for blocks, carved out of shared segments of ``arena_size`` bytes (or one of
    a buffer's own size, for a larger one); a segment's pages are taken only when written.

    Buffers are never given back one by one: the block store reuses them, so a partition
    stops taking new ones once its blocks are all made. ``locate`` says which segment, and
    where in it, a block lies; ``close`` frees them all.
    """

    ALIGN = 64  # each buffer starts on a cache line

    def __init__(self, arena_size: int = LARGEST_ARENA) -> None:
        self.arena_size = arena_size
        self._segments: dict[
            int, tuple[SharedSegment, int]
        ] = {}  # id(map) -> (segment, its address)
        self._current: SharedSegment | None = None
        self._used = 0

    def buffer(self, nbytes: int) -> memoryview:
        """``nbytes`` of shared memory, writable here, for one block."""
        if self._current is None or self._used + nbytes > len(self._current.map):
            self._current = SharedSegment(max(self.arena_size, nbytes))
            self._segments[id(self._current.map)] = (self._current, address(self._current.map))
            self._used = 0
        start = self._used
        self._used += -(-nbytes // self.ALIGN) * self.ALIGN
        return memoryview(self._current.map)[start : start + nbytes]

    def locate(self, block: memoryview) -> tuple[SharedSegment, int] | None:
        """The segment ``block`` lies in and its offset there; None if it is not in one."""
        found = self._segments.get(id(block.obj))
        if found is None:
            return None
        segment, base = found
        return segment, address(block) - base

    @property
    def count(self) -> int:
        """How many segments (descriptors) the arenas hold."""
        return len(self._segments)

    def close(self) -> None:
        for segment, _ in self._segments.values():
            segment.close()
        self._segments.clear()
        self._current = None


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

    def view(self, segment_id: int, offset: int, length: int) -> memoryview | None:
        """``length`` bytes at ``offset`` of a mapped segment, read in place; None when they
        are not all inside it (the peer named a place that is not there)."""
        mapped = self._maps[segment_id]
        if offset < 0 or offset + length > len(mapped):
            return None
        return memoryview(mapped)[offset : offset + length]

    def close(self) -> None:
        for mapped in self._maps.values():
            try:
                mapped.close()
            except BufferError:
                pass
        self._maps.clear()
