"""Update strategies: which weight versions a step reads, what an owner waits for, and how
many versions of each block the store keeps. Each rule is written here and nowhere else.

Every partition is a worker (it reads the weights, computes a gradient on its rows and
publishes it) and an owner (it turns the gradients of its slice into the slice's next
weights). A strategy is a rule about block versions on both sides:

``bsp``
    Step ``t`` reads weight version ``t`` of every slice. An owner waits for every
    partition's gradient ``t``, updates once and publishes version ``t + 1``. The owner
    runs inline, in the worker's own loop (aggregate, update, send), so with a lossless
    codec every partition ends bit-identical and a fit equals single-process mini-batch
    training.

``bsp`` with ``backup_workers=b``
    Each step takes the gradients of the first ``N - b`` partitions to finish it, as the
    owner of slice 0 sees them arrive (it publishes that choice, so every slice takes the
    same rows); each owner sums them in partition order, divides by their rows, updates
    once and publishes the next version; the rest are dropped. A worker reads the newest
    weights past the version it read last, so a straggler skips ahead instead of piling up
    late work; its gradient carries the version it read, and an owner takes only gradients
    of its current step. Owners run in a background thread, so a slow partition's own
    compute never holds up its slice.

``ssp`` with ``staleness=s``
    A partition's gradients are versioned by its own step count. An owner applies every
    gradient of every partition, in order, as it arrives: one update per batch of arrivals,
    the exact mean over their rows. A weight version carries the owner's *clock*: how many
    steps of every partition it has applied. Step ``t`` reads the newest slice whose clock
    is at least ``t - s``, so no partition runs more than ``s`` steps ahead of the slowest.

``asp``
    As ``ssp`` without the bound: step ``t`` reads the newest slice there is.

Under ``ssp`` and ``asp`` a gradient waits in its producer's store until its owner takes
it; a producer runs at most ``GRADIENT_BACKLOG`` versions ahead of an owner's reads, so
memory stays bounded (owners work in a background thread, so that wait is short).
"""

from __future__ import annotations

from dataclasses import dataclass

from allreduce_param.engine.blocks.store import BlockKind
from allreduce_param.errors import ConfigurationError

STRATEGIES = ("bsp", "ssp", "asp")

#: How partitions on several hosts exchange (``AllReduceParameter(topology=...)``): each host
#: first sums its own and one partition per host exchanges for it, or every partition with
#: every other; "auto" is the first where it changes anything (plain BSP, several hosts).
TOPOLOGIES = ("auto", "hierarchical", "flat")

#: ssp/asp: how many gradient versions a partition may publish that an owner has not yet
#: asked for; one more waits. Two let the owner read one while the next is encoded.
GRADIENT_BACKLOG = 2

#: ssp/asp: a weight version is ``clock << CLOCK_SHIFT | updates``, so that "the newest
#: version at least ``clock << CLOCK_SHIFT``" is a plain store read.
CLOCK_SHIFT = 32


@dataclass(frozen=True)
class WeightRead:
    """Which version of each weight slice a read takes: exactly ``version``, or the newest
    one at or above it."""

    version: int
    exact: bool


@dataclass(frozen=True)
class Strategy:
    """How the partitions synchronise; made on the driver, checked there (see the module)."""

    name: str = "bsp"
    staleness: int | None = None
    backup_workers: int = 0

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ConfigurationError(
                f"strategy={self.name!r} is not one of {', '.join(STRATEGIES)}"
            )
        if self.name == "ssp":
            if self.staleness is None:
                raise ConfigurationError(
                    "strategy='ssp' needs staleness=s, how many steps a partition may "
                    "run ahead of the slowest (s >= 1, e.g. staleness=3)"
                )
            if (
                isinstance(self.staleness, bool)
                or not isinstance(self.staleness, int)
                or self.staleness < 1
            ):
                raise ConfigurationError(
                    f"staleness must be a whole number >= 1, got {self.staleness!r}; "
                    "staleness 0 is strategy='bsp'"
                )
        elif self.staleness is not None:
            raise ConfigurationError(
                f"staleness={self.staleness!r} goes with strategy='ssp', not strategy={self.name!r}"
            )
        if (
            isinstance(self.backup_workers, bool)
            or not isinstance(self.backup_workers, int)
            or self.backup_workers < 0
        ):
            raise ConfigurationError(
                f"backup_workers must be a whole number >= 0, got {self.backup_workers!r}"
            )
        if self.backup_workers and self.name != "bsp":
            raise ConfigurationError(
                f"backup_workers={self.backup_workers} goes with strategy='bsp'; under "
                f"strategy={self.name!r} nobody waits for a straggler anyway"
            )

    def check_partitions(self, partition_num: int) -> None:
        """Raise unless the strategy can run on ``partition_num`` partitions."""
        if self.backup_workers >= partition_num:
            raise ConfigurationError(
                f"backup_workers={self.backup_workers} needs more than {self.backup_workers} workers, "
                f"this fit has {partition_num}: every step needs at least one gradient; lower "
                "backup_workers or raise num_workers"
            )

    def check_topology(self, topology: object) -> None:
        """Raise unless ``topology`` is one of ``TOPOLOGIES`` that this strategy can sync
        with: ``"hierarchical"`` goes with plain BSP only."""
        if not isinstance(topology, str) or topology not in TOPOLOGIES:
            raise ConfigurationError(
                f"topology must be one of {', '.join(map(repr, TOPOLOGIES))}, got {topology!r}"
            )
        if topology == "hierarchical" and not self.inline_owner:
            fix = "backup_workers=0" if self.backup_workers else "strategy='bsp'"
            raise ConfigurationError(
                f"topology='hierarchical' goes with strategy='bsp' and no backup workers, not with "
                f"{self.as_settings}: there each owner takes the partitions' gradients as they come, which a "
                f"host's sum would hold back. Leave topology='auto' (flat under {self.as_settings}) or set {fix}"
            )

    @property
    def as_settings(self) -> str:
        """The strategy as a message names its settings: ``strategy='ssp'``, or
        ``strategy='bsp', backup_workers=1``."""
        backup = f", backup_workers={self.backup_workers}" if self.backup_workers else ""
        return f"strategy={self.name!r}{backup}"

    @property
    def asynchronous(self) -> bool:
        """Whether owners apply every gradient as it arrives (ssp, asp)."""
        return self.name in ("ssp", "asp")

    @property
    def inline_owner(self) -> bool:
        """Whether the worker's own loop does the owner's part (plain bsp), not a background thread."""
        return self.name == "bsp" and not self.backup_workers

    def gradients_per_update(self, partition_num: int) -> int:
        """bsp: how many partitions' gradients of a step an owner waits for."""
        return partition_num - self.backup_workers

    #: backup workers: the partition whose owner chooses each step's gradients
    CHOOSER = 0

    # ---- versions ----------------------------------------------------------------------

    def weight_version(self, clock: int, updates: int) -> int:
        """The version an owner publishes after ``updates`` updates, at ``clock`` (the steps of
        every partition its slice holds; under BSP the two are the same)."""
        return (clock << CLOCK_SHIFT) | updates if self.asynchronous else clock

    def clock(self, weight_version: int) -> int:
        """How many steps of every partition a slice of ``weight_version`` includes."""
        return weight_version >> CLOCK_SHIFT if self.asynchronous else weight_version

    def weight_read(self, step: int, last_read: int) -> WeightRead:
        """What the read before step ``step`` may take; ``last_read``: the version read last
        (the lowest over the slices; -1 before the first read)."""
        if self.name == "ssp":
            return WeightRead(max(0, step - self.staleness) << CLOCK_SHIFT, exact=False)
        if self.name == "asp":
            return WeightRead(0, exact=False)
        if self.backup_workers:
            return WeightRead(last_read + 1, exact=False)
        return WeightRead(step, exact=True)

    def final_read(self, steps: int) -> WeightRead:
        """What a read takes once every partition's ``steps`` steps are applied: the final weights."""
        if self.asynchronous:
            return WeightRead(steps << CLOCK_SHIFT, exact=False)
        return WeightRead(steps, exact=True)

    def keep(self) -> dict[int, int]:
        """Versions each kind of block keeps: exactly those a reader can still ask for."""
        gradients = GRADIENT_BACKLOG if self.asynchronous else 1
        return {
            BlockKind.WEIGHT: 1,
            BlockKind.GRADIENT: gradients,
            BlockKind.REDUCE_INPUT: 1,
            BlockKind.REDUCE_OUTPUT: 1,
            BlockKind.CHOICE: 1,
            BlockKind.SIGNAL: 1,
            BlockKind.GRADIENT_HOST_SUM: 1,
            BlockKind.REDUCE_INPUT_HOST_SUM: 1,
            BlockKind.RAW_REDUCE_INPUT: 1,
            BlockKind.RAW_REDUCE_OUTPUT: 1,
            BlockKind.RAW_REDUCE_INPUT_HOST_SUM: 1,
            # all-gathered with no reduce between: a peer may still read v while we publish v+1
            BlockKind.METADATA: 2,
            # the typed collectives: a partition may publish v+1 while a peer still reads v
            # (a reduce_scatter's owner need not have fetched every chunk yet), never v+2,
            # for every call needs a block from every partition published after its last call
            BlockKind.TYPED_CHUNK: 2,
            BlockKind.TYPED_SLICE: 2,
        }

    def read_before_next(self) -> frozenset[int]:
        """Kinds whose every reader is done with a version before the next is published, by
        the order of the calls: under plain BSP weights and gradients (a peer reads weights
        t before its gradient t, which the owner sums before it publishes weights t+1; a
        leader's host sums and relays follow the same order), and allreduce's blocks under
        every strategy (all partitions go through it together)."""
        kinds = {
            BlockKind.REDUCE_INPUT,
            BlockKind.REDUCE_OUTPUT,
            BlockKind.REDUCE_INPUT_HOST_SUM,
            BlockKind.RAW_REDUCE_INPUT,
            BlockKind.RAW_REDUCE_OUTPUT,
            BlockKind.RAW_REDUCE_INPUT_HOST_SUM,
        }
        if self.inline_owner:
            kinds |= {BlockKind.WEIGHT, BlockKind.GRADIENT, BlockKind.GRADIENT_HOST_SUM}
        return frozenset(kinds)

    def waits_for_readers(self) -> frozenset[int]:
        """Kinds whose producer waits for room instead of dropping a version nobody took."""
        return frozenset({BlockKind.GRADIENT}) if self.asynchronous else frozenset()
