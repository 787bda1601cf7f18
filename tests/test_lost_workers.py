"""A Python worker that dies in the middle of a fit (killed: by the kernel for memory, or a
crash in native code) or runs out of memory ends the fit with one clear error naming the
partition, the likely cause and what to change; the stage runs again only as often as
``spark.stage.maxConsecutiveAttempts`` says, announced each time, and never hangs.

Also: how the driver reads Spark's report of it (whichever task's failure Spark reports
first), and a partition with no memory left to map a peer's block, which is its own
``MemoryError``, not the peer's loss. (A worker killed once, with retries, resumes from the
newest checkpoint and ends with the uninterrupted fit's weights: ``test_fault_tolerance``.)
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading

import numpy as np
import pytest
from conftest import random_rows
from pyspark import cloudpickle

from allreduce_param import (
    ConfigurationError,
    DamagedCheckpointError,
    DistriOptimizer,
    InputError,
    PeerLostError,
    TrainingError,
    UsageError,
    models,
    optim,
)
from allreduce_param.errors import peer_lost
from allreduce_param.train.driver.failures import OUT_OF_MEMORY_ADVICE, recurs, stage_error
from allreduce_param.train.records import task_failure

cloudpickle.register_pickle_by_value(sys.modules[__name__])


SPARK_MASTER = "local[2]"  # the session of test_fault_tolerance, Spark's 4 runs of a stage


@pytest.fixture(scope="module")
def data(spark):
    return random_rows(spark, seed=6)


class DiesAtStep(models.MLP):
    """Partition 1, at its ``at``-th gradient of every run: ``"kill"`` sends its own Python
    worker SIGKILL (as the kernel's OOM killer does); ``"allocate"`` limits the worker's
    address space to 4 GiB, as ``spark.executor.pyspark.memory=4g`` does (RLIMIT_AS; the
    setting itself would take a Spark session of its own), and asks for 16 GiB, which the
    limit refuses (untouched, it would cost nothing without one)."""

    def __init__(self, at: int, how: str) -> None:
        super().__init__([6, 8, 3])
        self.at, self.how, self.calls = at, how, 0

    def loss_and_grad(self, weights, X, y):
        from pyspark import TaskContext

        context = TaskContext.get()  # None on the driver, which tries the model on one row
        if context is not None and context.partitionId() == 1:
            self.calls += 1  # a fresh copy of the model in every run's task
            if self.calls == self.at and self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.calls == self.at:
                import resource

                soft, hard = resource.getrlimit(resource.RLIMIT_AS)
                resource.setrlimit(resource.RLIMIT_AS, (4 << 30, hard))
                try:
                    np.empty(16 << 30, np.uint8)
                finally:  # the worker process is reused
                    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        return super().loss_and_grad(weights, X, y)


def fit_within(seconds: float, data, model) -> BaseException | None:
    """Fit ``model`` on a thread; the error it ended with (None: it trained). Fails the test
    if the fit has not returned after ``seconds``: a dead worker must not leave it hanging."""
    outcome: list = [None]

    def run() -> None:
        try:
            DistriOptimizer(
                model, optim.SGD(lr=0.1), batch_size=40, epochs=2, progress=False, num_workers=2
            ).fit(data)
        except BaseException as error:  # the test inspects it
            outcome[0] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the fit has not returned after {seconds} s"
    return outcome[0]


@pytest.mark.slow
def test_a_worker_killed_in_every_run_ends_the_fit_with_one_clear_error(data):
    with pytest.warns(RuntimeWarning, match="the fit's stage failed, run 1 of at most 4") as said:
        # 240 s, all 4 runs, is less than the 300 s a peer waits (timeout): none waits it out
        error = fit_within(240, data, DiesAtStep(at=3, how="kill"))
    assert isinstance(error, TrainingError), error
    message = str(error)
    # Spark reports the dead worker itself, or the peer that lost it first: both name it
    assert message.startswith("partition 1's Python worker died in the middle of the fit ("), (
        message
    )
    assert "killed, most often for using more memory than it may" in message
    assert OUT_OF_MEMORY_ADVICE in message
    assert message.endswith(
        "(the fit ran its stage 4 times, as spark.stage.maxConsecutiveAttempts allows, and "
        "every run failed: this is the last run's error)"
    )
    assert "org.apache.spark" in str(error.__cause__)  # Spark's own report stays on it
    warned = [str(w.message) for w in said if "the fit's stage failed" in str(w.message)]
    assert len(warned) == 3, warned  # before each run again
    for run, text in enumerate(warned, 1):
        assert text.startswith(
            f"the fit's stage failed, run {run} of at most 4 (spark.stage.maxConsecutiveAttempts): "
            "partition 1's Python worker died in the middle of the fit ("
        ), text
        assert text.endswith(
            "It runs again, from the start; a fit with checkpoints (checkpoints=Checkpoints("
            "dir=...) in Python, checkpoint_dir in a job file, checkpointDir on an Estimator) "
            "would resume from its newest checkpoint"
        )


@pytest.mark.slow
def test_a_worker_out_of_memory_under_its_limit_says_which_setting_to_raise(data):
    with pytest.warns(RuntimeWarning, match="run 1 of at most 4"):
        error = fit_within(240, data, DiesAtStep(at=2, how="allocate"))
    assert isinstance(error, TrainingError), error
    message = str(error)
    assert message.startswith("partition 1, epoch 0, step 1: MemoryError"), message
    assert "Unable to allocate 16.0 GiB" in message
    assert f". {OUT_OF_MEMORY_ADVICE} (the fit ran its stage 4 times" in message


# ---- how the driver reads Spark's report of a dead worker (Spark's text, no session) ------

#: the head of what Spark's driver raises when a task of the fit's stage failed
ABORTED = (
    "An error occurred while calling o222.collectToPython.\n: org.apache.spark.SparkException: "
    "Job aborted due to stage failure: Could not recover from a failed barrier ResultStage. "
    "Most recent failure reason: Stage failed because barrier task ResultTask(26, {task}) "
    "finished unsuccessfully.\n"
)


def test_the_dead_worker_is_named_whether_spark_reports_it_or_the_peer_that_lost_it():
    crashed = ABORTED.format(task=1) + (
        "org.apache.spark.SparkException: Python worker exited unexpectedly (crashed). Consider "
        "setting 'spark.python.worker.faulthandler.enabled' ...\n\tat org.apache.spark.api..."
    )
    lost = peer_lost(  # the engine's own wording, which the driver reads
        "partition 1 at 127.0.0.1:4100 closed the connection ([Errno 104] Connection reset by "
        "peer) while we fetched gradient block from partition 1 to partition 0, version 4"
    )
    peer = ABORTED.format(task=0) + (
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        '  File "stage.py", line 78, in arrow_task\n'
        f"allreduce_param.errors.TrainingError: {task_failure(0, ', epoch 0, step 4', lost)}\n"
        " SQLSTATE: 38000\n\tat org.apache.spark.api..."
    )
    by_spark, by_peer = stage_error(Exception(crashed)), stage_error(Exception(peer))
    assert str(by_spark).startswith(
        "partition 1's Python worker died in the middle of the fit (Spark: Python worker exited "
        "unexpectedly): it was killed, most often for using more memory than it may"
    )
    assert str(by_peer).startswith(
        "partition 1's Python worker died in the middle of the fit (partition 0 (epoch 0, step 4) "
        "found that it closed the connection ([Errno 104] Connection reset by peer) while "
        "fetching gradient block from partition 1 to partition 0, version 4, without a word): "
        "it was killed, most often for using more memory than it may"
    )
    assert "or its executor was lost" in str(by_peer)
    for error in (by_spark, by_peer):
        assert isinstance(error, TrainingError)
        assert OUT_OF_MEMORY_ADVICE in str(error)
        assert "spark.python.worker.faulthandler.enabled=true" in str(error)
    assert str(stage_error(Exception(crashed), runs=3)).endswith(
        "(the fit ran its stage 3 times, as spark.stage.maxConsecutiveAttempts allows, and "
        "every run failed: this is the last run's error)"
    )


def test_a_peer_lost_without_a_word_names_the_settings_the_driver_names():
    """The engine's advice for a peer gone without a word and the driver's for the Python
    worker it names dead give the same Spark settings in the same order: the Python
    workers' memory, never spark.executor.memory (the JVM's heap, which cannot help them)."""
    engine = str(
        peer_lost("partition 1 at 127.0.0.1:4100 closed the connection while we fetched x")
    )
    named = re.findall(r"spark\.executor\.[\w.]*\w", engine)
    assert named == ["spark.executor.pyspark.memory", "spark.executor.memoryOverhead"]
    assert re.findall(r"spark\.executor\.[\w.]*\w", OUT_OF_MEMORY_ADVICE) == named


def test_a_lost_executor_is_named_with_its_reason_and_the_memory_settings():
    # as a local-cluster reports an executor whose JVM was SIGKILLed in the middle of a fit
    text = (
        "An error occurred while calling o166.collectToPython.\n: org.apache.spark.SparkException: "
        "Job aborted due to stage failure: ResultStage 8 (collect at stage.py:107) has failed the "
        "maximum allowable number of times: 4. Most recent failure reason: Stage failed because "
        "barrier task ResultTask(8, 1) finished unsuccessfully.\nExecutorLostFailure (executor 1 "
        "exited caused by one of the running tasks) Reason: Command exited with code 137\n"
        "\tat org.apache.spark.scheduler.DAGScheduler..."
    )
    error = stage_error(Exception(text))
    assert isinstance(error, TrainingError)
    assert str(error) == (
        "partition 1's executor was lost in the middle of the fit (Spark: ExecutorLostFailure "
        "(executor 1 exited caused by one of the running tasks) Reason: Command exited with code "
        "137): it was killed, most often for using more memory than its container may (exit code "
        "137 is SIGKILL), or its machine went away. Give the executors more memory: "
        "spark.executor.memoryOverhead (the Python workers' and native memory) or "
        "spark.executor.memory (the JVM's), or put fewer rows on each worker (a larger "
        "num_workers, more executors) (the fit ran its stage 4 times, as "
        "spark.stage.maxConsecutiveAttempts allows, and every run failed: this is the last "
        "run's error)"
    )


def test_a_memory_error_before_the_training_loop_names_the_partition_and_the_settings():
    text = ABORTED.format(task=1) + (
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        '  File "rows.py", line 40, in arrays_from_arrow\n'
        "MemoryError\n\n\tat org.apache.spark.api..."
    )
    assert str(stage_error(Exception(text))) == (
        "a task of the fit (partition 1) failed outside its training loop: MemoryError. "
        f"{OUT_OF_MEMORY_ADVICE}"
    )


def limited_fetch(results) -> None:
    """Two partitions (threads) of this process on one host; partition 1 fetches the
    weights, whose block it maps from partition 0's shared memory, under an address-space
    limit with no room for the mapping (as spark.executor.pyspark.memory sets one)."""
    import resource

    from allreduce_param.engine import AllReduceParameter, LocalRendezvous

    # the blocks' path (through the host arena the mapping is made at connect instead); a
    # model whose shared segment (84 MB, sized by the model) cannot fit the limit's headroom
    size = 10_000_000
    param = AllReduceParameter(2, size, codec="raw", timeout=30, host_arena=False)
    group = LocalRendezvous(2)
    fetched = threading.Barrier(2)
    outcome = [None, None]

    def run(i: int) -> None:
        try:
            with param.connect(group.member(i)) as p:
                p.init(np.zeros(size, np.float32))
                weights = np.empty(size, np.float32)  # made before the limit
                if i == 0:
                    p.get_weights()  # before the limit: partition 0 maps partition 1's memory
                fetched.wait(30)
                if i == 1:
                    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
                    status = open("/proc/self/status").read()
                    used = int(status.split("VmSize:")[1].split()[0]) * 1024
                    # room for threads' stacks, not for the peer's segment
                    resource.setrlimit(resource.RLIMIT_AS, (used + (64 << 20), hard))
                    try:
                        p.get_weights(out=weights)
                    finally:
                        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            outcome[i] = "trained"
        except BaseException as error:  # the test inspects it
            outcome[i] = f"{type(error).__name__}: {error}"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    results.put(outcome)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd and RLIMIT_AS: Linux")
def test_no_memory_to_map_a_peers_block_is_this_partitions_memory_error_not_the_peers_loss():
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # the limit stays in a process of its own
    results = context.Queue()
    process = context.Process(target=limited_fetch, args=(results,))
    process.start()
    try:
        outcome = results.get(timeout=120)
    finally:
        process.join(60)
    assert outcome[1].startswith(
        "MemoryError: this partition ran out of memory ([Errno 12] Cannot allocate memory) while "
        "it fetched weight block from partition 0 to all, version 0: it maps the shared memory"
    ), outcome
    assert "spark.executor.pyspark.memory" in outcome[1]
    assert "PeerLostError" not in outcome[0], outcome  # partition 0 did not lose a peer


def in_a_task(error: Exception, quoted_by_peer: bool = False) -> Exception:
    """Spark's report of a stage whose partition 1 raised ``error`` in its training loop
    (with ``quoted_by_peer``: as partition 0 quotes it, having lost that peer)."""
    failure = task_failure(1, ", epoch 0, step 0", error)
    if quoted_by_peer:
        said = PeerLostError(  # as errors.peer_lost quotes the reason the peer failed with
            f"partition 1 at 127.0.0.1:4000 shut down; it said: partition 1 failed: "
            f"TrainingError: {failure}"
        )
        failure = task_failure(0, ", epoch 0, step 0", said)
    return Exception(
        ABORTED.format(task=0 if quoted_by_peer else 1)
        + "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        f"allreduce_param.errors.TrainingError: {failure}\n\tat org.apache.spark.api..."
    )


@pytest.mark.parametrize("kind", [ConfigurationError, InputError, UsageError])
def test_a_task_error_every_run_would_meet_again_comes_back_as_itself(kind):
    for quoted in (False, True):
        found = stage_error(in_a_task(kind("no GPU for this task"), quoted))
        assert type(found) is kind and recurs(found)
        assert str(found) == "partition 1, epoch 0, step 0: no GPU for this task"
    outside = stage_error(
        Exception(
            ABORTED.format(task=1)
            + "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
            '  File "spill.py", line 40, in partition_rows\n'
            f"allreduce_param.errors.{kind.__name__}: a bad row\n\tat org.apache.spark.api..."
        )
    )
    assert type(outside) is kind and recurs(outside)
    assert str(outside) == (
        "a task of the fit (partition 1) failed outside its training loop: a bad row"
    )


def test_other_task_errors_stay_training_errors_that_a_new_run_may_not_meet():
    for error in (
        ValueError("a poisoned row"),
        PeerLostError("partition 0 went away"),
        DamagedCheckpointError("a checkpoint cut short"),  # a new run takes an older one
    ):
        found = stage_error(in_a_task(error))
        assert type(found) is TrainingError and not recurs(found)
        assert str(found) == f"partition 1, epoch 0, step 0: {type(error).__name__}: {error}"
