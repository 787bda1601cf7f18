"""A model too large for the memory Spark gives a worker is refused on the driver, before the
model is made there and before any stage: one ConfigurationError naming both figures."""

from __future__ import annotations

import pytest
from pyspark.ml.linalg import Vectors

from allreduce_param import ConfigurationError, DistriOptimizer, models, optim
from allreduce_param.train.driver.memory import spark_bytes, worker_allowance, worker_bytes

SPARK_MASTER = "local[2]"
#: test_fault_without_retries' session too (one JVM for both); the refusals here come
#: before any stage, so its stage retries off change nothing of them
SPARK_SETTINGS = {
    "spark.stage.maxConsecutiveAttempts": "1",
    "spark.executor.pyspark.memory": "2g",
}


def resident_bytes() -> int:
    """This process's resident memory now (``VmRSS``), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.slow
@pytest.mark.parametrize("bits", [28, 30])
def test_a_wide_sparse_logistic_regression_is_refused_naming_the_memory_and_its_size(spark, bits):
    width = 1 << bits
    rows = [(Vectors.sparse(width, [i, width - 1 - i], [1.0, 2.0]), float(i % 2)) for i in range(4)]
    df = spark.createDataFrame(rows, ["features", "label"])
    trainer = DistriOptimizer(
        models.LogisticRegression(width), optim.Adam(lr=0.1), batch_size=4, progress=False
    )
    before = resident_bytes()
    with pytest.raises(ConfigurationError) as caught:
        trainer.fit(df)
    assert resident_bytes() - before < 200 << 20  # the model was never made here
    message = str(caught.value)
    assert f"has {width + 1:,} parameters" in message
    assert f"{worker_bytes(width + 1, optim.Adam(), 2) / (1 << 30):.2f} GiB in all" in message
    assert "a worker has 2.00 GiB (spark.executor.pyspark.memory=2g)" in message


def test_what_a_worker_may_use_follows_sparks_settings():
    settings = {"spark.executor.pyspark.memory": "6g", "spark.executor.cores": "3"}
    assert worker_allowance(settings.get, 4) == (
        2 << 30,
        "spark.executor.pyspark.memory=6g, shared by spark.executor.cores=3 workers",
    )
    assert worker_allowance({"spark.master": "yarn"}.get, 4) is None  # unknown: unchecked
    local = worker_allowance({"spark.master": "local[4]"}.get, 4)
    assert local is not None and "available memory" in local[1] and local[0] > 0
    assert spark_bytes("512m", "x") == 512 << 20 and spark_bytes("1024", "x") == 1 << 30
    with pytest.raises(ConfigurationError, match="x='lots' is not an amount of memory"):
        spark_bytes("lots", "x")
    # Adam keeps two state vectors, each worker a quarter of them
    assert worker_bytes(1000, optim.Adam(), 4) == 4 * 1000 * 3 + 4 * 250 * 2
