"""AllReduceParameter: a float32 vector kept in sync across the partitions of a barrier stage.

Partition ``i`` of ``N`` owns slice ``i`` of the vector (``layout.SliceLayout``). Each step:

1. ``get_weights``: all-gather. Fetch every owner's published weight slice.
2. ``put_gradients``: cut the local gradient into N chunks and publish chunk ``j`` for owner ``j``.
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

import contextlib
import functools
import itertools
import logging
import secrets
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Literal

import numpy as np

from .codec import Codec, get_codec
from .errors import (
    AllReduceError,
    AuthenticationError,
    ConfigurationError,
    CorruptBlockError,
    InputError,
    NonFiniteGradientError,
    PeerLostError,
    UsageError,
)
from .layout import SliceLayout, split
from .rendezvous import BarrierRendezvous, Rendezvous
from .shm import SharedArenas, shared_memory_available
from .store import EVERY_PARTITION, BlockKey, BlockKind, BlockStore
from .strategy import Strategy, WeightRead
from .transport import BlockServer, PeerClient, local_scope

log = logging.getLogger(__name__)

_next_param_id = itertools.count()

#: Elements per part: blocks travel in parts of at most this many values (2 MiB of
#: float32), so that encoding, the wire and summing overlap (see the movements below).
PART_LENGTH = 1 << 19

#: How long, at most, a partition that failed keeps answering its peers with the reason
#: before it stops: only for a clearer message (the root cause in every peer's error), so
#: it is short, and it ends as soon as every peer has hung up.
FAILURE_LINGER_SECONDS = 10.0

#: The most a part can take encoded, whatever the codec: what a shared send buffer holds.
_LARGEST_PART = get_codec("raw").max_encoded_size(PART_LENGTH)


class AllReduceParameter:
    """The driver's description of one synchronised vector: its size, partitions, codec, secret.

    Make it on the driver and use it inside ``rdd.barrier().mapPartitions(task)``: every
    task calls ``connect()``. ``timeout`` bounds every wait for a peer, in seconds;
    ``fetch_threads`` is how many peers are fetched from at once (default: all);
    ``allow_nonfinite`` lets NaN/Inf gradients through instead of raising;
    ``unix_sockets`` lets peers on the same host talk over Unix sockets (Linux), which are
    faster than loopback TCP; cross-host peers always use TCP. ``shared_memory`` (with
    Unix sockets) lets such peers read each other's blocks in place from shared memory.
    ``strategy`` says how the partitions synchronise (``Strategy``; default BSP).
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
    ) -> None:
        self.layout = SliceLayout(size, partition_num)
        self.strategy = strategy or Strategy()
        self.strategy.check_partitions(partition_num)
        get_codec(codec)  # an unknown codec fails here, on the driver, not in every task
        if not timeout > 0:
            raise ConfigurationError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if fetch_threads is not None and fetch_threads < 1:
            raise ConfigurationError(f"fetch_threads must be at least 1, got {fetch_threads!r}")
        self.codec = codec
        self.timeout = float(timeout)
        self.fetch_threads = fetch_threads
        self.allow_nonfinite = allow_nonfinite
        self.unix_sockets = unix_sockets
        self.shared_memory = shared_memory
        self.param_id = next(_next_param_id) if param_id is None else int(param_id)
        self.secret = secrets.token_bytes(32)

    @property
    def size(self) -> int:
        """How many float32 elements the synchronised vector has."""
        return self.layout.size

    @property
    def partition_num(self) -> int:
        """How many partitions (barrier tasks) share the vector."""
        return self.layout.partition_num

    def __repr__(self) -> str:
        return (f"AllReduceParameter(partition_num={self.partition_num}, size={self.size}, "
                f"codec={self.codec!r}, strategy={self.strategy.name!r}, param_id={self.param_id})")

    def connect(self, rendezvous: Rendezvous | None = None) -> ConnectedParameter:
        """Inside a task: start serving, meet the peers, and return this partition's handle.

        With no ``rendezvous`` the peers meet through the Spark barrier stage's
        ``allGather`` (about one second, once). Close the handle on every path, best with
        ``with param.connect() as p:``.
        """
        return ConnectedParameter(self, rendezvous or BarrierRendezvous())


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


def _recheck(block: memoryview, header, what: str) -> None:
    """Raise if a block read in place was rewritten while it was read."""
    if not Codec.unchanged(block, header):
        raise CorruptBlockError(f"{what} was rewritten while it was read in place: a protocol slip (its owner "
                                "reused the buffer of a version still being read)")


class _Channel:
    """One thread's way to the peers: its own connections, fetch threads and landing buffers.

    The worker and a background owner each fetch through their own channel, so that an
    owner waiting for a slow partition's gradient never holds up the worker's reads. A
    fetched block stays valid (in a receive buffer, a scratch array, or a peer's shared
    memory) until the channel fetches the same source's next one.
    """

    def __init__(self, clients: dict[int, PeerClient], threads: int, name: str) -> None:
        self.clients = clients
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name) if threads else None
        self.reader = object()  # who reads the own store through this channel (for its holds)
        self._receive: dict[int, bytearray] = {}
        self._scratch: dict[int, np.ndarray] = {}

    def receive_buffer(self, source: int, nbytes: int) -> memoryview:
        """Where ``source``'s blocks land: reused, replaced by a larger one when too small."""
        buffer = self._receive.get(source)
        if buffer is None or len(buffer) < nbytes:
            buffer = self._receive[source] = bytearray(nbytes)
        return memoryview(buffer)

    def scratch(self, source: int, length: int) -> np.ndarray:
        """Float32 room to decode ``source``'s lossy blocks into, reused across fetches."""
        scratch = self._scratch.get(source)
        if scratch is None or scratch.size < length:
            scratch = self._scratch[source] = np.empty(length, dtype=np.float32)
        return scratch

    def abort(self) -> None:
        for client in self.clients.values():
            client.abort()

    def close(self) -> None:
        """Stop the fetch threads (after ``abort`` wakes any that wait) and the connections."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        for client in self.clients.values():
            client.close()


class ConnectedParameter:
    """One partition's live side of an ``AllReduceParameter``; made by ``connect()``.

    Every partition must make the same calls in the same order: the n-th call of a kind on
    one partition meets the n-th call on the others (the version numbers count them).
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
        self._param = param
        self._codec = get_codec(param.codec)
        self._versions = {BlockKind.WEIGHT: -1, BlockKind.GRADIENT: -1, BlockKind.REDUCE_INPUT: -1}
        self._weight: np.ndarray | None = None
        self._gradient = np.zeros(self.slice_length, dtype=np.float32)
        self._weights_out: np.ndarray | None = None  # what get_weights() fills when given no out
        self._gradient_pending = False
        # sends since the last aggregate: a second one could rewrite a version a peer still reads
        self._sends_since_aggregate = 0
        self._start = 0  # the global step the fit starts at (past a checkpoint when resumed)
        self._last_read = -1  # the lowest weight version the last get_weights took
        self._puts = 0  # gradients put so far, counted from the first step
        self._owner = None  # the background owner, under strategies other than plain BSP
        self._finished = False
        self._closed = False
        self._failure: BaseException | None = None  # what made a call fail partway
        self._done_peers: set[int] = set()
        self._done_changed = threading.Condition()

        # where blocks are encoded: shared memory peers on this host read in place, or bytearrays
        self._shared = SharedArenas() if param.unix_sockets and param.shared_memory \
            and shared_memory_available() else None
        self._store = BlockStore(keep=self.strategy.keep(), wait_for_readers=self.strategy.waits_for_readers(),
                                 reuse_at_once=self.strategy.read_before_next(), new_buffer=self._new_buffer)
        host, port = rendezvous.bind_address()
        self._server = BlockServer(
            self._store, param.secret, param.param_id, self.partition_id, host, port,
            partition_num=self.partition_num, on_done=self._peer_done, unix=param.unix_sockets,
            shared=self._shared, max_wait=param.timeout,
        )
        self._addresses: list = []
        self._channels: list[_Channel] = []
        try:
            self._addresses = rendezvous.exchange(self._server.advertised_address)
            peers = self.partition_num - 1
            self._worker = self._channel(min(param.fetch_threads or peers, peers), "fetch")
            # small blocks (choices, signals) on connections of their own, made at first use:
            # a background owner's channel may be waiting for a straggler's gradient meanwhile
            self._control = self._channel(1, "control")
        except BaseException:
            self._shutdown()
            raise
        self._peers = self._worker.clients

    def _channel(self, threads: int, role: str) -> _Channel:
        """A new set of connections to every peer (each connects on first use)."""
        clients = {}
        for peer in range(self.partition_num):
            if peer == self.partition_id:
                continue
            host, port, *local = self._addresses[peer]
            same_scope = len(local) == 2 and local[1] == local_scope()  # the same machine and network namespace
            clients[peer] = PeerClient(
                (host, port), self._param.secret, self._param.param_id, self.partition_id, peer,
                self._param.timeout,
                local_name=local[0] if same_scope else None,  # a Unix socket, and shared memory if on
            )
        channel = _Channel(clients, threads, f"allreduce-{role}-{self.partition_id}")
        self._channels.append(channel)
        return channel

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
            raise InputError(f"init(step={step!r}) on partition {self.partition_id}: a whole number >= 0")
        own = np.asarray(weights).size == self.slice_length
        vector = self._vector(weights, self.slice_length if own else self.layout.size, "init(weights)")
        self._weight = (vector if own else vector[self.layout.bounds(self.partition_id)]).copy()
        self._start = self._puts = int(step)
        self._last_read = self._versions[BlockKind.GRADIENT] = self._start - 1
        self._versions[BlockKind.WEIGHT] = self.strategy.weight_version(self._start, 0)
        self._publish(BlockKind.WEIGHT, self._versions[BlockKind.WEIGHT], self._weight)

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
        self._publish(BlockKind.WEIGHT, self._versions[BlockKind.WEIGHT], self._weight)

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
            self._last_read = self._gather(BlockKind.WEIGHT, read, self.layout, out)
        return out

    @property
    def last_read_version(self) -> int:
        """The lowest weight version (over the slices) the last ``get_weights`` took."""
        return self._last_read

    # ---- the gradients -------------------------------------------------------------------

    @_call
    def put_gradients(self, gradients: np.ndarray, count: float = 1.0) -> None:
        """Publish the local gradient sum, cut into one chunk per owner, with its sample count.

        ``gradients`` is the sum over this partition's ``count`` samples (count may be 0
        for an empty partition), so the owners can divide by the total count. NaN/Inf raise
        ``NonFiniteGradientError`` unless the parameter allows them. Under BSP call it once
        per step, then ``aggregate_gradient_partition``; under the other strategies once
        per ``get_weights`` (with backup workers the gradient belongs to the weights read).
        """
        if self._gradient_pending:
            raise UsageError(
                f"put_gradients() was called twice on partition {self.partition_id} without "
                "aggregate_gradient_partition() in between"
            )
        vector = self._vector(gradients, self.layout.size, "put_gradients(gradients)")
        if not float(count) >= 0:
            raise InputError(f"put_gradients(count={count!r}) on partition {self.partition_id}: "
                             "the sample count must be a number >= 0")
        if self.strategy.inline_owner:
            version = self._versions[BlockKind.GRADIENT] + 1
        elif self.strategy.asynchronous:
            version = self._puts
        else:  # backup workers: the step of the weights it was computed from
            if self._last_read <= self._versions[BlockKind.GRADIENT]:
                raise UsageError(
                    f"put_gradients() on partition {self.partition_id} came without a get_weights() "
                    "before it: with backup workers a gradient belongs to the weights it was computed from"
                )
            version = self._last_read
        self._versions[BlockKind.GRADIENT] = version
        # Checked part by part as each is published, so the check overlaps the peers' fetches;
        # a NaN found then fails this partition, and with it the step on every peer.
        inspect = None if self._param.allow_nonfinite else functools.partial(self._check_finite, version)
        with self._owner_failure_first():
            self._scatter(BlockKind.GRADIENT, version, vector, self.layout, float(count), inspect)
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
        if not self._gradient_pending:
            raise UsageError(
                f"aggregate_gradient_partition() on partition {self.partition_id} came before "
                "put_gradients() for this step"
            )
        version = self._versions[BlockKind.GRADIENT]
        total = self._reduce(BlockKind.GRADIENT, version, self.layout, self._gradient)
        self._gradient_pending = False
        self._sends_since_aggregate = 0
        divisor = total if avg is None else float(avg)
        if not divisor > 0:
            raise InputError(
                f"step {version} has nothing to divide by: "
                + ("every partition put count=0; pass avg= or put a positive count"
                   if avg is None else f"avg={avg!r} must be positive")
            )
        self._gradient /= np.float32(divisor)
        return self._gradient

    @property
    def gradient_partition(self) -> np.ndarray:
        """The last result of ``aggregate_gradient_partition``: this slice's mean gradient."""
        return self._gradient

    # ---- the background owner (strategies other than plain BSP) ----------------------------

    @_call
    def serve_updates(self, update: Callable[[np.ndarray, np.ndarray, int], None], steps: int,
                      on_steps_done: Callable[[int], None] | None = None) -> None:
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
        from .owner import BackgroundOwner

        self._require_init("serve_updates()")
        if self.strategy.inline_owner:
            raise UsageError("serve_updates() is for the strategies with a background owner; under plain "
                             "BSP a step calls aggregate_gradient_partition and send_weight_partition itself")
        if self._owner is not None:
            raise UsageError(f"serve_updates() was called twice on partition {self.partition_id}")
        self._owner = BackgroundOwner(self, self._channel(self.partition_num, "owner"), self._control, update,
                                      int(steps), on_steps_done)

    @_call
    def finish_updates(self) -> None:
        """Wait until every owner has applied every partition's gradients; afterwards
        ``get_weights`` gives the final weights. Ends with one exact allreduce as a barrier.
        """
        if self._owner is None:
            raise UsageError("finish_updates() came before serve_updates()")
        self._owner.join()
        with self._owner_failure_first():
            self.allreduce(np.zeros(1, np.float32), codec="raw")  # every owner has published its last
        self._finished = True

    # ---- signals ---------------------------------------------------------------------------

    @_call
    def signal(self, version: int) -> None:
        """Tell every partition this one has done ``version`` of something (e.g. written a
        checkpoint); see ``wait_for_signals``. Versions must increase."""
        self._publish(BlockKind.SIGNAL, version, np.ones(1, np.float32), codec=get_codec("raw"))

    @_call
    def wait_for_signals(self, version: int) -> None:
        """Wait until every partition has signalled ``version`` (or a later one)."""
        pending = self._fetch_all(self._control, BlockKind.SIGNAL, WeightRead(version, exact=False), None,
                                  EVERY_PARTITION, codec=get_codec("raw"), lengths=1)
        for futures in pending.values():
            futures[-1].result()

    @contextlib.contextmanager
    def _owner_failure_first(self):
        """A call that fails after the background owner failed raises the owner's error: the
        root cause, which the call's own error (a store closed, a peer gone) only follows from."""
        try:
            yield
        except Exception as error:
            failure = None if self._owner is None else self._owner.error
            if failure is not None and failure is not error:
                raise failure from error
            raise

    @property
    def updates(self) -> list:
        """The background owner's updates so far: which partitions' gradients each one took."""
        return [] if self._owner is None else list(self._owner.updates)

    # ---- any vector ----------------------------------------------------------------------

    @_call
    def allreduce(self, values: np.ndarray, op: Literal["sum", "mean"] = "sum",
                  codec: str | None = None) -> np.ndarray:
        """Sum (or average over partitions) a float32 vector of any length across partitions.

        A reduce-scatter then an all-gather, like a step, through the parameter's codec or
        ``codec`` (``"raw"`` for counts and metrics that a lossy codec would round). Every
        partition must call it with a vector of the same length; all get the same result.
        """
        if op not in ("sum", "mean"):
            raise InputError(f"allreduce(op={op!r}): op must be 'sum' or 'mean'")
        chosen = self._codec if codec is None else get_codec(codec)
        vector = self._vector(values, None, "allreduce(values)")
        layout = SliceLayout(vector.size, self.partition_num)
        version = self._versions[BlockKind.REDUCE_INPUT] = self._versions[BlockKind.REDUCE_INPUT] + 1
        self._scatter(BlockKind.REDUCE_INPUT, version, vector, layout, 1.0, codec=chosen)
        reduced = np.empty(layout.length(self.partition_id), dtype=np.float32)
        self._reduce(BlockKind.REDUCE_INPUT, version, layout, reduced, codec=chosen)
        if op == "mean":
            reduced /= np.float32(self.partition_num)
        self._publish(BlockKind.REDUCE_OUTPUT, version, reduced, codec=chosen)
        out = np.empty(vector.size, dtype=np.float32)
        self._gather(BlockKind.REDUCE_OUTPUT, WeightRead(version, exact=True), layout, out, codec=chosen)
        return out

    # ---- the four movements, written once --------------------------------------------------
    #
    # A block of more than PART_LENGTH elements travels as several parts: a peer fetches
    # part k while the owner still encodes part k+1, and the receiver sums part k while
    # part k+1 is on the wire. Each element is still summed in partition order.

    def _publish(self, kind: int, version: int, values: np.ndarray, destination: int = EVERY_PARTITION,
                 count: float = 0.0, inspect: Callable[[int, np.ndarray], None] | None = None,
                 offset: int = 0, codec=None) -> None:
        """Encode ``values`` part by part and put each in the own store as ``version``.

        Each part is encoded into a buffer the store gives out, which no reader still uses.
        ``inspect(index, part)``, if given, sees each part (``index`` counted from ``offset``)
        just after it is published, while the peers may already be fetching it.
        """
        for part, (start, length) in enumerate(split(values.size, PART_LENGTH)):
            key = BlockKey(kind, self.partition_id, destination, part)
            buffer = self._store.reserve(key, version, self._param.timeout)
            block = (codec or self._codec).encode(values[start:start + length], count=count, out=buffer,
                                                  ids=(kind, self.partition_id, destination, part, version),
                                                  checksum=False)  # sealed if it is ever sent
            self._store.put(key, version, block, buffer=buffer)
            del block  # the store holds its own view; ours would pin the buffer's size
            if inspect is not None:
                inspect(offset + start, values[start:start + length])

    def _new_buffer(self):
        """Room to encode one part into: shared memory when peers may read it in place."""
        return bytearray() if self._shared is None else self._shared.buffer(_LARGEST_PART)

    def _scatter(self, kind: int, version: int, vector: np.ndarray, layout: SliceLayout, count: float,
                 inspect: Callable[[int, np.ndarray], None] | None = None, codec=None) -> None:
        """Publish chunk ``j`` of ``vector`` for owner ``j``; the peers' first, the own last."""
        for step in range(1, self.partition_num + 1):
            owner = (self.partition_id + step) % self.partition_num
            self._publish(kind, version, vector[layout.bounds(owner)], destination=owner, count=count,
                          inspect=inspect, offset=layout.start(owner), codec=codec)

    def _reduce(self, kind: int, version: int, layout: SliceLayout, out: np.ndarray, codec=None) -> float:
        """Sum the own chunk of every partition into ``out``, in partition order; the summed counts."""
        pending = self._fetch_all(self._worker, kind, WeightRead(version, exact=True), layout,
                                  destination=self.partition_id, codec=codec)
        return self._sum(pending, range(self.partition_num), out)

    @staticmethod
    def _sum(pending: dict[int, list[Future]], sources, out: np.ndarray) -> float:
        """Sum the fetched chunks of ``sources`` into ``out``, in the order given; their counts."""
        total = 0.0
        for part, (start, length) in enumerate(split(out.size, PART_LENGTH)):
            target = out[start:start + length]
            partial = None  # the sum so far: the first source's own values, then target
            rechecks = []  # for values read in place, once they are used
            for source in sources:
                _, count, values, recheck = pending[source][part].result()
                if partial is None:
                    partial = values
                else:  # the first two are added in one pass, not copied and then added
                    np.add(partial, values, out=target)
                    partial = target
                if recheck is not None:
                    rechecks.append(recheck)
                if part == 0:
                    total += count
            if partial is not None and partial is not target:  # a single source
                np.copyto(target, partial)
            for recheck in rechecks:
                recheck()
        return total

    def _gather(self, kind: int, read: WeightRead, layout: SliceLayout, out: np.ndarray, codec=None) -> int:
        """Fetch every owner's slice into its place in ``out``; the lowest version taken."""
        pending = self._fetch_all(self._worker, kind, read, layout, destination=EVERY_PARTITION, codec=codec)
        lowest = None
        for owner in range(self.partition_num):
            base = layout.start(owner)
            for part, (start, length) in enumerate(split(layout.length(owner), PART_LENGTH)):
                version, _, values, recheck = pending[owner][part].result()
                np.copyto(out[base + start:base + start + length], values)
                if recheck is not None:
                    recheck()
                lowest = version if lowest is None else min(lowest, version)
        return lowest

    def _fetch_all(self, channel: _Channel, kind: int, read: WeightRead, layout: SliceLayout | None,
                   destination: int, codec=None, sources=None, follow_first: bool = False,
                   lengths: int | None = None) -> dict[int, list[Future]]:
        """Start fetching every part of block ``(kind, j, destination)`` from each partition ``j``
        of ``sources`` (default: all), as ``read`` says: each part on its own, or with
        ``follow_first`` every part in the version the first part came in. ``lengths``: the
        one length every source's block has (a control block), instead of ``layout``'s.

        ``result[j][k]`` is a future of part k's ``(version, count, values, recheck)``; values
        stay valid until the channel's next fetch from ``j``. ``recheck``, for a block read in
        place (the own store, a peer's shared memory), raises if the block was rewritten
        while it was read: call it after using the values. With the worker's channel the own blocks
        are read from the own store at once; otherwise, and for each peer, one pool thread
        fetches the parts in order.
        """
        pending: dict[int, list[Future]] = {}
        for source in range(self.partition_num) if sources is None else sources:
            slice_length = lengths if lengths is not None else \
                layout.length(source if destination == EVERY_PARTITION else destination)
            parts = split(slice_length, PART_LENGTH)
            futures = [Future() for _ in parts]
            arguments = (channel, source, kind, read, destination, parts, futures, codec or self._codec, follow_first)
            if source == self.partition_id and channel is self._worker:
                self._fetch_parts(*arguments)
            else:
                channel.pool.submit(self._fetch_parts, *arguments)
            pending[source] = futures
        return pending

    def _fetch_parts(self, channel: _Channel, source: int, kind: int, read: WeightRead, destination: int,
                     parts: list[tuple[int, int]], futures: list[Future], codec, follow_first: bool) -> None:
        """Fetch and decode ``source``'s parts in order, resolving one future per part.

        A failure fails this part and every later one, so the caller sees it where it waits.
        """
        sizes = [codec.max_encoded_size(length) for _, length in parts]
        local = source == self.partition_id
        # a peer on this host with shared memory is read in place: no receive buffer
        shared = not local and self._shared is not None and channel.clients[source].local_name is not None
        receive = None if local or shared else channel.receive_buffer(source, sum(sizes))
        offset = 0
        for part, ((start, length), size) in enumerate(zip(parts, sizes)):
            key = BlockKey(kind, source, destination, part)
            try:
                if local:
                    version, block = self._store.get(key, read.version, self._param.timeout,
                                                     newest=not read.exact, reader=channel.reader)
                else:
                    version, block = channel.clients[source].fetch(
                        key, read.version, size, None if receive is None else receive[offset:offset + size],
                        shared, newest=not read.exact)
                header, values = codec.decode(
                    block, length, scratch=channel.scratch(source, start + length)[start:start + length],
                    what=key.describe(version), expect=(kind, source, destination, part, version),
                    checksum=not (local or shared),  # in place: never left this host's memory
                )
            except BaseException as error:
                if isinstance(error, (PeerLostError, AuthenticationError)):
                    self._peer_done(source)  # gone, or not of this parameter: it fetches nothing from us
                for future in futures[part:]:
                    future.set_exception(error)
                return
            recheck = functools.partial(_recheck, block, header, key.describe(version)) if local or shared else None
            futures[part].set_result((version, header.count, values, recheck))
            offset += size
            if follow_first:
                read = WeightRead(version, exact=True)

    # ---- checks --------------------------------------------------------------------------

    def _vector(self, values, size: int | None, what: str) -> np.ndarray:
        array = np.asarray(values)
        if array.ndim != 1 or (size is not None and array.size != size) or array.size == 0:
            expected = f"a 1-D vector of {size} elements" if size is not None else "a non-empty 1-D vector"
            raise InputError(
                f"{what} on partition {self.partition_id}: expected {expected}, got shape {array.shape}"
            )
        if not np.issubdtype(array.dtype, np.floating):
            raise InputError(
                f"{what} on partition {self.partition_id}: expected floating-point values, got dtype "
                f"{array.dtype}; convert with .astype(np.float32)"
            )
        return np.ascontiguousarray(array, dtype=np.float32)

    def _check_finite(self, version: int, offset: int, values: np.ndarray) -> None:
        """Raise if ``values`` (the gradient from index ``offset`` on) holds NaN or Inf."""
        # One cheap pass: a sum is finite unless a value is NaN/Inf (or the sum overflows,
        # which the exact check below then clears).
        if np.isfinite(values.sum()) or np.isfinite(values).all():
            return
        bad = np.flatnonzero(~np.isfinite(values))
        raise NonFiniteGradientError(
            f"the gradient of partition {self.partition_id} for step {version} holds NaN/Inf "
            f"(first at index {offset + bad[0]}: {values[bad[0]]}); the model diverged or the "
            "data holds NaN. Lower the learning rate or clean the data, or pass "
            "AllReduceParameter(allow_nonfinite=True) to let them through"
        )

    def _require_init(self, what: str) -> None:
        if self._weight is None:
            raise UsageError(f"{what} on partition {self.partition_id} came before init(weights)")

    def _require_inline(self, what: str) -> None:
        if not self.strategy.inline_owner:
            raise UsageError(f"{what} is BSP's; under {self.strategy.name!r}"
                             f"{' with backup workers' if self.strategy.backup_workers else ''} the "
                             "background owner that serve_updates() starts aggregates and publishes")

    @staticmethod
    def _output(out: np.ndarray | None, size: int) -> np.ndarray:
        if out is None:
            return np.empty(size, dtype=np.float32)
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (size,) \
                or not out.flags.c_contiguous:
            raise InputError(f"out must be a contiguous float32 array of shape ({size},)")
        return out

    # ---- closing -------------------------------------------------------------------------

    def _peer_done(self, partition: int) -> None:
        with self._done_changed:
            self._done_peers.add(partition)
            self._done_changed.notify_all()

    def close(self) -> None:
        """Finish cleanly: tell every peer we are done, wait until they are, then stop serving.

        A partition that finishes first keeps serving its last blocks until every peer has
        said it fetched them (or the timeout passes), so no peer loses a block it needs.
        """
        if self._closed:
            return
        try:
            for client in self._peers.values():
                try:
                    client.done()
                except AllReduceError as error:
                    log.warning("partition %d: %s", self.partition_id, error)
            with self._done_changed:
                finished = self._done_changed.wait_for(
                    lambda: len(self._done_peers) >= len(self._peers), timeout=self._param.timeout
                )
            if not finished:
                missing = sorted(set(self._peers) - self._done_peers)
                log.warning("partition %d closed before partitions %s said they were done",
                            self.partition_id, missing)
        finally:
            self._shutdown()

    def _fail(self, reason: str) -> None:
        """Stop after an error, telling the peers why.

        Every fetch a peer makes is answered with ``reason`` (so its error names the root
        cause, whichever failure Spark reports first) until each peer has hung up, said it
        is done, is known to be gone, or refused us for want of our secret (then it is not
        of this parameter), or ``FAILURE_LINGER_SECONDS`` pass; then it stops.
        """
        if self._closed:  # closed already (e.g. close() then an error): nothing left to say
            return
        self._store.close(reason)
        for channel in self._channels:
            channel.abort()
        with self._done_changed:
            self._done_changed.wait_for(lambda: len(self._done_peers) >= len(self._peers),
                                        timeout=min(self._param.timeout, FAILURE_LINGER_SECONDS))
        self._shutdown()

    def _shutdown(self) -> None:
        """Stop at once: cut the connections, stop the fetch threads and the server. Once."""
        if self._closed:
            return
        self._closed = True
        for channel in self._channels:
            channel.abort()
        self._server.close()  # also closes the store, which ends a background owner's waits
        if self._owner is not None:
            self._owner.join(raise_error=False)
        for channel in self._channels:
            channel.close()
        if self._shared is not None:
            self._shared.close()

    def __enter__(self) -> ConnectedParameter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            self._fail(f"partition {self.partition_id} failed: {exc_type.__name__}: {exc}")
