"""A driver process for test_interrupts.py: a fit whose ``checkpoint_dir`` fills up with
its second checkpoint.

Run as ``python full_disk_driver.py FOLDER`` with ``FOLDER`` a small file system of its own
(the test mounts a tmpfs of 2 MiB; a checkpoint of this fit is about 1.4 MiB). Prints
``error <type> <message>``, then ``runs <n>``: the stage's runs again that the fit
announced, and ``left <json>``: each step folder left under the fit's folder, with whether
it holds a manifest.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import numpy as np

from allreduce_param import DistriOptimizer, models, optim
from allreduce_param.spark.session import local_spark
from allreduce_param.train.checkpoint import Checkpoints


def main(folder: str) -> None:
    spark = local_spark("local[2]", "full-disk")
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 3)).astype(np.float32)
    frame = spark.createDataFrame(
        [(x.tolist(), float(x[0] > 0)) for x in X], "features array<float>, label double"
    ).repartition(2)
    fit = DistriOptimizer(
        models.MLP([3, 20_000, 2]),  # 120,002 weights: with Adam's moments 1.4 MiB a checkpoint
        optim.Adam(lr=0.01),
        batch_size=32,
        epochs=3,
        num_workers=2,
        checkpoints=Checkpoints(folder, every=1, keep=1),
        progress=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fit.fit(frame)
            print("error none", flush=True)
        except Exception as error:
            print(f"error {type(error).__name__} {error}".replace("\n", " "), flush=True)
    again = [w for w in caught if "the fit's stage failed" in str(w.message)]
    print(f"runs {len(again)}", flush=True)
    left = {
        f"{fit_folder}/{step}": os.path.exists(
            os.path.join(folder, fit_folder, step, "manifest.json")
        )
        for fit_folder in os.listdir(folder)
        for step in os.listdir(os.path.join(folder, fit_folder))
    }
    print("left " + json.dumps(left), flush=True)
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1])
