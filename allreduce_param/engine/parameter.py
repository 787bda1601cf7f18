"""AllReduceParameter: a float32 vector kept in sync across the partitions of a barrier stage.

Partition ``i`` of ``N`` owns slice ``i`` of the vector (``layout.SliceLayout``). Each step:

1. ``get_weights``: all-gather. Fetch every owner's published weight slice.
2. ``put_gradients``: cut the local gradient into N chunks and publish chunk ``j`` for owner ``j``
   (or ``stream_gradients``: publish each chunk as soon as backward has finished it).
3. ``aggregate_gradient_partition``: reduce-scatter. The owner fetches its chunk from every
   peer and sums them, in partition order, in fp32, divided by the summed sample counts.
4. The optimizer updates ``weight_partition`` (the owned fp32 slice) in place.
5. ``send_weight_partition``: publish the updated slice as the next version.

That is BSP, the default. Under the other strategies (``strategy.Strategy``: BSP with
backup workers, SSP, ASP) steps 3-5 move to a background owner thread (``owner.py``) that
``serve_updates`` starts, and each step is just ``get_weights`` and ``put_gradients``.

Nothing here waits on Spark: a fetch of a version blocks until the peer publishes it. The
driver makes the ``AllReduceParameter`` (its id and secret travel with the task closure);
each task calls ``connect()``, which meets the peers once and returns a
``ConnectedParameter``, to be closed (or used as a context manager) on every path.
"""

from __future__ import annotations

import functools
import itertools
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, NamedTuple

import numpy as np

from allreduce_param.engine import surroundings
from allreduce_param.engine.blocks.codec import get_codec
from allreduce_param.engine.blocks.store import EVERY_PARTITION, BlockKind
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.movements import Movements, NonFiniteSum
from allreduce_param.engine.movement.peers import PeerGroup
from allreduce_param.engine.movement.rendezvous import Rendezvous
from allreduce_param.engine.owner import BackgroundOwner, owner_failure_first
from allreduce_param.engine.spec import ParameterSpec
from allreduce_param.engine.strategy import Strategy, WeightRead
from allreduce_param.engine.stream import GradientStream
from allreduce_param.engine.vectors import float32_vector, writable_output
from allreduce_param.engine.wire.network import NetworkSettings
from allreduce_param.errors import ConfigurationError, InputError, UsageError

_next_param_id = itertools.count()


class _Put(NamedTuple):
    """One put of a gradient, once checked: what its chunks are published with."""

    vector: np.ndarray
    version: int
    count: float
    keep_own: bool  # the own chunk is summed from ``vector``, not published
    in_place: memoryview | None  # ``vector``'s bytes, to publish where they lie


def _spec_field(name: str, doc: str) -> property:
    """A read-only attribute of ``AllReduceParameter``: its spec's ``name``."""
    return property(lambda self: getattr(self.spec, name), doc=doc)


class AllReduceParameter:
    """The driver's description of one synchronised vector: its size, partitions, codec, secret.

    Make it on the driver and use it inside ``rdd.barrier().mapPartitions(task)``: every
    task calls ``connect()``. ``timeout`` bounds every wait for a peer, in seconds;
    ``fetch_threads`` is how many peers are fetched from at once (default 16, or all when
    fewer: a few threads keep the link busy, and they do not grow with the partitions);
    ``allow_nonfinite`` lets NaN/Inf gradients through instead of raising;
    ``unix_sockets`` lets peers on the same host talk over Unix sockets (Linux), which are
    faster than loopback TCP; cross-host peers always use TCP. ``shared_memory`` (with
    Unix sockets) lets such peers read each other's blocks in place from shared memory.
    ``strategy`` says how the partitions synchronise (``Strategy``; default BSP).
    ``gradient_codec``: another codec for the gradients than ``codec`` (which then carries
    the weights and ``allreduce``), such as ``"topk"``, which only gradients can take.

    ``topology``: ``"hierarchical"`` (the default, ``"auto"``, where it changes anything:
    BSP, several hosts, one of them with several partitions) has each host's partitions
    sum through shared memory and only one partition per host, its leader, exchange with
    the other hosts' leaders, so connections and the bytes on each host's link grow with
    the hosts, not the partitions; ``"flat"`` has every partition exchange with every
    other. Both sum in the same order (``layout.HostLayout``), so a lossless codec gives
    the same bits either way; a lossy one rounds each host sum once more.

    Networking (``network.NetworkSettings``): ``bind_address`` is where each partition's
    block server listens (one address of its host, never every interface; default: its
    executor's address as Spark names it), ``advertise_address`` the address its peers are
    told, ``port_range`` the ports it may take (``"40000-40099"``; default any free one), and
    ``connect_timeout`` how long a connection and its handshake may take. Those left unset
    come from the Spark settings ``spark.allreduce.bindAddress``, ``...advertiseAddress``,
    ``...portRange`` and ``...connectTimeout`` of the driver's active session, when made
    there; the environment variables ``ALLREDUCE_BIND_ADDRESS`` and
    ``ALLREDUCE_ADVERTISE_ADDRESS`` win on the host that sets them. ``encrypt``: whether
    the blocks that travel over TCP (to peers on other hosts, or to all with
    ``unix_sockets=False``) are encrypted (AES-256-GCM, ``sealing.py``); Unix sockets and
    shared memory never leave the host and are not. Unset (None), it is the Spark setting
    ``spark.allreduce.encrypt``, else on where the session encrypts its own traffic
    (``spark.network.crypto.enabled`` or ``spark.ssl.enabled`` true), else off.
    ``network``: those five at once, resolved already (a ``NetworkSettings``, such as the
    trainer reads on the driver): used as it is, with no Spark setting read; giving it
    with any of the five keywords is a ``ConfigurationError``.

    Everything is checked here, on the driver, and kept in ``spec`` (a frozen
    ``ParameterSpec``): what every partition's engine reads its configuration from.
    """

    def __init__(
        self,
        partition_num: int,
        size: int,
        codec: str = "lz4",
        *,
        timeout: float = 120.0,
        fetch_threads: int | None = None,
        allow_nonfinite: bool = False,
        unix_sockets: bool = True,
        shared_memory: bool = True,
        param_id: int | None = None,
        strategy: Strategy | None = None,
        gradient_codec: str | None = None,
        bind_address: str | None = None,
        advertise_address: str | None = None,
        port_range: str | tuple[int, int] | None = None,
        connect_timeout: float | None = None,
        encrypt: bool | None = None,
        topology: Literal["auto", "hierarchical", "flat"] = "auto",
        network: NetworkSettings | None = None,
    ) -> None:
        network_keywords = dict(
            bind_address=bind_address,
            advertise_address=advertise_address,
            port_range=port_range,
            connect_timeout=connect_timeout,
            encrypt=encrypt,
        )
        if network is None:
            network = NetworkSettings.of(network_keywords, surroundings.current().setting)
        else:
            given = [name for name, value in network_keywords.items() if value is not None]
            if given:
                raise ConfigurationError(
                    f"network= and {', '.join(name + '=' for name in given)} were both given: "
                    f"pass the network settings one way, in network=NetworkSettings({given[0]}=...) "
                    "or as keywords"
                )
        #: what every partition uses; checked as it is made
        self.spec = ParameterSpec(
            layout=SliceLayout(size, partition_num),
            codec=codec,
            gradient_codec=gradient_codec,
            strategy=strategy or Strategy(),
            topology=topology,
            timeout=timeout,
            fetch_threads=fetch_threads,
            unix_sockets=unix_sockets,
            shared_memory=shared_memory,
            allow_nonfinite=allow_nonfinite,
            network=network,
            param_id=next(_next_param_id) if param_id is None else param_id,
            secret=secrets.token_bytes(32),
        )

    # the settings, as the spec holds them (read-only: every partition must agree on them)
    layout = _spec_field("layout", "The slices of the vector over the partitions.")
    network = _spec_field("network", "Where the servers listen; how long a connection may take.")
    strategy = _spec_field("strategy", "How the partitions synchronise.")
    topology = _spec_field("topology", "Hierarchical or flat (see the class).")
    codec = _spec_field("codec", "The codec of the weights and ``allreduce``.")
    gradient_codec = _spec_field("gradient_codec", "The codec of the gradients.")
    timeout = _spec_field("timeout", "The bound on every wait for a peer, in seconds.")
    fetch_threads = _spec_field("fetch_threads", "How many peers are fetched from at once.")
    allow_nonfinite = _spec_field("allow_nonfinite", "Whether NaN/Inf gradients pass.")
    unix_sockets = _spec_field("unix_sockets", "Whether same-host peers use Unix sockets.")
    shared_memory = _spec_field("shared_memory", "Whether they read blocks in shared memory.")
    param_id = _spec_field("param_id", "Which parameter this is, for the peers' handshake.")
    secret = _spec_field("secret", "The key the peers authenticate with.")
    size = _spec_field("size", "How many float32 elements the synchronised vector has.")
    partition_num = _spec_field("partition_num", "How many partitions share the vector.")

    def __repr__(self) -> str:
        gradients = (
            "" if self.gradient_codec == self.codec else f", gradient_codec={self.gradient_codec!r}"
        )
        return (
            f"AllReduceParameter(partition_num={self.partition_num}, size={self.size}, "
            f"codec={self.codec!r}{gradients}, strategy={self.strategy.name!r}, param_id={self.param_id})"
        )

    def connect(self, rendezvous: Rendezvous | None = None) -> ConnectedParameter:
        """Inside a task: start serving, meet the peers, and return this partition's handle.

        With no ``rendezvous`` the peers meet through the Spark barrier stage's
        ``allGather``, once (its coordinator answers on a fixed period, so this costs a
        fixed time per connect, never per step). Close the handle on every path, best with
        ``with param.connect() as p:``.
        """
        return ConnectedParameter(self, rendezvous or surroundings.current().rendezvous())


def _call(method):
    """A public call of a handle: refused once the handle failed or closed; one that fails
    partway (anything but a refusal of its arguments or order) marks the handle failed."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        what = f"{method.__name__}() on partition {self.partition_id}"
        if self._failure is not None:
            raise UsageError(
                f"{what}: this handle failed in an earlier call ({type(self._failure).__name__}: "
                f"{self._failure}); its blocks and versions are in an unknown state, so it takes no more "
                "calls: leave its with-block (or close it) and connect again"
            )
        if self._closed:
            raise UsageError(f"{what}: the handle is closed")
        try:
            return method(self, *args, **kwargs)
        except (InputError, UsageError):
            raise  # refused before it changed anything
        except BaseException as error:
            self._failure = error
            raise

    return call


class ConnectedParameter:
    """One partition's live side of an ``AllReduceParameter``; made by ``connect()``.

    Every partition must make the same calls in the same order: the n-th call of a kind on
    one partition meets the n-th call on the others (the version numbers count them). The
    peers are reached through a ``peers.PeerGroup``; blocks move through ``movements``.
    """

    def __init__(self, param: AllReduceParameter, rendezvous: Rendezvous) -> None:
        if rendezvous.partition_num != param.partition_num:
            raise ConfigurationError(
                f"{param!r} was made for {param.partition_num} partitions but this stage has "
                f"{rendezvous.partition_num} tasks: make it with partition_num=rdd.getNumPartitions(), "
                f"or repartition the data to {param.partition_num} partitions"
            )
        self.partition_id = rendezvous.partition_id
        self.partition_num = param.partition_num
        self.layout = param.layout
        self.strategy = param.strategy
        self.slice_start = self.layout.start(self.partition_id)
        self.slice_length = self.layout.length(self.partition_id)
        self._allow_nonfinite = param.allow_nonfinite
        self._versions = {kind: -1 for kind in BlockKind.NAMES}
        self._weight: np.ndarray | None = None
        self._gradient = np.zeros(self.slice_length, dtype=np.float32)
        self._weights_out: np.ndarray | None = None  # what get_weights() fills when given no out
        self._handed: tuple[np.ndarray, memoryview] | None = (
            None  # gradient_buffer(), and its bytes
        )
        self._gradient_pending = False
        self._own_gradient: tuple[np.ndarray, float] | None = (
            None  # BSP, exact codec: see put_gradients
        )
        # sends since the last aggregate: a second one could rewrite a version a peer still reads
        self._sends_since_aggregate = 0
        self._start = 0  # the global step the fit starts at (past a checkpoint when resumed)
        self._last_read = -1  # the lowest weight version the last get_weights took
        self._puts = 0  # gradients put so far, counted from the first step
        self._owner = None  # the background owner, under strategies other than plain BSP
        self._publisher: ThreadPoolExecutor | None = None  # publishes streamed gradients' chunks
        self._stream_open = False
        self._prefetched = (
            None  # a stream's fetches of the own chunk from the peers, for the aggregate
        )
        self._finished = False
        self._failure: BaseException | None = None  # what made a call fail partway
        self._peers = PeerGroup(param.spec, rendezvous)
        self._moves = Movements(
            self._peers, get_codec(param.codec), get_codec(param.gradient_codec)
        )

    @property
    def remote_peers(self) -> int:
        """How many peers this partition reaches over TCP (on other hosts, or with
        ``unix_sockets=False``); the others share its host and are reached over Unix sockets.
        Hierarchical, only a leader reaches any: the other hosts' leaders."""
        return self._peers.remote_peers

    @property
    def hosts(self) -> tuple[tuple[int, ...], ...]:
        """The partitions of each host (one scope: machine and network namespace), in the
        order sums are taken; a partition that shares nothing (Unix sockets off) is alone."""
        return self._peers.hosts.hosts

    @property
    def connections(self) -> dict[str, list[int]]:
        """The peers this partition holds a connection to now, by channel: ``"fetch"`` (the
        steps'), ``"control"`` (signals, step choices), ``"owner"`` (a background owner's).
        A connection is made at its first use: flat, a step connects to every peer;
        hierarchical, to this host's partitions and, a leader, to the other leaders."""
        return self._peers.connections()

    @property
    def hierarchical(self) -> bool:
        """Whether this sync is hierarchical: hosts sum within themselves and their leaders
        exchange (see ``AllReduceParameter``'s ``topology``)."""
        return self._peers.hierarchical

    @property
    def _closed(self) -> bool:
        return self._peers.closed

    # ---- the weights ---------------------------------------------------------------------

    @_call
    def init(self, weights: np.ndarray, step: int = 0) -> None:
        """Keep this partition's slice of ``weights`` (fp32) and publish it as the weights of
        ``step``, the global step the fit starts at (0, or the step after a checkpoint).

        Call once, before anything else, with the same full vector on every partition, or
        with this partition's own slice (what a checkpoint holds for it), and the same step.
        """
        if self._weight is not None:
            raise UsageError(f"init() was called twice on partition {self.partition_id}")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise InputError(
                f"init(step={step!r}) on partition {self.partition_id}: a whole number >= 0"
            )
        own = np.asarray(weights).size == self.slice_length
        vector = self._vector(
            weights, self.slice_length if own else self.layout.size, "init(weights)"
        )
        self._weight = (vector if own else vector[self.layout.bounds(self.partition_id)]).copy()
        self._start = self._puts = int(step)
        self._last_read = self._versions[BlockKind.GRADIENT] = self._start - 1
        self._versions[BlockKind.WEIGHT] = self.strategy.weight_version(self._start, 0)
        self._moves.publish(BlockKind.WEIGHT, self._versions[BlockKind.WEIGHT], self._weight)

    @property
    def weight_partition(self) -> np.ndarray:
        """This partition's fp32 slice of the weights; an optimizer updates it in place."""
        self._require_init("weight_partition")
        return self._weight

    @_call
    def send_weight_partition(self) -> None:
        """Publish ``weight_partition`` as the next version, for every peer's ``get_weights``.

        Call after updating the slice from ``aggregate_gradient_partition``'s result: at most
        one send per aggregate (the first may follow ``init``). A peer reads version v only
        before its own send of v+1, so the aggregate that follows our send of v+1 proves
        every peer is past its read of v.
        """
        self._require_init("send_weight_partition()")
        self._require_inline("send_weight_partition()")
        if self._sends_since_aggregate >= 1:
            raise UsageError(
                f"send_weight_partition() was called twice on partition {self.partition_id} with no "
                "aggregate_gradient_partition() in between: a peer may still be reading the version "
                "it would overwrite. A step is get_weights, put_gradients, "
                "aggregate_gradient_partition, update, send_weight_partition"
            )
        self._sends_since_aggregate += 1
        self._versions[BlockKind.WEIGHT] += 1
        self._moves.publish(BlockKind.WEIGHT, self._versions[BlockKind.WEIGHT], self._weight)

    @_call
    def get_weights(self, out: np.ndarray | None = None) -> np.ndarray:
        """All-gather: fetch every owner's published slice into one full float32 vector.

        Which version of each slice the strategy's rule gives this step: under BSP the one
        of this step, under the others the newest allowed (``last_read_version`` tells
        which); after ``finish_updates``, the final weights. Waits for slow owners up to the
        timeout. The own slice also goes through the codec, so every partition gets
        bit-identical weights. ``out`` (float32, ``size``) is filled and returned when
        given; otherwise one array the handle keeps, which the next ``get_weights()`` without
        ``out`` fills again: copy it to keep a version past that call.
        """
        self._require_init("get_weights()")
        if self._finished:
            read = self.strategy.final_read(self._owner.steps)
        elif self.strategy.inline_owner:
            read = WeightRead(self._versions[BlockKind.WEIGHT], exact=True)
        else:
            read = self.strategy.weight_read(self._puts, self._last_read)
        if out is None:
            if self._weights_out is None:
                self._weights_out = np.empty(self.layout.size, dtype=np.float32)
            out = self._weights_out
        out = self._output(out, self.layout.size)
        with self._owner_failure_first():
            self._last_read = self._moves.gather(BlockKind.WEIGHT, read, self.layout, out)
        if self._handed is not None:  # every peer has summed the last gradient published in place
            self._handed[0].flags.writeable = True
        return out

    @property
    def last_read_version(self) -> int:
        """The lowest weight version (over the slices) the last ``get_weights`` took."""
        return self._last_read

    # ---- the gradients -------------------------------------------------------------------

    @_call
    def gradient_buffer(self) -> np.ndarray:
        """A float32 vector of ``size`` (zeros at first) to compute the gradient into: the
        same array on every call, valid until the handle closes.

        Under BSP with the raw codec, ``put_gradients`` of this array publishes it where it
        lies (shared memory that same-host peers read in place) instead of copying it, and
        makes it read-only until the next ``get_weights`` returns, when every peer has summed
        it; a step writes its gradient after ``get_weights`` anyway. Under other codecs
        and strategies it is copied at put like any vector.
        """
        if self._handed is None:
            room = self._peers.room(4 * self.layout.size)
            self._handed = (np.frombuffer(room, dtype=np.float32), room)
        return self._handed[0]

    @_call
    def put_gradients(
        self, gradients: np.ndarray, count: float = 1.0, residual: np.ndarray | None = None
    ) -> None:
        """Publish the local gradient sum, cut into one chunk per owner, with its sample count.

        ``gradients`` is the sum over this partition's ``count`` samples (count may be 0
        for an empty partition), so the owners can divide by the total count. Under BSP
        call it once per step, then ``aggregate_gradient_partition``; under the other
        strategies once per ``get_weights`` (with backup workers the gradient belongs to
        the weights read). Under BSP keep ``gradients`` unchanged until
        ``aggregate_gradient_partition`` returns, as with any asynchronous collective: with
        an exact codec the own chunk is summed from it there, not from a copy (and the
        ``gradient_buffer()`` is not copied at all). NaN/Inf are
        found by the owners as they sum (one pass fewer
        than checking here): the owner's call raises ``NonFiniteGradientError`` naming
        this partition, the step and the index, unless the parameter allows them.

        ``residual``: error feedback for a lossy codec. A float32 vector of ``size``,
        zeros at first, that the caller keeps across steps and does not touch: what the
        codec's rounding took from this partition's gradients is added back at the next
        put, so the rounding errors do not add up over the steps.
        """
        put = self._start_put(gradients, count, residual, "put_gradients")
        with self._owner_failure_first():
            self._moves.scatter(
                BlockKind.GRADIENT,
                put.version,
                put.vector,
                self.layout,
                put.count,
                residual,
                own=not put.keep_own,
                in_place=put.in_place,
            )
        self._end_put(put)

    @_call
    def stream_gradients(
        self, gradients: np.ndarray, count: float = 1.0, residual: np.ndarray | None = None
    ) -> GradientStream:
        """``put_gradients``, chunk by chunk, while ``gradients`` is still being computed.

        Returns a ``GradientStream``: tell it ``ready(start, stop)`` as ranges of
        ``gradients`` become final (a backward pass, tensor by tensor), and each owner's
        chunk is published as soon as it is whole, on a thread of the handle's, while the
        computation goes on; under BSP this partition's own chunk also starts being
        fetched from every peer at once, so ``aggregate_gradient_partition`` finds it
        arriving. Close the stream (``with p.stream_gradients(...) as stream:``) once
        ``gradients`` is final in full: that publishes what is left, as ``put_gradients``
        would have. The published blocks are the same bits as ``put_gradients``'s.

        ``count`` (the rows the gradient sums over) is needed before the rows are summed,
        as every chunk carries it. ``gradients`` (best ``gradient_buffer()``) and
        ``residual`` are as for ``put_gradients``, and the same call order holds: the
        stream takes the place of the step's put. An error inside the with-block fails
        the handle, as a failed put would.
        """
        put = self._start_put(gradients, count, residual, "stream_gradients")
        if (
            self.strategy.inline_owner and not self.hierarchical
        ):  # the peers' chunks of the own slice: fetch as they come
            peers = [j for j in range(self.partition_num) if j != self.partition_id]
            self._prefetched = self._moves.fetch_own_chunks(
                BlockKind.GRADIENT, put.version, self.layout, peers
            )

        def publish(owner: int) -> None:
            with self._owner_failure_first():
                self._moves.scatter_chunk(
                    BlockKind.GRADIENT,
                    put.version,
                    put.vector,
                    self.layout,
                    put.count,
                    owner,
                    residual,
                    put.in_place,
                )

        def closed(error: BaseException | None) -> None:
            self._stream_open = False
            if error is None:
                self._end_put(put)
            elif self._failure is None:
                self._failure = error

        if self._publisher is None:
            self._publisher = ThreadPoolExecutor(
                1, thread_name_prefix=f"allreduce-publish-{self.partition_id}"
            )
        self._stream_open = True
        return GradientStream(
            self.layout,
            self._moves.scatter_order(own=not put.keep_own),
            publish,
            self._publisher,
            closed,
            f"stream_gradients() on partition {self.partition_id}",
        )

    def _start_put(self, gradients, count, residual, what: str) -> _Put:
        """Check a put's arguments and order, and take its version: what both puts share."""
        if self._stream_open:
            raise UsageError(
                f"{what}() on partition {self.partition_id} came while the gradient stream of "
                "the step is still open: close it (leave its with-block) first"
            )
        if self._gradient_pending:
            raise UsageError(
                f"{what}() was called twice on partition {self.partition_id} without "
                "aggregate_gradient_partition() in between"
            )
        vector = self._vector(gradients, self.layout.size, f"{what}(gradients)")
        if not float(count) >= 0:
            raise InputError(
                f"{what}(count={count!r}) on partition {self.partition_id}: "
                "the sample count must be a number >= 0"
            )
        if residual is not None:
            self._output(residual, self.layout.size, f"{what}(residual=)")
        if self.strategy.inline_owner:
            version = self._versions[BlockKind.GRADIENT] + 1
        elif self.strategy.asynchronous:
            version = self._puts
        else:  # backup workers: the step of the weights it was computed from
            if self._last_read <= self._versions[BlockKind.GRADIENT]:
                raise UsageError(
                    f"{what}() on partition {self.partition_id} came without a get_weights() "
                    "before it: with backup workers a gradient belongs to the weights it was computed from"
                )
            version = self._last_read
        self._versions[BlockKind.GRADIENT] = version
        # BSP with an exact codec: the own chunk is summed straight from the caller's vector
        codec = self._moves.codecs[BlockKind.GRADIENT]
        keep_own = (
            self.strategy.inline_owner and not codec.lossy and not self.hierarchical
        )  # a leader reads it
        self._own_gradient = (
            (vector[self.layout.bounds(self.partition_id)], float(count)) if keep_own else None
        )
        handed = self._handed is not None and vector.ctypes.data == self._handed[0].ctypes.data
        in_place = (
            handed and self.strategy.inline_owner and codec.publishes_in_place and residual is None
        )
        return _Put(vector, version, float(count), keep_own, self._handed[1] if in_place else None)

    def _end_put(self, put: _Put) -> None:
        """After every chunk of a put is published."""
        if put.in_place is not None:
            self._handed[0].flags.writeable = False  # peers read it until our next get_weights
        self._puts += 1
        self._gradient_pending = self.strategy.inline_owner

    @_call
    def aggregate_gradient_partition(self, avg: float | None = None) -> np.ndarray:
        """Reduce-scatter: sum this slice's chunk from every partition and divide.

        Fetches chunk ``partition_id`` of the last ``put_gradients`` from every peer, sums in
        partition order in fp32, then divides by ``avg`` when given, else by the summed
        sample counts (the exact mean over all samples). Returns ``gradient_partition``,
        which the next call overwrites. BSP only: under the other strategies the background
        owner does this.
        """
        self._require_inline("aggregate_gradient_partition()")
        if self._stream_open:
            raise UsageError(
                f"aggregate_gradient_partition() on partition {self.partition_id} came while the "
                "step's gradient stream is still open: close it (leave its with-block) first"
            )
        if not self._gradient_pending:
            raise UsageError(
                f"aggregate_gradient_partition() on partition {self.partition_id} came before "
                "put_gradients() for this step"
            )
        if avg is not None and not float(avg) > 0:
            raise InputError(
                f"aggregate_gradient_partition(avg={avg!r}) on partition {self.partition_id}: "
                "avg must be a positive number"
            )
        version = self._versions[BlockKind.GRADIENT]
        total = self._moves.reduce(
            BlockKind.GRADIENT,
            version,
            self.layout,
            self._gradient,
            divisor=lambda total: (total if total > 0 else None) if avg is None else float(avg),
            check=self._nonfinite_check(version),
            own=self._own_gradient,
            pending=self._prefetched,
        )
        self._gradient_pending, self._own_gradient, self._prefetched = False, None, None
        self._sends_since_aggregate = 0
        if avg is None and not total > 0:
            raise InputError(
                f"step {version} has nothing to divide by: every partition put count=0; "
                "pass avg= or put a positive count"
            )
        return self._gradient

    @property
    def gradient_partition(self) -> np.ndarray:
        """The last result of ``aggregate_gradient_partition``: this slice's mean gradient."""
        return self._gradient

    def _nonfinite_check(self, version: int) -> NonFiniteSum | None:
        """What checks this slice's summed gradients of ``version`` for NaN/Inf, unless allowed."""
        return None if self._allow_nonfinite else NonFiniteSum(version, self.slice_start)

    # ---- the background owner (strategies other than plain BSP) ----------------------------

    @_call
    def serve_updates(
        self,
        update: Callable[[np.ndarray, np.ndarray, int], None],
        steps: int,
        on_steps_done: Callable[[int], None] | None = None,
    ) -> None:
        """Start the background owner: it takes the gradients of this slice as the strategy
        allows, calls ``update(gradient, weight_partition, step)`` to change the slice in
        place (``gradient``: the exact mean over the rows of the gradients taken; ``step``:
        0-based, for learning-rate schedules), and publishes the slice after each update.

        ``steps``: the fit's global steps, the first being ``init``'s. Every partition puts
        a gradient for each (with backup workers, for those it does not skip).
        ``on_steps_done(k)``, if given, is called once the slice holds every partition's
        gradients of the steps before k (ssp, asp: its clock reached k), for each k.
        Call once, after ``init``; both callables run on the owner's thread.
        """
        self._require_init("serve_updates()")
        if self.strategy.inline_owner:
            raise UsageError(
                "serve_updates() is for the strategies with a background owner; under plain "
                "BSP a step calls aggregate_gradient_partition and send_weight_partition itself"
            )
        if self._owner is not None:
            raise UsageError(f"serve_updates() was called twice on partition {self.partition_id}")
        # waiting idle: the owner takes whichever gradient comes first, and a source's next one
        # may wait for weights this owner publishes only after another source's (ssp's clock),
        # so a fetch that held a thread while it waited could keep a ready one queued for good
        channel = self._peers.channel(self._peers.fetch_threads, "owner", idle_waits=True)
        self._owner = BackgroundOwner(
            self._moves,
            channel,
            self.strategy,
            self.layout,
            self._weight,
            self._gradient,
            self._start,
            update,
            int(steps),
            on_steps_done,
            check=self._nonfinite_check,
        )

    @_call
    def finish_updates(self) -> None:
        """Wait until every owner has applied every partition's gradients; afterwards
        ``get_weights`` gives the final weights. Ends with one exact allreduce as a barrier.
        """
        if self._owner is None:
            raise UsageError("finish_updates() came before serve_updates()")
        self._owner.join()
        with self._owner_failure_first():
            self.allreduce_exact(np.zeros(1))  # every owner has published its last
        self._finished = True

    def _owner_failure_first(self):
        """A context in which an error raises the background owner's first, if it failed."""
        return owner_failure_first(self._owner)

    @property
    def updates(self) -> list:
        """The background owner's updates so far: which partitions' gradients each one took."""
        return [] if self._owner is None else list(self._owner.updates)

    # ---- signals ---------------------------------------------------------------------------

    @_call
    def signal(self, version: int) -> None:
        """Tell every partition this one has done ``version`` of something (e.g. written a
        checkpoint); see ``wait_for_signals``. Versions must increase.

        Hierarchical, a leader's signal stands for its whole host: it first waits until
        every partition of its host has signalled ``version``, so that a waiter reads only
        its own host's signals and the leaders', not a connection to every partition."""
        if self._peers.is_leader:
            self._wait_for(version, self._peers.hosts.mates(self.partition_id))
        self._moves.publish(BlockKind.SIGNAL, version, np.ones(1, np.float32))

    @_call
    def wait_for_signals(self, version: int) -> None:
        """Wait until every partition has signalled ``version`` (or a later one)."""
        hosts = self._peers.hosts
        self._wait_for(
            version,
            sorted({*hosts.host(self.partition_id), *hosts.leaders})
            if self.hierarchical
            else range(self.partition_num),
        )

    def _wait_for(self, version: int, sources) -> None:
        """Wait until each partition of ``sources`` has signalled ``version`` or a later one."""
        ones = SliceLayout(self.partition_num, self.partition_num)  # one value from each
        pending = self._moves.fetch_all(
            self._peers.control,
            BlockKind.SIGNAL,
            WeightRead(version, exact=False),
            ones,
            EVERY_PARTITION,
            sources=sources,
        )
        for futures in pending.values():
            futures[-1].result()

    # ---- any vector ----------------------------------------------------------------------

    @_call
    def allreduce(self, values: np.ndarray, op: Literal["sum", "mean"] = "sum") -> np.ndarray:
        """Sum (or average over partitions) a float32 vector of any length across partitions.

        A reduce-scatter then an all-gather, like a step, through the parameter's codec.
        Every partition must call it with a vector of the same length; all get the same
        result. For counts, norms and metrics that a lossy codec would round, use
        ``allreduce_exact``.
        """
        if op not in ("sum", "mean"):
            raise InputError(f"allreduce(op={op!r}): op must be 'sum' or 'mean'")
        vector = self._vector(values, None, "allreduce(values)")
        version = self._versions[BlockKind.REDUCE_INPUT] = (
            self._versions[BlockKind.REDUCE_INPUT] + 1
        )
        return self._moves.allreduce(version, vector, mean=op == "mean")

    @_call
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
        version = self._versions[BlockKind.METADATA] = self._versions[BlockKind.METADATA] + 1
        return self._moves.allreduce_exact(version, vector)

    # ---- checks --------------------------------------------------------------------------

    def _vector(self, values, size: int | None, what: str) -> np.ndarray:
        return float32_vector(values, size, f"{what} on partition {self.partition_id}")

    def _output(self, out: np.ndarray, size: int, what: str = "get_weights(out=)") -> np.ndarray:
        return writable_output(out, size, f"{what} on partition {self.partition_id}")

    def _require_init(self, what: str) -> None:
        if self._weight is None:
            raise UsageError(f"{what} on partition {self.partition_id} came before init(weights)")

    def _require_inline(self, what: str) -> None:
        if not self.strategy.inline_owner:
            raise UsageError(
                f"{what} is BSP's; under {self.strategy.name!r}"
                f"{' with backup workers' if self.strategy.backup_workers else ''} the "
                "background owner that serve_updates() starts aggregates and publishes"
            )

    # ---- closing -------------------------------------------------------------------------

    def close(self) -> None:
        """Finish cleanly: tell every peer we are done, wait until they are, then stop serving.

        A partition that finishes first keeps serving its last blocks until every peer has
        said it fetched them (or the timeout passes), so no peer loses a block it needs.
        """
        self._peers.close(join=self._join_threads)

    def _join_threads(self) -> None:
        """End the handle's threads: the background owner's, the publishing one."""
        if self._owner is not None:
            self._owner.join(raise_error=False)
        if self._publisher is not None:
            self._publisher.shutdown(wait=True)

    def __enter__(self) -> ConnectedParameter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            self._peers.fail(
                f"partition {self.partition_id} failed: {exc_type.__name__}: {exc}",
                join=self._join_threads,
            )
