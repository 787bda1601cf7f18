"""The background owner: a partition's slice kept up to date from every partition's
gradients, in a thread of its own, under every strategy but plain BSP.

A partition that computes slowly is still a prompt owner: its thread takes the peers'
gradients for its slice as they come, whatever the partition's own loop is doing. What it
waits for is the strategy's rule (``strategy.py``):

- backup workers: step by step, the gradients of the first ``N - b`` partitions to finish
  the step, as the owner of slice 0 sees them arrive and publishes (a choice block);
- ssp and asp: every gradient of every partition, in order, as it arrives.

It fetches through a channel of its own (its own connections, and fetches that wait for a
producer without holding a thread: ``channels.Channel``'s idle waits), at most one request
per producer at a time, so a block it has fetched stays valid until it has summed it. After
each update it publishes the slice. An error stops the owner and closes the
partition's store with the reason, which the partition's next call then raises.

The handle hands out ``Background`` as ``p.background``: ``serve_updates`` starts the owner,
``finish_updates`` waits for it, ``updates`` tells what it took.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from allreduce_param.engine.blocks.store import EVERY_PARTITION, BlockKind
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.step import StepState, handle_call
from allreduce_param.engine.strategy import Strategy, WeightRead
from allreduce_param.errors import UsageError

if TYPE_CHECKING:
    from allreduce_param.engine.movement.movements import Movements
    from allreduce_param.engine.movement.sums import NonFiniteSum


@contextlib.contextmanager
def owner_failure_first(owner: BackgroundOwner | None):
    """A call that fails after the background ``owner`` failed raises the owner's error: the
    root cause, which the call's own error (a store closed, a peer gone) only follows from."""
    try:
        yield
    except Exception as error:
        failure = None if owner is None else owner.error
        if failure is not None and failure is not error:
            raise failure from error
        raise


class Background:
    """A partition's background owner, as its handle hands it out (``p.background``): its
    calls are the handle's (``step.handle_call``), in the order ``state`` keeps.

    Made by ``ConnectedParameter`` with its ``moves``, the slice's ``layout``, where the
    slice's gradient is summed (``gradient``), how to find the owned slice once ``init``
    has made it (``weight()``), what checks a summed gradient for NaN/Inf (``check``), and
    ``barrier(values)``: an exact allreduce every partition makes once its owner is done.
    """

    def __init__(
        self,
        moves: Movements,
        state: StepState,
        layout: SliceLayout,
        gradient: np.ndarray,
        weight: Callable[[], np.ndarray],
        check: Callable[[int], NonFiniteSum | None],
        barrier: Callable[[np.ndarray], np.ndarray],
    ) -> None:
        self._moves = moves
        self._peers = moves.peers
        self._state = state
        self._layout = layout
        self._gradient = gradient
        self._weight = weight
        self._check = check
        self._barrier = barrier
        self._owner: BackgroundOwner | None = None

    @handle_call
    def serve_updates(
        self,
        update: Callable[[np.ndarray, np.ndarray, int], None],
        steps: int,
        on_steps_done: Callable[[int], None] | None = None,
    ) -> None:
        """Start the background owner (``BackgroundOwner``; once, after ``init``, under a
        strategy other than plain BSP): it takes this slice's gradients as the strategy
        allows, calls ``update(gradient, weight_partition, step)`` to change the slice in
        place, and publishes it. ``steps``: the fit's global steps, the first being
        ``init``'s; ``on_steps_done(k)`` follows the update after which the slice holds
        every partition's steps before k.
        """
        self._state.start_owner()
        self._owner = BackgroundOwner(
            self._moves, self._state.strategy, self._layout, self._weight(), self._gradient,
            self._state.start, update, int(steps), on_steps_done, check=self._check,
        )  # fmt: skip

    @handle_call
    def finish_updates(self) -> None:
        """Wait until every owner has applied every partition's gradients (after
        ``serve_updates``); afterwards ``get_weights`` gives the final weights. Ends with
        one exact allreduce as a barrier.
        """
        self._state.check_finish()
        self._owner.join()
        with self.failure_first():
            self._barrier(np.zeros(1))  # every owner has published its last
        self._state.finished()

    @property
    def updates(self) -> list[Update]:
        """The background owner's updates so far: which partitions' gradients each one took."""
        return [] if self._owner is None else list(self._owner.updates)

    # ---- for the handle -----------------------------------------------------------------

    @property
    def final_steps(self) -> int | None:
        """The fit's steps, once the owner was started: what the final weights' read takes."""
        return None if self._owner is None else self._owner.steps

    def failure_first(self) -> contextlib.AbstractContextManager:
        """A context in which an error raises the owner's first, if it failed."""
        return owner_failure_first(self._owner)

    def stop(self) -> None:
        """End the owner's thread (the handle is closing), raising nothing."""
        if self._owner is not None:
            self._owner.join(raise_error=False)


@dataclass(frozen=True)
class Update:
    """One update of the owned slice: its step, whose gradients it took, and their rows."""

    step: int
    sources: tuple[int, ...]
    count: float


class BackgroundOwner:
    """Runs the owner's side of one partition's slice until every partition's ``steps``
    gradients are in (``steps``: the fit's global steps, the first being ``start``; every
    partition puts a gradient for each, with backup workers for those it does not skip).

    Made by ``ConnectedParameter.background.serve_updates``: ``weight`` and ``gradient`` are the
    handle's owned slice and its gradient room, ``start`` the fit's first step.
    ``update(gradient, weights, step)`` changes the owned slice in place (``gradient``: the
    exact mean over the rows of the gradients taken; ``step``: 0-based, for learning-rate
    schedules). ``on_steps_done(k)`` follows each update after which the slice holds every
    partition's steps before k (ssp, asp: its clock reached k), for each k; both run on the
    owner's thread. ``check(version)`` gives what checks a summed gradient for NaN/Inf
    (None: they are allowed). A channel of its own fetches the gradients; the peer group's
    control channel, with backup workers on every owner but the chooser, the chooser's
    choices.
    """

    def __init__(
        self,
        moves: Movements,
        strategy: Strategy,
        layout: SliceLayout,
        weight: np.ndarray,
        gradient: np.ndarray,
        start: int,
        update: Callable[[np.ndarray, np.ndarray, int], None],
        steps: int,
        on_steps_done: Callable[[int], None] | None = None,
        check: Callable[[int], NonFiniteSum | None] = lambda version: None,
    ) -> None:
        self.steps = steps
        self.updates: list[Update] = []
        self._moves = moves
        self._partition_id = moves.partition_id
        self._partition_num = moves.partition_num
        self._strategy = strategy
        self._layout = layout
        self._weight = weight
        self._gradient = gradient
        self._start = start
        # waiting idle: the owner takes whichever gradient comes first, and a source's next one
        # may wait for weights this owner publishes only after another source's (ssp's clock),
        # so a fetch that held a thread while it waited could keep a ready one queued for good
        peers = moves.peers
        self._channel = peers.channel(peers.fetch_threads, "owner", idle_waits=True)
        self._control = moves.peers.control  # backup workers: where the chooser's choices come from
        self._update = update
        self._on_steps_done = on_steps_done or (lambda steps_done: None)
        self._check = check
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"allreduce-owner-{self._partition_id}"
        )
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """What stopped the owner, if anything did: the root cause of its partition's failure."""
        return self._error

    def join(self, raise_error: bool = True) -> None:
        """Wait for the owner to finish (every wait inside is bounded by the timeout, and
        closing the partition's store ends them); raise its error, if it had one."""
        self._thread.join()
        if raise_error and self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            if self._strategy.backup_workers:
                self._steps_with_backups()
            else:
                self._arrivals()
        except BaseException as error:
            self._error = error
            self._moves.peers.store.close(
                f"partition {self._partition_id}'s owner failed: {type(error).__name__}: {error}"
            )

    def _fetch(self, source: int, version: int, exact: bool) -> list[Future]:
        """Start fetching ``source``'s gradient for this slice: the part futures."""
        pending = self._moves.fetcher.fetch_all(
            self._channel,
            BlockKind.GRADIENT,
            WeightRead(version, exact),
            self._layout,
            destination=self._partition_id,
            sources=[source],
            follow_first=True,
        )
        return pending[source]

    def _apply(self, pending: dict[int, list[Future]], sources: list[int], step: int) -> float:
        """Sum the fetched gradients of ``sources`` in their order, update the slice with their
        mean; their rows (a zero total changes nothing)."""
        gradient = self._gradient
        count = self._moves.sum(
            pending,
            sources,
            gradient,
            divisor=lambda total: total if total > 0 else None,
            check=self._check(step),
        )
        if count > 0:
            self._update(gradient, self._weight, step)
        self.updates.append(Update(step, tuple(sources), count))
        return count

    def _arrivals(self) -> None:
        """ssp, asp: apply every partition's gradients in order, as they arrive."""
        partitions, start = self._partition_num, self._start
        taken = [start] * partitions
        pending = (
            {source: self._fetch(source, start, exact=True) for source in range(partitions)}
            if start < self.steps
            else {}
        )
        while pending:
            wait([futures[-1] for futures in pending.values()], return_when=FIRST_COMPLETED)
            arrived = [source for source in sorted(pending) if pending[source][-1].done()]
            self._apply(pending, arrived, sum(taken) // partitions)
            clock = min(taken)
            for source in arrived:
                taken[source] += 1
                del pending[source]
            version = self._strategy.weight_version(min(taken), len(self.updates))
            self._moves.publish(BlockKind.WEIGHT, version, self._weight)
            for steps_done in range(clock + 1, min(taken) + 1):
                self._on_steps_done(steps_done)
            for source in arrived:
                if taken[source] < self.steps:
                    pending[source] = self._fetch(source, taken[source], exact=True)

    def _steps_with_backups(self) -> None:
        """bsp with backup workers: each step takes the first N - b of its gradients to arrive
        at the chooser, which publishes its choice for the other owners."""
        partitions = self._partition_num
        choice = np.zeros(partitions, np.float32)
        requests: dict[int, tuple[int, list[Future]]] = {}  # source -> (step asked at, parts)
        for step in range(self._start, self.steps):
            for source in range(partitions):
                if source not in requests:
                    requests[source] = (step, self._fetch(source, step, exact=False))
            if self._partition_id == Strategy.CHOOSER:
                taken = self._first(requests, step, self._strategy.gradients_per_update(partitions))
                choice[:] = 0
                choice[taken] = 1
                self._moves.publish(BlockKind.CHOICE, step, choice)
            else:
                pending = self._moves.fetcher.fetch_all(
                    self._control,
                    BlockKind.CHOICE,
                    WeightRead(step, exact=True),
                    SliceLayout(partitions, 1),
                    EVERY_PARTITION,
                    sources=[Strategy.CHOOSER],
                )
                _, _, chosen, recheck = pending[Strategy.CHOOSER][0].result()
                taken = [int(source) for source in np.flatnonzero(chosen)]
                if recheck is not None:
                    recheck()
                for source in taken:
                    self._of_step(requests, source, step)
            self._apply({source: requests[source][1] for source in taken}, taken, step)
            for source in taken:
                del requests[source]
            self._moves.publish(BlockKind.WEIGHT, step + 1, self._weight)
            self._on_steps_done(step + 1)

    def _first(
        self, requests: dict[int, tuple[int, list[Future]]], step: int, need: int
    ) -> list[int]:
        """The chooser: the first ``need`` partitions whose gradient of ``step`` arrives."""
        taken: list[int] = []
        while len(taken) < need:
            wait(
                [parts[-1] for source, (_, parts) in requests.items() if source not in taken],
                return_when=FIRST_COMPLETED,
            )
            for source in sorted(requests):
                if source in taken or not requests[source][1][-1].done():
                    continue
                version = self._of_step(requests, source, step, block=False)
                if version == step and len(taken) < need:
                    taken.append(source)
                elif version == step:  # one more than the step needs: dropped
                    del requests[source]
        return sorted(taken)

    def _of_step(
        self,
        requests: dict[int, tuple[int, list[Future]]],
        source: int,
        step: int,
        block: bool = True,
    ) -> int | None:
        """``source``'s request, made ``step``'s if it was asked at an earlier step and brought
        an older gradient (late: dropped); with ``block``, until it brings ``step``'s."""
        while True:
            asked, parts = requests[source]
            version = self._version(parts, late=asked < step)
            if version is not None and version > step:
                raise UsageError(
                    f"partition {source} published a gradient for step {version} while "
                    f"partition {self._partition_id}'s owner is at step {step}"
                )
            if version == step:
                return version
            requests[source] = (step, self._fetch(source, step, exact=False))
            if not block:
                return None

    @staticmethod
    def _version(parts: list[Future], late: bool) -> int | None:
        """The version a finished fetch brought; None for a failed one asked at an earlier step
        (a late block may be replaced while it is read: it would be dropped anyway)."""
        try:
            return parts[-1].result()[0]
        except Exception:
            if late:
                return None
            raise
