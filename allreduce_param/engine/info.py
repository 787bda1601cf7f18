"""HandleInfo: what one partition's handle is, read-only (``ConnectedParameter.info``).

A loop reads these to cut its data, log, or check a placement; none of them changes what a
call does. The fixed ones (which partition, its slice, the layout, the strategy, the
hosts) are set at ``connect()``; ``last_read_version`` and ``connections`` say where the
handle is now.
"""

from __future__ import annotations

from collections.abc import Callable

from allreduce_param.engine.encoded import GradientPutPlan
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.peers import PeerGroup
from allreduce_param.engine.step import StepState
from allreduce_param.engine.strategy import Strategy


class HandleInfo:
    """One partition's handle, described: made by ``ConnectedParameter``, from its
    ``StepState``, its ``PeerGroup``, whether its step goes through a host arena, and how
    its gradient put plan is made."""

    __slots__ = ("_state", "_peers", "_host_arena", "_plan")

    def __init__(
        self,
        state: StepState,
        peers: PeerGroup,
        host_arena: bool,
        plan: Callable[[], GradientPutPlan],
    ) -> None:
        self._state = state
        self._peers = peers
        self._host_arena = host_arena
        self._plan = plan

    @property
    def partition_id(self) -> int:
        """This partition's index, 0 to ``partition_num - 1``: the slice it owns."""
        return self._state.partition_id

    @property
    def partition_num(self) -> int:
        """How many partitions share the vector."""
        return self._peers.spec.partition_num

    @property
    def layout(self) -> SliceLayout:
        """The slices of the vector over the partitions."""
        return self._peers.spec.layout

    @property
    def strategy(self) -> Strategy:
        """How the partitions synchronise."""
        return self._state.strategy

    @property
    def slice_start(self) -> int:
        """Where this partition's slice starts in the vector."""
        return self.layout.start(self.partition_id)

    @property
    def slice_length(self) -> int:
        """How many elements this partition's slice has (``weight_partition``'s size)."""
        return self.layout.length(self.partition_id)

    @property
    def last_read_version(self) -> int:
        """The lowest weight version (over the slices) the last ``get_weights`` took."""
        return self._state.last_read

    @property
    def remote_peers(self) -> int:
        """How many peers are reached over TCP: ``PeerGroup.remote_peers``."""
        return self._peers.remote_peers

    @property
    def hosts(self) -> tuple[tuple[int, ...], ...]:
        """The partitions of each host, in the order sums take them: ``HostLayout.hosts``."""
        return self._peers.hosts.hosts

    @property
    def connections(self) -> dict[str, list[int]]:
        """The peers connected to now, by channel: ``PeerGroup.connections``."""
        return self._peers.connections()

    @property
    def host_arena(self) -> bool:
        """Whether this partition's step goes through its host's shared arena
        (``AllReduceParameter(host_arena=)``, where it applies), not blocks."""
        return self._host_arena

    @property
    def hierarchical(self) -> bool:
        """Whether hosts sum within themselves first: ``PeerGroup.hierarchical``."""
        return self._peers.hierarchical

    @property
    def gradient_put_plan(self) -> GradientPutPlan:
        """How this partition's gradient put is cut, for an ``EncodedGradient``: the gradient
        codec's name, the parts (``encoded.EncodedPart``: which values of the vector each
        holds, where its stream lies in the payload and how many bytes it takes) and the
        payload's size; ``refusal`` says why this parameter takes no pre-encoded payloads
        (a lossless gradient codec, a host arena), None where it does. The same plan every
        time."""
        return self._plan()

    def __repr__(self) -> str:
        return (
            f"HandleInfo(partition_id={self.partition_id}, partition_num={self.partition_num}, "
            f"strategy={self.strategy.name!r}, host_arena={self.host_arena}, "
            f"hierarchical={self.hierarchical})"
        )
