"""How a partition's gradient of a step leaves it: put at once, or streamed chunk by chunk
while backward still computes the rest, copied or published where it lies.

A put cuts the gradient into one chunk per owner and publishes chunk ``j`` for owner ``j``
(``Movements.scatter``). Two shortcuts keep copies off the step under plain BSP:

- with an exact codec, the own chunk is not published at all: the aggregate sums it
  straight from the caller's vector (``reduce``);
- the lent buffer (``buffer``, the handle's ``gradient_buffer()``), put with the raw
  codec, is published where it lies: same-host peers read it in place from shared memory,
  and it is read-only until the next ``get_weights`` has shown every peer summed it.

Through a host arena (``arena_steps.ArenaSteps``: plain BSP, one host) a put publishes
no blocks: the gradient is written (or, the lent buffer, found) in this partition's vector
of the arena, where the owners sum it from.

A stream (``stream``) publishes each owner's chunk once it is final (``stream.py``), and
under BSP starts fetching the own chunk from every peer at once, so the aggregate finds it
arriving. A gradient encoded elsewhere (a GPU) is ``encoded_puts.EncodedPuts``'s, which
shares this class's movements, guard, publishing thread and prefetch.
A ``SparseGradient`` (``put_touched``) travels as its touched elements alone
(``movement/touched.py``), under plain BSP with a lossless codec; through a host arena it
is written densely into the arena's gradient, which the owners read in place. Each put
asks the handle's ``step.StepState`` first, and tells it when done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from allreduce_param.engine.blocks.store import BlockKind
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.arena_steps import ArenaSteps
from allreduce_param.engine.movement.movements import Movements
from allreduce_param.engine.movement.sums import NonFiniteSum
from allreduce_param.engine.movement.touched import TouchedMoves, TouchedPut
from allreduce_param.engine.step import StepState
from allreduce_param.engine.stream import GradientStream
from allreduce_param.engine.vectors import (
    SparseGradient,
    float32_vector,
    sparse_gradient,
    writable_output,
)
from allreduce_param.errors import InputError


class Put(NamedTuple):
    """One put of a gradient, once checked: what its chunks are published with."""

    vector: np.ndarray
    version: int
    count: float
    residual: np.ndarray | None
    keep_own: bool  # the own chunk is summed from ``vector``, not published
    in_place: memoryview | None  # ``vector``'s bytes, to publish where they lie


class GradientPuts:
    """One partition's puts of its gradients through ``moves``, in the call order ``state``
    keeps (and under its strategy).

    ``guard()``: a context that a publish runs in, so that its error is raised as the
    root cause it follows from (the background owner's, if it failed). ``arena``: the
    step through the host arena, where there is one. Those, ``layout``, ``prefetch`` and
    ``publishing_thread`` are what ``encoded_puts.EncodedPuts`` shares with it.
    """

    def __init__(
        self,
        moves: Movements,
        layout: SliceLayout,
        state: StepState,
        guard: Callable[[], contextlib.AbstractContextManager],
        arena: ArenaSteps | None = None,
    ) -> None:
        self.moves = moves
        self.arena = arena
        self._peers = moves.peers
        self.partition_id = moves.partition_id
        self.layout = layout
        self.state = state
        self._strategy = state.strategy
        self.guard = guard
        self._lent: tuple[np.ndarray, memoryview] | None = None  # buffer(), and its bytes
        self._own: tuple[np.ndarray, float] | None = None  # the own chunk, summed from the vector
        self._prefetched: dict[int, list[Future]] | None = None  # a stream's own-chunk fetches
        self._publisher: ThreadPoolExecutor | None = None  # publishes streamed chunks
        self._touched_moves = TouchedMoves(moves)
        self._touched: TouchedPut | None = None  # a touched put's, for the step's aggregate

    def buffer(self) -> np.ndarray:
        """The lent gradient buffer (``ConnectedParameter.gradient_buffer``): a float32
        vector of ``size``, zeros at first, made at the first call, the same array after.

        Under BSP with the raw codec, a put of this array publishes it where it lies
        (shared memory that same-host peers read in place) instead of copying it, and
        makes it read-only until the next ``get_weights`` returns, when every peer has
        summed it; a step writes its gradient after ``get_weights`` anyway. Under other
        codecs and strategies it is copied at put like any vector. Through a host arena it
        is this partition's gradient vector there, put where it lies whatever the codec.
        """
        if self._lent is None and self.arena is not None:
            self._lent = (self.arena.arena.gradient(self.partition_id), None)
        if self._lent is None:
            room = self._peers.room(4 * self.layout.size)
            self._lent = (np.frombuffer(room, dtype=np.float32), room)
        return self._lent[0]

    def put(self, gradients, count: float, residual: np.ndarray | None) -> None:
        """``ConnectedParameter.put_gradients``: publish every owner's chunk now."""
        put = self._start(gradients, count, residual, "put_gradients")
        if self.arena is not None:
            self._put_in_arena(put)
            return
        with self.guard():
            self.moves.scatter(
                BlockKind.GRADIENT,
                put.version,
                put.vector,
                self.layout,
                put.count,
                put.residual,
                own=not put.keep_own,
                in_place=put.in_place,
            )
        self._published(put)

    def put_touched(
        self,
        gradient: SparseGradient,
        count: float,
        residual: np.ndarray | None,
        exchange: Callable[[np.ndarray], np.ndarray],
    ) -> None:
        """``ConnectedParameter.put_gradients`` of a ``SparseGradient``: its pairs, cut by
        owner, published for each peer owner once ``exchange`` (an exact allreduce) has told
        every partition the blocks' lengths (``TouchedMoves.scatter``)."""
        what = "put_gradients(SparseGradient)"
        version = self.state.check_put(what)
        where = f"{what} on partition {self.partition_id}"
        gradient = sparse_gradient(gradient, self.layout.size, where)
        codec = self.moves.codecs[BlockKind.GRADIENT]
        refusal = (
            "its strategy has a background owner, which sums dense chunks"
            if not self._strategy.inline_owner
            else f"its gradient codec {codec.name!r} is lossy"
            if codec.lossy
            else "its hosts sum within themselves first (topology hierarchical)"
            if self._peers.hierarchical
            else "residual= is for a lossy codec's error feedback"
            if residual is not None
            else "its slices have 2^32 elements or more (the pairs' indices are uint32)"
            if self.layout.length(0) >= 2**32
            else None
        )
        if refusal is not None:
            raise InputError(
                f"{where}: the touched elements alone travel only under plain BSP, with a "
                f"lossless codec and a flat topology, and here {refusal}: put the gradient as "
                "a dense float32 vector"
            )
        if not float(count) >= 0:
            raise InputError(f"{where}: count={count!r}; the sample count must be a number >= 0")
        if self.arena is not None:
            # one host: the owners read the arena's dense gradients at memory speed, with no
            # pairs to count or cut; the lent buffer takes the pairs (the same bits summed)
            dense = self.buffer()
            dense.fill(0)
            dense[gradient.indices] = gradient.values
            self.put(dense, count, None)
            return
        self.state.put_started(version)
        self._own = None
        with self.guard():
            self._touched = self._touched_moves.scatter(
                version, gradient, self.layout, float(count), exchange
            )
        self.state.put_done()

    def reduce(
        self,
        version: int,
        out: np.ndarray,
        divisor: Callable[[float], float | None],
        check: NonFiniteSum | None,
    ) -> float:
        """The step's aggregate (``ConnectedParameter.aggregate_gradient_partition``): this
        slice's chunks of ``version`` summed into ``out``, from the touched pairs
        (``TouchedMoves.reduce``), the peers' gradients in the host arena, or their blocks
        (with the own chunk and a stream's fetches, taken once): the summed counts."""
        touched, self._touched = self._touched, None
        if touched is not None:
            return self._touched_moves.reduce(version, self.layout, touched, out, divisor, check)
        if self.arena is not None:
            return self.arena.reduce(version, out, divisor=divisor, check=check)
        own, prefetched = self._own, self._prefetched
        self._own, self._prefetched = None, None
        return self.moves.reduce(
            BlockKind.GRADIENT,
            version,
            self.layout,
            out,
            divisor=divisor,
            check=check,
            own=own,
            pending=prefetched,
        )

    def stream(self, gradients, count: float, residual: np.ndarray | None) -> GradientStream:
        """``ConnectedParameter.stream_gradients``: a ``GradientStream`` that publishes each
        owner's chunk as soon as it is final, on the handle's publishing thread, while the
        computation goes on; under BSP (flat) this partition's own chunk also starts being
        fetched from every peer at once, so the aggregate finds it arriving. Its close
        publishes what is left, as a put would have: the same bits. An error inside the
        with-block fails the handle, as a failed put would."""
        put = self._start(gradients, count, residual, "stream_gradients")
        if self.arena is not None:  # nothing leaves early: the close puts it in the arena
            return self._arena_stream(put)
        self.prefetch(put.version)

        def publish(owner: int) -> None:
            with self.guard():
                self.moves.scatter_chunk(
                    BlockKind.GRADIENT,
                    put.version,
                    put.vector,
                    self.layout,
                    put.count,
                    owner,
                    put.residual,
                    put.in_place,
                )

        def closed(error: BaseException | None) -> None:
            self.state.stream_closed()
            if error is None:
                self._published(put)
            else:
                self.state.fail(error)

        self.state.stream_opened()
        return GradientStream(
            self.layout,
            self.moves.scatter_order(own=not put.keep_own),
            publish,
            self.publishing_thread(),
            closed,
            f"stream_gradients() on partition {self.partition_id}",
        )

    def prefetch(self, version: int) -> None:
        """Under BSP (flat), a stream's start: fetch the peers' chunks of the own slice as
        they come, so the aggregate finds them arriving."""
        if self._strategy.inline_owner and not self._peers.hierarchical:
            peers = [j for j in range(self.moves.partition_num) if j != self.partition_id]
            self._prefetched = self.moves.fetcher.fetch_own_chunks(
                BlockKind.GRADIENT, version, self.layout, peers
            )

    def publishing_thread(self) -> ThreadPoolExecutor:
        """The one thread a stream publishes its chunks and runs its close on, made at the
        first stream."""
        if self._publisher is None:
            self._publisher = ThreadPoolExecutor(
                1, thread_name_prefix=f"allreduce-publish-{self.partition_id}"
            )
        return self._publisher

    def _put_in_arena(self, put: Put) -> None:
        """Make ``put`` this partition's gradient in the host arena: the lent buffer stays
        unchanged (read-only) until the next ``get_weights``; of a vector of the caller's
        the peers' chunks are copied there, and its own chunk is summed where it lies by
        the aggregate (``ArenaSteps.put``)."""
        self._own = None  # the arena's reduce sums the own chunk, not Movements.reduce
        self.arena.put(put.vector, put.count, put.version, put.residual)
        if self._lent is not None and put.vector.ctypes.data == self._lent[0].ctypes.data:
            self._lent[0].flags.writeable = False  # the owners read it until our next get_weights
        self.state.put_done()

    def _arena_stream(self, put: Put) -> GradientStream:
        """A stream whose close puts the gradient in the host arena (``_put_in_arena``): the
        owners read it where it lies, so there is nothing to send early."""

        def closed(error: BaseException | None) -> None:
            self.state.stream_closed()
            if error is None:
                try:
                    self._put_in_arena(put)
                except BaseException as failure:
                    self.state.fail(failure)
                    raise
            else:
                self.state.fail(error)

        self.state.stream_opened()
        return GradientStream(
            self.layout,
            [],
            lambda owner: None,
            self.publishing_thread(),
            closed,
            f"stream_gradients() on partition {self.partition_id}",
        )

    def _start(self, gradients, count, residual, what: str) -> Put:
        """Check a put's order and arguments, and take its version: what both puts share."""
        version = self.state.check_put(what)
        size, where = self.layout.size, f"on partition {self.partition_id}"
        vector = float32_vector(gradients, size, f"{what}(gradients) {where}")
        if not float(count) >= 0:
            raise InputError(
                f"{what}(count={count!r}) {where}: the sample count must be a number >= 0"
            )
        if residual is not None:
            writable_output(residual, size, f"{what}(residual=) {where}")
        count = float(count)
        self.state.put_started(version)
        inline = self._strategy.inline_owner
        codec = self.moves.codecs[BlockKind.GRADIENT]
        # BSP with an exact codec: the own chunk is summed straight from the caller's vector
        # (hierarchical, a leader reads it from the store)
        keep_own = inline and not codec.lossy and not self._peers.hierarchical
        bounds = self.layout.bounds(self.partition_id)
        self._own = (vector[bounds], count) if keep_own else None
        lent = self._lent is not None and vector.ctypes.data == self._lent[0].ctypes.data
        in_place = lent and inline and codec.publishes_in_place and residual is None
        in_place = in_place and self._lent[1] is not None
        return Put(vector, version, count, residual, keep_own, self._lent[1] if in_place else None)

    def _published(self, put: Put) -> None:
        """Every chunk of ``put`` is out: the lent buffer, if published in place, stays
        unchanged until every peer has read it; the state is told."""
        if put.in_place is not None:
            self._lent[0].flags.writeable = False  # peers read it until our next get_weights
        self.state.put_done()

    def weights_read(self) -> None:
        """A ``get_weights`` returned: every peer has summed the last gradient published
        in place, and the lent buffer may be written again."""
        if self._lent is not None:
            self._lent[0].flags.writeable = True

    def close(self) -> None:
        """End the publishing thread, once its publishes are done."""
        if self._publisher is not None:
            self._publisher.shutdown(wait=True)
