"""What the driver makes of a failed fit stage: one clear error from the wall of Java stack
Spark gives, and what the fit's checkpoints make possible then.

A task's own failure is ``records.task_failure``'s, found again by
``records.recover_task_failure``; the other causes (too few slots, data that changed under
the fit, a task that failed outside its training loop) are recognised here.
"""

from __future__ import annotations

import re

from allreduce_param.errors import ConfigurationError, TrainingError
from allreduce_param.spark.info import SparkInfo
from allreduce_param.train.checkpoint import CheckpointSettings, newest
from allreduce_param.train.records import recover_task_failure

#: Spark's reason when a barrier stage has more tasks than the cluster has slots
NOT_ENOUGH_SLOTS = "SPARK-24819"
#: what Spark says when a task of a barrier stage that returns results failed
TASK_FAILED = "Could not recover from a failed barrier ResultStage"
#: Spark's refusal of a barrier stage over rows whose lineage has a union or a coalesce
UNSUPPORTED_CHAIN = "BarrierJobUnsupportedRDDChainException"
#: a Python error outside the training loop (e.g. the task's closure failed to unpickle)
_PYTHON_ERROR = re.compile(
    r"Traceback \(most recent call last\):\n(?:[ \t][^\n]*\n)*([A-Za-z_][\w.]*: [^\n]*)"
)
#: placing the rows found data that changed since prepare() counted it (partitioning.py)
_PLACEMENT_MESSAGE = re.compile(r"row \d+ of partition \d+ of the prepared data is not among[^\n]*")
_SPARK_REASON = re.compile(r"org\.apache\.spark\.[\w.]*(?:Exception|Failed)[^\n]*")


def stage_attempts(spark: SparkInfo) -> int:
    """How many times in all a fit runs its stage when tasks fail: Spark's own setting for
    retrying a stage, ``spark.stage.maxConsecutiveAttempts``."""
    # Spark's scheduler reads it at start-up: a session that runs has a valid one
    return max(1, int(spark.setting("spark.stage.maxConsecutiveAttempts", "4")))


def task_failed(error: Exception) -> bool:
    """Whether ``error`` is Spark's report that a task of the fit's stage failed (the stage
    may run again), rather than a refusal of the stage."""
    return TASK_FAILED in str(error)


def stage_error(error: Exception) -> Exception:
    """One clear error from the wall of Java stack a failed barrier stage gives.

    A partition that lost a failed peer quotes what that peer said; the innermost quote
    is the root cause, whichever task's failure Spark reported.
    """
    text = str(error)
    if NOT_ENOUGH_SLOTS in text:  # where the slots could only be estimated first (Spark Connect)
        return ConfigurationError(
            "Spark refused the fit's barrier stage: it needs more task slots than the cluster has "
            f"({NOT_ENOUGH_SLOTS}, after spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures "
            "tries); lower num_workers, or give Spark more executors or cores"
        )
    failure = recover_task_failure(text)
    if failure is not None:
        return failure
    placement = _PLACEMENT_MESSAGE.search(text)
    if placement:
        return TrainingError(placement.group(0))
    python = _PYTHON_ERROR.search(text)
    if python:
        return TrainingError(
            f"a task of the fit failed outside its training loop: {python.group(1)}"
        )
    spark_reason = _SPARK_REASON.search(text)
    return TrainingError(
        spark_reason.group(0) if spark_reason else text.splitlines()[0] if text else repr(error)
    )


def with_checkpoint_advice(
    error: TrainingError, checkpoints: CheckpointSettings, spark: SparkInfo
) -> TrainingError:
    """The failure, with what the fit's checkpoints make possible now."""
    found = newest(checkpoints.directory)
    if found is None:
        advice = f"The fit wrote no complete checkpoint to {checkpoints.directory} before it failed"
    else:
        advice = (
            f"Its newest checkpoint, of step {found.step}, is {found.folder}: "
            f"fit(..., resume_from={found.folder!r}) continues from it"
        )
        if stage_attempts(spark) == 1:
            advice += (
                "; the stage ran once (spark.stage.maxConsecutiveAttempts=1): with 2 or "
                "more it resumes from the checkpoint on its own"
            )
    return TrainingError(f"{error}. {advice}")
