"""AllReduceProcessGroup: a ``torch.distributed`` process group whose collectives run on one
partition's engine handle (``ConnectedParameter.collectives``).

``DistributedDataParallel``, FSDP and ``torch.distributed``'s functions call a process group's
methods with lists of tensors and an options object, and wait on the ``Work`` it returns.
Here every call is queued, in call order, to the group's one thread, which runs it on the
engine's typed collectives (``engine/typed_collectives.py``: raw bytes, combined at each
slice's owner in the tensors' dtype in rank order, so every rank gets the same bits) and
then resolves the Work's future: an ``async_op=True`` call, or DDP's bucket allreduce,
overlaps whatever the caller does next. A call that fails fails its Work (``wait()``
raises the engine's error, naming the peer or what was wrong) and the handle, as any
failed collective does; later calls fail at once.

What maps onto what: ``allreduce`` (SUM, AVG, MIN, MAX, PRODUCT) and ``reduce`` are a
``reduce_scatter`` then an ``all_gather`` of the tensors' values; ``broadcast`` and
``scatter`` are the engine's ``broadcast``; ``allgather``, ``all_gather_single`` (torch's
``all_gather_into_tensor``) and ``gather`` its ``all_gather``; ``reduce_scatter`` and
``reduce_scatter_single`` (``reduce_scatter_tensor``) its ``reduce_scatter``; ``barrier``
an all-gather of one byte. Several tensors in one call (DDP's coalesced buckets) travel
as one vector. Point-to-point calls and all-to-all are refused with an error saying so.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from allreduce_param.engine import ConnectedParameter, SliceLayout
from allreduce_param.errors import InputError, UsageError
from allreduce_param.torch_backend.tensors import (
    FlatValues,
    HostBuffers,
    as_tensor_values,
    common_dtype,
)
from allreduce_param.torch_backend.work import CallThread, EngineWork

#: The backend's name, for ``init_process_group(backend=...)`` and ``getBackendName()``.
BACKEND = "allreduce_param"

#: The largest allreduce, in bytes, that runs on the caller's thread when every peer already
#: waits in it (and the group's thread is idle): DDP's last bucket, issued as backward ends
#: and waited for at once, then moves without the two thread hand-offs on the step's
#: critical path. Larger calls stay on the group's thread, where they overlap what the
#: caller does next (DDP's first bucket is 1 MiB).
CALLER_BYTES = 1 << 20

_OPS = {
    dist.ReduceOp.RedOpType.SUM: "sum",
    dist.ReduceOp.RedOpType.PRODUCT: "product",
    dist.ReduceOp.RedOpType.MIN: "min",
    dist.ReduceOp.RedOpType.MAX: "max",
    dist.ReduceOp.RedOpType.AVG: "sum",  # then divided by the world size
}


class AllReduceProcessGroup(dist.ProcessGroup):
    """A process group over ``handle``: rank ``handle.info.partition_id`` of
    ``handle.info.partition_num``. Flat topology (the typed collectives'). ``close()`` stops
    its thread (the handle stays the caller's to close)."""

    def __init__(self, handle: ConnectedParameter) -> None:
        info = handle.info
        super().__init__(info.partition_id, info.partition_num)
        self._collectives = handle.collectives
        self._rank, self._world = info.partition_id, info.partition_num
        self._buffers = HostBuffers()
        self._thread = CallThread(
            f"{BACKEND}-rank{self._rank}",
            f"in the {BACKEND} process group's {{}} on rank {self._rank}",
        )
        self._closed = False
        self._name = ""

    def _set_group_name(self, name: str) -> None:
        """Keep the name torch gives the group: torch's own getter asks the C++ backends
        registered with a group, and a group written in Python has none (``DeviceMesh``,
        and so FSDP, reads it)."""
        self._name = name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:
        """The name torch gave the group (``_set_group_name``)."""
        return self._name

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The backend's name, as ``dist.get_backend()`` reports it."""
        return BACKEND

    def close(self) -> None:
        """Finish the queued calls and stop the group's thread; later calls are refused."""
        if not self._closed:
            self._closed = True
            self._thread.close()

    # -- the collectives -------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        """Combine each element over the ranks (``opts.reduceOp``), in place in ``tensors``."""
        call = "allreduce"
        op, average = self._op(opts, call)
        flat = self._flat(tensors, call)
        if average:
            _divide(flat.values[:0], self._world, call)  # refuses a mean of bools up front

        def run() -> None:  # gathered straight into the tensors' values where it can be
            flat.write(self._allreduce(flat.values, op, average, call, into=flat.values))

        def here() -> bool:  # its peers wait in it already: run it here, not hand it over
            return (
                flat.values.nbytes <= CALLER_BYTES and self._collectives.allreduce_peers_arrived()
            )

        return self._queue(call, run, tensors, flat, here)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        """``allreduce`` of several tensors at once."""
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        """``allreduce``, written only into the root's tensors (``opts.rootRank``)."""
        call = "reduce"
        op, average = self._op(opts, call)
        flat = self._flat(tensors, call)
        root = opts.rootRank

        def run() -> None:
            result = self._allreduce(flat.values, op, average, call)
            if self._rank == root:
                flat.write(result)

        return self._queue(call, run, tensors, flat)

    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        """The root's tensors (``opts.rootRank``) into every rank's."""
        call = "broadcast"
        flat = self._flat(tensors, call)
        root = opts.rootRank

        def run() -> None:
            flat.write(self._collectives.broadcast(flat.values, root))

        return self._queue(call, run, tensors, flat)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None
    ) -> dist.Work:
        """Every rank's ``inputs[i]`` into ``outputs[i][rank]``, on every rank."""
        call = "allgather"
        _expect_one(inputs, call)
        self._expect_per_rank(outputs[0], call, "output_tensor_list")
        flat = self._flat(inputs, call)

        def run() -> None:
            self._split(self._all_gather(flat.values), outputs[0])

        return self._queue(call, run, outputs, flat)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        """Every rank's ``input`` into its place in ``output`` (world size x as long)."""
        call = "all_gather_into_tensor"
        flat = self._flat([input], call)
        _expect_length(output, flat.size * self._world, call)

        def run() -> None:
            self._split(self._all_gather(flat.values), [output])

        return self._queue(call, run, [output], flat)

    _allgather_base = all_gather_single

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None
    ) -> dist.Work:
        """``allgather``, written only into the root's ``outputs`` (``opts.rootRank``)."""
        call = "gather"
        _expect_one(inputs, call)
        flat = self._flat(inputs, call)
        root = opts.rootRank
        if self._rank == root:
            self._expect_per_rank(outputs[0], call, "gather_list")

        def run() -> None:
            gathered = self._all_gather(flat.values)
            if self._rank == root:
                self._split(gathered, outputs[0])

        return self._queue(call, run, outputs, flat)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts=None
    ) -> dist.Work:
        """The root's ``inputs[0][rank]`` into each rank's ``outputs[0]`` (a broadcast of
        the root's list: for small tensors, as torch's ``scatter_object_list``)."""
        call = "scatter"
        _expect_one(outputs, call)
        root = opts.rootRank
        if self._rank == root:
            self._expect_per_rank(inputs[0], call, "scatter_list")
            flat = self._flat(inputs[0], call)
        else:  # the same length and dtype as the root's list
            room = torch.empty(outputs[0].numel() * self._world, dtype=outputs[0].dtype)
            flat = self._flat([room], call)
        mine = SliceLayout(flat.size, self._world).bounds(self._rank)

        def run() -> None:
            whole = self._collectives.broadcast(flat.values, root)
            outputs[0].copy_(as_tensor_values(np.ascontiguousarray(whole[mine]), outputs[0]))

        return self._queue(call, run, outputs, flat)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts=None
    ) -> dist.Work:
        """Rank r's ``outputs[0]``: the combination over the ranks of their ``inputs[0][r]``."""
        call = "reduce_scatter"
        _expect_one(outputs, call)
        self._expect_per_rank(inputs[0], call, "input_list")
        op, average = self._op(opts, call)
        flat = self._flat(inputs[0], call)
        _expect_length(outputs[0], flat.size // self._world, call)

        def run() -> None:
            self._reduce_scatter_into(flat.values, op, average, outputs[0], call)

        return self._queue(call, run, outputs, flat)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts=None
    ) -> dist.Work:
        """Rank r's ``output``: the combination over the ranks of their ``input``'s r-th
        slice (``input`` is world size x as long)."""
        call = "reduce_scatter_tensor"
        op, average = self._op(opts, call)
        flat = self._flat([input], call)
        _expect_length(output, flat.size // self._world, call)
        if flat.size != output.numel() * self._world:
            raise InputError(
                f"{call}: the input holds {flat.size} elements, not world size "
                f"({self._world}) x the output's {output.numel()}"
            )

        def run() -> None:
            self._reduce_scatter_into(flat.values, op, average, output, call)

        return self._queue(call, run, [output], flat)

    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts=None) -> dist.Work:
        """Done once every rank has called it."""

        def run() -> None:
            self._collectives.all_gather(
                np.zeros(1, np.uint8), SliceLayout(self._world, self._world)
            )

        return self._queue("barrier", run, [], None)

    def _refuse(self, call: str):
        raise UsageError(
            f"{call} is not supported by the {BACKEND} backend (it has the collectives: "
            "allreduce, broadcast, allgather, reduce_scatter, reduce, gather, scatter, barrier)"
        )

    def send(self, *args, **kwargs):
        self._refuse("send")

    def recv(self, *args, **kwargs):
        self._refuse("recv")

    def recv_anysource(self, *args, **kwargs):
        self._refuse("recv_anysource")

    def alltoall(self, *args, **kwargs):
        self._refuse("all_to_all")

    def alltoall_base(self, *args, **kwargs):
        self._refuse("all_to_all_single")

    all_to_all_single = alltoall_base

    # -- how -----------------------------------------------------------------------

    def _allreduce(
        self, values: np.ndarray, op: str, average: bool, call: str, into: np.ndarray | None = None
    ) -> np.ndarray:
        """The engine's allreduce of any dtype (``allreduce_typed``: through the host's
        shared memory where every rank is on one host, else a reduce_scatter then an
        all_gather), into ``into`` (``values`` themselves for an allreduce in place)."""
        if values.size == 0:
            return values
        finish = (lambda mine: _divide(mine, self._world, call)) if average else None
        return self._collectives.allreduce_typed(values, op, out=into, finish=finish)

    def _all_gather(self, values: np.ndarray) -> np.ndarray:
        """Every rank's ``values`` (as long on every rank), in rank order, concatenated."""
        layout = SliceLayout(values.size * self._world, self._world)
        if layout.size == 0:
            return values
        return self._collectives.all_gather(values, layout)

    def _reduce_scatter_into(
        self, values: np.ndarray, op: str, average: bool, output: torch.Tensor, call: str
    ) -> None:
        """This rank's slice of the combination of every rank's ``values``, into ``output``."""
        if values.size == 0:
            return
        mine = self._collectives.reduce_scatter(values, op, SliceLayout(values.size, self._world))
        if average:
            mine = _divide(mine, self._world, call)
        output.copy_(as_tensor_values(mine, output))

    def _split(self, gathered: np.ndarray, outputs: list[torch.Tensor]) -> None:
        """``gathered`` cut, in order, into ``outputs``."""
        offset = 0
        for output in outputs:
            piece = gathered[offset : offset + output.numel()]
            output.copy_(as_tensor_values(np.ascontiguousarray(piece), output))
            offset += output.numel()

    def _queue(
        self,
        call: str,
        run: Callable[[], None],
        result,
        flat: FlatValues | None,
        here: Callable[[], bool] | None = None,
    ) -> dist.Work:
        """Run ``run`` on the group's thread after the calls before it (or on this thread,
        where the group's is idle and ``here()`` says so: ``CallThread``); a Work whose
        future gives ``result`` once it is done, or its error."""
        if self._closed:
            raise UsageError(f"{call}: this {BACKEND} process group is closed")
        work = EngineWork(torch.futures.Future())
        release = None if flat is None else flat.release
        self._thread.put(call, run, work, result, release, here)
        return work

    def _flat(self, tensors: list[torch.Tensor], call: str) -> FlatValues:
        """``tensors``' values as one numpy vector (checked: one supported dtype)."""
        return FlatValues(tensors, common_dtype(tensors, call), self._buffers)

    def _expect_per_rank(self, tensors: list, call: str, name: str) -> None:
        """Raise unless ``tensors`` holds one tensor per rank."""
        if len(tensors) != self._world:
            raise InputError(
                f"{call}: {name} holds {len(tensors)} tensors; it must hold one per rank "
                f"({self._world})"
            )

    def _op(self, opts, call: str) -> tuple[str, bool]:
        """The engine's op for ``opts.reduceOp``, and whether to divide by the world size."""
        op = getattr(opts.reduceOp, "op", opts.reduceOp)
        if op not in _OPS:
            raise InputError(
                f"{call}: ReduceOp {op.name} is not supported by the {BACKEND} backend; use "
                "SUM, AVG, PRODUCT, MIN or MAX"
            )
        return _OPS[op], op == dist.ReduceOp.RedOpType.AVG


def _expect_one(tensors: list, call: str) -> None:
    """Raise unless ``tensors`` holds one tensor (torch's lists of one per device)."""
    if len(tensors) != 1:
        raise InputError(f"{call}: expected one tensor per call, got {len(tensors)}")


def _expect_length(tensor: torch.Tensor, length: int, call: str) -> None:
    """Raise unless the output ``tensor`` holds ``length`` elements."""
    if tensor.numel() != length:
        raise InputError(
            f"{call}: the output holds {tensor.numel()} elements, it must hold {length}"
        )


def _divide(values: np.ndarray, world: int, call: str) -> np.ndarray:
    """``values`` / ``world`` in their dtype (ReduceOp.AVG). Integers are divided as NCCL
    divides them, truncating toward zero (Lightning averages its integer batch counts with
    AVG on every backend but gloo); bool, which has no mean, is refused."""
    if values.dtype.kind == "b":
        raise InputError(
            f"{call}: ReduceOp.AVG of bool tensors is not supported by the {BACKEND} backend "
            "(a mean of booleans is not one); use SUM or MAX"
        )
    if values.dtype.kind in "iu":
        divisor = values.dtype.type(world)
        quotient = values // divisor  # floor: one up where a negative value had a remainder
        if values.dtype.kind == "i":
            quotient += ((values < 0) & (values % divisor != 0)).astype(values.dtype)
        return quotient
    return (values / values.dtype.type(world)).astype(values.dtype, copy=False)
