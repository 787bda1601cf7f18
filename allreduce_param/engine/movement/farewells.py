"""Farewells: which peers are done with this partition, waiting for them, and goodbyes.

A partition that ends keeps serving until each peer it serves is done with it: the peer
said so, hung up, is known to be gone, or (through a host arena) stopped there. A failed
partition also says goodbye to the peers it never connected to, so that a peer failing at
the same time need not wait for a hang-up that never comes. ``peers.PeerGroup`` decides
whom to wait for and when (``close``, ``fail``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable

from allreduce_param.engine.blocks.arena import HostArena
from allreduce_param.engine.wire.blocks import PeerClient
from allreduce_param.errors import AllReduceError

log = logging.getLogger(__name__)

#: How often (seconds) a partition ending looks whether its peers stopped in the host arena.
ARENA_LOOK = 0.02


class Farewells:
    """The peers done with partition ``partition_id``; waits last ``timeout`` by default."""

    def __init__(self, partition_id: int, timeout: float) -> None:
        self.partition_id = partition_id
        self.timeout = timeout
        self._done: set[int] = set()
        self._changed = threading.Condition()

    def peer_done(self, partition: int) -> None:
        """``partition`` fetches nothing more from us: it said so, hung up, or is gone."""
        with self._changed:
            self._done.add(partition)
            self._changed.notify_all()

    def wait(
        self,
        partitions: Collection[int],
        timeout: float | None = None,
        arena: HostArena | None = None,
    ) -> bool:
        """Wait until each of ``partitions`` is done with us (at most ``timeout``, default the
        parameter's); log those that are not. Through a host ``arena`` a peer that stopped
        there (closed, failed, its process gone) is done too: it may never have connected."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout

        def done() -> bool:
            left = set(partitions) - self._done
            return not left or (arena is not None and all(arena.ended(p) for p in left))

        with self._changed:
            while not (finished := done()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # the arena's ends ring no condition: look again in a while
                self._changed.wait(left if arena is None else min(left, ARENA_LOOK))
            missing = sorted(set(partitions) - self._done)
        if not finished:
            log.warning(
                "partition %d stopped waiting for partitions %s to say they were done",
                self.partition_id,
                missing,
            )
        return finished

    def part_from(
        self, partitions: Iterable[int], client_of: Callable[[int], PeerClient]
    ) -> list[threading.Thread]:
        """Tell each of ``partitions`` (peers never connected to) that this failed partition
        fetches nothing more from it, each on a connection of its own (``client_of(peer)``),
        all at once (a peer out of reach costs one connect timeout, whatever their number);
        the threads doing it.

        Without it a peer that fails too, before either fetched from the other, would wait
        ``failure_linger`` for our hang-up as we wait for its, though neither will fetch
        again. A connection of its own: a channel's client may be held by a fetch."""

        def goodbye(partition: int) -> None:
            client = client_of(partition)
            try:
                client.done()
            except (AllReduceError, OSError) as error:  # gone, or not of this parameter
                log.debug("partition %d: no goodbye to %d: %s", self.partition_id, partition, error)
            finally:
                client.close()

        threads = [
            threading.Thread(
                target=goodbye, args=(p,), name=f"allreduce-goodbye-{self.partition_id}-{p}"
            )
            for p in partitions
        ]
        for thread in threads:
            thread.start()
        return threads
