"""What Spark can run at once: the task slots a barrier stage gets, and dynamic allocation.

A barrier stage needs all its tasks running at the same time. Spark checks that only when
the stage is submitted (after the data was checked and placed), so the driver asks the
same questions first, the way Spark answers them, and says which setting to change.
"""

from __future__ import annotations

import re
import time
from typing import Any

from allreduce_param.errors import ConfigurationError
from allreduce_param.spark.info import SparkInfo


def check_no_dynamic_allocation(info: SparkInfo | None) -> None:
    """Refuse dynamic allocation on the driver, as Spark would refuse the barrier stage.

    Spark refuses a barrier stage (BarrierJobRunWithDynamicAllocationException, SPARK-24942)
    when ``Utils.isDynamicAllocationEnabled`` holds: ``spark.dynamicAllocation.enabled=true``
    with a master other than ``local``/``local[...]``, or in local mode only with
    ``spark.dynamicAllocation.testing=true``. In local mode Spark ignores the setting (no
    executors come or go; tried: a barrier stage on local[4] with it on runs), so a local
    user with it on, e.g. from a cluster's spark-defaults.conf, is not refused: the check
    asks Spark's own function, so it refuses exactly what would fail. When that function is
    out of reach (another Spark, or Spark Connect), the same rule is applied here.
    """
    if info is None:  # not Spark data: fit() says so next
        return
    try:
        context = info.context
        enabled = bool(
            context._jvm.org.apache.spark.util.Utils.isDynamicAllocationEnabled(
                context._jsc.sc().conf()
            )
        )
    except Exception:  # py4j's errors vary with the Spark version; fall back to the rule itself
        enabled = info.setting("spark.dynamicAllocation.enabled", "false").lower() == "true" and (
            not _is_local(info.setting("spark.master", ""))
            or info.setting("spark.dynamicAllocation.testing", "false").lower() == "true"
        )
    if enabled:
        raise ConfigurationError(
            "spark.dynamicAllocation.enabled=true, but a barrier stage (the fit) cannot run under dynamic "
            "allocation (Spark refuses it, SPARK-24942): start the session with "
            "spark.dynamicAllocation.enabled=false and a fixed number of executors, spark.executor.instances=N, "
            "with N x spark.executor.cores / spark.task.cpus >= num_workers"
        )


def _is_local(master: str) -> bool:
    """Whether ``master`` runs tasks in the driver's JVM (``local``, ``local[N]``, ``local[N,F]``,
    ``local[*]``), as Spark's ``Utils.isLocalMaster`` says; ``local-cluster[...]`` is not."""
    return master == "local" or master.startswith("local[")


def task_slots(info: SparkInfo, needed: int = 1, profile: Any = None) -> tuple[int, str]:
    """How many tasks of the fit's stage Spark can run at once, and how that was counted.

    Counted as Spark's barrier scheduler counts them before it starts a barrier stage:
    ``SparkContext.maxNumConcurrentTasks`` of the stage's resource profile (``profile``, a
    ``pyspark.resource.ResourceProfile`` asking for GPUs; None: the default one), i.e.
    over the executors registered now, each one's cores / ``spark.task.cpus`` (and custom
    resources / their amount per task), summed. The method
    is ``private[spark]``, public in the bytecode; when py4j cannot reach it (another
    Spark, or Spark Connect, which has no JVM here), ``defaultParallelism // spark.task.cpus``
    stands in. With fewer than ``needed`` on a cluster, executors may still be registering:
    see ``_wait_for_slots``.
    """
    cpus = int(info.setting("spark.task.cpus", "1"))
    master = info.setting("spark.master", "")
    try:
        context = info.context._jsc.sc()
        profiles = context.resourceProfileManager()
        counted_for = (
            profiles.defaultResourceProfile()
            if profile is None
            else profile._java_resource_profile  # a task profile's count: its GPUs too
        )
        slots, waited = int(context.maxNumConcurrentTasks(counted_for)), 0.0
        if slots < needed and not _is_local(master):  # in local mode the count never changes
            slots, waited = _wait_for_slots(context, counted_for, master, needed)
    except Exception:  # py4j's errors vary with the Spark version
        parallelism = info.default_parallelism()
        return max(
            1, parallelism // cpus
        ), f"defaultParallelism={parallelism} / spark.task.cpus={cpus}"
    if _is_local(master):
        return slots, f"the cores of {master}" + (f" / spark.task.cpus={cpus}" if cpus != 1 else "")
    cluster = _LOCAL_CLUSTER.fullmatch(master)
    cores = cluster.group(2) if cluster else info.setting("spark.executor.cores", "its default")
    counted = (
        f"{_executors(context)} executors registered x {cores} cores (spark.executor.cores) "
        f"/ spark.task.cpus={cpus}"
    )
    if profile is not None:
        gpus = info.setting("spark.executor.resource.gpu.amount", "0")
        counted += f", and their {gpus} GPUs each / gpus_per_task"
    if waited:
        counted += f", after waiting {waited:.0f} s for more ({_SLOTS_CHECK_INTERVAL} x {_SLOTS_CHECK_TRIES})"
    return slots, counted


def _wait_for_slots(context, profile, master: str, needed: int) -> tuple[int, float]:
    """Count the slots again while executors register, as Spark's barrier check does before
    it fails a stage: every ``spark.scheduler.barrier.maxConcurrentTasksCheck.interval``, at
    most ``...maxFailures`` times, and no longer once every executor asked for
    (``spark.executor.instances``, or N of ``local-cluster[N,...]``) is there. The slots,
    and the seconds waited."""
    conf = context.conf()
    interval = conf.getTimeAsMs(_SLOTS_CHECK_INTERVAL, "15s") / 1000
    cluster = _LOCAL_CLUSTER.fullmatch(master)
    expected = int(cluster.group(1)) if cluster else int(conf.get("spark.executor.instances", "0"))
    slots, waited = int(context.maxNumConcurrentTasks(profile)), 0.0
    for _ in range(int(conf.get(_SLOTS_CHECK_TRIES, "40"))):
        if slots >= needed or (expected and _executors(context) >= expected):
            break  # enough, or every executor asked for is here: no more slots will come
        time.sleep(interval)
        waited += interval
        slots = int(context.maxNumConcurrentTasks(profile))
    return slots, waited


def _executors(context) -> int:
    """How many executors have registered with the (JVM) SparkContext ``context``."""
    return max(0, len(context.statusTracker().getExecutorInfos()) - 1)  # less the driver


#: Spark's barrier check counts the slots again this often, this many times, before it fails.
_SLOTS_CHECK_INTERVAL = "spark.scheduler.barrier.maxConcurrentTasksCheck.interval"
_SLOTS_CHECK_TRIES = "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures"
#: local-cluster[executors, cores per executor, MiB per executor]
_LOCAL_CLUSTER = re.compile(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,.*\]")
