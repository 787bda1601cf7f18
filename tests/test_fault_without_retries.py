"""With Spark's stage retries off, a failed fit says where its newest checkpoint is, how to
continue from it, and which setting would have let Spark resume on its own."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import random_rows
from pyspark import cloudpickle
from test_fault_tolerance import FailsOnce

from allreduce_param import DistriOptimizer, TrainingError, optim
from allreduce_param.train import Checkpoints

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(sys.modules["test_fault_tolerance"])


SPARK_MASTER = "local[2]"
#: test_worker_memory's session too (one JVM for both: a session of settings of its own
#: takes seconds to start); its memory setting changes nothing of these small fits
SPARK_SETTINGS = {
    "spark.stage.maxConsecutiveAttempts": "1",
    "spark.executor.pyspark.memory": "2g",
}


@pytest.fixture(scope="module")
def data(spark):
    return random_rows(spark, seed=5)


@pytest.mark.slow
def test_the_error_says_a_retry_would_resume_and_which_setting_allows_it(data, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    # at step 7: partition 1 needs partition 0's weights of step 7 for it, which partition 0
    # sends only after the manifest of step 6 (a fault at step 6 could beat that manifest)
    trainer = DistriOptimizer(
        FailsOnce(str(marks), at=8, kill=False),
        optim.SGD(lr=0.1),
        batch_size=40,
        epochs=3,
        progress=False,
        num_workers=2,
        checkpoints=Checkpoints(str(tmp_path / "ck"), every=2),
    )
    with pytest.raises(TrainingError) as failure:
        trainer.fit(data)
    message = str(failure.value)
    assert message.startswith(
        "partition 1, epoch 2, step 1: ValueError: a fault injected at call 8."
    )
    found = re.search(
        r"Its newest checkpoint, of step 6, is (\S+): fit\(\.\.\., resume_from='(\S+)'\) "
        r"continues from it; the stage ran once \(spark.stage.maxConsecutiveAttempts=1\): "
        r"with 2 or more it resumes from the checkpoint on its own",
        message,
    )
    assert found, message
    resumed = trainer.fit(data, resume_from=found.group(2))
    assert resumed.history.resumed == [6] and len(resumed.history.steps) == 9
