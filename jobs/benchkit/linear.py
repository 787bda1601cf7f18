"""bench_linear's run: MLlib's ``LogisticRegression`` / ``LinearRegression`` against
``allreduce_param.ml``'s drop-ins on the same cached rows and Params, alternating rounds.

Problems: ``text`` (hashed documents, ``sparse_data.TextData``, 2^18 features), ``clicks``
(a hashed click log, ``sparse_data.ClickData``, at each of ``--click-features``), ``dense``
(Gaussian features, a linear label plus noise: ``LinearRegression``). Per fit: seconds,
iterations, the final objective, the driver's and the Python workers' peak RSS
(``sparse_runs.Watcher``); per pair of fits: the largest relative difference of the
coefficients (max |ours - MLlib| / max |MLlib|) and the objective's relative difference.
"s to MLlib's objective" is ours' fit time times the share of its iterations done when its
objective history first reached MLlib's final value: an estimate (the tasks do not stamp
their iterations), marked "~". A fit that fails has its reason in the table instead.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np

from benchkit.machine import CONF_DIR, machine
from benchkit.sparse_data import ClickData, TextData, hashed_frame
from benchkit.sparse_runs import Watcher, failure_text
from benchkit.tables import render


@dataclass
class LinearRun:
    """One fit's figures, or why there are none (``problem``)."""

    contender: str
    seconds: float | None = None
    iterations: int | None = None
    objective: float | None = None
    history: list | None = None
    coefficients: np.ndarray | None = None
    driver_peak: int = 0
    workers_peak: int = 0
    problem: str = ""


def problems(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(name, kind, features) of each problem the command line asks for."""
    found = []
    for name in args.problems.split(","):
        if name == "text":
            found.append((f"text 2^{args.text_features}", "text", 2**args.text_features))
        elif name == "clicks":
            for bits in map(int, args.click_features.split(",")):
                found.append((f"clicks 2^{bits}", "clicks", 2**bits))
        elif name == "dense":
            found.append((f"dense {args.dense_rows} x {args.dense_features}", "dense", 0))
        else:
            raise SystemExit(f"--problems: {name!r} is not one of text, clicks, dense")
    return found


def frame_of(spark, kind: str, features: int, args: argparse.Namespace):
    """The problem's rows, ``features vector, label double``, cached and counted."""
    if kind == "text":
        frame = hashed_frame(spark, TextData(args.text_rows, seed=args.seed), features)
    elif kind == "clicks":
        frame = hashed_frame(spark, ClickData(args.click_rows, seed=args.seed), features)
    else:
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F

        width = args.dense_features
        columns = [F.randn(args.seed + i) for i in range(width)]
        truth = np.random.default_rng(args.seed).normal(size=width)
        raw = spark.range(args.dense_rows).select(F.array(*columns).alias("x"))
        label = sum(F.col("x")[i] * float(truth[i]) for i in range(width))
        frame = raw.select(
            array_to_vector("x").alias("features"),
            (label + F.randn(args.seed + width)).alias("label"),
        )
    frame = frame.select("features", "label").cache()
    frame.count()
    return frame


def fit_once(spark, contender: str, kind: str, frame, args, jvm_pid: int) -> LinearRun:
    """One fit of ``contender`` ("ours" or "mllib"), timed and watched."""
    if contender == "ours":
        from allreduce_param import ml as module
    elif kind == "dense":
        from pyspark.ml import regression as module
    else:
        from pyspark.ml import classification as module
    estimator_class = module.LinearRegression if kind == "dense" else module.LogisticRegression
    params = {"regParam": args.reg_param, "maxIter": args.max_iter, "tol": args.tol}
    if kind == "dense":
        params["solver"] = "l-bfgs"
    run = LinearRun(contender)
    watcher = Watcher(jvm_pid)
    started = time.time()
    try:
        with watcher:
            model = estimator_class(**params).fit(frame)
            run.seconds = time.time() - started
        summary = model.summary
        run.history = list(summary.objectiveHistory)
        run.iterations, run.objective = summary.totalIterations, run.history[-1]
        matrix = model.coefficientMatrix if kind != "dense" else model.coefficients
        run.coefficients = np.asarray(matrix.toArray(), np.float64).ravel()
    except Exception as error:
        run.problem = failure_text(error, False)
        traceback.print_exc(file=sys.stderr)
    run.driver_peak, run.workers_peak = watcher.driver_peak, watcher.workers_peak
    return run


def to_objective(ours: LinearRun, theirs: LinearRun) -> str:
    """Ours' estimated seconds to reach MLlib's final objective (see the module's text)."""
    if ours.history is None or theirs.objective is None or not ours.iterations:
        return "-"
    for index, value in enumerate(ours.history):
        if value <= theirs.objective * (1 + 1e-9):
            return f"~{ours.seconds * index / max(len(ours.history) - 1, 1):.1f}"
    return "not reached"


def rows_of(name: str, ours: LinearRun, theirs: LinearRun) -> list[tuple]:
    """The table's two rows of one round."""
    difference = objective = "-"
    if ours.coefficients is not None and theirs.coefficients is not None:
        scale = max(float(np.abs(theirs.coefficients).max()), 1e-12)
        difference = f"{float(np.abs(ours.coefficients - theirs.coefficients).max()) / scale:.1e}"
        objective = f"{(ours.objective - theirs.objective) / abs(theirs.objective):+.1e}"
    lines = []
    for run, reach in ((ours, to_objective(ours, theirs)), (theirs, "")):
        if run.problem:
            lines.append((name, run.contender, run.problem, "", "", "", "", "", ""))
            continue
        lines.append(
            (
                name,
                run.contender,
                f"{run.seconds:.1f}",
                str(run.iterations),
                f"{run.objective:.9g}",
                reach,
                difference if run is ours else "",
                objective if run is ours else "",
                f"{run.driver_peak / 2**20:.0f} / {run.workers_peak / 2**20:.0f}",
            )
        )
    return lines


def run(args: argparse.Namespace) -> str:
    """Every problem's alternating rounds; the table, with the machine's line."""
    from allreduce_param.spark.session import local_spark

    spark = local_spark(
        args.master,
        "allreduce-param linear benchmark",
        CONF_DIR,
        **{"spark.driver.memory": args.driver_memory},
    )
    try:
        jvm_pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
        lines = []
        for name, kind, features in problems(args):
            frame = frame_of(spark, kind, features, args)
            for _ in range(args.rounds):
                ours = fit_once(spark, "ours", kind, frame, args, jvm_pid)
                theirs = fit_once(spark, "mllib", kind, frame, args, jvm_pid)
                lines.extend(rows_of(name, ours, theirs))
            frame.unpersist()
    finally:
        spark.stop()
    header = (
        "problem",
        "fit",
        "s",
        "iterations",
        "final objective",
        "s to MLlib's objective",
        "max rel. coef. diff",
        "objective diff",
        "peak MiB driver / workers",
    )
    return f"machine: {machine()}\n\n{render(header, lines)}"
