"""GradientStream: a gradient published chunk by chunk while backward still computes the rest.

A model's backward pass finishes its gradient one tensor at a time, last layer first. A
``GradientStream`` is told each range of the gradient vector as it becomes final
(``ready(start, stop)``); as soon as every element of owner ``j``'s chunk is final, that
chunk is published for ``j`` on a publishing thread, so owner ``j`` fetches and sums it
while this partition's backward goes on: the reduce-scatter overlaps the rest of backward,
as DDP's gradient buckets do. Here the buckets are the owners' chunks, which the block
store moves anyway, so the result is the same bits as publishing the whole vector at once.

``ConnectedParameter.stream_gradients`` makes one; this module knows nothing of versions or
codecs: it is told how to publish one owner's chunk.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

from allreduce_param.engine.layout import SliceLayout
from allreduce_param.errors import InputError, UsageError


class GradientStream:
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
        self._layout = layout
        self._owners = owners  # in the order to publish those left at close
        self._publish_chunk = publish_chunk
        self._publisher = publisher
        self._on_close = on_close
        self._what = what
        self._waiting = {owner: layout.length(owner) for owner in owners}  # elements not yet final
        self._ranges: list[tuple[int, int]] = []  # reported so far, none empty: disjoint, by start
        self._published: list[Future] = []
        self._lock = threading.Lock()
        self._closed = False

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
            if self._closed:
                raise UsageError(
                    f"{self._what}: ready({start}, {stop}) came after the stream was closed"
                )
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
                    self._submit(owner)

    def _submit(self, owner: int) -> None:
        """Publish ``owner``'s chunk on the publishing thread; under the lock."""
        del self._waiting[owner]
        self._published.append(self._publisher.submit(self._publish_chunk, owner))

    def close(self) -> None:
        """Publish what is left, wait for every publish, and raise the first error one met.
        The gradient vector must be final in full by now."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for owner in [owner for owner in self._owners if owner in self._waiting]:
                self._submit(owner)
        failure = None
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

    def __enter__(self) -> GradientStream:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc is None:
            self.close()
        else:
            self.abandon(exc)
