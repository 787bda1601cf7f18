"""A Python worker that dies in the middle of a fit (killed: by the kernel for memory, or a
crash in native code) or runs out of memory ends the fit with one clear error naming the
partition, the likely cause and what to change; the stage runs again only as often as
``spark.stage.maxConsecutiveAttempts`` says, announced each time, and never hangs.

(A worker killed once, with retries, resumes from the newest checkpoint and ends with the
uninterrupted fit's weights: ``test_fault_tolerance``.)
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import numpy as np
import pytest
from pyspark import cloudpickle

from allreduce_param import DistriOptimizer, TrainingError, models, optim
from allreduce_param.train.driver.failures import OUT_OF_MEMORY_ADVICE

cloudpickle.register_pickle_by_value(sys.modules[__name__])


SPARK_MASTER = "local[2]"  # the session of test_fault_tolerance, Spark's 4 runs of a stage


@pytest.fixture(scope="module")
def data(spark):
    rng = np.random.default_rng(6)
    labels = rng.integers(0, 3, 120)
    X = rng.standard_normal((120, 6)).astype(np.float32)
    return spark.createDataFrame(
        [(row.tolist(), float(label)) for row, label in zip(X, labels)],
        "features array<float>, label double",
    )


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


def test_a_worker_killed_in_every_run_ends_the_fit_with_one_clear_error(data):
    with pytest.warns(RuntimeWarning, match="the fit's stage failed, run 1 of at most 4") as said:
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
            "It runs again, from the start (a fit with checkpoint_dir would "
            "resume from its newest checkpoint)"
        )


def test_a_worker_out_of_memory_under_its_limit_says_which_setting_to_raise(data):
    with pytest.warns(RuntimeWarning, match="run 1 of at most 4"):
        error = fit_within(240, data, DiesAtStep(at=2, how="allocate"))
    assert isinstance(error, TrainingError), error
    message = str(error)
    assert message.startswith("partition 1, epoch 0, step 1: MemoryError"), message
    assert "Unable to allocate 16.0 GiB" in message
    assert f". {OUT_OF_MEMORY_ADVICE} (the fit ran its stage 4 times" in message
