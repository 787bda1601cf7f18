"""Across two executor JVMs (local-cluster[2,1,1024]): nothing may rely on sharing one executor."""

from __future__ import annotations

import sys
from pathlib import Path

import test_spark
from pyspark import cloudpickle
from spark_standalone import class_archive_options
from test_spark import digest, expected_after, run_stage, start_weights, step_task

from allreduce_param import AllReduceParameter

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(test_spark)

SPARK_MASTER = "local-cluster[2,1,1024]"
SPARK_SETTINGS = {"spark.executor.memory": "1g"}
if archive := class_archive_options():  # the executors' JVMs map the class archive: sooner up
    SPARK_SETTINGS["spark.executor.extraJavaOptions"] = archive


def test_two_executors_sync_exactly_and_bit_identically(spark):
    sizes = [1, 7919, 2_000_003]
    seed = 42
    # raw through shared memory between the executors' workers, lz4 over TCP
    params = [
        AllReduceParameter(2, size, codec=codec, timeout=60, unix_sockets=codec == "raw")
        for size in sizes
        for codec in ("raw", "lz4")
    ]

    def where(_rows):
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        yield context.getTaskInfos()[context.partitionId()].address

    rdd = spark.sparkContext.parallelize(range(2), 2)
    addresses = rdd.barrier().mapPartitions(where).collect()
    assert len(set(addresses)) == 2, f"both tasks ran in one executor: {addresses}"

    report = run_stage(spark, 2, step_task(params, seed))
    for size in sizes:
        expected = digest(expected_after(size, seed, 2))
        for codec in ("raw", "lz4"):
            rows = [row for row in report if row[0] == size and row[1] == codec]
            assert sorted(row[2] for row in rows) == [0, 1]
            assert {row[3] for row in rows} == {digest(start_weights(size, seed))}
            assert {row[4] for row in rows} == {expected}, (size, codec)
            assert {tuple(row[6]) for row in rows} == {
                ("AF_UNIX", "shared memory") if codec == "raw" else ("AF_INET",)
            }


def test_stopping_the_session_leaves_no_worker_folder_in_the_installed_pyspark(spark):
    """A local-cluster's workers write each application's folder under SPARK_HOME/work,
    which for a pip install is inside the installed pyspark package: the tests' session
    stop removes it (this module's session stops here, as the conftest stops it)."""
    from conftest import _stop_shared_spark
    from pyspark.find_spark_home import _find_spark_home

    folder = Path(_find_spark_home()) / "work" / spark.sparkContext.applicationId
    assert folder.is_dir(), f"the workers wrote no {folder}: where do they write now?"
    _stop_shared_spark()
    assert not folder.exists()
