"""The host arena: one weight vector and every partition's gradient in one shared segment.

Under plain BSP with every partition on one host, the partitions need not publish blocks
to each other at all: one ``memfd`` segment, made by the host's leader and mapped
writable by every partition (its descriptor passed over the leader's Unix socket,
``BlockServer``'s ``OP_ARENA``), holds

- a control line per partition: the version of its weight slice and of its gradient
  that it last made whole (plus one: 0 means none yet), its gradient's sample count, its
  state (alive, closed, failed, with the reason in a text slot of its own), its pid and
  its pid namespace (a pid is only looked up from the same namespace);
- the weight vector, once: each owner updates its slice where it lies;
- one gradient vector per partition, written where the owners read it. Each lies on pages
  of its own and is mapped apart (``map_gradients``): a partition maps those of its host
  only, so on several hosts (hierarchical) the other hosts' slots, never written, take
  neither memory nor address space.

Readiness is signalled through the segment itself: a partition writes its data, then
the version word, then rings the other partitions' doorbells (an ``eventfd`` each, made by
the leader and passed with the segment). A waiter reads the words, spins briefly, and
then sleeps on its doorbell and on the ``pidfd`` of every process it waits for, so a
peer's death ends the wait at once (a ``PeerLostError``), a peer's failure with its reason,
and a peer that never comes at the timeout (a ``FetchTimeoutError``): never a hang.

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
import select
import socket
import time

import numpy as np

from allreduce_param.engine.blocks.store import EVERY_PARTITION, BlockKey, BlockKind
from allreduce_param.errors import (
    FetchTimeoutError,
    PeerLostError,
    ProtocolError,
    StoreClosedError,
    peer_lost,
)

MAGIC = 0x414E455241505241  # "ARPARENA", little-endian, in the segment's first word
LINE = 64  # every region starts on a cache line; a control line is 8 int64 words
REASON_BYTES = 1024  # each partition's failure text slot

#: The words of a partition's control line.
WEIGHT, GRADIENT, COUNT, STATE, PID, REASON_LENGTH, PID_NAMESPACE = range(7)
ALIVE, CLOSED, FAILED = 0, 1, 2

#: How long a waiter reads the words before it sleeps on its doorbell, in seconds: a
#: peer a few microseconds away is waited for on the CPU; a slower one costs no CPU (and
#: takes none from the peer it waits for, where cores are fewer than partitions).
SPIN = 20e-6
#: How long one sleep on the doorbell lasts at most, in seconds, before the words and
#: the partitions' states are read again (a lost process is seen through its pidfd at once).
NAP = 1.0


def arena_available() -> bool:
    """Whether this platform can share an arena: memfd, eventfd, pidfd, descriptor passing,
    and x86-64's store order (a version word is never seen before the data it guards)."""
    return (
        all(hasattr(os, name) for name in ("memfd_create", "eventfd", "pidfd_open"))
        and hasattr(socket, "send_fds")
        and platform.machine().lower() in ("x86_64", "amd64")
    )


def _pid_namespace() -> int:
    """This process's pid namespace (its inode), or 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


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
    writes through this mapping; ``timeout`` bounds every wait.
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
        self._doorbells = doorbells
        self._owner = owner  # made the segment and its doorbells: offers them to the others
        self._pidfds: dict[int, int] = {}
        self._closed = False
        #: how errors name each partition (``"partition 1 at 127.0.0.1:4000"``)
        self.names = [f"partition {p}" for p in range(partition_num)]
        #: who writes each partition's words: itself, or (hierarchical, a partition on
        #: another host) this host's leader, which brings its slice here; a wait watches the
        #: writer's state and process
        self.writers = list(range(partition_num))
        layout = self.layout
        if os.fstat(fd).st_size < layout.nbytes:
            raise ProtocolError(
                f"the host arena passed to partition {partition_id} holds "
                f"{os.fstat(fd).st_size} bytes, not {layout.nbytes}"
            )
        self._map = self._mapped(layout.gradients, 0)  # the control lines and the weights
        self._gradient_maps: list[mmap.mmap] = []
        self._gradient_mapped: dict[int, mmap.mmap] = {}  # partition -> its vector's mapping
        self._words = np.frombuffer(self._map, np.int64, 8 * (partition_num + 1))
        self._counts = np.frombuffer(self._map, np.float64, 8 * (partition_num + 1))
        self.weights = np.frombuffer(self._map, np.float32, size, layout.weights)
        self._gradients: dict[int, np.ndarray] = {}  # those mapped (``map_gradients``)
        if owner:
            self._words[:4] = (MAGIC, partition_num, size, 1)
        elif tuple(self._words[:3]) != (MAGIC, partition_num, size):
            raise ProtocolError(
                f"the host arena passed to partition {partition_id} is for "
                f"{int(self._words[1])} partitions of {int(self._words[2])} floats, not "
                f"{partition_num} of {size}: every partition must run the same parameter"
            )
        own = self._word(partition_id)
        own[PID_NAMESPACE] = _pid_namespace()
        own[PID] = os.getpid()

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
        return text.encode(), [self._fd, *self._doorbells]

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

    # ---- the regions ---------------------------------------------------------------------

    def _word(self, partition: int) -> np.ndarray:
        start = 8 * (partition + 1)
        return self._words[start : start + 8]

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

    def count(self, partition: int) -> float:
        """The sample count ``partition`` put with its last gradient."""
        return float(self._counts[8 * (partition + 1) + COUNT])

    def version(self, field: int, partition: int) -> int | None:
        """The version of ``partition``'s weight slice or gradient made whole last; None if none."""
        word = int(self._word(partition)[field])
        return word - 1 if word else None

    # ---- publishing and waiting ----------------------------------------------------------

    def publish(self, field: int, version: int, count: float | None = None) -> None:
        """This partition's weight slice (``WEIGHT``) or gradient (``GRADIENT``, with its
        ``count``) of ``version`` is whole: its word says so, and every peer is woken."""
        line = 8 * (self.partition_id + 1)
        if count is not None:
            self._counts[line + COUNT] = count
        self._words[line + field] = version + 1
        self._ring()

    def publish_for(self, partitions, field: int, version: int) -> None:
        """The ``field`` of ``version`` of each of ``partitions`` (other hosts' partitions,
        whose data this host's leader brought here) is whole: their words say so, and every
        peer is woken."""
        for partition in partitions:
            self._words[8 * (partition + 1) + field] = version + 1
        self._ring()

    def _ring(self) -> None:
        for partition, doorbell in enumerate(self._doorbells):
            if partition != self.partition_id:
                os.eventfd_write(doorbell, 1)

    def describe(self, field: int, partition: int, version: int) -> str:
        """For errors, as the blocks would say it: 'weight block from partition 1 to all,
        version 3'."""
        if field == WEIGHT:
            return BlockKey(BlockKind.WEIGHT, partition, EVERY_PARTITION, 0).describe(version)
        return BlockKey(BlockKind.GRADIENT, partition, self.partition_id, 0).describe(version)

    def wait(self, field: int, version: int, partitions=None) -> None:
        """Return once every partition (or each of ``partitions``) has made ``version`` of
        ``field`` whole. A peer that
        failed or closed is a ``PeerLostError`` with its reason, one whose process is gone
        one saying so, at once; one that is not there within the timeout a
        ``FetchTimeoutError``; a word past ``version`` (calls out of step) a ``ProtocolError``."""
        target = version + 1
        column = self._words[8 + field :: 8]  # a view: it sees the peers' writes
        every = partitions is None
        if every:
            done = lambda: (column == target).all()  # noqa: E731
        else:
            done = lambda: all(column[p] == target for p in partitions)  # noqa: E731
        if done():
            return
        now = time.monotonic()
        deadline, spin_until = now + self.timeout, now + SPIN
        while not done() and time.monotonic() < spin_until:
            pass
        while True:
            missing = (
                np.flatnonzero(column != target).tolist()
                if every
                else [p for p in partitions if column[p] != target]
            )
            if not missing:
                return
            self._check(missing, field, version)
            left = deadline - time.monotonic()
            if left <= 0:
                late = missing[0]
                writer = self.writers[late]
                who = (
                    f"{self.names[late]} did not publish"
                    if writer == late
                    else f"{self.names[writer]} (this host's leader) did not bring"
                )
                raise FetchTimeoutError(
                    f"{who} the {self.describe(field, late, version)} "
                    f"within {self.timeout:g} s (partition {self.partition_id} waited in the "
                    "host's shared memory). The peer is stuck or much slower; raise "
                    "AllReduceParameter(timeout=...) if its steps are this slow"
                )
            self._sleep(missing, min(left, NAP), field, version)

    def _check(self, missing: list[int], field: int, version: int) -> None:
        """Raise for a missing partition that will never come: failed, closed, ahead."""
        own = self._word(self.partition_id)
        if own[STATE] != ALIVE:
            raise StoreClosedError(
                f"partition {self.partition_id} is shutting down: it stopped waiting for "
                f"version {version} in the host's shared memory"
            )
        for partition in missing:
            word = self._word(partition)
            if word[field] > version + 1:
                ahead = self.describe(field, partition, int(word[field]) - 1)
                raise ProtocolError(
                    f"{self.names[partition]} published the {ahead} while partition "
                    f"{self.partition_id} waits for version {version}: the partitions' calls "
                    "went out of step (every partition must make the same calls in the same order)"
                )
            writer = self.writers[partition]
            state = self._word(writer)[STATE]
            if state == CLOSED:
                raise self._lost(
                    partition, field, version, "closed its handle", said="it makes no more calls"
                )
            if state != ALIVE:
                raise self._lost(partition, field, version, "shut down", said=self._reason(writer))

    def _sleep(self, missing: list[int], seconds: float, field: int, version: int) -> None:
        """Sleep on the doorbell and on the missing peers' processes for at most ``seconds``.
        Returns at once when this mapping was closed meanwhile (a shutdown from another
        thread): the caller's next look finds this partition ended."""
        if self._closed:
            return
        poller = select.poll()
        doorbell = self._doorbells[self.partition_id]
        poller.register(doorbell, select.POLLIN)
        for writer in {self.writers[partition] for partition in missing}:
            pidfd = self._pidfd(writer)
            if pidfd is not None:
                poller.register(pidfd, select.POLLIN)
        for fd, events in poller.poll(seconds * 1000):
            if self._closed or events & select.POLLNVAL:
                return
            if fd == doorbell:
                try:
                    os.eventfd_read(doorbell)
                except OSError:  # drained by another waiter, or closed meanwhile
                    pass
                continue
            writer = next((p for p, each in self._pidfds.items() if each == fd), None)
            if writer is None:
                continue
            for partition in missing:  # gone without a word
                word = self._word(partition)
                if self.writers[partition] == writer and word[field] != version + 1:
                    if self._word(writer)[STATE] == ALIVE:
                        raise self._lost(
                            partition,
                            field,
                            version,
                            f"(pid {int(self._word(writer)[PID])}) exited",
                        )

    def ended(self, partition: int) -> bool:
        """Whether ``partition`` has stopped: closed, failed, or its process gone."""
        if self._closed:
            return True
        if self._word(partition)[STATE] != ALIVE:
            return True
        try:
            pidfd = self._pidfd(partition)
        except PeerLostError:
            return True
        if pidfd is None:
            return False
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def _pidfd(self, partition: int) -> int | None:
        """A descriptor that becomes readable when ``partition``'s process ends; None for
        a partition of this very process (threads), one not attached yet, or one in
        another pid namespace (a container of the same pod: its pid means nothing here;
        its failure and its timeout still end a wait)."""
        if partition in self._pidfds:
            return self._pidfds[partition]
        word = self._word(partition)
        pid, namespace = int(word[PID]), int(word[PID_NAMESPACE])
        if pid == 0 or pid == os.getpid() or not namespace or namespace != _pid_namespace():
            return None
        try:
            self._pidfds[partition] = os.pidfd_open(pid)
        except ProcessLookupError:
            raise self._lost(partition, None, 0, f"(pid {pid}) exited") from None
        return self._pidfds[partition]

    def _reason(self, partition: int) -> str:
        length = int(self._word(partition)[REASON_LENGTH])
        start = self.layout.reasons + REASON_BYTES * partition
        return bytes(self._map[start : start + min(length, REASON_BYTES)]).decode(
            "utf-8", "replace"
        )

    def _lost(self, partition: int, field: int | None, version: int, detail: str, said: str = ""):
        what = "anything" if field is None else f"the {self.describe(field, partition, version)}"
        writer = self.writers[partition]
        who = (
            self.names[partition]
            if writer == partition
            else f"{self.names[writer]} (this host's leader, which brings it)"
        )
        text = (
            f"{who} {detail} while partition {self.partition_id} waited "
            f"for {what} in the host's shared memory"
        )
        return peer_lost(text, said)

    # ---- the end -------------------------------------------------------------------------

    def end(self, reason: str | None) -> None:
        """This partition stops: closed (``reason`` None) or failed with ``reason``; whoever
        waits for it hears so at once. Once; the mapping stays until ``close``."""
        own = self._word(self.partition_id)
        if self._closed or own[STATE] != ALIVE:
            return
        if reason is not None:
            data = reason.encode("utf-8")[:REASON_BYTES]
            start = self.layout.reasons + REASON_BYTES * self.partition_id
            self._map[start : start + len(data)] = data
            own[REASON_LENGTH] = len(data)
        own[STATE] = CLOSED if reason is None else FAILED
        self._ring()
        os.eventfd_write(self._doorbells[self.partition_id], 1)  # a waiter of our own, too

    def close(self) -> None:
        """Unmap (once no view of it is left) and close every descriptor. Once."""
        if self._closed:
            return
        self.end(None)
        self._closed = True
        for fd in [self._fd, *self._doorbells, *self._pidfds.values()]:
            os.close(fd)
        self._pidfds.clear()
        self._gradients.clear()
        for mapped in [self._map, *self._gradient_maps]:
            try:
                mapped.close()
            except BufferError:  # a view handed out still exists: the mapping goes when it does
                pass
