"""EncodeBuffers: the buffers one store's blocks are encoded into, and when one is free again.

A reader may still be reading a version (in place, from shared memory, or while the server
sends it) after a newer one replaced it, so a buffer is reused only when its version is
neither kept nor *held*: a reader holds the version it was last served of a block until it
asks for that block again or goes away. The store (``store.BlockStore``) says which
versions it keeps; this pool remembers which version each buffer holds and which version
each reader holds, and hands out a free buffer or a new one.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Collection, Hashable
from typing import Union

Buffer = Union[bytearray, mmap.mmap, memoryview]  # noqa: UP007 - what blocks are encoded into

_RESERVED = -1  # a buffer handed out by take() and not yet put


class EncodeBuffers:
    """Each block key's buffers, the version each holds, and the versions readers hold.

    ``new_buffer()`` makes a buffer (a ``bytearray``, or shared memory that peers read in
    place). For the kinds in ``reuse_at_once`` the first buffer is taken whatever readers
    still hold (the update strategy guarantees they are done). Not thread-safe: the store
    calls it under its lock.
    """

    def __init__(
        self, new_buffer: Callable[[], Buffer], reuse_at_once: Collection[int] = ()
    ) -> None:
        self._new_buffer = new_buffer
        self._reuse_at_once = frozenset(reuse_at_once)
        self._buffers: dict[Hashable, list[Buffer]] = {}
        self._versions: dict[int, int] = {}  # id(buffer) -> the version it holds
        self._holds: dict[Hashable, dict[Hashable, int]] = {}  # reader -> version last served

    def take(self, key: Hashable, kind: int, kept: Collection[int]) -> Buffer:
        """A buffer of ``key`` (of block kind ``kind``) that holds no version in ``kept``
        and none a reader holds (or a new one), marked reserved until ``filled``."""
        for buffer in self._buffers.setdefault(key, []):
            if kind in self._reuse_at_once or not self._in_use(key, buffer, kept):
                break
        else:
            buffer = self._new_buffer()
            self._buffers[key].append(buffer)
        self._versions[id(buffer)] = _RESERVED
        return buffer

    def filled(self, buffer: object, version: int) -> None:
        """``buffer`` now holds ``version`` (a buffer not from ``take`` is ignored)."""
        if id(buffer) in self._versions:
            self._versions[id(buffer)] = version

    def hold(self, key: Hashable, reader: Hashable, version: int) -> None:
        """``reader`` was served ``version`` of ``key``: it holds it until ``unhold``."""
        self._holds.setdefault(key, {})[reader] = version

    def unhold(self, key: Hashable, reader: Hashable) -> None:
        """``reader``'s hold of its last version of ``key`` ends (it asks for another)."""
        self._holds.get(key, {}).pop(reader, None)

    def release(self, reader: Hashable) -> None:
        """Drop every hold of ``reader``."""
        for holders in self._holds.values():
            holders.pop(reader, None)

    def count(self, key: Hashable) -> int:
        """How many buffers ``key`` has needed so far."""
        return len(self._buffers.get(key, ()))

    def clear(self) -> None:
        """Forget every buffer and hold (the store closed)."""
        self._buffers.clear()
        self._versions.clear()
        self._holds.clear()

    def _in_use(self, key: Hashable, buffer: Buffer, kept: Collection[int]) -> bool:
        version = self._versions.get(id(buffer), _RESERVED)
        return (
            version == _RESERVED or version in kept or version in self._holds.get(key, {}).values()
        )
