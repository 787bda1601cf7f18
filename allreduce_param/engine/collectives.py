"""Collectives on any vector, beside the steps: allreduce (through the codec, or raw), exact
allreduce (row counts, norms, metrics), signals (a checkpoint written, a fit's stop), and
the typed collectives of any numeric dtype (reduce_scatter, all_gather, broadcast), which
``typed_collectives.py`` carries out.

Each is made of the four movements (``movement/movements.py``) and has block kinds of its
own, so it never meets a step's weights or gradients: a partition may call them between
any two calls of a step. Like the steps, every partition makes the same calls in the same
order; the n-th call meets the n-th on the others (its version counts them).
``ConnectedParameter`` hands this object out as ``p.collectives``: ``p.collectives.allreduce(v)``.
Its calls are the handle's (``step.handle_call``): refused once the handle failed or closed,
and one that fails partway fails the handle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import numpy as np

from allreduce_param.engine.blocks.store import EVERY_PARTITION, BlockKind
from allreduce_param.engine.host_collectives import HostAllreduce
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.movements import Movements
from allreduce_param.engine.step import StepState, handle_call
from allreduce_param.engine.strategy import WeightRead
from allreduce_param.engine.typed_collectives import (
    OPS,
    TypedCollectives,
    call_signature,
    describe_signature,
)
from allreduce_param.engine.vectors import float32_vector
from allreduce_param.errors import InputError


class Collectives:
    """One partition's collectives, through its ``Movements``, as calls of the handle whose
    call order ``state`` keeps."""

    def __init__(self, moves: Movements, state: StepState) -> None:
        self._moves = moves
        self._state = state
        self._peers = moves.peers
        self.partition_id = moves.partition_id
        self.partition_num = moves.partition_num
        self._allreduces = -1  # versions taken so far
        self._raw_allreduces = -1
        self._exact_allreduces = -1
        self._typed = TypedCollectives(moves)
        self._host: HostAllreduce | None = None  # made at the first allreduce_typed through it

    @handle_call
    def allreduce(
        self, values: np.ndarray, op: Literal["sum", "mean"] = "sum", raw: bool = False
    ) -> np.ndarray:
        """Sum (or average over partitions) a float32 vector of any length across partitions.

        A reduce-scatter then an all-gather, like a step, through the parameter's codec;
        ``raw=True``: through the raw codec whatever the parameter's, so that only the
        float32 sums round (the same bits as a raw parameter's allreduce: statistics a
        lossy codec must not change, such as the features' moments of a standardized fit).
        Every partition must call it with a vector of the same length and the same ``raw``;
        all get the same result. For counts, norms and metrics, which float32 would round,
        use ``allreduce_exact``.
        """
        if op not in ("sum", "mean"):
            raise InputError(f"allreduce(op={op!r}): op must be 'sum' or 'mean'")
        vector = float32_vector(values, None, f"allreduce(values) on partition {self.partition_id}")
        if raw:
            self._raw_allreduces += 1
            version = self._raw_allreduces
            inputs, outputs = BlockKind.RAW_REDUCE_INPUT, BlockKind.RAW_REDUCE_OUTPUT
        else:
            self._allreduces += 1
            version = self._allreduces
            inputs, outputs = BlockKind.REDUCE_INPUT, BlockKind.REDUCE_OUTPUT
        moves = self._moves
        layout = SliceLayout(vector.size, self.partition_num)
        moves.scatter(inputs, version, vector, layout, 1.0)
        reduced = np.empty(layout.length(self.partition_id), dtype=np.float32)
        moves.reduce(
            inputs,
            version,
            layout,
            reduced,
            divisor=(lambda total: self.partition_num) if op == "mean" else None,
        )
        moves.publish(outputs, version, reduced)
        out = np.empty(vector.size, dtype=np.float32)
        moves.gather(outputs, WeightRead(version, exact=True), layout, out)
        return out

    @handle_call
    def allreduce_exact(self, values) -> np.ndarray:
        """Sum small float64 vectors (row counts, norms, metrics) across partitions, exactly.

        Every partition's vector reaches every partition unrounded, whatever the codec, and
        each sums them in partition order in float64: all get the same bits, and whole
        numbers up to 2**53 stay exact. Every partition must call it with a vector of the
        same length. For large vectors use ``allreduce``: this moves N copies of each.
        """
        vector = np.ascontiguousarray(values, dtype=np.float64)
        if vector.ndim != 1 or vector.size == 0:
            raise InputError(
                f"allreduce_exact(values) on partition {self.partition_id}: expected a "
                f"non-empty 1-D vector, got shape {vector.shape}"
            )
        self._exact_allreduces += 1
        version = self._exact_allreduces
        bits = vector.view(np.float32)  # carried as its bytes: the raw codec copies, never rounds
        self._moves.publish(BlockKind.METADATA, version, bits)
        everyone = SliceLayout(bits.size * self.partition_num, self.partition_num)
        gathered = np.empty(everyone.size, dtype=np.float32)
        self._moves.gather(BlockKind.METADATA, WeightRead(version, exact=True), everyone, gathered)
        rows = gathered.view(np.float64).reshape(self.partition_num, vector.size)
        total = rows[0].copy()
        for row in rows[1:]:
            total += row
        return total

    @handle_call
    def reduce_scatter(
        self,
        values: np.ndarray,
        op: Literal["sum", "product", "min", "max"] = "sum",
        layout: SliceLayout | None = None,
    ) -> np.ndarray:
        """This partition's slice of the elementwise ``op`` of every partition's ``values``.

        ``values``: a 1-D numpy array of any numeric dtype (float16, ml_dtypes' bfloat16,
        float32, float64, signed and unsigned integers, bool), the same length and dtype on
        every partition; ``layout`` (default ``SliceLayout(values.size, N)``) says which
        slice is whose. The owner combines the chunks in partition order in the dtype itself
        (float64 stays float64; integers wrap as numpy's do; bool sums are "or"), so every
        run gives the same bits. The bytes travel raw, whatever the parameter's codec.
        Flat topology only (a hierarchical handle refuses it with a ``UsageError``); a
        partition whose length, dtype or op differs from its peers' gets a
        ``CollectiveMismatchError``."""
        return self._typed.reduce_scatter(values, op, layout)

    @handle_call
    def allreduce_typed(
        self,
        values: np.ndarray,
        op: Literal["sum", "product", "min", "max"] = "sum",
        out: np.ndarray | None = None,
        finish: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> np.ndarray:
        """The elementwise ``op`` of every partition's ``values`` (any numeric dtype, as
        ``reduce_scatter``'s), on every partition, the same bits everywhere: into ``out``
        (``values`` itself for an allreduce in place) or a new array. ``finish`` maps each
        owner's combined slice before it is shared (a mean's division).

        A ``reduce_scatter`` then an ``all_gather``; but where every partition is on one
        host and the handle has a host arena it has never stepped through
        (``torch_backend.process_group_parameter``'s), through that arena's shared memory
        instead (``host_collectives.py``: two signals per call, no blocks), for calls up to
        its capacity. A handle that did so takes no steps (``init`` is refused)."""
        vector = self._typed.checked(values, op, "allreduce_typed")
        if out is None:
            out = np.empty_like(vector)
        host = self._host_path()
        if host is not None and host.allreduce(
            vector, OPS[op], call_signature(vector.dtype, op, vector.size), out, finish
        ):
            return out
        layout = SliceLayout(vector.size, self.partition_num)
        mine = self._typed.reduce_scatter(vector, op, layout)
        if finish is not None:
            mine = finish(mine)
        return self._typed.all_gather(mine, layout, out)

    def allreduce_peers_arrived(self) -> bool:
        """Whether every other partition is already in this partition's next
        ``allreduce_typed`` through the host arena, waiting for it: a call made now finds
        them there. False where calls do not go through the arena, or the handle failed or
        closed. A caller that would only hand such a call to another thread and wait for it
        can run it itself (``torch_backend``'s process group)."""
        if self._state.failure is not None or self._peers.closed:
            return False
        host = self._host_path()
        return host is not None and host.peers_arrived()

    def _host_path(self) -> HostAllreduce | None:
        """The allreduce through the host arena, where this handle may use it (above)."""
        if self._host is None and self._peers.arena is not None and not self._state.initialised:
            self._state.collectives_in_arena = True
            self._host = HostAllreduce(self._peers.arena, describe_signature)
        return self._host

    @handle_call
    def all_gather(
        self, own: np.ndarray, layout: SliceLayout, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The whole vector of ``layout``, from each partition's slice of it (``own``: this
        partition's, ``values[layout.bounds(p.info.partition_id)]``, any numeric dtype, the
        same on every partition); every partition gets the same. Raw and flat as
        ``reduce_scatter``. ``out``: an array (``own``'s dtype, ``layout.size`` long) to
        gather into and return, sparing a copy of the result."""
        return self._typed.all_gather(own, layout, out)

    @handle_call
    def broadcast(self, values: np.ndarray, root: int) -> np.ndarray:
        """Partition ``root``'s ``values`` on every partition; each passes an array of the
        same length and dtype (any numeric one), whose contents count only on the root.
        The root sends each partition one piece, which they then all-gather. Raw and flat
        as ``reduce_scatter``."""
        return self._typed.broadcast(values, root)

    @handle_call
    def signal(self, version: int) -> None:
        """Tell every partition this one has done ``version`` of something (e.g. written a
        checkpoint); see ``wait_for_signals``. Versions must increase.

        Hierarchical, a leader's signal stands for its whole host: it first waits until
        every partition of its host has signalled ``version``, so that a waiter reads only
        its own host's signals and the leaders', not a connection to every partition."""
        if self._peers.is_leader:
            self._wait_for(version, self._peers.hosts.mates(self.partition_id))
        self._moves.publish(BlockKind.SIGNAL, version, np.ones(1, np.float32))

    @handle_call
    def wait_for_signals(self, version: int) -> None:
        """Wait until every partition has signalled ``version`` (or a later one)."""
        hosts = self._peers.hosts
        self._wait_for(
            version,
            sorted({*hosts.host(self.partition_id), *hosts.leaders})
            if self._peers.hierarchical
            else range(self.partition_num),
        )

    def _wait_for(self, version: int, sources: Iterable[int]) -> None:
        """Wait until each partition of ``sources`` has signalled ``version`` or a later one."""
        ones = SliceLayout(self.partition_num, self.partition_num)  # one value from each
        pending = self._moves.fetcher.fetch_all(
            self._peers.control,
            BlockKind.SIGNAL,
            WeightRead(version, exact=False),
            ones,
            EVERY_PARTITION,
            sources=sources,
        )
        for futures in pending.values():
            futures[-1].result()
