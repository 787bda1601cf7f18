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
``p.background.serve_updates`` starts, and each step is just ``get_weights`` and ``put_gradients``.

Nothing here waits on Spark: a fetch of a version blocks until the peer publishes it. The
driver makes the ``AllReduceParameter`` (its id and secret travel with the task closure);
each task calls ``connect()``, which meets the peers once and returns a
``ConnectedParameter``, to be closed (or used as a context manager) on every path.

The handle's calls are written here; what they lean on has a module each: ``spec.py``
(the settings every partition agrees on), ``step.py`` (the call order and versions),
``gradients.py`` (puts and streams of a gradient), ``encoded_puts.py`` (of one encoded
elsewhere), ``collectives.py`` (allreduce, signals: ``p.collectives``), ``owner.py`` (the
background owner: ``p.background``), ``info.py`` (what the handle is: ``p.info``),
``movement/`` (the peers and the blocks' movements).
"""

from __future__ import annotations

import itertools
import secrets
from typing import Literal

import numpy as np

from allreduce_param.engine import surroundings
from allreduce_param.engine.blocks.codec import get_codec
from allreduce_param.engine.blocks.store import BlockKind
from allreduce_param.engine.collectives import Collectives
from allreduce_param.engine.encoded_puts import EncodedPuts
from allreduce_param.engine.gradients import GradientPuts
from allreduce_param.engine.info import HandleInfo
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.arena_steps import ArenaSteps
from allreduce_param.engine.movement.movements import Movements
from allreduce_param.engine.movement.peers import PeerGroup
from allreduce_param.engine.movement.rendezvous import Rendezvous
from allreduce_param.engine.movement.sums import NonFiniteSum
from allreduce_param.engine.owner import Background
from allreduce_param.engine.spec import ParameterSpec
from allreduce_param.engine.step import StepState, handle_call
from allreduce_param.engine.strategy import Strategy
from allreduce_param.engine.stream import EncodedStream, GradientStream
from allreduce_param.engine.vectors import (
    EncodedGradient,
    SparseGradient,
    float32_vector,
    writable_output,
)
from allreduce_param.engine.wire.settings import NetworkSettings
from allreduce_param.errors import InputError

_next_param_id = itertools.count()


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
    ``host_arena`` (with shared memory, under plain BSP with lossless codecs, every
    partition on one host): the step goes through one shared arena per host instead of
    blocks: the weights live there once (each owner updates its slice in place, so
    ``send_weight_partition`` copies nothing, and ``get_weights()`` hands out a read-only
    view), and the owners sum straight from the partitions' gradients there, the same
    bits in the same order.
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

    ``network`` (a ``wire.settings.NetworkSettings``): where each partition's block server
    listens (``bind_address``: one address of its host, never every interface; default: its
    executor's address as Spark names it), the address its peers are told
    (``advertise_address``), the ports it may take (``port_range``, ``"40000-40099"``;
    default any free one), how long a connection and its handshake may take
    (``connect_timeout``), and whether the blocks that travel over TCP (to peers on other
    hosts, or to all with ``unix_sockets=False``) are encrypted (``encrypt``, AES-256-GCM,
    ``sealing.py``; Unix sockets and shared memory never leave the host and are not). Given,
    it is used as it is, with no Spark setting read. Unset (None), each of the five comes
    from the Spark settings ``spark.allreduce.bindAddress``, ``...advertiseAddress``,
    ``...portRange``, ``...connectTimeout`` and ``...encrypt`` of the driver's active
    session, when made there, else its default; ``encrypt`` unset is on where the session
    encrypts its own traffic (``spark.network.crypto.enabled`` or ``spark.ssl.enabled``
    true). Either way the environment variables ``ALLREDUCE_BIND_ADDRESS`` and
    ``ALLREDUCE_ADVERTISE_ADDRESS`` win on the host that sets them.

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
        host_arena: bool = True,
        param_id: int | None = None,
        strategy: Strategy | None = None,
        gradient_codec: str | None = None,
        topology: Literal["auto", "hierarchical", "flat"] = "auto",
        network: NetworkSettings | None = None,
    ) -> None:
        if network is None:
            network = NetworkSettings.of({}, surroundings.current().setting)
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
            host_arena=host_arena,
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
    host_arena = _spec_field("host_arena", "Whether one host's BSP step goes through an arena.")
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


class ConnectedParameter:
    """One partition's live side of an ``AllReduceParameter``; made by ``connect()``.

    Every partition must make the same calls in the same order: the n-th call of a kind on
    one partition meets the n-th call on the others (the version numbers count them). The
    step's calls are written here (BigDL's ``init``, ``get_weights``, ``put_gradients``,
    ``aggregate_gradient_partition``, ``send_weight_partition``, and what a loop needs
    beside them); the call order is ``step.StepState``'s. Three small objects it hands out
    hold the rest: ``info`` (what this handle is: ``info.HandleInfo``), ``collectives``
    (allreduce and signals: ``collectives.Collectives``) and ``background`` (the background
    owner of the strategies other than BSP: ``owner.Background``).
    """

    def __init__(self, param: AllReduceParameter, rendezvous: Rendezvous) -> None:
        spec = param.spec
        spec.check_stage(rendezvous.partition_num, repr(param))
        self._partition_id = partition_id = rendezvous.partition_id
        self._layout = layout = spec.layout
        self._allow_nonfinite = spec.allow_nonfinite
        self._state = StepState(partition_id, spec.strategy)
        self._weight: np.ndarray | None = None
        self._weights_out: np.ndarray | None = None  # what get_weights() fills when given no out
        self._peers = PeerGroup(spec, rendezvous)
        self._moves = Movements(self._peers, get_codec(spec.codec), get_codec(spec.gradient_codec))
        #: the step through the host arena, where the peer group has one (else blocks)
        self._arena = ArenaSteps.of(self._moves, layout)
        summed = None if self._arena is None else self._arena.summed_slice()
        # where the slice's mean gradient is summed: in the host arena (zeros at first, as
        # its pages are), else a vector of its own
        self._gradient = (
            np.zeros(layout.length(partition_id), dtype=np.float32) if summed is None else summed
        )
        #: allreduce, allreduce_exact, signal, wait_for_signals: ``collectives.Collectives``
        self.collectives = Collectives(self._moves, self._state)
        #: serve_updates, finish_updates, updates: ``owner.Background``
        self.background = Background(
            self._moves, self._state, layout, self._gradient, lambda: self._weight,
            self._nonfinite_check, self.collectives.allreduce_exact,
        )  # fmt: skip
        guard = self.background.failure_first
        self._gradients = GradientPuts(self._moves, layout, self._state, guard, self._arena)
        self._encoded = EncodedPuts(self._gradients)
        #: what this handle is (partition, slice, strategy, hosts, ...): ``info.HandleInfo``
        self.info = HandleInfo(
            self._state, self._peers, self._arena is not None, self._encoded.plan
        )

    # ---- the weights ---------------------------------------------------------------------

    @handle_call
    def init(self, weights: np.ndarray, step: int = 0) -> None:
        """Keep this partition's slice of ``weights`` (fp32) and publish it as the weights of
        ``step``, the global step the fit starts at (0, or the step after a checkpoint).

        Call once, before anything else, with the same full vector on every partition, or
        with this partition's own slice (what a checkpoint holds for it), and the same step.
        """
        self._state.check_init(step)
        length = self._layout.length(self._partition_id)
        own = np.asarray(weights).size == length
        vector = float32_vector(
            weights,
            length if own else self._layout.size,
            f"init(weights) on partition {self._partition_id}",
        )
        own_slice = vector if own else vector[self._layout.bounds(self._partition_id)]
        if self._arena is not None:  # the slice lives in the host's weight vector
            self._weight = self._arena.own_slice()
            np.copyto(self._weight, own_slice)
            self._arena.publish_weights(self._state.init(step))
            return
        self._weight = own_slice.copy()
        self._moves.publish(BlockKind.WEIGHT, self._state.init(step), self._weight)

    @property
    def weight_partition(self) -> np.ndarray:
        """This partition's fp32 slice of the weights (after ``init``); an optimizer updates
        it in place."""
        self._state.require_init("weight_partition")
        return self._weight

    @handle_call
    def send_weight_partition(self) -> None:
        """Publish ``weight_partition`` as the next version, for every peer's ``get_weights``.

        Call after updating the slice from ``aggregate_gradient_partition``'s result: at most
        one send per aggregate (the first may follow ``init``). A peer reads version v only
        before its own send of v+1, so the aggregate that follows our send of v+1 proves
        every peer is past its read of v. Through a host arena nothing is copied: the
        slice already lies where the peers read it.
        """
        if self._arena is not None:
            self._arena.publish_weights(self._state.send())
            return
        self._moves.publish(BlockKind.WEIGHT, self._state.send(), self._weight)

    @handle_call
    def get_weights(self, out: np.ndarray | None = None) -> np.ndarray:
        """All-gather: fetch every owner's published slice into one full float32 vector.

        After ``init``; each step's first call. Which version of each slice the strategy's
        rule gives this step: under BSP the one of this step, under the others the newest
        allowed (``info.last_read_version`` tells which); after
        ``background.finish_updates``, the final weights. Waits for slow owners up to the
        timeout. The own slice also goes through the codec, so every partition gets
        bit-identical weights. ``out`` (float32,
        ``size``) is filled and returned when given; otherwise one array the handle keeps,
        which the next ``get_weights()`` without ``out`` fills again: copy it to keep a
        version past that call. Through a host arena (``AllReduceParameter(host_arena=)``)
        no ``out`` gives a read-only view of the host's one weight vector instead, valid
        until this partition's next ``put_gradients`` (the owners then update it in
        place); ``out`` still gets a copy, to keep.
        """
        read = self._state.weight_read(self.background.final_steps)
        if self._arena is not None:
            if out is not None:
                out = writable_output(
                    out, self._layout.size, f"get_weights(out=) on partition {self._partition_id}"
                )
            out = self._arena.gather(read.version, out)
            self._state.weights_read(read.version)
            self._gradients.weights_read()
            return out
        if out is None:
            if self._weights_out is None:
                self._weights_out = np.empty(self._layout.size, dtype=np.float32)
            out = self._weights_out
        out = writable_output(
            out, self._layout.size, f"get_weights(out=) on partition {self._partition_id}"
        )
        with self.background.failure_first():
            lowest = self._moves.gather(BlockKind.WEIGHT, read, self._layout, out)
        self._state.weights_read(lowest)
        self._gradients.weights_read()  # every peer has summed the last gradient put in place
        return out

    # ---- the gradients -------------------------------------------------------------------

    @handle_call
    def put_gradients(
        self,
        gradients: np.ndarray | SparseGradient | EncodedGradient,
        count: float = 1.0,
        residual: np.ndarray | None = None,
    ) -> None:
        """Publish the local gradient sum, cut into one chunk per owner, with its sample count.

        ``gradients`` is the sum over this partition's ``count`` samples (count may be 0
        for an empty partition), so the owners can divide by the total count. Under BSP
        call it once per step, after ``get_weights``, then ``aggregate_gradient_partition``;
        under the other strategies once per ``get_weights`` (with backup workers the
        gradient belongs to the weights read). Under BSP keep ``gradients`` unchanged until
        ``aggregate_gradient_partition`` returns, as with any asynchronous collective: with
        an exact codec the own chunk is summed from it there, not from a copy (and the
        ``gradient_buffer()`` is not copied at all). NaN/Inf are found by the owners as
        they sum (one pass fewer than checking here): the owner's call raises
        ``NonFiniteGradientError`` naming this partition, the step and the index, unless
        the parameter allows them.

        ``residual``: error feedback for a lossy codec. A float32 vector of ``size``,
        zeros at first, that the caller keeps across steps and does not touch: what the
        codec's rounding took from this partition's gradients is added back at the next
        put, so the rounding errors do not add up over the steps.

        ``gradients`` may be a ``SparseGradient`` (its touched elements' indices and values,
        every other element zero): then only those travel, as (index, value) pairs cut by
        owner, and each owner sums them into its dense slice with the bits the dense vector
        would have given (``movement/touched.py``). Plain BSP, a lossless gradient codec and
        a flat topology only; every partition puts a ``SparseGradient`` at the same step, or
        none does. It costs one small exact allreduce more (the pairs' counts).

        ``gradients`` may be an ``EncodedGradient``: a gradient whose lossy codec ran
        elsewhere (the GPU that computed it: ``models.device_codecs``), its payload the
        streams of every part of ``info.gradient_put_plan`` (the caller keeps the error
        feedback residual, so no ``residual=`` here). Only the block headers are written
        here: the same blocks as the float32 put with its residual, so the same bits are
        summed, and a NaN/Inf still reaches the owners (every lossy codec decodes it to
        NaN). Any strategy, either topology; the payload may be reused once this returns.
        Refused (``InputError``) where the plan has a ``refusal`` (``encoded_puts.py``).
        """
        if isinstance(gradients, EncodedGradient):
            self._encoded.put(gradients.payload, count, residual)
        elif isinstance(gradients, SparseGradient):
            self._gradients.put_touched(
                gradients, count, residual, self.collectives.allreduce_exact
            )
        else:
            self._gradients.put(gradients, count, residual)

    @handle_call
    def stream_gradients(
        self,
        gradients: np.ndarray | None = None,
        count: float = 1.0,
        residual: np.ndarray | None = None,
        *,
        encoded: bool = False,
    ) -> GradientStream | EncodedStream:
        """``put_gradients``, chunk by chunk, while ``gradients`` is still being computed: a
        ``GradientStream`` to tell ``ready(start, stop)`` as ranges become final, and to
        close (``with p.stream_gradients(...) as stream:``) once all are. The same bits are
        published, and the same call order holds: the stream takes the place of the step's
        put. Arguments as for ``put_gradients`` (``count`` is needed at once: every chunk
        carries it); how it publishes: ``GradientPuts.stream``.

        ``encoded=True`` (with no ``gradients``): an ``EncodedGradient`` put, owner by owner,
        while the rest of the gradient is still being computed and encoded: an
        ``EncodedStream`` to hand each owner's bytes (``ready(owner, payload)``: the streams
        of its parts, laid out as ``info.gradient_put_plan.owner_span(owner)`` says) as soon
        as they are made, and to close once every owner's are. The same blocks, errors and
        call order as ``put_gradients(EncodedGradient(...))``: ``EncodedPuts.stream``.
        """
        if encoded:
            return self._encoded.stream(count, gradients, residual)
        if gradients is None:
            raise InputError(
                f"stream_gradients() on partition {self._partition_id}: give the float32 "
                "gradients vector being computed (or encoded=True for a gradient encoded elsewhere)"
            )
        return self._gradients.stream(gradients, count, residual)

    @handle_call
    def gradient_buffer(self) -> np.ndarray:
        """A float32 vector of ``size`` (zeros at first) to compute the gradient into, at any
        point after ``connect()``: the same array on every call, valid until the handle closes; under BSP with the raw
        codec, put where it lies, not copied (``GradientPuts.buffer``)."""
        return self._gradients.buffer()

    @handle_call
    def aggregate_gradient_partition(self, avg: float | None = None) -> np.ndarray:
        """Reduce-scatter: sum this slice's chunk from every partition and divide.

        Fetches chunk ``info.partition_id`` of the last ``put_gradients`` from every peer, sums in
        partition order in fp32, then divides by ``avg`` when given, else by the summed
        sample counts (the exact mean over all samples). Returns this slice's mean gradient,
        which the next call overwrites (through a host arena on one host, the next
        ``put_gradients`` already: it lies in this partition's gradient vector, so a host
        keeps no vector more for it; copy it to keep it longer). BSP only, after the step's ``put_gradients`` (or
        its stream, closed): under the other strategies the background owner does this.
        """
        version = self._state.check_aggregate()
        if avg is not None and not float(avg) > 0:
            raise InputError(
                f"aggregate_gradient_partition(avg={avg!r}) on partition {self._partition_id}: "
                "avg must be a positive number"
            )

        def divisor(total: float) -> float | None:
            return (total if total > 0 else None) if avg is None else float(avg)

        check = self._nonfinite_check(version)
        total = self._gradients.reduce(version, self._gradient, divisor, check)
        self._state.aggregated()
        if avg is None and not total > 0:
            raise InputError(
                f"step {version} has nothing to divide by: every partition put count=0; "
                "pass avg= or put a positive count"
            )
        return self._gradient

    def _nonfinite_check(self, version: int) -> NonFiniteSum | None:
        """What checks this slice's summed gradients of ``version`` for NaN/Inf, unless allowed."""
        start = self._layout.start(self._partition_id)
        return None if self._allow_nonfinite else NonFiniteSum(version, start)

    # ---- closing -------------------------------------------------------------------------

    def close(self) -> None:
        """Finish cleanly: tell every peer we are done, wait until they are, then stop serving.

        A partition that finishes first keeps serving its last blocks until every peer has
        said it fetched them (or the timeout passes), so no peer loses a block it needs.
        """
        self._peers.close(join=self._join_threads)

    def _join_threads(self) -> None:
        """End the handle's threads: the background owner's, the publishing one."""
        self.background.stop()
        self._gradients.close()

    def __enter__(self) -> ConnectedParameter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            self._peers.fail(
                f"partition {self._partition_id} failed: {exc_type.__name__}: {exc}",
                join=self._join_threads,
            )
