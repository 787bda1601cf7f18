"""BlockStore: the versioned, bounded blocks one partition publishes for its peers.

A partition puts encoded blocks here (its gradient chunks for their owners, its weight
slice for everyone); the block server hands them out to peers that ask for a version. A
get for a version that is not there yet waits for it, so a fast partition simply blocks
until a slow one publishes: this is how steps synchronise without a Spark ``barrier()``.

How many versions of a block are kept, and whether a producer waits for its reader
instead of dropping a version nobody took, follow from the update strategy
(``strategy.Strategy.keep``): under BSP one version each.

The store also owns the buffers blocks are encoded into (``encode_buffers.EncodeBuffers``:
one is reused only when its version is neither kept nor held by a reader). A get can also
not wait (``get_or_notify``): a server that serves many connections with a few threads
registers a callback instead of holding a thread (``waiters.Waiters``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Mapping
from typing import NamedTuple, Union

from allreduce_param.engine.blocks.encode_buffers import Buffer, EncodeBuffers
from allreduce_param.engine.blocks.waiters import Waiter, Waiters
from allreduce_param.errors import (
    AllReduceError,
    ConfigurationError,
    FetchTimeoutError,
    StaleVersionError,
    StoreClosedError,
    UsageError,
)

#: ``BlockKey.destination`` of a block meant for every peer (a weight slice).
EVERY_PARTITION = 0xFFFFFFFF


class SplitBlock(NamedTuple):
    """A block whose header and payload lie in different buffers: a vector published where
    it lies (the payload is the caller's memory; only the header was written)."""

    header: memoryview
    payload: memoryview

    @property
    def nbytes(self) -> int:
        return self.header.nbytes + self.payload.nbytes


Block = Union[memoryview, SplitBlock]  # noqa: UP007 - what the store keeps and serves


class BlockKind:
    """What a block holds; the numbers go on the wire."""

    WEIGHT = 1  # an owner's weight slice, for every partition
    GRADIENT = 2  # a partition's gradient chunk, for the chunk's owner
    REDUCE_INPUT = 3  # allreduce(): a chunk of the input, for the chunk's owner
    REDUCE_OUTPUT = 4  # allreduce(): an owner's reduced slice, for every partition
    CHOICE = 5  # backup workers: which partitions' gradients a step takes, for every owner
    SIGNAL = 6  # "I have done v" (a checkpoint written), for whoever waits for everyone's
    # allreduce_exact(): a partition's float64 values (counts, norms), for every partition
    METADATA = 7
    # hierarchical sync: a host's sum of its partitions' chunks for one owner, made by its leader
    GRADIENT_HOST_SUM = 8
    REDUCE_INPUT_HOST_SUM = 9
    # allreduce(raw=True): as REDUCE_INPUT, REDUCE_OUTPUT and their host sum, always raw
    RAW_REDUCE_INPUT = 10
    RAW_REDUCE_OUTPUT = 11
    RAW_REDUCE_INPUT_HOST_SUM = 12
    # the typed collectives (any dtype, as bytes, always raw): a chunk for its owner
    # (reduce_scatter's inputs, a broadcast root's pieces), a slice for every partition
    TYPED_CHUNK = 13
    TYPED_SLICE = 14

    NAMES = {
        WEIGHT: "weight",
        GRADIENT: "gradient",
        REDUCE_INPUT: "allreduce input",
        REDUCE_OUTPUT: "allreduce output",
        CHOICE: "step choice",
        SIGNAL: "signal",
        METADATA: "metadata",
        GRADIENT_HOST_SUM: "host sum of gradients",
        REDUCE_INPUT_HOST_SUM: "host sum of allreduce inputs",
        RAW_REDUCE_INPUT: "raw allreduce input",
        RAW_REDUCE_OUTPUT: "raw allreduce output",
        RAW_REDUCE_INPUT_HOST_SUM: "host sum of raw allreduce inputs",
        TYPED_CHUNK: "typed collective chunk",
        TYPED_SLICE: "typed collective slice",
    }
    #: the kind a leader sums a host's blocks of each summed kind into
    HOST_SUM = {
        GRADIENT: GRADIENT_HOST_SUM,
        REDUCE_INPUT: REDUCE_INPUT_HOST_SUM,
        RAW_REDUCE_INPUT: RAW_REDUCE_INPUT_HOST_SUM,
    }


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


class BlockStore:
    """Versioned blocks in memory, ``keep`` versions per key and at most ``max_bytes`` in all.

    ``keep`` is one number for every key or one per ``BlockKind``. For the kinds in
    ``wait_for_readers`` a producer's ``reserve`` waits until the oldest kept version has
    been asked past, rather than dropping it unread. For the kinds in ``reuse_at_once`` the
    update strategy guarantees that every reader is done with a version before the next is
    published, so the next takes its buffer at once: one buffer per block, whatever readers
    still hold (were the guarantee broken, the readers' check after use would say so).
    ``new_buffer()`` makes a buffer to encode a block into (a ``bytearray``, or shared
    memory that peers read in place).

    Thread-safe: the partition's threads reserve and put, the server's threads get.
    """

    def __init__(
        self,
        keep: int | Mapping[int, int] = 1,
        max_bytes: int | None = None,
        wait_for_readers: Collection[int] = (),
        reuse_at_once: Collection[int] = (),
        new_buffer: Callable[[], Buffer] = bytearray,
    ) -> None:
        self._keep = dict(keep) if isinstance(keep, Mapping) else None
        self._default_keep = keep if isinstance(keep, int) else 1
        if any(n < 1 for n in [self._default_keep, *(self._keep or {}).values()]):
            raise ConfigurationError(
                f"a block store must keep at least one version, got keep={keep}"
            )
        self.max_bytes = max_bytes
        self._wait_for_readers = frozenset(wait_for_readers)
        self._blocks: dict[BlockKey, OrderedDict[int, Block]] = {}
        self._asked: dict[BlockKey, int] = {}  # the highest version any reader asked for
        self._buffers = EncodeBuffers(new_buffer, reuse_at_once)  # and the readers' holds
        self._bytes = 0
        self._closed = False
        self._closing_reason = ""
        self._waiters = Waiters()  # gets that did not wait
        self._changed = threading.Condition()

    def keep(self, key: BlockKey) -> int:
        """How many versions of ``key`` are kept."""
        return (
            self._default_keep
            if self._keep is None
            else self._keep.get(key.kind, self._default_keep)
        )

    def reserve(self, key: BlockKey, version: int, timeout: float) -> Buffer:
        """A buffer to encode ``version`` of ``key`` into, then ``put``; no reader uses it.

        For a kind that waits for its readers, first waits (up to ``timeout``) until
        publishing ``version`` drops no version that was never asked past.
        """
        with self._changed:
            if key.kind in self._wait_for_readers:
                ready = self._changed.wait_for(
                    lambda: self._closed or self._room(key), timeout=timeout
                )
                self._raise_if_closed(key, version)
                if not ready:
                    reader = f"partition {key.destination}"
                    raise FetchTimeoutError(
                        f"{reader} did not take {key.describe(self._oldest(key))} within {timeout:g} s, so "
                        f"{key.describe(version)} has no room: the owner is stuck or much slower"
                    )
            return self._buffers.take(key, key.kind, self._blocks.get(key, ()))

    def put(
        self,
        key: BlockKey,
        version: int,
        block: bytes | bytearray | memoryview | SplitBlock,
        buffer: Buffer | memoryview | None = None,
    ) -> None:
        """Publish ``block`` as ``version`` of ``key`` and wake the gets waiting for it.

        The store keeps a reference, not a copy: the caller must not change ``block`` while
        the version is kept (a buffer from ``reserve`` is safe to write until it is put;
        pass it as ``buffer`` when ``block``, or a split block's header, lies in it).
        Versions of a key must increase; the oldest beyond ``keep`` go.
        """
        view = block if isinstance(block, SplitBlock) else memoryview(block).cast("B")
        with self._changed:
            self._raise_if_closed(key, version, "cannot publish")
            versions = self._blocks.setdefault(key, OrderedDict())
            if versions and version <= next(reversed(versions)):
                raise UsageError(
                    f"{key.describe(version)} was published after version {next(reversed(versions))}: "
                    "versions must increase; every partition must make the same calls in the same order"
                )
            dropping = list(versions)[: max(0, len(versions) + 1 - self.keep(key))]
            after = self._bytes + view.nbytes - sum(versions[v].nbytes for v in dropping)
            if self.max_bytes is not None and after > self.max_bytes:
                raise AllReduceError(
                    f"the block store would hold {after} bytes with {key.describe(version)}, "
                    f"over its limit of {self.max_bytes}: more blocks are published than are fetched"
                )
            for old in dropping:
                del versions[old]
            versions[version] = view
            if buffer is None:
                buffer = (view.header if isinstance(view, SplitBlock) else view).obj
            self._buffers.filled(buffer, version)
            self._bytes = after
            self._changed.notify_all()
            ready = self._waiters.ready(key, version)
        for waiter in ready:
            waiter.notify()

    def get(
        self,
        key: BlockKey,
        version: int,
        timeout: float,
        *,
        newest: bool = False,
        reader: Hashable | None = None,
    ) -> tuple[int, Block]:
        """``(version, block)``: ``version`` of ``key``, or with ``newest`` the newest version at
        or above it; waits up to ``timeout`` seconds for it to be put.

        ``reader`` (a connection, a thread's role) then holds the version served until its
        next get of ``key`` or ``release``, so its buffer is not rewritten while being read.
        Raises ``FetchTimeoutError`` when it does not come in time, ``StaleVersionError`` when
        it was already replaced, ``StoreClosedError`` when the store closes meanwhile.
        """
        with self._changed:
            self._ask(key, version, reader)
            found = self._changed.wait_for(
                lambda: self._closed or self._newest(key) >= version, timeout=timeout
            )
            self._raise_if_closed(key, version)
            if not found:
                raise self._not_published(key, version, timeout)
            return self._take(key, version, newest, reader)

    def get_or_notify(
        self,
        key: BlockKey,
        version: int,
        on_ready: Callable[[], None],
        *,
        newest: bool = False,
        reader: Hashable | None = None,
    ) -> tuple[int, Block] | Waiter:
        """``get`` without waiting: ``(version, block)`` when it is there (raising as ``get``
        does when it was replaced or the store is closed), else a ``Waiter``.

        The waiter's ``on_ready()`` is then called once the version (or, with ``newest``, one
        at or above it) is put or the store closes, from the thread that put it or closed the
        store, outside the store's lock: it must return at once and not raise (hand the
        answer to another thread), which then asks again here. A waiter that should stop
        waiting (its timeout) is ended with ``Waiter.expire``: the store keeps no clock.
        ``reader`` holds as with ``get``.
        """
        with self._changed:
            self._ask(key, version, reader)
            if self._closed or self._newest(key) >= version:
                self._raise_if_closed(key, version)
                return self._take(key, version, newest, reader)
            waiter = Waiter(self._expire, key, version, on_ready)
            self._waiters.add(waiter)
            return waiter

    def release(self, reader: Hashable) -> None:
        """Drop every hold of ``reader`` (its connection ended, or it is done reading)."""
        with self._changed:
            self._buffers.release(reader)

    def newest(self, key: BlockKey) -> int:
        """The newest version of ``key`` in the store, or -1."""
        with self._changed:
            return self._newest(key)

    @property
    def waiting(self) -> int:
        """How many gets wait through ``get_or_notify`` (holding no thread) right now."""
        with self._changed:
            return len(self._waiters)

    @property
    def nbytes(self) -> int:
        """The bytes of all kept blocks."""
        with self._changed:
            return self._bytes

    def buffer_count(self, key: BlockKey) -> int:
        """How many buffers ``key`` has needed so far (bounded by kept + held versions + 1)."""
        with self._changed:
            return self._buffers.count(key)

    def close(self, reason: str = "") -> None:
        """Drop every block and fail every waiting (and later) get with ``StoreClosedError``.

        ``reason``, when given, is that error's message: why this partition stops.
        """
        with self._changed:
            self._closed = True
            self._closing_reason = self._closing_reason or reason
            self._blocks.clear()
            self._buffers.clear()
            self._bytes = 0
            self._changed.notify_all()
            ready = self._waiters.all()
        for waiter in ready:
            waiter.notify()

    def _expire(self, waiter: Waiter, timeout: float) -> FetchTimeoutError | None:
        with self._changed:
            if not self._waiters.expire(waiter):
                return None
            return self._not_published(waiter.key, waiter.version, timeout)

    # ---- under the lock ------------------------------------------------------------------

    def _ask(self, key: BlockKey, version: int, reader: Hashable | None) -> None:
        """A reader asks for ``version``: a producer waiting for room may go on, and the
        reader's hold of its last version of ``key`` ends."""
        if version > self._asked.get(key, -1):
            self._asked[key] = version
            self._changed.notify_all()  # a producer may wait for this
        if reader is not None:
            self._buffers.unhold(key, reader)

    def _take(
        self, key: BlockKey, version: int, newest: bool, reader: Hashable | None
    ) -> tuple[int, Block]:
        """The block a get serves, once ``version`` (or a newer one) has been put."""
        versions = self._blocks[key]
        if newest:
            version = next(reversed(versions))
        elif version not in versions:
            raise StaleVersionError(
                f"{key.describe(version)} is no longer kept (kept: {list(versions)}); "
                "a peer fell behind further than the update strategy allows"
            )
        if reader is not None:
            self._buffers.hold(key, reader, version)
        return version, versions[version]

    def _not_published(self, key: BlockKey, version: int, timeout: float) -> FetchTimeoutError:
        return FetchTimeoutError(
            f"{key.describe(version)} was not published within {timeout:g} s "
            f"(newest there: {self._newest(key) if key in self._blocks else 'none'})"
        )

    def _newest(self, key: BlockKey) -> int:
        versions = self._blocks.get(key)
        return next(reversed(versions)) if versions else -1

    def _oldest(self, key: BlockKey) -> int:
        versions = self._blocks.get(key)
        return next(iter(versions)) if versions else -1

    def _room(self, key: BlockKey) -> bool:
        """Whether a new version of ``key`` would drop only versions a reader asked past."""
        versions = self._blocks.get(key)
        return (
            not versions
            or len(versions) < self.keep(key)
            or self._oldest(key) < self._asked.get(key, -1)
        )

    def _raise_if_closed(self, key: BlockKey, version: int, doing: str = "") -> None:
        if self._closed:
            if doing:
                raise StoreClosedError(
                    f"{doing} {key.describe(version)}: "
                    f"{self._closing_reason or 'the block store is closed'}"
                )
            raise StoreClosedError(
                self._closing_reason
                or f"{key.describe(version)} was asked for while the store closed"
            )
