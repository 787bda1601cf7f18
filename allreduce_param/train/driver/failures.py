"""What the driver makes of a failed fit stage: one clear error from the wall of Java stack
Spark gives, and what the fit's checkpoints make possible then.

A task's own failure is ``records.task_failure``'s, found again by
``records.recover_task_failure``; the other causes (too few slots, data that changed under
the fit, a task that failed outside its training loop) are recognised here. A task's error
that every run of the stage would meet again (``RECURRING``: a setting, an input, a call
out of order) comes back as its own type, and the fit does not run its stage again for it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from allreduce_param.errors import (
    AllReduceError,
    ConfigurationError,
    InputError,
    TrainingError,
    UsageError,
)
from allreduce_param.spark.info import SparkInfo
from allreduce_param.train.checkpoint import CheckpointSettings, newest
from allreduce_param.train.records import recover_task_failure

#: Spark's reason when a barrier stage has more tasks than the cluster has slots
NOT_ENOUGH_SLOTS = "SPARK-24819"
#: what Spark says when a task of a barrier stage that returns results failed
TASK_FAILED = "Could not recover from a failed barrier ResultStage"
#: Spark's refusal of a barrier stage over rows whose lineage has a union or a coalesce
UNSUPPORTED_CHAIN = "BarrierJobUnsupportedRDDChainException"
#: what Spark says when a task's Python worker process died under it: killed (by the
#: kernel for memory, by a container's limit) or crashed in native code
WORKER_CRASHED = "Python worker exited unexpectedly"
#: what Spark says when a task's executor (its JVM, with its Python workers) went away
_EXECUTOR_LOST = re.compile(r"ExecutorLostFailure \(([^)\n]*)\)(?: Reason: ([^\n]*))?")
#: Spark ran the stage again itself (after a lost executor), this many runs in all
_SPARK_RUNS = re.compile(r"has failed the maximum allowable number of times: (\d+)")
#: the task whose failure Spark reports, ``ResultTask(stage, partition)``
_FAILED_TASK = re.compile(r"barrier task \w*Task\(\d+, (\d+)\)")
#: a Python error outside the training loop (e.g. the task's closure failed to unpickle);
#: its last line, with its message if it has one (a bare ``MemoryError`` has none)
_PYTHON_ERROR = re.compile(
    r"Traceback \(most recent call last\):\n(?:[ \t][^\n]*\n)*([A-Za-z_][\w.]*(?:: [^\n]*)?)"
)
#: a partition's report that a peer went away with no reason given (``errors.peer_lost``,
#: from a fetch or a wait in the host arena): its process died, or its executor
_PEER_GONE = re.compile(
    r"^partition (\d+)(?:, ([^:]*))?: PeerLostError: partition (\d+) at \S+ (.*?) while "
    r"(?:we fetched|partition \d+ waited for) (.*?), without a word"
)
#: a task's error that says its process ran out of memory (ENOMEM is errno 12)
_OUT_OF_MEMORY = re.compile(r"MemoryError|\[Errno 12\]")
#: placing the rows found data that changed since prepare() counted it (partitioning.py)
_PLACEMENT_MESSAGE = re.compile(r"row \d+ of partition \d+ of the prepared data is not among[^\n]*")
#: the errors a task meets again on every run of the stage, whatever its data or peers do:
#: a setting (e.g. a GPU asked for that the task has not), an input, a call out of order.
#: Only these exact types: a ``DamagedCheckpointError`` (an ``InputError``) is a file that a
#: new run passes over for an older intact checkpoint.
RECURRING = (ConfigurationError, InputError, UsageError)
_RECURRING_NAMES = {kind.__name__: kind for kind in RECURRING}
#: a task's failure as ``records.task_failure`` words it: where, the error's type, its message
_TASK_FAILURE_PARTS = re.compile(r"(partition [^:]*): (\w+): (.*)", re.DOTALL)
_SPARK_REASON = re.compile(r"org\.apache\.spark\.[\w.]*(?:Exception|Failed)[^\n]*")


def stage_attempts(spark: SparkInfo) -> int:
    """How many times in all a fit runs its stage when tasks fail: Spark's own setting for
    retrying a stage, ``spark.stage.maxConsecutiveAttempts``."""
    # Spark's scheduler reads it at start-up: a session that runs has a valid one
    return max(1, int(spark.setting("spark.stage.maxConsecutiveAttempts", "4")))


Start = TypeVar("Start")
Result = TypeVar("Result")


def run_until_done(
    run: Callable[[Start], Result],
    first: Start,
    attempts: int,
    again: Callable[[Exception, int], Start],
    failed: Callable[[], None] | None = None,
) -> Result:
    """What ``run(start)`` returns the first time it succeeds, of at most ``attempts`` runs:
    a fit's barrier stage, which Spark does not run again when a task of it fails (it
    returns its results itself). The first run starts at ``first``; after a failed one,
    ``again(error, failures)`` (``error``: ``stage_error``'s, ``failures``: the runs failed
    so far) says where the next starts (a fit's newest checkpoint) and warns that it runs
    again. ``failed()``, where given, is called after each failed run first.

    The last run's error (``stage_error``'s, Spark's report as its cause) ends it: after
    ``attempts`` runs, at once where the stage did not fail in a task (``task_failed``: it
    was refused), or where every run would meet that error again (``recurs``). The one
    loop DistriOptimizer's stage (``stage.run_stage``) and the linear models'
    (``glm_attempts``) run under."""
    start, failures = first, 0
    while True:
        try:
            return run(start)
        except Exception as error:
            if failed is not None:
                failed()
            failures += 1
            found = stage_error(error, runs=failures)
            if failures >= attempts or not task_failed(error) or recurs(found):
                raise found from error  # Spark's own report stays on it, as the cause
            start = again(stage_error(error), failures)


def recurs(error: Exception) -> bool:
    """Whether ``error`` (``stage_error``'s) is one that every run of the stage would meet
    again: the fit then ends at once rather than run the stage again."""
    return type(error) in RECURRING


def task_failed(error: Exception) -> bool:
    """Whether ``error`` is Spark's report that a task of the fit's stage failed (the stage
    may run again), rather than a refusal of the stage."""
    return TASK_FAILED in str(error)


def stage_error(error: Exception, runs: int = 1) -> Exception:
    """One clear error from the wall of Java stack a failed barrier stage gives; ``runs``:
    how many times the fit ran its stage, each failing (this is the last run's error).

    A partition that lost a failed peer quotes what that peer said; the innermost quote
    is the root cause, whichever task's failure Spark reported. A task whose Python worker
    died (``WORKER_CRASHED``), whose executor was lost, or that ran out of memory gets what
    to change for it. A task's ``RECURRING`` error comes back as its own type, its message
    after where it was raised.
    """
    text = str(error)
    if NOT_ENOUGH_SLOTS in text:  # where the slots could only be estimated first (Spark Connect)
        return ConfigurationError(
            "Spark refused the fit's barrier stage: it needs more task slots than the cluster has "
            f"({NOT_ENOUGH_SLOTS}, after spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures "
            "tries); lower num_workers, or give Spark more executors or cores"
        )
    found = _task_error(error)
    spark_runs = _SPARK_RUNS.search(text)
    runs = max(runs, int(spark_runs.group(1)) if spark_runs else 1)
    if _OUT_OF_MEMORY.search(str(found)) and OUT_OF_MEMORY_ADVICE not in str(found):
        found = TrainingError(f"{found}. {OUT_OF_MEMORY_ADVICE}")
    if runs > 1:
        found = TrainingError(
            f"{found} (the fit ran its stage {runs} times, as spark.stage.maxConsecutiveAttempts "
            "allows, and every run failed: this is the last run's error)"
        )
    return found


#: What to change when a Python worker ran out of memory, or was killed for it.
OUT_OF_MEMORY_ADVICE = (
    "Give the Python workers more memory: raise spark.executor.pyspark.memory where it is set "
    "(it limits each worker's address space, mapped shared memory included), else "
    "spark.executor.memoryOverhead (the OS or the cluster kills a process over the "
    "executor's memory), or put fewer rows on each worker (a larger num_workers, more "
    "executors)"
)


def _worker_died(partition: str, how: str, executor: bool = False) -> TrainingError:
    """The error for a partition whose process died in the middle of the fit: ``how`` it
    shows; with ``executor``, the whole executor may have gone with it."""
    lost = "; or its executor was lost" if executor else ""
    return TrainingError(
        f"partition {partition}'s Python worker died in the middle of the fit ({how}): it was "
        "killed, most often for using more memory than it may (by the kernel's OOM killer, or "
        f"a container's or YARN's limit), or it crashed in a native library{lost}. "
        f"{OUT_OF_MEMORY_ADVICE}. For a crash, set spark.python.worker.faulthandler.enabled=true "
        "and read the executor's stderr"
    )


def _task_error(error: Exception) -> AllReduceError:
    """The failed task's error, from the text of Spark's report: a ``TrainingError``, or
    the task's own ``RECURRING`` one (``_recurring``)."""
    text = str(error)
    task = _FAILED_TASK.search(text)
    partition = task.group(1) if task else "?"
    if WORKER_CRASHED in text:
        return _worker_died(partition, "Spark: Python worker exited unexpectedly")
    executor = _EXECUTOR_LOST.search(text)
    if executor is not None:
        detail, reason = executor.groups()
        said = f" Reason: {reason}" if reason else ""
        return TrainingError(
            f"partition {partition}'s executor was lost in the middle of the fit (Spark: "
            f"ExecutorLostFailure ({detail}){said}): it was killed, most often for using more "
            "memory than its container may (exit code 137 is SIGKILL), or its machine went "
            "away. Give the executors more memory: spark.executor.memoryOverhead (the Python "
            "workers' and native memory) or spark.executor.memory (the JVM's), or put fewer "
            "rows on each worker (a larger num_workers, more executors)"
        )
    failure = recover_task_failure(text)
    if failure is not None:
        gone = _PEER_GONE.search(str(failure))
        if gone is None:
            parts = _TASK_FAILURE_PARTS.fullmatch(str(failure))
            return (_recurring(*parts.groups()) if parts else None) or failure
        reporter, where, dead, detail, what = gone.groups()
        at = f" ({where})" if where else ""
        return _worker_died(
            dead,
            f"partition {reporter}{at} found that it {detail} while fetching {what}, without a "
            "word",
            executor=True,
        )
    placement = _PLACEMENT_MESSAGE.search(text)
    if placement:
        return TrainingError(placement.group(0))
    python = _PYTHON_ERROR.search(text)
    if python:
        where = f"a task of the fit (partition {partition}) failed outside its training loop"
        name, _, message = python.group(1).partition(": ")
        return _recurring(where, name.rpartition(".")[2], message) or TrainingError(
            f"{where}: {python.group(1)}"
        )
    spark_reason = _SPARK_REASON.search(text)
    return TrainingError(
        spark_reason.group(0) if spark_reason else text.splitlines()[0] if text else repr(error)
    )


def _recurring(where: str, name: str, message: str) -> AllReduceError | None:
    """A task's error of type ``name`` with ``message``, raised ``where``, as that type when
    it is ``RECURRING``; else None."""
    kind = _RECURRING_NAMES.get(name)
    return None if kind is None else kind(f"{where}: {message}")


def with_checkpoint_advice(
    error: TrainingError,
    checkpoints: CheckpointSettings,
    spark: SparkInfo,
    resume: str = "fit(..., resume_from={folder!r})",
) -> TrainingError:
    """The failure, with what the fit's checkpoints make possible now: ``resume`` (with the
    checkpoint's ``folder``) says how to continue from the newest."""
    found = newest(checkpoints.directory)
    if found is None:
        advice = f"The fit wrote no complete checkpoint to {checkpoints.directory} before it failed"
    else:
        advice = (
            f"Its newest checkpoint, of step {found.step}, is {found.folder}: "
            f"{resume.format(folder=found.folder)} continues from it"
        )
        if stage_attempts(spark) == 1:
            advice += (
                "; the stage ran once (spark.stage.maxConsecutiveAttempts=1): with 2 or "
                "more it resumes from the checkpoint on its own"
            )
    return TrainingError(f"{error}. {advice}")
