"""ParameterSpec: what every partition of one synchronised vector agrees on, fixed on the driver.

The driver's ``AllReduceParameter`` makes one (its constructor's keywords, checked here,
with the network settings resolved once and a fresh secret), and it travels with the task
closure; everything below (the peer group, its server and clients, the movements) reads
its configuration from the spec and from nothing else. It is frozen: a task cannot change
what its peers assume.

Every check of a setting lives here, once: a spec that exists is a valid one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from allreduce_param.engine.blocks.codec import codec_names
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.strategy import Strategy
from allreduce_param.engine.wire.settings import NetworkSettings
from allreduce_param.errors import ConfigurationError

Topology = Literal["auto", "hierarchical", "flat"]


@dataclass(frozen=True)
class ParameterSpec:
    """One synchronised vector's settings, as every partition uses them.

    ``layout``: its size and partitions. ``codec`` carries the weights and ``allreduce``;
    ``gradient_codec`` the gradients (unset: ``codec``). ``strategy`` and ``topology``:
    how the partitions synchronise. ``timeout``: the bound on every wait for a peer, in
    seconds. Transport: ``fetch_threads`` (None: ``peers.FETCH_THREADS``),
    ``unix_sockets``, ``shared_memory``, ``host_arena`` (one host's BSP step through one
    shared arena, ``peers.PeerGroup.arena``); ``network``: where servers listen and how long a
    connection may take. ``allow_nonfinite``: NaN/Inf gradients pass instead of raising.
    ``param_id`` and ``secret`` tell this vector's peers from any other's (the secret is
    left out of the repr). See ``AllReduceParameter`` for what each one means to a user.
    """

    layout: SliceLayout
    codec: str = "lz4"
    gradient_codec: str | None = None
    strategy: Strategy = field(default_factory=Strategy)
    topology: Topology = "auto"
    timeout: float = 120.0
    fetch_threads: int | None = None
    unix_sockets: bool = True
    shared_memory: bool = True
    host_arena: bool = True
    allow_nonfinite: bool = False
    network: NetworkSettings = field(default_factory=NetworkSettings)
    param_id: int = 0
    secret: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        self.strategy.check_partitions(self.layout.partition_num)
        self.strategy.check_topology(self.topology)
        # an unknown codec fails here, on the driver, not in every task
        codec, gradient_codec = codec_names(self.codec, self.gradient_codec)
        object.__setattr__(self, "codec", codec)
        object.__setattr__(self, "gradient_codec", gradient_codec)
        if not self.timeout > 0:
            raise ConfigurationError(
                f"timeout must be a positive number of seconds, got {self.timeout!r}"
            )
        object.__setattr__(self, "timeout", float(self.timeout))
        threads = self.fetch_threads
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
        ):
            raise ConfigurationError(
                f"fetch_threads must be a positive whole number, got {threads!r}"
            )
        if not isinstance(self.network, NetworkSettings):
            raise ConfigurationError(
                f"network must be a NetworkSettings, got {type(self.network).__name__}"
            )
        if self.network.connect_timeout is None or self.network.encrypt is None:
            # unset ones take their defaults here, with no Spark setting read
            object.__setattr__(self, "network", self.network.resolved())
        object.__setattr__(self, "param_id", int(self.param_id))

    @property
    def size(self) -> int:
        """How many float32 elements the synchronised vector has."""
        return self.layout.size

    @property
    def partition_num(self) -> int:
        """How many partitions (barrier tasks) share the vector."""
        return self.layout.partition_num

    def check_stage(self, tasks: int, name: str) -> None:
        """Raise unless a stage of ``tasks`` barrier tasks can use this spec (one task per
        partition); ``name``: what the error calls the parameter."""
        if tasks != self.partition_num:
            raise ConfigurationError(
                f"{name} was made for {self.partition_num} partitions but this stage has "
                f"{tasks} tasks: make it with partition_num=rdd.getNumPartitions(), or "
                f"repartition the data to {self.partition_num} partitions"
            )
