"""The ``allreduce_param`` backend of ``torch.distributed``: registering it, and binding it to
an engine handle so that ``init_process_group(backend="allreduce_param")`` makes an
``AllReduceProcessGroup`` over that handle.

A process group is made by torch, from its registered backend's creator, when the training
code calls ``init_process_group`` (or ``new_group``); the creator is told only the rank, the
world size, a store and a timeout. So the handle it runs on is bound beforehand, once per
process, by whoever started the process (the distributor, a test, a launcher)::

    param = process_group_parameter(world_size=2)          # on the driver: holds the secret
    ...                                                     # in each process (rank r):
    with param.connect(rendezvous) as handle, bind(handle):
        dist.init_process_group(backend=BACKEND, rank=r, world_size=2, store=...)
        ...  # DistributedDataParallel(model), dist.all_reduce(t), ...
        dist.destroy_process_group()

The store torch asks for (``init_method="env://"`` with ``MASTER_ADDR``/``MASTER_PORT``, or
``store=``) is torch's own; the backend moves nothing through it. The collectives move
through the engine: authenticated (and, as the parameter's network settings say,
encrypted) connections between the ranks, shared memory between ranks of one host.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch.distributed as dist

from allreduce_param.engine import AllReduceParameter, ConnectedParameter, NetworkSettings
from allreduce_param.errors import ConfigurationError, UsageError
from allreduce_param.torch_backend.process_group import BACKEND, AllReduceProcessGroup

__all__ = ["BACKEND", "bind", "process_group_parameter", "register"]

#: How long a collective waits for a peer by default (seconds): as long as torch's own
#: default process group timeout, for a rank may reach a collective only after a slow
#: training step, a checkpoint or an evaluation of its own.
DEFAULT_TIMEOUT = 1800.0

#: The largest allreduce (bytes) that goes through one host's shared memory: above DDP's
#: default bucket cap (25 MiB). The host arena maps this once per rank and once more.
HOST_BUCKET_BYTES = 32 << 20

_lock = threading.Lock()
_bound: ConnectedParameter | None = None
_groups: list[AllReduceProcessGroup] = []  # made while bound: closed when the binding ends


def register() -> str:
    """Register the backend with ``torch.distributed`` (once per process; again is a no-op)
    and return its name, for ``init_process_group(backend=...)``."""
    with _lock:
        if BACKEND.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(
                BACKEND, _create, extended_api=True, devices=["cpu", "cuda"]
            )
    return BACKEND


@contextlib.contextmanager
def bind(handle: ConnectedParameter) -> Iterator[ConnectedParameter]:
    """While in this context, process groups of the backend in this process run on
    ``handle`` (one handle per process at a time); it registers the backend first. On
    leaving, the groups made here are closed (their threads stop); ``handle`` stays open."""
    global _bound
    register()
    with _lock:
        if _bound is not None:
            raise UsageError(
                f"bind(): this process is already bound to partition {_bound.info.partition_id}'s "
                "handle; a process holds one binding at a time (leave the first one's with-block)"
            )
        _bound = handle
    try:
        yield handle
    finally:
        with _lock:
            _bound = None
            groups = list(_groups)
            _groups.clear()
        for group in groups:
            group.close()


def process_group_parameter(
    world_size: int,
    network: NetworkSettings | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
) -> AllReduceParameter:
    """The ``AllReduceParameter`` whose handles the process groups wrap, one per rank; made
    where the ranks are started (the driver), as it holds the secret they prove.

    ``network``: where the ranks listen and whether their connections are encrypted (default:
    the surroundings' settings, Spark's on a driver). ``timeout``: how long a collective waits
    for a peer before it fails, naming it (default 30 minutes, as torch's). Only the
    parameter's collectives are used (its steps are never taken): raw, flat (the typed
    collectives' topology), its vector ``HOST_BUCKET_BYTES`` of float32 because the host
    arena is sized by the vector: where every rank is on one host, the ranks' allreduces go
    through that arena (DDP's default buckets of 25 MiB fit; a larger call moves as blocks).
    Its pages (and the vector's own buffers') are taken only as they are written, but the
    mappings count against an address-space limit (``spark.executor.pyspark.memory``)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigurationError(f"world_size must be a positive whole number, got {world_size!r}")
    return AllReduceParameter(
        world_size,
        HOST_BUCKET_BYTES // 4,
        "raw",
        timeout=timeout,
        topology="flat",
        host_arena=True,
        network=network,
    )


def _create(options, backend_options=None) -> AllReduceProcessGroup:
    """torch's creator of a process group (``register_backend``'s, extended API): a group over
    the bound handle, once the rank and world size torch was given are the handle's."""
    with _lock:
        handle = _bound
        if handle is None:
            raise UsageError(
                f"init_process_group(backend={BACKEND!r}) needs an engine handle bound in this "
                "process: call it inside allreduce_param.torch_backend.bind(handle) (the "
                "distributor does so for the function it runs)"
            )
        info = handle.info
        rank, size = options.group_rank, options.group_size
        if (rank, size) != (info.partition_id, info.partition_num):
            raise ConfigurationError(
                f"init_process_group(backend={BACKEND!r}, rank={rank}, world_size={size}): the "
                f"bound handle is partition {info.partition_id} of {info.partition_num}; pass "
                f"rank={info.partition_id} and world_size={info.partition_num} (a new_group of "
                "some ranks is not supported by this backend)"
            )
        group = AllReduceProcessGroup(handle)
        _groups.append(group)
        return group
