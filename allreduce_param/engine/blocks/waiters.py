"""Waiter and Waiters: the gets of a block store that did not wait (``get_or_notify``).

A server that serves many connections with a few threads registers a callback instead of
holding a thread while a version is awaited. ``Waiters`` keeps them by block key, hands
back those a newly put version answers, and all of them when the store closes; the store
calls their ``on_ready()`` outside its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from allreduce_param.errors import FetchTimeoutError


class Waiter:
    """A get that found its version not there yet and did not wait (``get_or_notify``).

    Its ``on_ready()`` is called once, when the version (or a newer one) is put or the store
    closes; or never, when ``expire`` came first.
    """

    __slots__ = ("_expire", "key", "version", "_on_ready", "fired")

    def __init__(
        self,
        expire: Callable[[Waiter, float], FetchTimeoutError | None],
        key: Hashable,
        version: int,
        on_ready: Callable[[], None],
    ) -> None:
        self._expire, self.key, self.version, self._on_ready = expire, key, version, on_ready
        self.fired = False  # on_ready was called, or the wait expired: nothing more will happen

    def expire(self, timeout: float) -> FetchTimeoutError | None:
        """End the wait at its timeout (``timeout``: how long it was, for the message): the
        error a blocking get would have raised, or None when ``on_ready`` came first."""
        return self._expire(self, timeout)

    def notify(self) -> None:
        """Call ``on_ready``: the store does, once, outside its lock."""
        self._on_ready()


class Waiters:
    """The waiting gets of one store, by block key. Not thread-safe: the store calls it
    under its lock, and each waiter's ``on_ready`` after it lets go."""

    def __init__(self) -> None:
        self._by_key: dict[Hashable, list[Waiter]] = {}

    def add(self, waiter: Waiter) -> None:
        """``waiter`` waits for its key's version."""
        self._by_key.setdefault(waiter.key, []).append(waiter)

    def __len__(self) -> int:
        return sum(len(waiters) for waiters in self._by_key.values())

    def ready(self, key: Hashable, version: int) -> list[Waiter]:
        """The waiters of ``key`` that ``version``, just put, answers; no longer waiting."""
        waiters = self._by_key.get(key)
        if not waiters:
            return []
        ready = [waiter for waiter in waiters if waiter.version <= version]
        if ready:
            left = [waiter for waiter in waiters if waiter.version > version]
            if left:
                self._by_key[key] = left
            else:
                del self._by_key[key]
            for waiter in ready:
                waiter.fired = True
        return ready

    def all(self) -> list[Waiter]:
        """Every waiter, no longer waiting (the store closes)."""
        ready = [waiter for waiters in self._by_key.values() for waiter in waiters]
        self._by_key.clear()
        for waiter in ready:
            waiter.fired = True
        return ready

    def expire(self, waiter: Waiter) -> bool:
        """End ``waiter``'s wait: whether it was still waiting (else ``on_ready`` came first)."""
        if waiter.fired:
            return False
        waiter.fired = True
        waiters = self._by_key.get(waiter.key, [])
        waiters.remove(waiter)
        if not waiters:
            self._by_key.pop(waiter.key, None)
        return True
