"""The driver process that saves the Spark driver JVM's class archive early in a distributed
test run that has none yet (a fresh clone's new virtual environment: the archive's name
follows the Java and the Spark installation, ``allreduce_param.spark.class_archive``).

Without it, the first session of a pytest-xdist worker would claim the save and write the
archive only as that worker ends, so no JVM of the run maps it: each of the run's driver
JVMs (the workers' sessions, the jobs, notebooks and drivers the tests start in processes
of their own, the standalone clusters' daemons) then spends about 10 s of CPU more on its
start and first fit, measured on the 2-core VM. ``conftest.start_class_archive_driver`` starts
this script before the workers start; it runs one session and a small fit on it (the
classes most tests' JVMs load), and its JVM writes the archive as it exits (about 30 s of
CPU, once), which every JVM started after that maps. It changes nothing any test checks:
the classes a JVM maps are the ones it would load.

Run as ``python class_archive_driver.py CONF_DIR``.
"""

from __future__ import annotations

import sys

import numpy as np

from allreduce_param import DistriOptimizer, models, optim
from allreduce_param.spark.session import local_spark


def main(conf_dir: str) -> None:
    spark = local_spark("local[2]", "allreduce-param class archive", conf_dir)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 3)).astype(np.float32)
    frame = spark.createDataFrame(
        [(x.tolist(), float(x.sum() > 0)) for x in X], "features array<float>, label double"
    )
    DistriOptimizer(
        models.LogisticRegression(3),
        optim.SGD(lr=0.1),
        batch_size=8,
        epochs=1,
        num_workers=2,
        progress=False,
    ).fit(frame)
    spark.stop()  # the JVM writes the archive as this process exits (local_spark's atexit)


if __name__ == "__main__":
    main(sys.argv[1])
