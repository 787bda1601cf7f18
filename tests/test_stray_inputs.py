"""Inputs a demanding user gets wrong, refused on the driver before anything model-sized is
made: a stray label far above the others, ..."""

from __future__ import annotations

import threading

import pytest
from pyspark.ml.linalg import Vectors
from pyspark.sql import functions as F

from allreduce_param import DistriOptimizer, InputError, models, optim
from allreduce_param.ml import AllReduceClassifier


def resident_bytes() -> int:
    """This process's resident memory now (``VmRSS``), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def labelled(spark, labels):
    rows = [(Vectors.dense([float(i), 1.0]), float(label)) for i, label in enumerate(labels)]
    return spark.createDataFrame(rows, ["features", "label"])


@pytest.mark.slow
def test_a_stray_label_is_refused_on_the_driver_with_its_memory_untouched(spark):
    for stray in (1e9, 1e4):
        df = labelled(spark, [0, 1, 0, 1, stray, 1])
        before = resident_bytes()
        with pytest.raises(InputError) as caught:
            AllReduceClassifier(hiddenLayers=[], showProgress=False).fit(df)
        assert resident_bytes() - before < 200 * 2**20
        message = str(caught.value)
        assert f"the largest label in 'label' (labelCol) is {stray:g}" in message
        assert f"a model of {int(stray) + 1:,} classes" in message
        assert "at most 1,000 classes" in message and "StringIndexer" in message


@pytest.mark.slow
def test_a_class_count_the_metadata_states_is_taken_beyond_the_inferred_limit(spark):
    df = labelled(spark, [0, 1, 1499, 1, 0, 1499])
    stated = df.withColumn(
        "label",
        F.col("label").alias("label", metadata={"ml_attr": {"type": "nominal", "num_vals": 1500}}),
    )
    classifier = AllReduceClassifier(hiddenLayers=[], maxEpochs=1, batchSize=6, showProgress=False)
    with pytest.warns(UserWarning, match="the model has 1500"):
        model = classifier.fit(stated)
    assert model.numClasses == 1500


class LockedListener:
    """A listener as a user writes one: its events kept under a lock (which cannot pickle)."""

    def __init__(self) -> None:
        self.lock, self.kinds = threading.Lock(), []

    def __call__(self, kind: str, fields: dict) -> None:
        with self.lock:
            self.kinds.append(kind)


@pytest.mark.slow
def test_a_listener_holding_a_lock_stays_on_the_driver_and_hears_the_fit(spark):
    listener = LockedListener()
    trainer = DistriOptimizer(
        models.LinearRegression(2),
        optim.SGD(lr=0.1),
        batch_size=4,
        epochs=1,
        num_workers=2,
        progress=False,
        listener=listener,
    )
    trained = trainer.fit(labelled(spark, [0, 1, 2, 3, 4, 5, 6, 7]))
    assert trained.steps_done == 2
    assert "start" in listener.kinds and listener.kinds.count("step") == 2
