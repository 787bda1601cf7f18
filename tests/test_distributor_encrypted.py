"""The Distributor on a session whose Spark encrypts its traffic
(``spark.network.crypto.enabled``), where PySpark's TorchDistributor refuses: the ranks'
connections and the driver's message channel follow it, as a fit's do. The session is
test_encryption's (the same master and settings), so no other one starts."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest

torch = pytest.importorskip("torch")

from pyspark import cloudpickle  # noqa: E402

from allreduce_param.engine.wire.settings import NetworkSettings  # noqa: E402
from allreduce_param.spark.info import SparkInfo  # noqa: E402
from allreduce_param.torch import Distributor  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: test_encryption's master and settings, so that the two modules share one session
SPARK_MASTER = "local[2]"
SPARK_SETTINGS = {"spark.authenticate": "true", "spark.network.crypto.enabled": "true"}


def _sums_rank_plus_one() -> float:
    import torch
    import torch.distributed as dist

    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    print(f"summed {float(total)}")
    return float(total)


@pytest.mark.slow
def test_the_distributor_runs_where_spark_encrypts(spark):
    assert spark.sparkContext.getConf().get("spark.network.crypto.enabled") == "true"
    # what the Distributor resolves its network with, as a fit does: encrypted
    assert NetworkSettings().resolved(SparkInfo(spark).session_setting).encrypt is True
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert Distributor(num_processes=2).run(_sums_rank_plus_one) == 3.0
    lines = sorted(line for line in printed.getvalue().splitlines() if "summed" in line)
    assert lines == ["[rank 0] summed 3.0", "[rank 1] summed 3.0"]
