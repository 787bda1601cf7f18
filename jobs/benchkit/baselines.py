"""The two syncs that the engine is measured against, for ``bench_allreduce.py``.

* :func:`mllib_sync_ms` -- how Spark MLlib's gradient descent syncs once per iteration: the
  driver broadcasts the weights, every partition computes a gradient from them, and the driver
  gathers the sum with ``treeAggregate``. This is what a Spark user has without this project.
* :func:`gloo_allreduce_ms` -- ``torch.distributed.all_reduce`` over gloo between processes on
  loopback: the bar a purpose-built collective sets on the same machine.

Both return the median milliseconds of one sync of a float32 vector; ``bench_allreduce.py``
prints them beside the engine's figures. The gloo baseline
needs torch; the CPU build is enough (``pip install torch==2.13.0`` on this machine).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import socket
import statistics
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_GLOO_TIMEOUT = datetime.timedelta(seconds=120)
"""How long a gloo rank waits for its peers (rendezvous or one collective) before it fails."""


# --------------------------------------------------------------------------------------------
# MLlib-style sync: broadcast + treeAggregate
# --------------------------------------------------------------------------------------------


def mllib_sync_ms(
    spark: SparkSession,
    size: int,
    partitions: int = 2,
    steps: int = 5,
    warmup: int = 1,
    *,
    dense_zero: bool = False,
) -> float:
    """Median milliseconds of one MLlib-style sync of ``size`` float32 weights.

    One step, as in ``org.apache.spark.mllib.optimization.GradientDescent``: the driver
    broadcasts the weights, each of ``partitions`` partitions computes a gradient of the same
    size from the broadcast value, the driver gathers their sum with ``rdd.treeAggregate``
    (depth 2) and destroys the broadcast (non-blocking, as MLlib does). The timed part is
    broadcast + treeAggregate round trip + destroy. Between steps, outside the timer, the
    driver checks the sum and applies it to the weights, so every step broadcasts new values.
    ``warmup`` untimed steps come first (they start the Python workers).

    The zero value of ``treeAggregate`` is ``None`` by default, which is the better PySpark
    idiom: a dense zero vector (what MLlib passes, ``dense_zero=True``) is pickled into every
    task's closure, which PySpark ships as one more broadcast of ``size`` floats per step;
    at 10M elements that adds about 350 ms per step on this machine.

    ``spark`` is used as given and not stopped.
    """
    if size < 1 or partitions < 1 or steps < 1 or warmup < 0:
        raise ValueError(
            f"need size, partitions, steps >= 1 and warmup >= 0; got {size=}, {partitions=}, "
            f"{steps=}, {warmup=}"
        )

    # Defined in here, not at module level, so that cloudpickle ships them by value: this file
    # is imported from jobs/, which the executors' Python workers cannot import from.
    def gradient(weights: np.ndarray) -> np.ndarray:
        """A stand-in gradient that costs one pass over the weights: that of ``||w||^2 / 4``."""
        return weights * np.float32(0.5)

    def add_into(acc: np.ndarray | None, value: np.ndarray | None) -> np.ndarray | None:
        """Sum two partial results, reusing ``acc``'s buffer; ``None`` is the empty sum.

        Serves as both ``seqOp`` and ``combOp``; ``None`` lets an empty partition pass
        through. Adding in place is safe: ``acc`` is always an array of this task's own (the
        zero value unpickled with the task, a gradient computed here, or a partial sum
        unpickled from a child of the tree), never the broadcast value.
        """
        if acc is None:
            return value
        if value is None:
            return acc
        acc += value
        return acc

    sc = spark.sparkContext
    seeds = sc.parallelize(range(partitions), partitions)  # one record per partition
    weights = np.random.default_rng(0).standard_normal(size, dtype=np.float32)
    times_ms: list[float] = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        bc = sc.broadcast(weights)
        zero = np.zeros(size, dtype=np.float32) if dense_zero else None
        try:
            total = seeds.map(lambda _, bc=bc: gradient(bc.value)).treeAggregate(
                zero, add_into, add_into, depth=2
            )
        finally:
            bc.destroy(blocking=False)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        if step >= warmup:
            times_ms.append(elapsed_ms)
        expected = gradient(weights) * np.float32(partitions)
        if total is None or total.shape != weights.shape or not np.allclose(total, expected):
            raise AssertionError(f"treeAggregate returned a wrong gradient sum at step {step}")
        weights -= np.float32(0.01) * total
    return statistics.median(times_ms)


# --------------------------------------------------------------------------------------------
# torch.distributed gloo all_reduce
# --------------------------------------------------------------------------------------------


def _loopback_interface() -> str:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS).

    Gloo picks the interface it listens on from the host name unless ``GLOO_SOCKET_IFNAME``
    names one; naming loopback keeps every byte on 127.0.0.1.
    """
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"


def _gloo_rank(
    rank: int,
    world_size: int,
    size: int,
    steps: int,
    warmup: int,
    port_queue: Any,
    result_queue: Any,
) -> None:
    """One rank of :func:`gloo_allreduce_ms`, run in a spawned process.

    Rank 0 hosts the rendezvous store on a port the OS picks (no free-port race) and hands
    the port to the other ranks through ``port_queue``. Each step refills the tensor and
    checks the sum outside the timer, lines the ranks up with a barrier, then times one
    ``all_reduce`` on every rank. One more ``all_reduce`` (max) gives every rank the per-step
    maxima over the ranks; rank 0 puts that list on ``result_queue``.
    """
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    torch.set_num_threads(1)  # as many processes as cores: no oversubscription
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            timeout=_GLOO_TIMEOUT,
            wait_for_workers=False,
        )
        for _ in range(world_size - 1):
            port_queue.put(store.port)
    else:
        store = dist.TCPStore(
            "127.0.0.1", port_queue.get(), world_size, is_master=False, timeout=_GLOO_TIMEOUT
        )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=_GLOO_TIMEOUT
    )
    try:
        tensor = torch.empty(size, dtype=torch.float32)
        expected = float(world_size * (world_size + 1) // 2)  # rank r contributes r + 1
        times_ms = torch.zeros(steps, dtype=torch.float64)
        for step in range(warmup + steps):
            tensor.fill_(rank + 1)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            elapsed_ms = (time.perf_counter() - start) * 1e3
            if step >= warmup:
                times_ms[step - warmup] = elapsed_ms
            if not bool(torch.all(tensor == expected)):
                raise AssertionError(f"rank {rank}: all_reduce gave a wrong sum at step {step}")
        dist.all_reduce(times_ms, op=dist.ReduceOp.MAX)
        if rank == 0:
            result_queue.put(times_ms.tolist())
    finally:
        dist.destroy_process_group()


def gloo_available() -> bool:
    """Whether torch, and with it gloo, is installed."""
    return importlib.util.find_spec("torch") is not None


def gloo_allreduce_ms(
    size: int, processes: int = 2, steps: int = 10, warmup: int = 2
) -> float | None:
    """Median milliseconds of one gloo ``all_reduce`` (sum) of ``size`` float32 elements.

    Runs ``processes`` ranks as spawned processes talking over 127.0.0.1 only. Before each
    step the ranks meet at a barrier, so a step's time is the collective alone and not a wait
    for a late peer; each rank times its own ``all_reduce``, the step counts as its slowest
    rank (max over ranks, since the sync is done only when every rank has the sum), and the
    result is the median over the ``steps`` timed steps after ``warmup`` untimed ones.

    Returns ``None`` when torch is not installed. Raises if a rank fails; every process is
    joined (the others terminated) before this returns or raises.
    """
    if not gloo_available():
        return None
    if size < 1 or processes < 1 or steps < 1 or warmup < 0:
        raise ValueError(
            f"need size, processes, steps >= 1 and warmup >= 0; got {size=}, {processes=}, "
            f"{steps=}, {warmup=}"
        )
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port_queue = ctx.SimpleQueue()
    result_queue = ctx.SimpleQueue()
    # join=True waits for every rank and, if one fails, terminates the rest and re-raises.
    mp.start_processes(
        _gloo_rank,
        args=(processes, size, steps, warmup, port_queue, result_queue),
        nprocs=processes,
        join=True,
        start_method="spawn",
    )
    return statistics.median(result_queue.get())
