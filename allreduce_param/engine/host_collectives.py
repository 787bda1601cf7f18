"""HostAllreduce: an allreduce of any dtype between the partitions of one host, through the
host arena's shared memory, with no blocks, no requests and no thread of its own.

A ``torch.distributed`` process group (DDP's gradient buckets) calls an allreduce for every
bucket of every step; through blocks each costs a publish, a request per peer and per part,
landing buffers and a thread handoff per fetch. On one host the partitions can instead share
one segment: the host arena (``blocks/arena.py``, made by partition 0 at ``connect``), here
used not for a step but as N input vectors and one result vector, each of the arena's
capacity in bytes. The call, version ``t``:

1. every partition copies its values into its own input vector (all but its own slice,
   which only it reads, from the values themselves) and publishes its ``GRADIENT`` word of
   ``t`` with the call's signature (dtype, op, length) as the count;
2. once every word is there, every signature is compared (a partition whose call differs is
   a ``CollectiveMismatchError`` naming it, on every partition); each partition combines its
   slice of the result from every input vector, in partition order (the bits the typed
   collectives' ``reduce_scatter`` gives), writes it into the result vector and publishes
   its ``WEIGHT`` word of ``t``;
3. each copies the result out, a slice at a time as its owner publishes it (its own first).

numpy combines and copies whole slices, so the GIL is released while the bytes move. A
call whose values do not fit the arena publishes only its signature in step 1 and returns
False: every partition then knows its peers agree, and the caller takes the blocks' path.

Why nothing is overwritten while read: a partition writes its input of ``t + 1`` only after
its wait for every slice of ``t``, which each owner publishes after it has read every input
of ``t``; an owner writes its slice of ``t + 1`` only after its wait for every input of
``t + 1``, which each partition publishes after it copied the result of ``t`` out.

A peer that dies, fails or closes while another waits is a ``PeerLostError`` at once (its
pidfd, its state in the arena), one that never comes a ``FetchTimeoutError`` at the handle's
timeout: the arena's waits (``arena_signals.py``). A call that fails here ends this
partition in the arena with the reason, so its peers hear why instead of waiting.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from allreduce_param.engine.blocks.arena import HostArena
from allreduce_param.engine.blocks.arena_signals import GRADIENT, WEIGHT
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.errors import CollectiveMismatchError


class HostAllreduce:
    """Allreduces of one partition through its host's ``arena`` (every partition of the
    handle on that host). ``describe`` puts a call's signature in words, for errors."""

    def __init__(self, arena: HostArena, describe: Callable[[int], str]) -> None:
        self._arena = arena
        self._describe = describe
        self.partition_id = arena.partition_id
        self.partition_num = arena.partition_num
        #: the largest call, in bytes, that goes through the arena
        self.capacity = 4 * arena.layout.size
        self._calls = -1  # versions taken so far

    def allreduce(
        self,
        values: np.ndarray,
        combine: np.ufunc,
        signature: int,
        out: np.ndarray,
        finish: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> bool:
        """Combine ``values`` (contiguous, 1-D) with every partition's by ``combine``, in
        partition order, into ``out`` (as long, the same dtype; may be ``values``);
        ``finish`` maps this partition's combined slice before it is shared (the mean's
        division). False, with nothing written, when the call is larger than the arena
        (every partition then agrees so: the caller uses blocks)."""
        self._calls += 1
        version = self._calls
        arena = self._arena
        result = target = pieces = None  # views of the arena: none kept in a failure's traceback
        try:
            fits = values.nbytes <= self.capacity
            layout = SliceLayout(values.size, self.partition_num)
            mine = layout.bounds(self.partition_id)
            if fits:  # the peers' slices only: this partition sums its own from ``values``
                self._copy_in(values, mine)
            arena.publish(GRADIENT, version, count=float(signature))
            arena.wait(GRADIENT, version)
            self._check(signature)
            if not fits:
                return False
            result = self._vector(arena.weights, values)
            target = result[mine]
            pieces = [
                values[mine] if source == self.partition_id else
                self._vector(arena.gradient(source), values)[mine]
                for source in range(self.partition_num)
            ]  # fmt: skip
            if len(pieces) == 1:
                np.copyto(target, pieces[0])
            else:  # the one order, partition order; the first two at once, not copied first
                with np.errstate(over="ignore", invalid="ignore"):  # inf, NaN as numpy's
                    combine(pieces[0], pieces[1], out=target)
                    for index in range(2, len(pieces)):
                        combine(target, pieces[index], out=target)
            if finish is not None:
                np.copyto(target, finish(target))
            arena.publish(WEIGHT, version)
            for step in range(self.partition_num):  # own slice first, each as it is there
                owner = (self.partition_id + step) % self.partition_num
                if step:
                    arena.wait(WEIGHT, version, partitions=(owner,))
                np.copyto(out[layout.bounds(owner)], result[layout.bounds(owner)])
            return True
        except BaseException as error:
            result = target = pieces = None  # noqa: F841 - the arena unmaps with its last view
            arena.end(f"{type(error).__name__}: {error}")  # its peers hear why at once
            raise

    def peers_arrived(self) -> bool:
        """Whether every other partition has already published its values of the next call:
        a call made now waits for none of them to come, only for the owners' sums. (Read
        between calls, on the thread that makes them.)"""
        version = self._calls + 1
        return all(
            self._arena.version(GRADIENT, partition) == version
            for partition in range(self.partition_num)
            if partition != self.partition_id
        )

    def _copy_in(self, values: np.ndarray, mine: slice) -> None:
        """``values`` but this partition's slice ``mine`` into its input vector."""
        own = self._vector(self._arena.gradient(self.partition_id), values)
        np.copyto(own[: mine.start], values[: mine.start])
        np.copyto(own[mine.stop :], values[mine.stop :])

    def _vector(self, words: np.ndarray, like: np.ndarray) -> np.ndarray:
        """The first ``like.nbytes`` of the arena's float32 ``words``, as ``like``'s dtype."""
        return words.view(np.uint8)[: like.nbytes].view(like.dtype)

    def _check(self, signature: int) -> None:
        """Raise if a partition's call differs from this one's (its published signature)."""
        for partition in range(self.partition_num):
            theirs = int(self._arena.count(partition))
            if theirs != signature:
                raise CollectiveMismatchError(
                    f"allreduce on partition {self.partition_id}: partition {partition} called "
                    f"it with {self._describe(theirs)}, this partition with "
                    f"{self._describe(signature)}; every partition must pass the same length, "
                    "dtype and op"
                )
