"""Across two executor JVMs (local-cluster[2,1,1024]): nothing may rely on sharing one executor;
and GPUs as Spark assigns them, from a discovery script's fake addresses (the workers and
executors have two each, the tasks none unless a stage asks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import test_spark
from harness.spark_standalone import class_archive_options
from pyspark import cloudpickle
from test_spark import digest, expected_after, run_stage, start_weights, step_task

from allreduce_param.engine import AllReduceParameter
from allreduce_param.engine.movement.peers import PART_LENGTH

pytestmark = pytest.mark.slow

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(test_spark)

SPARK_MASTER = "local-cluster[2,1,1024]"
FAKE_GPUS = str(Path(__file__).with_name("fake_gpus.sh"))  # prints addresses 0 and 1
SPARK_SETTINGS = {
    "spark.executor.memory": "1g",
    "spark.worker.resource.gpu.amount": "2",
    "spark.worker.resource.gpu.discoveryScript": FAKE_GPUS,
    "spark.executor.resource.gpu.amount": "2",
    "spark.executor.resource.gpu.discoveryScript": FAKE_GPUS,
}
if archive := class_archive_options():  # the executors' JVMs map the class archive: sooner up
    SPARK_SETTINGS["spark.executor.extraJavaOptions"] = archive


def test_two_executors_sync_exactly_and_bit_identically(spark):
    # 1_100_009: each partition's slice (550,005 values) is two parts of a block (PART_LENGTH
    # 2^19), as many as a slice of 2_000_003 makes, in a little over half the data
    sizes = [1, 7919, 1_100_009]
    assert PART_LENGTH < sizes[-1] // 2 < 2 * PART_LENGTH
    seed = 42
    # raw through the host arena the executors' workers share, lz4 over TCP
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
                ("host arena",) if codec == "raw" else ("AF_INET",)
            }


def test_a_stage_asking_for_gpus_gets_them_and_the_device_follows_them(spark):
    """``gpus_per_task`` through the fit's own profile: each task is assigned a GPU from the
    discovery script's addresses (a stage without it, none), and the device a TorchModel
    chooses follows the address (with CUDA taken as there: the refusal of this machine's
    torch is test_torch_devices'). Then a fit runs its barrier stage under that profile."""
    import numpy as np

    from allreduce_param import DistriOptimizer, models, optim
    from allreduce_param.spark.gpus import stage_profile
    from allreduce_param.spark.info import SparkInfo

    def choose(batches):
        import pyarrow as pa

        from allreduce_param.models.devices import CudaInfo, choose_device, task_gpus
        from allreduce_param.spark.gpus import task_resources

        for _ in batches:
            pass
        gpus = task_gpus(task_resources())
        chosen = choose_device("auto", gpus, CudaInfo(True, 2, "a CUDA build"))
        yield pa.RecordBatch.from_pydict({"gpus": [",".join(gpus)], "device": [chosen]})

    frame = spark.range(2).repartition(2)
    profile = stage_profile(SparkInfo(spark), 1)
    asked = frame.mapInArrow(choose, "gpus string, device string", barrier=True, profile=profile)
    assert [tuple(row) for row in asked.collect()] == [("0", "cuda:0")] * 2  # one per executor
    plain = frame.mapInArrow(choose, "gpus string, device string", barrier=True)
    assert [tuple(row) for row in plain.collect()] == [("", "cpu")] * 2

    X = np.random.default_rng(0).standard_normal((16, 2))
    data = spark.createDataFrame(
        [(row.tolist(), float(row[0] > 0)) for row in X], "features array<float>, label double"
    )
    trained = DistriOptimizer(
        models.LogisticRegression(2),
        optim.SGD(0.1),
        gpus_per_task=1,
        num_workers=2,
        epochs=1,
        batch_size=8,
        progress=False,
    ).fit(data)
    assert len(trained.history.epochs) == 1


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
