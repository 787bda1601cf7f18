"""A driver process for test_interrupts.py: a fit that the test interrupts with SIGINT, then
a second fit in the same process and session.

Run as ``python interrupted_driver.py FOLDER``; ``FOLDER`` holds this session's local
directory (``spark.local.dir``) and checkpoints. It prints, one line each: ``training``
once the first fit has trained a step (the test sends SIGINT then), ``interrupted <type>
<seconds>`` when the first fit has raised, ``trained <epochs>`` after the second fit, and
``ui <json>``: the jobs the Spark UI's REST API lists, each with its group and description.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

import numpy as np

from allreduce_param import DistriOptimizer, models, optim
from allreduce_param.spark.session import local_spark
from allreduce_param.train.checkpoint import Checkpoints


def main(folder: str) -> None:
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
    with urllib.request.urlopen(url, timeout=30) as answer:
        jobs = json.load(answer)
    named = [{key: job.get(key) for key in ("jobId", "jobGroup", "description")} for job in jobs]
    print("ui " + json.dumps(named), flush=True)
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1])
