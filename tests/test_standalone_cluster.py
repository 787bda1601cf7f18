"""The README's cluster recipe, as written, on a real standalone cluster: a master and two
one-core workers (the conftest's ``two_workers``, which test_network_namespace shares: on
192.0.2.1 in a simulated host where root can make one, else on 127.0.0.1), and the main job
through ``spark-submit --properties-file conf/cluster/standalone.conf``.

The job runs from the checkout with only what this machine needs besides the recipe:
SPARK_LOCAL_IP (the cluster's address), the Python (PYSPARK_PYTHON), PYTHONPATH when the
package is not installed in that Python, and the tests' JVM options for every JVM (C1 alone,
and the class archive of the tests' local sessions, through JAVA_TOOL_OPTIONS: a JVM starts
with seconds less CPU; what Spark runs is the same).
"""

from __future__ import annotations

import re

import pytest
from harness.spark_standalone import SPARK_SUBMIT

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.cluster]

EPOCHS = 4


@pytest.fixture(scope="module")
def cluster(two_workers):
    return two_workers[0]


def test_the_readme_recipe_trains_the_main_job_on_a_standalone_cluster(cluster, tmp_path):
    # the README's command, from the checkout; --set only keeps it short and writes the model here
    command = [
        str(SPARK_SUBMIT),
        "--master",
        cluster.url,
        "--properties-file",
        "conf/cluster/standalone.conf",
        "jobs/train.py",
        "--conf",
        "conf/digits.toml",
        "--set",
        f"train.epochs={EPOCHS}",
        "--set",
        f"output.model_path='{tmp_path / 'model'}'",
        "--set",
        "output.loss_curve=''",
    ]
    status, output = cluster.run(command, tmp_path / "submit.log", timeout=240)
    assert status == 0, f"{output[-6000:]}\n{cluster.logs()}"
    accuracy = re.search(r"\| test accuracy\s+\|\s+([\d.]+) \|", output)
    assert accuracy and float(accuracy.group(1)) > 0.85, output[-3000:]
    assert re.search(rf"\| epochs\s+\|\s+{EPOCHS} \|", output), output[-3000:]
    assert (tmp_path / "model" / "weights.npy").is_file()
    # on the cluster: an executor of the application in each worker's work dir, the fit's
    # barrier stage on both (Spark's INFO line), and the tasks' live progress reached the driver
    (application,) = set(re.findall(r"app ID (app-[\d-]+)", output))
    executors = [sorted(work.glob(f"{application}/*/stderr")) for work in cluster.worker_dirs()]
    assert [len(found) for found in executors] == [1, 1], executors
    assert "scheduled all the 2 tasks for barrier stage" in output, output[-3000:]
    assert (
        f"epoch {EPOCHS - 1}: val_loss" in output
        and "tasks reached the driver within" not in output
    )
