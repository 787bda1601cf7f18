"""The host arena: one weight vector and every partition's gradient in one shared segment.

Under plain BSP with every partition on one host, the partitions need not publish blocks
to each other at all: one ``memfd`` segment, made by the host's leader and mapped
writable by every partition (its descriptor passed over the leader's Unix socket,
``BlockServer``'s ``OP_ARENA``), holds

- a control line per partition: its version words, count, state and pid, read and written
  by ``arena_signals.ArenaSignals`` (with the failure text slots after the lines);
- the weight vector, once: each owner updates its slice where it lies;
- one gradient vector per partition, written where the owners read it. Each lies on pages
  of its own and is mapped apart (``map_gradients``): a partition maps those of its host
  only, so on several hosts (hierarchical) the other hosts' slots, never written, take
  neither memory nor address space.

This module is the memory: the segment, its layout, the mappings and the vectors in them.
Readiness is signalled through the segment itself (a partition writes its data, then its
version word, then rings the others' doorbells), which ``arena_signals.py`` holds: the
waits, the peers' liveness and the errors that end a wait, never a hang. ``HostArena``
passes its signalling calls on to its ``signals``, so callers hold one object.

The ordering this relies on (a word written after the data it guards is never seen
before that data) is x86-64's; ``arena_available`` says no elsewhere, and the blocks
travel as before there.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import platform
import socket

import numpy as np

from allreduce_param.engine.blocks.arena_signals import REASON_BYTES, ArenaSignals
from allreduce_param.errors import ProtocolError

MAGIC = 0x414E455241505241  # "ARPARENA", little-endian, in the segment's first word
LINE = 64  # every region starts on a cache line; a control line is 8 int64 words


def arena_available() -> bool:
    """Whether this platform can share an arena: memfd, eventfd, pidfd, descriptor passing,
    and x86-64's store order (a version word is never seen before the data it guards)."""
    return (
        all(hasattr(os, name) for name in ("memfd_create", "eventfd", "pidfd_open"))
        and hasattr(socket, "send_fds")
        and platform.machine().lower() in ("x86_64", "amd64")
    )


def _aligned(nbytes: int, unit: int = LINE) -> int:
    return -(-nbytes // unit) * unit


class ArenaLayout:
    """Where each region of the arena of ``partition_num`` partitions and ``size`` floats lies."""

    def __init__(self, partition_num: int, size: int) -> None:
        self.partition_num = partition_num
        self.size = size
        self.control = LINE
        self.reasons = self.control + LINE * partition_num
        self.weights = _aligned(self.reasons + REASON_BYTES * partition_num)
        # each gradient is mapped on its own: it starts on a page (an mmap offset's unit)
        self.stride = _aligned(4 * size, mmap.ALLOCATIONGRANULARITY)
        self.gradients = _aligned(self.weights + 4 * size, mmap.ALLOCATIONGRANULARITY)
        self.nbytes = self.gradients + self.stride * partition_num


class HostArena:
    """One partition's mapping of its host's arena (see the module).

    Made by ``create`` (the leader: a new segment and a doorbell for every partition) or
    ``attach`` (the others: the descriptors the leader passed). ``partition_id`` is who
    writes through this mapping; ``timeout`` bounds every wait. ``signals`` reads and
    writes the control lines; the waits and ends below are its, passed on.
    """

    def __init__(
        self,
        fd: int,
        doorbells: list[int],
        partition_num: int,
        size: int,
        partition_id: int,
        timeout: float,
        owner: bool,
    ) -> None:
        self.layout = ArenaLayout(partition_num, size)
        self.partition_id = partition_id
        self.partition_num = partition_num
        self.timeout = timeout
        self._fd = fd
        self._owner = owner  # made the segment and its doorbells: offers them to the others
        layout = self.layout
        if os.fstat(fd).st_size < layout.nbytes:
            raise ProtocolError(
                f"the host arena passed to partition {partition_id} holds "
                f"{os.fstat(fd).st_size} bytes, not {layout.nbytes}"
            )
        self._map = self._mapped(layout.gradients, 0)  # the control lines and the weights
        self._gradient_maps: list[mmap.mmap] = []
        self._gradient_mapped: dict[int, mmap.mmap] = {}  # partition -> its vector's mapping
        words = np.frombuffer(self._map, np.int64, 8 * (partition_num + 1))
        self.signals = ArenaSignals(
            words,
            np.frombuffer(self._map, np.float64, 8 * (partition_num + 1)),
            np.frombuffer(self._map, np.uint8, REASON_BYTES * partition_num, layout.reasons),
            doorbells,
            partition_id,
            timeout,
        )
        self.weights = np.frombuffer(self._map, np.float32, size, layout.weights)
        self._gradients: dict[int, np.ndarray] = {}  # those mapped (``map_gradients``)
        if owner:
            words[:4] = (MAGIC, partition_num, size, 1)
        elif tuple(words[:3]) != (MAGIC, partition_num, size):
            raise ProtocolError(
                f"the host arena passed to partition {partition_id} is for "
                f"{int(words[1])} partitions of {int(words[2])} floats, not "
                f"{partition_num} of {size}: every partition must run the same parameter"
            )
        self.signals.mark_own_process()

    def _mapped(self, nbytes: int, offset: int) -> mmap.mmap:
        try:
            return mmap.mmap(self._fd, nbytes, offset=offset)
        except OSError as error:
            if error.errno != errno.ENOMEM:
                raise
            raise MemoryError(
                f"partition {self.partition_id} ran out of memory ({error}) while it mapped its "
                f"host's shared arena ({nbytes} bytes more: the weights, or a partition's "
                "gradient): a limit on its address space counts the mapping (under Spark, "
                "spark.executor.pyspark.memory sets one on each Python worker): raise that "
                "limit or leave it unset"
            ) from error

    def map_gradients(self, partitions) -> None:
        """Map the gradient vectors of ``partitions`` (this host's), for ``gradient``."""
        layout = self.layout
        for partition in partitions:
            if partition not in self._gradients:
                mapped = self._mapped(layout.stride, layout.gradients + partition * layout.stride)
                self._gradient_maps.append(mapped)
                self._gradient_mapped[partition] = mapped
                self._gradients[partition] = np.frombuffer(mapped, np.float32, layout.size)

    # ---- making and passing ------------------------------------------------------------

    @classmethod
    def create(cls, partition_num: int, size: int, partition_id: int, timeout: float) -> HostArena:
        """A new arena (the host's leader), its pages taken only when written."""
        fd = os.memfd_create("allreduce-param-arena", os.MFD_CLOEXEC)
        doorbells: list[int] = []
        try:
            os.ftruncate(fd, ArenaLayout(partition_num, size).nbytes)
            for _ in range(partition_num):
                doorbells.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
            return cls(fd, doorbells, partition_num, size, partition_id, timeout, owner=True)
        except BaseException:
            for each in [fd, *doorbells]:
                os.close(each)
            raise

    def offer(self) -> tuple[bytes, list[int]]:
        """What a peer on this host needs to ``attach``: a description and the descriptors
        (the segment, then every partition's doorbell), for ``socket.send_fds``."""
        text = json.dumps({"partitions": self.partition_num, "size": self.layout.size})
        return text.encode(), [self._fd, *self.signals.doorbells]

    @classmethod
    def attach(cls, text: bytes, fds: list[int], partition_id: int, timeout: float) -> HostArena:
        """Map the arena a leader ``offer``\\ ed (its descriptors are kept, and closed with it)."""
        try:
            found = json.loads(text)
            partition_num, size = int(found["partitions"]), int(found["size"])
            if len(fds) != partition_num + 1:
                raise ProtocolError(
                    f"the host arena came with {len(fds)} descriptors, not {partition_num + 1}"
                )
            return cls(fds[0], fds[1:], partition_num, size, partition_id, timeout, owner=False)
        except (ValueError, KeyError, TypeError) as error:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"the host arena's description {text[:200]!r}: {error}") from error
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    # ---- the vectors ---------------------------------------------------------------------

    def gradient(self, partition: int) -> np.ndarray:
        """``partition``'s gradient vector (mapped by ``map_gradients``), where the owners
        read it."""
        return self._gradients[partition]

    def summing_view(self, partition: int, bounds: slice) -> np.ndarray:
        """A writable view of ``partition``'s gradient vector at ``bounds`` (its own slice),
        apart from ``gradient``'s array, which a put makes read-only until the next
        ``get_weights``: where that partition sums its slice of the mean gradient. No other
        partition reads the own slice of a vector, so the sum needs no vector of its own."""
        return np.frombuffer(self._gradient_mapped[partition], np.float32, self.layout.size)[bounds]

    # ---- the signals, passed on (``ArenaSignals`` says what each does) ---------------------

    @property
    def names(self) -> list[str]:
        """How errors name each partition (``"partition 1 at 127.0.0.1:4000"``)."""
        return self.signals.names

    @names.setter
    def names(self, names: list[str]) -> None:
        self.signals.names = names

    @property
    def writers(self) -> list[int]:
        """Who writes each partition's words: itself, or (hierarchical) this host's leader."""
        return self.signals.writers

    @writers.setter
    def writers(self, writers: list[int]) -> None:
        self.signals.writers = writers

    def count(self, partition: int) -> float:
        """The sample count ``partition`` put with its last gradient."""
        return self.signals.count(partition)

    def version(self, field: int, partition: int) -> int | None:
        """The version of ``partition``'s weight slice or gradient made whole last; None if none."""
        return self.signals.version(field, partition)

    def describe(self, field: int, partition: int, version: int) -> str:
        """For errors, as the blocks would say it (``ArenaSignals.describe``)."""
        return self.signals.describe(field, partition, version)

    def publish(self, field: int, version: int, count: float | None = None) -> None:
        """This partition's ``field`` of ``version`` is whole (``ArenaSignals.publish``)."""
        self.signals.publish(field, version, count)

    def publish_for(self, partitions, field: int, version: int) -> None:
        """Other hosts' ``partitions``' ``field`` is whole (``ArenaSignals.publish_for``)."""
        self.signals.publish_for(partitions, field, version)

    def wait(self, field: int, version: int, partitions=None) -> None:
        """Return once ``version`` of ``field`` is whole everywhere (``ArenaSignals.wait``)."""
        self.signals.wait(field, version, partitions)

    def ended(self, partition: int) -> bool:
        """Whether ``partition`` has stopped: closed, failed, or its process gone."""
        return self.signals.ended(partition)

    # ---- the end -------------------------------------------------------------------------

    def end(self, reason: str | None) -> None:
        """This partition stops: closed (``reason`` None) or failed with ``reason``; whoever
        waits for it hears so at once. Once; the mapping stays until ``close``."""
        self.signals.end(reason)

    def close(self) -> None:
        """Unmap (once no view of it is left) and close every descriptor. Once."""
        if self.signals.closed:
            return
        self.signals.close()
        os.close(self._fd)
        self._gradients.clear()
        for mapped in [self._map, *self._gradient_maps]:
            try:
                mapped.close()
            except BufferError:  # a view handed out still exists: the mapping goes when it does
                pass
