"""Gradient streams: a gradient published chunk by chunk while backward still computes the rest.

A model's backward pass finishes its gradient one tensor at a time, last layer first. A
``GradientStream`` is told each range of the gradient vector as it becomes final
(``ready(start, stop)``); as soon as every element of owner ``j``'s chunk is final, that
chunk is published for ``j`` on a publishing thread, so owner ``j`` fetches and sums it
while this partition's backward goes on: the reduce-scatter overlaps the rest of backward,
as DDP's gradient buckets do. Here the buckets are the owners' chunks, which the block
store moves anyway, so the result is the same bits as publishing the whole vector at once.

An ``EncodedStream`` does the same for a gradient whose lossy codec runs where the gradient
lies (a GPU: ``models.device_codecs``): it is handed each owner's encoded bytes
(``ready(owner, payload)``) once the caller has encoded that owner's chunk, and publishes
them as ``put_gradients(EncodedGradient)`` would have.

``ConnectedParameter.stream_gradients`` and ``stream_gradients(encoded=True)`` make them; this
module knows nothing of versions or codecs: it is told how to publish one owner's chunk.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

import numpy as np

from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.vectors import byte_payload
from allreduce_param.errors import InputError, UsageError


class _Publishing:
    """What both streams share: chunks published on the handle's publishing thread, a close
    that waits for them all and raises the first error one met, and an ``abandon`` for a
    computation that broke. Subclasses submit under ``_lock`` and say, at close, what is
    left (``_leftover``)."""

    def __init__(
        self,
        publisher: Executor,
        on_close: Callable[[BaseException | None], None],
        what: str,
    ) -> None:
        self._publisher = publisher
        self._on_close = on_close
        self._what = what
        self._published: list[Future] = []
        self._lock = threading.Lock()
        self._closed = False

    def _submit(self, publish: Callable, *args) -> None:
        """Run ``publish(*args)`` on the publishing thread; under the lock."""
        self._published.append(self._publisher.submit(publish, *args))

    def _refuse_closed(self, call: str) -> None:
        """Under the lock: refuse ``call`` on a closed stream."""
        if self._closed:
            raise UsageError(f"{self._what}: {call} came after the stream was closed")

    def _leftover(self) -> BaseException | None:
        """Under the lock, at close: publish what is left; an error if that cannot be done."""
        raise NotImplementedError

    def close(self) -> None:
        """Publish what is left, wait for every publish, and raise the first error one met."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            failure = self._leftover()
        for future in self._published:
            error = future.exception()
            failure = failure or error
        self._on_close(failure)
        if failure is not None:
            raise failure

    def abandon(self, error: BaseException) -> None:
        """End the stream after ``error`` broke the computation: publish nothing more, wait
        for the publishes under way, and let the handle fail."""
        with self._lock:
            self._closed = True
        for future in self._published:
            future.exception()
        self._on_close(error)

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc is None:
            self.close()
        else:
            self.abandon(exc)


class GradientStream(_Publishing):
    """Publishes each owner's chunk of one gradient once it is final; close it on every path.

    Made by ``ConnectedParameter.stream_gradients``. Call ``ready(start, stop)`` (from any
    thread) for each range of the gradient vector once nothing will write it any more;
    ranges must not overlap, and need not come in any order. ``close()`` (or leaving the
    with-block) publishes every chunk not yet published, waits until all are, and raises
    the first error a publish met. Calling ``ready`` is only a hint that lets chunks leave
    early: a stream closed with no ``ready`` at all publishes everything at its close.
    """

    def __init__(
        self,
        layout: SliceLayout,
        owners: list[int],
        publish_chunk: Callable[[int], None],
        publisher: Executor,
        on_close: Callable[[BaseException | None], None],
        what: str,
    ) -> None:
        super().__init__(publisher, on_close, what)
        self._layout = layout
        self._owners = owners  # in the order to publish those left at close
        self._publish_chunk = publish_chunk
        self._waiting = {owner: layout.length(owner) for owner in owners}  # elements not yet final
        self._ranges: list[tuple[int, int]] = []  # reported so far, none empty: disjoint, by start

    def ready(self, start: int, stop: int) -> None:
        """Say that elements ``start:stop`` of the gradient vector are final: each owner's
        chunk that is then whole is published (on the publishing thread), and this returns
        at once. Refused if the range lies outside the vector or overlaps one already
        reported (it would count elements twice)."""
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= self._layout.size:
            raise InputError(
                f"{self._what}: ready({start}, {stop}) lies outside the gradient vector of "
                f"{self._layout.size} elements"
            )
        with self._lock:
            self._refuse_closed(f"ready({start}, {stop})")
            if start == stop:
                return
            # the reported ranges are disjoint and sorted: only the neighbours can overlap
            at = bisect.bisect(self._ranges, (start, stop))
            for done_start, done_stop in self._ranges[max(0, at - 1) : at + 1]:
                if start < done_stop and done_start < stop:
                    raise InputError(
                        f"{self._what}: ready({start}, {stop}) overlaps ready({done_start}, "
                        f"{done_stop}) reported before; report each element once"
                    )
            self._ranges.insert(at, (start, stop))
            for owner in self._layout.owners(start, stop):
                if owner not in self._waiting:  # the own chunk, which is not published
                    continue
                bounds = self._layout.bounds(owner)
                self._waiting[owner] -= min(stop, bounds.stop) - max(start, bounds.start)
                if self._waiting[owner] == 0:
                    del self._waiting[owner]
                    self._submit(self._publish_chunk, owner)

    def _leftover(self) -> BaseException | None:
        """The gradient vector is final in full by now: publish the chunks not yet whole."""
        for owner in [owner for owner in self._owners if owner in self._waiting]:
            del self._waiting[owner]
            self._submit(self._publish_chunk, owner)
        return None

    def __enter__(self) -> GradientStream:
        return self


class EncodedStream(_Publishing):
    """Publishes each owner's chunk of one gradient from the bytes its lossy codec made
    elsewhere (``put_gradients(EncodedGradient)``, owner by owner); close it on every path.

    Made by ``ConnectedParameter.stream_gradients(encoded=True)``. Call ``ready(owner, payload)``
    (from any thread) once for every owner: ``payload`` holds the streams of the owner's
    parts, as ``info.gradient_put_plan.owner_span(owner)`` lays them out (a view of a full
    payload at that span is one), and is read on the publishing thread, so it must stay
    unchanged until the stream is closed. ``close()`` (or leaving the with-block) waits for
    every publish and raises the first error one met; a close with an owner never given is
    an error (there is nothing to publish it from) that fails the handle, so the peers
    hear of it rather than wait.
    """

    def __init__(
        self,
        spans: dict[int, tuple[int, int]],
        publish_owner: Callable[[int, np.ndarray], None],
        publisher: Executor,
        on_close: Callable[[BaseException | None], None],
        what: str,
    ) -> None:
        super().__init__(publisher, on_close, what)
        self._spans = spans  # owner -> (offset, nbytes) in a full payload
        self._publish_owner = publish_owner
        self._given: set[int] = set()

    def ready(self, owner: int, payload: np.ndarray) -> None:
        """Publish ``owner``'s chunk from ``payload`` (uint8, its parts' streams one after the
        other) on the publishing thread; this returns at once. Refused for an owner that is
        not one, one given before, or a payload of another size or type."""
        owner = int(owner)
        if owner not in self._spans:
            raise InputError(
                f"{self._what}: ready({owner}, ...) names no owner: the owners are 0 to "
                f"{len(self._spans) - 1}"
            )
        nbytes = self._spans[owner][1]
        byte_payload(
            payload,
            nbytes,
            f"{self._what}: ready({owner}, payload)",
            f"the streams of owner {owner}'s parts: info.gradient_put_plan.owner_span({owner})",
        )
        with self._lock:
            self._refuse_closed(f"ready({owner}, ...)")
            if owner in self._given:
                raise InputError(
                    f"{self._what}: ready({owner}, ...) came twice; give each owner's payload once"
                )
            self._given.add(owner)
            self._submit(self._publish_owner, owner, payload)

    def _leftover(self) -> BaseException | None:
        """Every owner must have been given: there is no vector to publish the rest from."""
        missing = sorted(set(self._spans) - self._given)
        if not missing:
            return None
        return UsageError(
            f"{self._what}: the stream was closed with no payload for owner(s) {missing}: "
            "give every owner's with ready(owner, payload) before closing"
        )

    def __enter__(self) -> EncodedStream:
        return self
