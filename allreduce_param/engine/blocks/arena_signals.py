"""The host arena's signals: version words, doorbells, and knowing when a peer is gone.

A host arena (``arena.py``) holds vectors; this module says when they are whole. Each
partition has a control line of 8 int64 words in the segment: the version (plus one; 0 is
none yet) of its weight slice and of its gradient that it last made whole, its gradient's
sample count, its state (alive, closed, failed, with the reason in a text slot of its
own), its pid and its pid namespace (a pid is only looked up from the same namespace).

A partition writes its data, then its version word, then rings the other partitions'
doorbells (an ``eventfd`` each). A waiter reads the words, spins briefly, and then sleeps
on its doorbell and on the ``pidfd`` of every process it waits for, so a peer's death ends
the wait at once (a ``PeerLostError``), a peer's failure with its reason, and a peer that
never comes at the timeout (a ``FetchTimeoutError``): never a hang.

Kept apart from the vectors because this is the part with the protocol in it (ordering,
liveness, the errors' wording), and the part a reader of a hang or a lost peer needs.
"""

from __future__ import annotations

import os
import select
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


def pid_namespace() -> int:
    """This process's pid namespace (its inode), or 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class ArenaSignals:
    """One partition's view of its host arena's control lines and doorbells (see the module).

    ``words`` and ``counts`` are the segment's header line and control lines, as int64 and
    as float64 (the count word is a float); ``reasons`` the failure text slots, as bytes;
    ``doorbells`` every partition's eventfd. Closing closes the doorbells and the pidfds
    this view opened; the memory is the arena's.
    """

    def __init__(
        self,
        words: np.ndarray,
        counts: np.ndarray,
        reasons: np.ndarray,
        doorbells: list[int],
        partition_id: int,
        timeout: float,
    ) -> None:
        self.partition_id = partition_id
        self.timeout = timeout
        self.doorbells = doorbells
        self._words = words
        self._counts = counts
        self._reasons = reasons
        self._pidfds: dict[int, int] = {}
        self.closed = False
        partition_num = len(doorbells)
        #: how errors name each partition (``"partition 1 at 127.0.0.1:4000"``)
        self.names = [f"partition {p}" for p in range(partition_num)]
        #: who writes each partition's words: itself, or (hierarchical, a partition on
        #: another host) this host's leader, which brings its slice here; a wait watches the
        #: writer's state and process
        self.writers = list(range(partition_num))

    def mark_own_process(self) -> None:
        """Write this process's pid and pid namespace into its own line, for the peers'
        pidfds."""
        own = self.line(self.partition_id)
        own[PID_NAMESPACE] = pid_namespace()
        own[PID] = os.getpid()

    # ---- reading the words -----------------------------------------------------------------

    def line(self, partition: int) -> np.ndarray:
        """``partition``'s control line (a view: it sees the peers' writes)."""
        start = 8 * (partition + 1)
        return self._words[start : start + 8]

    def count(self, partition: int) -> float:
        """The sample count ``partition`` put with its last gradient."""
        return float(self._counts[8 * (partition + 1) + COUNT])

    def version(self, field: int, partition: int) -> int | None:
        """The version of ``partition``'s weight slice or gradient made whole last; None if none."""
        word = int(self.line(partition)[field])
        return word - 1 if word else None

    def describe(self, field: int, partition: int, version: int) -> str:
        """For errors, as the blocks would say it: 'weight block from partition 1 to all,
        version 3'."""
        if field == WEIGHT:
            return BlockKey(BlockKind.WEIGHT, partition, EVERY_PARTITION, 0).describe(version)
        return BlockKey(BlockKind.GRADIENT, partition, self.partition_id, 0).describe(version)

    # ---- publishing --------------------------------------------------------------------------

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
        for partition, doorbell in enumerate(self.doorbells):
            if partition != self.partition_id:
                os.eventfd_write(doorbell, 1)

    # ---- waiting -----------------------------------------------------------------------------

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
        own = self.line(self.partition_id)
        if own[STATE] != ALIVE:
            raise StoreClosedError(
                f"partition {self.partition_id} is shutting down: it stopped waiting for "
                f"version {version} in the host's shared memory"
            )
        for partition in missing:
            word = self.line(partition)
            if word[field] > version + 1:
                ahead = self.describe(field, partition, int(word[field]) - 1)
                raise ProtocolError(
                    f"{self.names[partition]} published the {ahead} while partition "
                    f"{self.partition_id} waits for version {version}: the partitions' calls "
                    "went out of step (every partition must make the same calls in the same order)"
                )
            writer = self.writers[partition]
            state = self.line(writer)[STATE]
            # a peer that made the version whole after the caller looked and then ended at once
            # (its last publish, then close) is not missing: its word is read after its state,
            # and it wrote the word before the state
            if state != ALIVE and self.line(partition)[field] == version + 1:
                continue
            if state == CLOSED:
                raise self._lost(
                    partition, field, version, "closed its handle", said="it makes no more calls"
                )
            if state != ALIVE:
                raise self._lost(partition, field, version, "shut down", said=self._reason(writer))

    def _sleep(self, missing: list[int], seconds: float, field: int, version: int) -> None:
        """Sleep on the doorbell and on the missing peers' processes for at most ``seconds``.
        Returns at once when this view was closed meanwhile (a shutdown from another
        thread): the caller's next look finds this partition ended."""
        if self.closed:
            return
        poller = select.poll()
        doorbell = self.doorbells[self.partition_id]
        poller.register(doorbell, select.POLLIN)
        for writer in {self.writers[partition] for partition in missing}:
            pidfd = self._pidfd(writer)
            if pidfd is not None:
                poller.register(pidfd, select.POLLIN)
        for fd, events in poller.poll(seconds * 1000):
            if self.closed or events & select.POLLNVAL:
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
                word = self.line(partition)
                if self.writers[partition] == writer and word[field] != version + 1:
                    if self.line(writer)[STATE] == ALIVE:
                        raise self._lost(
                            partition,
                            field,
                            version,
                            f"(pid {int(self.line(writer)[PID])}) exited",
                        )

    # ---- the peers' liveness -----------------------------------------------------------------

    def ended(self, partition: int) -> bool:
        """Whether ``partition`` has stopped: closed, failed, or its process gone."""
        if self.closed:
            return True
        if self.line(partition)[STATE] != ALIVE:
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
        word = self.line(partition)
        pid, namespace = int(word[PID]), int(word[PID_NAMESPACE])
        if pid == 0 or pid == os.getpid() or not namespace or namespace != pid_namespace():
            return None
        try:
            self._pidfds[partition] = os.pidfd_open(pid)
        except ProcessLookupError:
            raise self._lost(partition, None, 0, f"(pid {pid}) exited") from None
        return self._pidfds[partition]

    def _reason(self, partition: int) -> str:
        length = int(self.line(partition)[REASON_LENGTH])
        start = REASON_BYTES * partition
        return bytes(self._reasons[start : start + min(length, REASON_BYTES)]).decode(
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

    # ---- the end -----------------------------------------------------------------------------

    def end(self, reason: str | None) -> None:
        """This partition stops: closed (``reason`` None) or failed with ``reason``; whoever
        waits for it hears so at once. Once."""
        own = self.line(self.partition_id)
        if self.closed or own[STATE] != ALIVE:
            return
        if reason is not None:
            data = reason.encode("utf-8")[:REASON_BYTES]
            start = REASON_BYTES * self.partition_id
            self._reasons[start : start + len(data)] = np.frombuffer(data, np.uint8)
            own[REASON_LENGTH] = len(data)
        own[STATE] = CLOSED if reason is None else FAILED
        self._ring()
        os.eventfd_write(self.doorbells[self.partition_id], 1)  # a waiter of our own, too

    def close(self) -> None:
        """End this partition (closed, unless it ended already) and close the doorbells and
        the pidfds. Once."""
        if self.closed:
            return
        self.end(None)
        self.closed = True
        for fd in [*self.doorbells, *self._pidfds.values()]:
            os.close(fd)
        self._pidfds.clear()
