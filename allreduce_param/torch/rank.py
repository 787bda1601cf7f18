"""One rank of a ``Distributor`` run, inside its Spark barrier task: the peers met, the
environment torchrun would set, the default process group on the engine's backend, the
user's function, and what goes back to the driver.

Everything a task changes in its process is put back when the rank ends (the environment,
``sys.stdout``, ``torch.distributed.init_process_group``, the default group): Spark reuses
its Python workers for later tasks (``spark.python.worker.reuse``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from allreduce_param.engine.movement.rendezvous import Address, Rendezvous
from allreduce_param.engine.parameter import AllReduceParameter
from allreduce_param.engine.wire.messages import MessageClient
from allreduce_param.errors import AllReduceError, ConfigurationError, TrainingError
from allreduce_param.torch.output import streamed_output

log = logging.getLogger(__name__)

#: The kind of the message a rank sends the driver when its function raised.
FAILED = "failed"


class RankWork(Protocol):
    """What the ranks run (``FunctionRun``, ``script.ScriptRun``): ``rank(job)`` runs this
    task's rank and returns rank 0's result, pickled (None on the other ranks)."""

    def rank(self, job: RankJob) -> bytes | None: ...


@dataclass(frozen=True)
class RankJob:
    """What every rank needs, made on the driver and shipped in the stage's closure:
    the engine's parameter the process group runs over, the driver's message client
    (None: the tasks cannot reach the driver, under Spark Connect; they meet through
    Spark), how long the meeting waits, how ranks get GPUs (``gpus``: ``"none"``,
    ``"spark"`` for the ones Spark assigned the task, ``"local"`` for the driver host's,
    by local rank), and what to run (``FunctionRun``, ``script.ScriptRun``): its
    ``rank(job)`` runs this task's rank."""

    param: AllReduceParameter
    link: MessageClient | None
    patience: float
    gpus: str
    work: RankWork


class KeptAddresses(Rendezvous):
    """A rendezvous that meets through ``inner`` and keeps the addresses it exchanged: the
    ranks' block servers, each held by its rank until its handle closes (rank 0's is
    ``MASTER_ADDR``/``MASTER_PORT``)."""

    def __init__(self, inner: Rendezvous) -> None:
        self._inner = inner
        self.partition_id = inner.partition_id
        self.partition_num = inner.partition_num
        self.addresses: list[Address] = []

    def bind_address(self) -> Address:
        return self._inner.bind_address()

    def exchange(self, address: Address) -> list[Address]:
        self.addresses = self._inner.exchange(address)
        return self.addresses


def rank_environment(
    rank: int, hosts: tuple[tuple[int, ...], ...], master: Address
) -> dict[str, str]:
    """The variables torchrun sets for ``rank``, given the ranks on each host (``hosts``,
    the engine's ``HandleInfo.hosts``) and rank 0's block server address (``master``):
    a true address and a port rank 0 holds while the group lives, which nothing else
    can take (the group needs no store of torch's: its collectives run on the engine).

    ``TORCHELASTIC_RUN_ID`` (with the restart counts, 0: a run is never restarted) says
    the processes were started for the user, as torchrun's are: Lightning reads it to take
    its ranks from this environment (its ``TorchElasticEnvironment``) instead of starting
    processes of its own."""
    world = sum(len(ranks) for ranks in hosts)
    node = next(index for index, ranks in enumerate(hosts) if rank in ranks)
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(hosts[node].index(rank)),
        "LOCAL_WORLD_SIZE": str(len(hosts[node])),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": str(master[0]),
        "MASTER_PORT": str(master[1]),
        "TORCHELASTIC_RUN_ID": f"allreduce-param-{master[0]}-{master[1]}",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


@contextlib.contextmanager
def environment(variables: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``variables`` for the length of the block, then as it was."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def gpu_environment(how: str, local_rank: int) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for a rank: the GPUs Spark assigned its task (``"spark"``),
    or one of the driver host's by local rank (``"local"``); nothing for ``"none"``."""
    if how == "none":
        return {}
    if how == "spark":
        from allreduce_param.spark.gpus import task_resources

        resources = task_resources() or {}
        gpu = resources.get("gpu")
        if gpu is None or not gpu.addresses:
            raise ConfigurationError(
                "Distributor(use_gpu=True): Spark assigned this rank's task no GPU; start "
                "the session with spark.executor.resource.gpu.amount and its "
                "discoveryScript, and spark.task.resource.gpu.amount"
            )
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpu.addresses)}
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigurationError(
            "Distributor(use_gpu=True, local_mode=True): this host's PyTorch sees no GPU; "
            "pass use_gpu=False"
        )
    return {"CUDA_VISIBLE_DEVICES": str(local_rank % count)}


@contextlib.contextmanager
def default_group(handle, rank: int, world: int) -> Iterator[None]:
    """The default process group on the engine's backend over ``handle`` for the length of
    the block, destroyed after it; and meanwhile ``init_process_group`` answered by it, so
    that code which makes the group itself (Lightning, Hugging Face: usually after asking
    ``is_initialized()``) gets this one (``guarded_init``)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from allreduce_param.torch_backend import backend

    backend.register()
    original = distributed_c10d.init_process_group

    def open_group() -> None:
        original(backend=backend.BACKEND, rank=rank, world_size=world, store=dist.HashStore())

    guarded = guarded_init(original, open_group, rank, world)
    with backend.bind(handle):
        open_group()
        dist.init_process_group = distributed_c10d.init_process_group = guarded
        try:
            yield
        finally:
            dist.init_process_group = distributed_c10d.init_process_group = original
            if dist.is_initialized():
                dist.destroy_process_group()


def guarded_init(
    original: Callable, open_group: Callable[[], None], rank: int, world: int
) -> Callable:
    """What ``torch.distributed.init_process_group`` does while a rank's function runs:
    the default group is the Distributor's, on the engine's backend, whatever backend is
    asked for; a call that names another rank or world size than the rank's is a
    ConfigurationError; a call after the function destroyed the group opens it again."""
    signature = inspect.signature(original)

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        asked = signature.bind_partial(*args, **kwargs).arguments
        for name, own in (("rank", rank), ("world_size", world)):
            value = asked.get(name, -1)
            if value not in (-1, None) and int(value) != own:
                raise ConfigurationError(
                    f"init_process_group({name}={value}) inside a Distributor's function, "
                    f"whose {name} is {own}: leave {name} unset (or read it from the "
                    "environment, RANK and WORLD_SIZE)"
                )
        if asked.get("backend") not in (None, "", _backend_name()):
            log.info(
                "init_process_group(backend=%r) inside a Distributor's function: its group "
                "runs on %r",
                asked.get("backend"),
                _backend_name(),
            )
        if not dist.is_initialized():
            open_group()

    init_process_group.__doc__ = original.__doc__
    return init_process_group


def _backend_name() -> str:
    from allreduce_param.torch_backend import backend

    return backend.BACKEND


@dataclass(frozen=True)
class FunctionRun:
    """A rank's ``train_fn(*args, **kwargs)`` in the task's own process, with the default
    group made before it and destroyed after it."""

    train_fn: Callable[..., Any]
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        """The function's name, for the Spark UI."""
        return getattr(self.train_fn, "__qualname__", None) or repr(self.train_fn)

    def rank(self, job: RankJob) -> bytes | None:
        """This task's rank of the run: ``run_rank``."""
        return run_rank(job)

    def __call__(self, variables: Mapping[str, str], handle) -> Any:
        rank, world = int(variables["RANK"]), int(variables["WORLD_SIZE"])
        with default_group(handle, rank, world):
            return self.train_fn(*self.args, **self.kwargs)


def run_rank(job: RankJob) -> bytes | None:
    """Run one rank in this barrier task: meet the peers, set the environment and the
    group, run ``job.work``; rank 0's return value, pickled (None for the other ranks).

    A rank whose function raises tells the driver (a ``FAILED`` message with the
    traceback) and then closes its handle, so that the peers waiting for it in a
    collective fail at once instead of at their timeout; it raises a TrainingError naming
    the rank, which fails the stage."""
    from pyspark import cloudpickle

    with driver_link(job.link):
        inner = meeting(job)
        rank, met = inner.partition_id, KeptAddresses(inner)
        try:
            with job.param.connect(met) as handle:
                variables = rank_environment(rank, handle.info.hosts, met.addresses[0])
                variables.update(gpu_environment(job.gpus, int(variables["LOCAL_RANK"])))
                with environment(variables), streamed_output(job.link, rank):
                    try:
                        value = job.work(variables, handle)
                    except BaseException as error:
                        tell_driver(job.link, rank, error)
                        raise TrainingError(
                            f"rank {rank}: {type(error).__name__}: {error}"
                        ) from error
        except TrainingError:
            raise
        except Exception as error:  # meeting the peers, or making the group, failed
            tell_driver(job.link, rank, error, where=" while it met its peers")
            raise TrainingError(
                f"rank {rank} (while it met its peers): {type(error).__name__}: {error}"
            ) from error
        return cloudpickle.dumps(value) if rank == 0 else None


@contextlib.contextmanager
def driver_link(link: MessageClient | None) -> Iterator[None]:
    """A rank's connection to the driver, opened as the task starts (a driver out of reach
    now is tried again at the meeting, and met without) and closed as it ends."""
    if link is not None:
        try:
            link.connect()
        except (OSError, AllReduceError) as error:
            log.info("this rank cannot reach the driver yet (%s)", error)
    try:
        yield
    finally:
        if link is not None:
            link.close()


def meeting(job: RankJob) -> Rendezvous:
    """How this task meets its peers: at the driver, else through Spark's ``allGather``."""
    from allreduce_param.spark.rendezvous import BarrierRendezvous, DriverRendezvous

    return BarrierRendezvous() if job.link is None else DriverRendezvous(job.link, job.patience)


def tell_driver(
    link: MessageClient | None,
    rank: int,
    error: BaseException,
    where: str = "",
    traceback_text: str | None = None,
) -> None:
    """Send the driver a rank's failure, with its traceback (``traceback_text``, else
    ``error``'s), before the peers hear of it."""
    if link is None:
        return
    text = traceback_text
    if text is None:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        link.send(
            {
                "kind": FAILED,
                "rank": rank,
                "where": where,
                "error": f"{type(error).__name__}: {error}",
                "traceback": text[-(256 << 10) :],
            }
        )
    except Exception as lost:  # the stage's failure still names the rank
        log.warning("rank %d could not tell the driver of its failure: %s", rank, lost)
