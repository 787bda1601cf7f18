"""BlockStore: the versioned, bounded blocks one partition publishes for its peers.

A partition puts encoded blocks here (its gradient chunks for their owners, its weight
slice for everyone); the block server hands them out to peers that ask for a version. A
get for a version that is not there yet waits for it, so a fast partition simply blocks
until a slow one publishes: this is how steps synchronise without a Spark ``barrier()``.

Only the newest ``keep`` versions of each block are kept. Under BSP a peer has fetched
version ``t`` before anyone can publish ``t + 1`` (see DESIGN.md), so ``keep=1`` suffices;
SSP with staleness ``s`` needs ``s + 1``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

from .errors import AllReduceError, ConfigurationError, FetchTimeoutError, UsageError

#: ``BlockKey.destination`` of a block meant for every peer (a weight slice).
EVERY_PARTITION = 0xFFFFFFFF


class BlockKind:
    """What a block holds; the numbers go on the wire."""

    WEIGHT = 1  # an owner's weight slice, for every partition
    GRADIENT = 2  # a partition's gradient chunk, for the chunk's owner
    REDUCE_INPUT = 3  # allreduce(): a chunk of the input, for the chunk's owner
    REDUCE_OUTPUT = 4  # allreduce(): an owner's reduced slice, for every partition

    NAMES = {WEIGHT: "weight", GRADIENT: "gradient", REDUCE_INPUT: "allreduce input",
             REDUCE_OUTPUT: "allreduce output"}


class BlockKey(NamedTuple):
    """Which block: its kind, the partition that made it, the one it is for, and which part.

    A large slice travels as several parts, so that a peer can fetch the first while the
    owner still encodes the next.
    """

    kind: int
    source: int
    destination: int
    part: int = 0

    def describe(self, version: int | None = None) -> str:
        """For error messages: 'gradient block from partition 2 to partition 0, version 7'."""
        kind = BlockKind.NAMES.get(self.kind, f"kind-{self.kind}")
        target = "all" if self.destination == EVERY_PARTITION else f"partition {self.destination}"
        text = f"{kind} block from partition {self.source} to {target}"
        if self.part:
            text += f" (part {self.part})"
        return text if version is None else f"{text}, version {version}"


class StoreClosedError(AllReduceError):
    """The store was closed while a get waited on it: the partition is shutting down."""


class StaleVersionError(AllReduceError):
    """The asked-for version has already been replaced by newer ones."""


class BlockStore:
    """Versioned blocks in memory, at most ``keep`` versions per key and ``max_bytes`` in all.

    Thread-safe: the partition's own thread puts, the server's connection threads get.
    """

    def __init__(self, keep: int = 1, max_bytes: int | None = None) -> None:
        if keep < 1:
            raise ConfigurationError(f"a block store must keep at least one version, got keep={keep}")
        self.keep = keep
        self.max_bytes = max_bytes
        self._blocks: dict[BlockKey, OrderedDict[int, memoryview]] = {}
        self._bytes = 0
        self._closed = False
        self._closing_reason = ""
        self._changed = threading.Condition()

    def put(self, key: BlockKey, version: int, block: bytes | bytearray | memoryview) -> None:
        """Publish ``block`` as ``version`` of ``key`` and wake the gets waiting for it.

        The store keeps a reference, not a copy: the caller must not change ``block`` while
        the version is kept. Versions of a key must increase; the oldest beyond ``keep`` go.
        """
        view = memoryview(block).cast("B")
        with self._changed:
            if self._closed:
                raise StoreClosedError(f"cannot publish {key.describe(version)}: the block store is closed")
            versions = self._blocks.setdefault(key, OrderedDict())
            if versions and version <= next(reversed(versions)):
                raise UsageError(
                    f"{key.describe(version)} was published after version {next(reversed(versions))}: "
                    "versions must increase; every partition must make the same calls in the same order"
                )
            dropping = list(versions)[: max(0, len(versions) + 1 - self.keep)]
            after = self._bytes + view.nbytes - sum(versions[v].nbytes for v in dropping)
            if self.max_bytes is not None and after > self.max_bytes:
                raise AllReduceError(
                    f"the block store would hold {after} bytes with {key.describe(version)}, "
                    f"over its limit of {self.max_bytes}: more blocks are published than are fetched"
                )
            for old in dropping:
                del versions[old]
            versions[version] = view
            self._bytes = after
            self._changed.notify_all()

    def get(self, key: BlockKey, version: int, timeout: float) -> memoryview:
        """Return ``version`` of ``key``, waiting up to ``timeout`` seconds for it to be put.

        Raises ``FetchTimeoutError`` when it does not come in time, ``StaleVersionError`` when
        it was already replaced, ``StoreClosedError`` when the store closes meanwhile.
        """
        with self._changed:
            found = self._changed.wait_for(
                lambda: self._closed or self._newest(key) >= version, timeout=timeout
            )
            if self._closed:
                raise StoreClosedError(self._closing_reason or f"{key.describe(version)} was asked for while the store closed")
            if not found:
                raise FetchTimeoutError(
                    f"{key.describe(version)} was not published within {timeout:g} s "
                    f"(newest there: {self._newest(key) if key in self._blocks else 'none'})"
                )
            versions = self._blocks[key]
            if version not in versions:
                raise StaleVersionError(
                    f"{key.describe(version)} is no longer kept (kept: {list(versions)}); "
                    "a peer fell behind further than the update strategy allows"
                )
            return versions[version]

    def newest(self, key: BlockKey) -> int:
        """The newest version of ``key`` in the store, or -1."""
        with self._changed:
            return self._newest(key)

    @property
    def nbytes(self) -> int:
        """The bytes of all kept blocks."""
        with self._changed:
            return self._bytes

    def close(self, reason: str = "") -> None:
        """Drop every block and fail every waiting (and later) get with ``StoreClosedError``.

        ``reason``, when given, is that error's message: why this partition stops.
        """
        with self._changed:
            self._closed = True
            self._closing_reason = self._closing_reason or reason
            self._blocks.clear()
            self._bytes = 0
            self._changed.notify_all()

    def _newest(self, key: BlockKey) -> int:
        versions = self._blocks.get(key)
        return next(reversed(versions)) if versions else -1
