"""The driver process of test_interrupts.py: a fit that the test interrupts with SIGINT, a
second fit in the same process and session, then (given a second folder) a fit whose
``checkpoint_dir`` fills up with its second checkpoint. One process and one Spark session
for all three: starting a driver and its JVM is most of each scenario's time.

Run as ``python interrupted_driver.py FOLDER [SMALL]``; ``FOLDER`` holds this session's local
directory (``spark.local.dir``) and the first fit's checkpoints; ``SMALL`` is a small file
system of its own (the test mounts a tmpfs of 2 MiB; a checkpoint of the third fit is about
1.4 MiB). It prints, one line each: ``training`` once the first fit has trained a step (the
test sends SIGINT then), ``interrupted <type>`` when the first fit has raised, ``trained
<epochs> <seconds>`` after the second fit, and ``ui <json>``: the jobs the Spark UI's REST
API lists, each with its group and description (the first two fits' only: the third runs
after). With ``SMALL``: ``error <type> <message>``, then ``runs <n>``: the stage's runs
again that the third fit announced, and ``left <json>``: each step folder left under its
fit's folder, with whether it holds a manifest. Last, once the session has stopped, ``shm
<json>``: ``/dev/shm``'s device and its names with "allreduce" in them (the test gives the
driver a ``/dev/shm`` of its own where it can).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
import warnings

import numpy as np

from allreduce_param import DistriOptimizer, models, optim
from allreduce_param.spark.session import local_spark
from allreduce_param.train.checkpoint import Checkpoints


def interrupted_then_trained(spark, frame, folder: str) -> None:
    """The first fit, interrupted; the second, trained; the UI's jobs of both."""
    stepped: list[bool] = []  # no lock: the listener travels in the fit's closure

    def listener(kind: str, fields: dict) -> None:
        if kind == "step" and not stepped:
            stepped.append(True)
            print("training", flush=True)

    long_fit = DistriOptimizer(
        models.LogisticRegression(3),
        optim.SGD(lr=0.1),
        batch_size=8,
        epochs=100_000,
        num_workers=2,
        data_in="disk",
        checkpoints=Checkpoints(f"{folder}/checkpoints", every=1, keep=1),
        listener=listener,
        progress=False,
    )
    started = None
    try:
        long_fit.fit(frame)
    except KeyboardInterrupt as error:
        started = time.monotonic()
        print(f"interrupted {type(error).__name__}", flush=True)
    short = DistriOptimizer(
        models.LogisticRegression(3), optim.SGD(lr=0.1), batch_size=8, epochs=2, progress=False
    )
    trained = short.fit(frame)
    print(f"trained {len(trained.history.epochs)} {time.monotonic() - started:.1f}", flush=True)
    url = (
        f"{spark.sparkContext.uiWebUrl}/api/v1/applications/{spark.sparkContext.applicationId}/jobs"
    )
    # the REST API starts on its first call (Jersey): seconds of CPU on a busy 2-core machine
    with urllib.request.urlopen(url, timeout=120) as answer:
        jobs = json.load(answer)
    named = [{key: job.get(key) for key in ("jobId", "jobGroup", "description")} for job in jobs]
    print("ui " + json.dumps(named), flush=True)


def checkpoints_fill(frame, small: str) -> None:
    """A fit whose checkpoints in ``small`` fill it: its error, the runs again, what is left."""
    fit = DistriOptimizer(
        models.MLP([3, 20_000, 2]),  # 120,002 weights: with Adam's moments 1.4 MiB a checkpoint
        optim.Adam(lr=0.01),
        batch_size=32,
        epochs=3,
        num_workers=2,
        checkpoints=Checkpoints(small, every=1, keep=1),
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
            os.path.join(small, fit_folder, step, "manifest.json")
        )
        for fit_folder in os.listdir(small)
        for step in os.listdir(os.path.join(small, fit_folder))
    }
    print("left " + json.dumps(left), flush=True)


def main(folder: str, small: str | None = None) -> None:
    spark = local_spark(
        "local[2]",
        "interrupted",
        **{
            "spark.local.dir": f"{folder}/local",
            "spark.ui.enabled": "true",
            "spark.ui.port": "0",
            "spark.ui.host": "127.0.0.1",
        },
    )
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 3)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5]) > 0).astype(float)
    frame = spark.createDataFrame(
        [(x.tolist(), float(label)) for x, label in zip(X, y)],
        "features array<float>, label double",
    ).repartition(2)
    interrupted_then_trained(spark, frame, folder)
    if small is not None:
        checkpoints_fill(frame, small)
    spark.stop()
    shared = [name for name in os.listdir("/dev/shm") if "allreduce" in name]
    print("shm " + json.dumps({"device": os.stat("/dev/shm").st_dev, "names": shared}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
