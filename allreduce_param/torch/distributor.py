"""``Distributor``: your own PyTorch training function (or script) run on Spark, each rank
a task of one barrier stage, its default process group on this project's backend.

The shape is PySpark's ``TorchDistributor`` (``num_processes``, ``local_mode``, ``use_gpu``;
``run(train_fn, *args)``), but the collectives run on the engine (authenticated, encrypted
where Spark's settings say, shared memory between ranks of one host) instead of gloo or
NCCL, and a failure comes back as one ``TrainingError`` naming the rank.

What ``local_mode`` means here: the ranks always run as Spark tasks (never as processes
the driver starts itself, as TorchDistributor's local mode does). ``local_mode=True``
asks for every rank on the driver's host: the session must run its tasks there (a
``local[N]`` or ``local-cluster`` master), else the run is refused, naming
``local_mode=False``; ``local_mode=False`` runs the ranks wherever Spark places them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from allreduce_param.engine.wire.settings import NetworkSettings
from allreduce_param.errors import ConfigurationError, TrainingError
from allreduce_param.spark.gpus import stage_profile
from allreduce_param.spark.info import SparkInfo
from allreduce_param.spark.jobs import fit_jobs
from allreduce_param.spark.slots import check_no_dynamic_allocation, task_slots
from allreduce_param.torch.driver_end import DriverEnd
from allreduce_param.torch.rank import FunctionRun, RankJob
from allreduce_param.torch.script import ScriptRun

log = logging.getLogger(__name__)

#: The masters whose tasks all run on the driver's host (``local_mode=True``).
_LOCAL_MASTERS = ("local", "local[", "local-cluster[")


class Distributor:
    """Runs a PyTorch training function on ``num_processes`` ranks, each a Spark task of
    one barrier stage, with ``torch.distributed``'s default group already made on this
    project's backend.

    ``num_processes``: how many ranks (tasks; Spark must be able to run them all at once).
    ``local_mode``: every rank on the driver's host (a local master); False for a
    cluster's executors. ``use_gpu``: each rank gets a GPU: on a cluster the one Spark
    assigns its task (through the stage-level resource profile a fit asks GPUs with,
    one GPU per task), in local mode one of the host's by ``LOCAL_RANK``; its
    ``CUDA_VISIBLE_DEVICES`` says which. False by default (TorchDistributor's is True):
    the backend runs on the CPU, and CUDA tensors travel through host copies.
    ``network``: where the ranks' servers listen and whether they encrypt, as a fit's
    (unset fields follow ``spark.allreduce.*`` and Spark's own encryption settings).

    In each rank, before the function starts: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` (rank 0's block
    server, held by it for the whole run) are set, and
    ``torch.distributed.init_process_group`` has been called; a call of it in the function
    returns that group.
    """

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool = False,
        *,
        network: NetworkSettings | None = None,
    ) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, int):
            raise ConfigurationError(
                f"Distributor(num_processes={num_processes!r}): give the number of ranks, "
                "a positive integer"
            )
        if num_processes < 1:
            raise ConfigurationError(
                f"Distributor(num_processes={num_processes}): there must be at least one rank"
            )
        if importlib.util.find_spec("torch") is None:
            raise ConfigurationError(
                "Distributor needs PyTorch, which is not installed here: pip install torch "
                "(and on every executor's Python)"
            )
        self.num_processes = num_processes
        self.local_mode = bool(local_mode)
        self.use_gpu = bool(use_gpu)
        self.network = network or NetworkSettings()

    def __repr__(self) -> str:
        return (
            f"Distributor(num_processes={self.num_processes}, local_mode={self.local_mode}, "
            f"use_gpu={self.use_gpu})"
        )

    def run(self, train_object: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object(*args, **kwargs)`` on every rank; rank 0's return value.
        ``train_object`` may be the path of a script file instead: each rank runs it in a
        ``python`` process of its own, with ``args`` as its command line (as torchrun
        would; the group is made before the script starts), and the run returns None.

        A function travels to the tasks pickled (cloudpickle), as a Spark task's code does,
        and so do its arguments and rank 0's return value. A rank that raises ends the run:
        its peers' collectives fail at once, and the error is one ``TrainingError`` naming
        the rank, with its traceback."""
        if isinstance(train_object, str):
            return self._run(self._script(train_object, args, kwargs))
        if not callable(train_object):
            raise ConfigurationError(
                f"Distributor.run({train_object!r}): give a function to run on every rank"
            )
        return self._run(FunctionRun(train_object, args, kwargs))

    def _script(self, path: str, args: tuple, kwargs: dict) -> ScriptRun:
        """A script file to run on every rank, as torchrun would, with ``args`` as its
        command line."""
        if kwargs:
            raise ConfigurationError(
                f"Distributor.run({path!r}, ...) got keyword arguments {sorted(kwargs)}: a "
                "script takes its command line only; pass them as '--name=value' strings"
            )
        if self.local_mode and not os.path.isfile(path):
            raise ConfigurationError(
                f"Distributor.run({path!r}): there is no such file on this host, where "
                "local_mode=True runs every rank"
            )
        return ScriptRun(os.path.abspath(path) if self.local_mode else path, tuple(map(str, args)))

    def _run(self, work: Any) -> Any:
        from pyspark.sql import SparkSession

        session = SparkSession.getActiveSession()
        if session is None:
            raise ConfigurationError(
                "Distributor.run needs an active SparkSession: start one first "
                "(SparkSession.builder...getOrCreate())"
            )
        spark = SparkInfo(session)
        gpus, profile = self._check(spark)
        network = self.network.resolved(spark.session_setting)
        from allreduce_param.torch_backend.backend import process_group_parameter

        param = process_group_parameter(self.num_processes, network=network)
        end = DriverEnd(spark, self.num_processes, network)
        try:
            job = RankJob(param, end.client, network.meeting_patience, gpus, work)
            # its jobs in one group named for the run in the Spark UI; on Ctrl-C (or any
            # error) they are cancelled and their tasks waited for before it re-raises
            with fit_jobs(spark, f"Distributor: {work.name}"):
                try:
                    payloads = _stage(session, job, self.num_processes, profile)
                except Exception as error:
                    end.stage_failed()
                    raise _run_error(end, error) from error
        finally:
            end.close()
        from pyspark import cloudpickle

        if len(payloads) != 1:
            raise TrainingError(
                f"the Distributor's stage returned {len(payloads)} results, expected rank 0's"
            )
        return cloudpickle.loads(payloads[0])

    def _check(self, spark: SparkInfo) -> tuple[str, Any]:
        """The checks before the stage, as Spark would fail it (or wait) only later; how the
        ranks get GPUs, and the stage's resource profile (None: the session's default)."""
        master = spark.setting("spark.master", "")
        local = master.startswith(_LOCAL_MASTERS)
        if self.local_mode and not local:
            raise ConfigurationError(
                f"Distributor(local_mode=True) runs every rank on the driver's host, but this "
                f"session's master {master!r} runs its tasks on executors: pass "
                "local_mode=False to run the ranks there"
            )
        check_no_dynamic_allocation(spark)
        gpus, profile = "none", None
        if self.use_gpu and (master == "local" or master.startswith("local[")):
            gpus = "local"  # local mode assigns no GPUs: the host's, by local rank
            import torch

            if torch.cuda.device_count() == 0:
                raise ConfigurationError(
                    f"Distributor(use_gpu=True) on {master}: its ranks run on this host, and "
                    "this host's PyTorch sees no GPU; pass use_gpu=False (the ranks run on "
                    "the CPU)"
                )
        elif self.use_gpu:
            gpus, profile = "spark", stage_profile(spark, 1)
        slots, counted = task_slots(spark, needed=self.num_processes, profile=profile)
        if self.num_processes > slots:
            raise ConfigurationError(
                f"Distributor(num_processes={self.num_processes}), but Spark has {slots} task "
                f"slots ({counted}); a barrier stage needs all its tasks running at once: "
                "lower num_processes, or give Spark more cores (local[N], "
                "spark.executor.instances x spark.executor.cores / spark.task.cpus"
                + (", and GPUs: spark.executor.resource.gpu.amount" if profile else "")
                + ")"
            )
        return gpus, profile


def _stage(session: Any, job: RankJob, ranks: int, profile: Any) -> list[bytes]:
    """The barrier stage of ``ranks`` tasks, one row each, through the DataFrame API (which
    Spark Connect has too); rank 0's pickled value."""
    from allreduce_param.spark.arrow import record_batch

    def task(batches):
        for _ in batches:  # the task's one row: its place only
            pass
        value = job.work.rank(job)
        if value is not None:
            yield record_batch(value=[value])

    extra = {} if profile is None else {"profile": profile}
    frame = session.range(0, ranks, 1, ranks).mapInArrow(
        task, "value binary", barrier=True, **extra
    )
    return [bytes(row["value"]) for row in frame.collect()]


def _run_error(end: DriverEnd, error: Exception) -> Exception:
    """One error for a failed stage: the failing rank's own report (its traceback), else
    what Spark's report says (a crashed worker, too few slots...), as a fit words it."""
    from allreduce_param.train.driver.failures import stage_error

    found = end.reports.root_failure()
    if found is not None:
        return found
    return stage_error(error)
