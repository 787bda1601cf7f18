"""GPUs in Spark: the ones a task was assigned, and what a fit's stage asks Spark for.

In a task, ``task_resources()`` is ``TaskContext.get().resources()`` (None outside a Spark
task), which ``TorchModel`` reads to pick its device (``models.devices``).

On the driver, ``stage_profile(info, gpus_per_task)`` is the stage-level resource profile
the fit's barrier stage runs with, so that each task is assigned ``gpus_per_task`` GPUs
(a fraction shares one GPU between tasks). What Spark supports, as Spark 4.x's
``ResourceProfileManager.isSupported`` says:

- a *task* resource profile (task requests only, as here) with dynamic allocation off on
  a standalone cluster (Spark 3.4+, SPARK-39853; ``local-cluster`` counts as one), on YARN
  and on Kubernetes (SPARK-45250, SPARK-45495; in Spark 4.0 and the later 3.5 releases):
  the stage's tasks run on the executors the application has, so those must have the GPUs
  (``spark.executor.resource.gpu.amount`` and a discovery script);
- not local mode (``local[N]``): its tasks are assigned no GPUs at all;
- ``DataFrame.mapInArrow(profile=)``, which the fit's stage is, came in PySpark 4.0.

Where the session's own ``spark.task.resource.gpu.amount`` already asks what
``gpus_per_task`` asks, no profile is needed and every Spark runs the stage as it is.
Anything else is refused before the stage, naming the settings to change, rather than
left to fail (or, for a barrier stage whose tasks cannot all be placed, to wait) inside
Spark.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from allreduce_param.errors import ConfigurationError
from allreduce_param.spark.info import SparkInfo
from allreduce_param.spark.versions import pyspark_version


def task_resources() -> Mapping[str, Any] | None:
    """This Spark task's resources by name (``TaskContext.get().resources()``); None outside
    a Spark task. pyspark is not imported for the asking: a Python worker has it loaded."""
    if "pyspark" not in sys.modules:
        return None
    from pyspark import TaskContext

    context = TaskContext.get()
    return None if context is None else context.resources()


def on_spark_driver() -> bool:
    """Whether this process is a classic Spark driver (it has an active SparkContext), where
    the GPUs a fit asks for are the executors', not its own."""
    if "pyspark" not in sys.modules:
        return False
    from pyspark import SparkContext

    return SparkContext._active_spark_context is not None


def stage_profile(info: SparkInfo | None, gpus_per_task: float | None) -> Any:
    """The ``pyspark.resource.ResourceProfile`` the fit's stage runs with, or None where the
    session's settings already give each task ``gpus_per_task`` GPUs (or none is asked).
    A ConfigurationError, naming the settings, where Spark could not honour the ask."""
    if info is None or not profile_needed(
        info.setting, info.connect, gpus_per_task, pyspark_version()
    ):
        return None
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    requests = TaskResourceRequests().cpus(int(info.setting("spark.task.cpus", "1")))
    requests.resource("gpu", float(gpus_per_task))
    return ResourceProfileBuilder().require(requests).build


def profile_needed(
    setting: Callable[[str, str], str],
    connect: bool,
    gpus_per_task: float | None,
    version: tuple[int, int],
) -> bool:
    """Whether the stage needs a profile of its own for ``gpus_per_task`` GPUs per task, given
    the session's settings (``setting(key, default)``), whether it is a Spark Connect client
    and the PySpark ``version``; a ConfigurationError naming what to set where Spark could
    not honour one."""
    if gpus_per_task is None:
        return False
    asked = float(gpus_per_task)
    default = setting("spark.task.resource.gpu.amount", "")
    if default and float(default) == asked:
        return False
    how = (
        f"start the session with spark.task.resource.gpu.amount={gpus_per_task} (and "
        "spark.executor.resource.gpu.amount with its discoveryScript)"
    )
    master = setting("spark.master", "")
    if master == "local" or master.startswith("local["):  # not local-cluster[...]
        raise ConfigurationError(
            f"gpus_per_task={gpus_per_task}: Spark's local mode ({master}) assigns tasks no "
            "GPUs; on one machine either leave gpus_per_task unset and give the model its "
            "device (TorchModel(device='cuda:0')), or use a standalone or local-cluster "
            "master whose workers have GPUs (spark.worker.resource.gpu.amount and "
            "spark.worker.resource.gpu.discoveryScript)"
        )
    if connect:
        raise ConfigurationError(
            f"gpus_per_task={gpus_per_task}: a Spark Connect client cannot give the stage "
            f"a resource profile here; {how} on the server"
        )
    executor = setting("spark.executor.resource.gpu.amount", "")
    if not executor or float(executor) < asked:
        raise ConfigurationError(
            f"gpus_per_task={gpus_per_task}: the executors have "
            f"{'no GPUs' if not executor else f'{executor} GPU(s) each'} "
            "(spark.executor.resource.gpu.amount); the stage runs on the executors the "
            "application has, so start it with spark.executor.resource.gpu.amount >= "
            "gpus_per_task and spark.executor.resource.gpu.discoveryScript (on a standalone "
            "cluster also spark.worker.resource.gpu.amount and its discoveryScript)"
        )
    if version < (4, 0):
        raise ConfigurationError(
            f"gpus_per_task={gpus_per_task}: the fit's stage takes a resource profile from "
            f"PySpark 4.0 (DataFrame.mapInArrow(profile=)); on this PySpark, {how}"
        )
    return True
