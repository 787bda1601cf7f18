"""StepState: where one partition's handle is in its steps, and which call may come next.

A ``ConnectedParameter`` is called in a fixed order (``init``; then each step
``get_weights``, ``put_gradients``, and under plain BSP ``aggregate_gradient_partition``
and ``send_weight_partition``), and every partition makes the same calls, so the n-th call
of a kind on one partition meets the n-th on the others: the version numbers count them.
This class holds that order and those counts, and nothing else: each call of the handle
asks it first (``check_...``: raises ``UsageError`` naming what must come first, and
changes nothing) and tells it once done (a named transition). The blocks themselves move
elsewhere (``movement/``).
"""

from __future__ import annotations

import functools

import numpy as np

from allreduce_param.engine.strategy import Strategy, WeightRead
from allreduce_param.errors import InputError, UsageError

#: A BSP step, in the words the errors use.
BSP_STEP = (
    "A step is get_weights, put_gradients, aggregate_gradient_partition, update, "
    "send_weight_partition"
)


def handle_call(method):
    """A public call of a handle or of an object it hands out (its collectives, its
    background owner): refused once the handle failed or closed; one that fails partway
    (anything but a refusal of its arguments or order) marks the handle failed. The
    object keeps the handle's ``StepState`` as ``_state`` and its ``PeerGroup`` as ``_peers``."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        self._state.check_usable(f"{method.__name__}()", self._peers.closed)
        try:
            return method(self, *args, **kwargs)
        except (InputError, UsageError):
            raise  # refused before it changed anything
        except BaseException as error:
            self._state.fail(error)
            raise

    return call


class StepState:
    """The call order of one partition's handle under ``strategy``, and the versions it takes.

    ``weight_version``: the weights this partition last published; ``gradient_version``:
    its last gradient's; ``last_read``: the lowest weight version the last ``get_weights``
    took; ``puts``: gradients put so far, counted from the first step; ``start``: the
    global step the fit starts at (past a checkpoint when resumed).
    """

    def __init__(self, partition_id: int, strategy: Strategy) -> None:
        self.partition_id = partition_id
        self.strategy = strategy
        self.initialised = False
        self.collectives_in_arena = False  # allreduce_typed went through the host arena
        self.start = 0
        self.weight_version = -1
        self.gradient_version = -1
        self.last_read = -1
        self.puts = 0
        self.failure: BaseException | None = None  # what made a call fail partway
        self._gradient_pending = False  # BSP: a put waits for its aggregate
        # sends since the last aggregate: a second one could rewrite a version a peer still reads
        self._sends_since_aggregate = 0
        self._stream_open = False
        self._owner_started = False
        self._finished = False  # finish_updates() returned: reads take the final weights

    def _on(self, what: str) -> str:
        return f"{what} on partition {self.partition_id}"

    # ---- the handle as a whole ----------------------------------------------------------

    def check_usable(self, what: str, closed: bool) -> None:
        """Refuse any call once the handle failed partway or closed."""
        if self.failure is not None:
            raise UsageError(
                f"{self._on(what)}: this handle failed in an earlier call "
                f"({type(self.failure).__name__}: {self.failure}); its blocks and versions are in "
                "an unknown state, so it takes no more calls: leave its with-block (or close it) "
                "and connect again"
            )
        if closed:
            raise UsageError(f"{self._on(what)}: the handle is closed")

    def fail(self, error: BaseException) -> None:
        """A call failed partway (``error``: the first such failure is kept)."""
        if self.failure is None:
            self.failure = error

    def require_init(self, what: str) -> None:
        if not self.initialised:
            raise UsageError(f"{self._on(what)} came before init(weights)")

    def require_inline(self, what: str) -> None:
        """Refuse a call of BSP's own loop under a strategy with a background owner."""
        if not self.strategy.inline_owner:
            backups = " with backup workers" if self.strategy.backup_workers else ""
            raise UsageError(
                f"{what} is BSP's; under {self.strategy.name!r}{backups} the background owner "
                "that serve_updates() starts aggregates and publishes"
            )

    # ---- the weights ----------------------------------------------------------------------

    def check_init(self, step: object) -> None:
        """Before ``init(weights, step)``: once, with a whole ``step`` >= 0."""
        if self.initialised:
            raise UsageError(f"init() was called twice on partition {self.partition_id}")
        if self.collectives_in_arena:
            raise UsageError(
                f"init() on partition {self.partition_id}: this handle's allreduce_typed calls "
                "went through its host arena, where the steps would go too; take steps on a "
                "parameter of their own"
            )
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise InputError(f"{self._on(f'init(step={step!r})')}: a whole number >= 0")

    def init(self, step: int) -> int:
        """``init`` at global ``step``: the weight version it publishes."""
        self.initialised = True
        self.start = self.puts = int(step)
        self.last_read = self.gradient_version = self.start - 1
        self.weight_version = self.strategy.weight_version(self.start, 0)
        return self.weight_version

    def send(self) -> int:
        """``send_weight_partition``: at most one per aggregate (the first may follow
        ``init``); the version it publishes."""
        self.require_init("send_weight_partition()")
        self.require_inline("send_weight_partition()")
        if self._sends_since_aggregate >= 1:
            raise UsageError(
                f"send_weight_partition() was called twice on partition {self.partition_id} with "
                "no aggregate_gradient_partition() in between: a peer may still be reading the "
                f"version it would overwrite. {BSP_STEP}"
            )
        self._sends_since_aggregate += 1
        self.weight_version += 1
        return self.weight_version

    def weight_read(self, final_steps: int | None) -> WeightRead:
        """Which weights ``get_weights`` takes: the step's under BSP, the newest the strategy
        allows under the others; after ``finish_updates`` (``final_steps``: the owner's
        steps), the final ones."""
        self.require_init("get_weights()")
        if self._finished:
            return self.strategy.final_read(final_steps)
        if self.strategy.inline_owner:
            return WeightRead(self.weight_version, exact=True)
        return self.strategy.weight_read(self.puts, self.last_read)

    def weights_read(self, lowest_version: int) -> None:
        """``get_weights`` took slices of ``lowest_version`` and later."""
        self.last_read = lowest_version

    # ---- the gradients --------------------------------------------------------------------

    def check_put(self, what: str) -> int:
        """Before a put (``what``: ``put_gradients`` or ``stream_gradients``): the version its
        gradient takes. Under BSP one per step, after the last one's aggregate; under ssp
        and asp the count of puts; with backup workers the weights read before it."""
        if self._stream_open:
            raise UsageError(
                f"{self._on(f'{what}()')} came while the gradient stream of the step is still "
                "open: close it (leave its with-block) first"
            )
        if self._gradient_pending:
            raise UsageError(
                f"{what}() was called twice on partition {self.partition_id} without "
                "aggregate_gradient_partition() in between"
            )
        if self.strategy.inline_owner:
            return self.gradient_version + 1
        if self.strategy.asynchronous:
            return self.puts
        if self.last_read <= self.gradient_version:
            raise UsageError(
                f"{self._on(f'{what}()')} came without a get_weights() before it: with backup "
                "workers a gradient belongs to the weights it was computed from"
            )
        return self.last_read

    def put_started(self, version: int) -> None:
        """A put of ``version`` (``check_put``'s) begins publishing."""
        self.gradient_version = version

    def stream_opened(self) -> None:
        self._stream_open = True

    def stream_closed(self) -> None:
        self._stream_open = False

    def put_done(self) -> None:
        """Every chunk of the put is published: under BSP its aggregate comes next."""
        self.puts += 1
        self._gradient_pending = self.strategy.inline_owner

    def check_aggregate(self) -> int:
        """Before ``aggregate_gradient_partition``: after the step's put, its stream closed;
        the gradient version it sums."""
        what = "aggregate_gradient_partition()"
        self.require_inline(what)
        if self._stream_open:
            raise UsageError(
                f"{self._on(what)} came while the step's gradient stream is still open: close "
                "it (leave its with-block) first"
            )
        if not self._gradient_pending:
            raise UsageError(f"{self._on(what)} came before put_gradients() for this step")
        return self.gradient_version

    def aggregated(self) -> None:
        """The step's gradients are summed: the next send, and the next put, may come."""
        self._gradient_pending = False
        self._sends_since_aggregate = 0

    # ---- the background owner -------------------------------------------------------------

    def start_owner(self) -> None:
        """``serve_updates``: once, after ``init``, under a strategy with a background owner."""
        self.require_init("serve_updates()")
        if self.strategy.inline_owner:
            raise UsageError(
                "serve_updates() is for the strategies with a background owner; under plain "
                "BSP a step calls aggregate_gradient_partition and send_weight_partition itself"
            )
        if self._owner_started:
            raise UsageError(f"serve_updates() was called twice on partition {self.partition_id}")
        self._owner_started = True

    def check_finish(self) -> None:
        """Before ``finish_updates``: the owner was started."""
        if not self._owner_started:
            raise UsageError("finish_updates() came before serve_updates()")

    def finished(self) -> None:
        """Every owner has applied every gradient: reads take the final weights."""
        self._finished = True
