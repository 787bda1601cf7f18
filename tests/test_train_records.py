"""The records a task sends the driver: each one decodes to what was encoded, the driver
gathers them by kind, and a task's failure is found again in Spark's text."""

from __future__ import annotations

import numpy as np
import pytest

from allreduce_param import TrainingError
from allreduce_param.train.records import (
    STEP_FIELDS,
    UPDATE_FIELDS,
    Buffers,
    Clock,
    EpochDone,
    Epochs,
    Resumed,
    StageOutput,
    Started,
    StepDone,
    Steps,
    Updates,
    Weights,
    decode,
    read_report,
    recover_task_failure,
    task_failure,
)


def test_every_record_decodes_to_what_was_encoded_and_is_gathered_by_kind():
    steps = np.arange(2 * len(STEP_FIELDS), dtype=np.float64).reshape(2, -1)
    updates = np.ones((3, len(UPDATE_FIELDS) + 2))
    records = [
        Steps(steps),
        Epochs([{"epoch": 0, "partition": 1, "val": [1.0, 2.0, 3.0]}]),
        Clock({"started": 1.0, "loaded": 2.0, "met": 3.0, "trained": 4.0}),
        Updates(updates),
        Buffers({"bn.mean": np.array([0.5, 1.5], np.float32)}, 7),
        Resumed([4, 8]),
        Weights(np.array([1.0, -2.0], np.float32)),
    ]
    pairs = [record.encode() for record in records]
    assert [kind for kind, _ in pairs] == [
        "steps",
        "epochs",
        "clock",
        "updates",
        "buffers",
        "resumed",
        "weights",
    ]
    assert all(isinstance(payload, bytes) for _, payload in pairs)
    back = decode(*pairs[4], partitions=2)
    assert isinstance(back, Buffers) and back.rows == 7
    np.testing.assert_array_equal(back.buffers["bn.mean"], [0.5, 1.5])
    output = StageOutput.of(pairs, partitions=2)
    np.testing.assert_array_equal(output.steps[0], steps)
    np.testing.assert_array_equal(output.updates[0], updates)
    assert output.epochs == [{"epoch": 0, "partition": 1, "val": [1.0, 2.0, 3.0]}]
    assert output.clocks == [{"started": 1.0, "loaded": 2.0, "met": 3.0, "trained": 4.0}]
    assert output.resumed == [4, 8] and output.weights.tolist() == [1.0, -2.0]
    with pytest.raises(TrainingError, match="a task sent a record of kind 'bogus'; the kinds are"):
        decode("bogus", b"", partitions=2)


def test_the_progress_reports_travel_as_messages_and_read_back():
    start = Started(partition=1, steps=5, epochs=2, done=3, resumed=[0, 3])
    assert start.message() == {
        "kind": "start",
        "partition": 1,
        "steps": 5,
        "epochs": 2,
        "resumed": [0, 3],
        "done": 3,
    }
    assert Started(0, 5, 2).message() == {"kind": "start", "partition": 0, "steps": 5, "epochs": 2}
    assert read_report(start.message()) == start
    step = StepDone([1.0, 4.0, 2.0, 3.0], partition=0)
    assert read_report(step.message()) == step and step.key == ("step", 1, 4)
    epoch = EpochDone({"epoch": 2, "partition": 1, "val": [1.0, 1.0, 2.0]})
    assert read_report(epoch.message()) == epoch and epoch.key == ("epoch", 2)
    assert read_report({"kind": "meet", "partition": 0}) is None


def test_a_tasks_failure_is_found_again_in_sparks_text_innermost_first():
    inner = task_failure(2, ", epoch 1, step 3", ValueError("a poisoned row"))
    assert str(inner) == "partition 2, epoch 1, step 3: ValueError: a poisoned row"
    outer = task_failure(
        0, ", epoch 1, step 3", RuntimeError(f"PeerLostError: TrainingError: {inner}")
    )
    text = f"org.apache.spark.SparkException: Job aborted\nTraceback ...\nTrainingError: {outer}\n\tat ..."
    found = recover_task_failure(text)
    assert isinstance(found, TrainingError) and str(found) == str(inner)
    assert recover_task_failure("org.apache.spark.SparkException: lost an executor") is None
