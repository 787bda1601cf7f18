"""bench_linear's fits: MLlib's ``LogisticRegression`` / ``LinearRegression`` and
``allreduce_param.ml``'s drop-ins, one fit at a time, on the same rows, partitions and
Params. ``linear_rounds`` alternates them (ours, MLlib, ours, MLlib, ...), in its own
session or each fit in a session of its own (``linear_child``).

Problems: ``text`` (hashed documents, ``sparse_data.TextData``, 2^18 features), ``clicks``
(a hashed click log, ``sparse_data.ClickData``: 26 categorical fields with Zipf-distributed
values and a hidden logistic label, at each of ``--click-features``), ``dense`` (Gaussian
features ``randn(seed + j)``, a linear label plus noise: ``LinearRegression``). Every
generator is seeded by ``--seed``.

How each figure is taken:

- fit time: ``time.time()`` around ``fit`` on the driver (the data checks, the stage, the
  model's return: all of it);
- time to MLlib's objective: for ours, the first ``summary.objectiveTimes`` entry (stamped
  by partition 0's task when the value was reached: in local mode the driver's clock) whose
  ``objectiveHistory`` value is within 1e-6 relative of MLlib's final one, less the fit's
  start; for MLlib, its fit time (its last iteration reaches it);
- MLlib's objective against time (the plot): MLlib's summary has no times, so the first
  round also fits MLlib with ``maxIter = k`` for ``--mllib-curve`` values of k (the same
  path: L-BFGS is deterministic on the same rows) and plots (fit time, final objective);
- memory (``linear_watch.MemoryWatcher``): peaks sampled every 0.1 s from /proc (VmRSS) of
  the driver JVM, which in local mode is also the executor, and of the Python workers under
  it (summed), plus the JVM heap in use (``Runtime``, after a ``System.gc()`` before each
  fit), all as the peak during that fit (up to its failure, where it fails);
- a failed fit: a short phrase from its error (``linear_report.failure_phrase``), the first
  cause that names a reason (``java.lang.OutOfMemoryError: Java heap space``, say).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from benchkit.linear_report import failure_phrase
from benchkit.linear_watch import MemoryWatcher
from benchkit.sparse_data import ClickData, TextData, hashed_frame


@dataclass
class LinearRun:
    """One fit's figures, or why there are none (``problem``: a short phrase for the table,
    ``linear_report.failure_phrase``'s; ``error``: the whole error text it came from).
    ``times``: seconds from the fit's start at which each ``history`` value was reached
    (ours; MLlib's: the curve points ``(seconds, objective)`` in ``curve``). ``rows``: the
    rows fitted, where the fit ran in a session of its own (``linear_child``)."""

    contender: str
    seconds: float | None = None
    iterations: int | None = None
    objective: float | None = None
    history: list = field(default_factory=list)
    times: list = field(default_factory=list)
    curve: list = field(default_factory=list)
    coefficients: np.ndarray | None = None
    jvm_peak: int = 0
    heap_peak: int = 0
    workers_peak: int = 0
    problem: str = ""
    error: str = ""
    rows: int | None = None


#: The problems' kinds, as ``--problems`` names them.
KINDS = ("text", "clicks", "dense")


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
            found.append((f"dense {args.dense_rows:,} x {args.dense_features}", "dense", 0))
        else:
            raise SystemExit(f"--problems: {name!r} is not one of {', '.join(KINDS)}")
    return found


def frame_of(spark, kind: str, features: int, args: argparse.Namespace):
    """The problem's rows, ``features vector, label double``, cached and counted, in as
    many partitions as the master's task slots (both fits read the same partitions)."""
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
        # x . truth as one fold over the array (a sum of 512 terms as nested expressions
        # overflows the JVM's stack while Spark analyses it)
        weights = F.array(*(F.lit(float(t)) for t in truth))
        products = F.zip_with(F.col("x"), weights, lambda a, b: a * b)
        label = F.aggregate(products, F.lit(0.0), lambda total, term: total + term)
        frame = raw.select(
            array_to_vector("x").alias("features"),
            (label + F.randn(args.seed + width)).alias("label"),
        )
    frame = frame.select("features", "label").cache()
    frame.count()
    return frame


def estimator(contender: str, kind: str, args: argparse.Namespace, max_iter: int):
    """The contender's Estimator with the benchmark's Params (the same for both)."""
    if contender == "ours":
        from allreduce_param import ml as module
    elif kind == "dense":
        from pyspark.ml import regression as module
    else:
        from pyspark.ml import classification as module
    params = {"regParam": args.reg_param, "maxIter": max_iter, "tol": args.tol}
    if kind == "dense":
        return module.LinearRegression(solver="l-bfgs", **params)
    return module.LogisticRegression(**params)


def fit_once(spark, contender: str, kind: str, frame, args, jvm_pid: int) -> LinearRun:
    """One fit of ``contender`` ("ours" or "mllib"), timed and watched."""
    run = LinearRun(contender)
    spark.sparkContext._jvm.java.lang.System.gc()  # each fit's heap peak from a clean heap
    watcher = MemoryWatcher(spark, jvm_pid)
    started = time.time()
    try:
        with watcher:
            model = estimator(contender, kind, args, args.max_iter).fit(frame)
            run.seconds = time.time() - started
        summary = model.summary
        run.history = list(summary.objectiveHistory)
        run.times = [t - started for t in getattr(summary, "objectiveTimes", [])]
        run.iterations, run.objective = summary.totalIterations, run.history[-1]
        matrix = model.coefficients if kind == "dense" else model.coefficientMatrix
        run.coefficients = np.asarray(matrix.toArray(), np.float64).ravel()
    except Exception as error:  # the fit failed, or took the JVM down with it
        run.error = f"{type(error).__name__}: {error}"
        run.problem = failure_phrase(run.error)
        traceback.print_exc(file=sys.stderr)
    run.jvm_peak, run.heap_peak = watcher.jvm_peak, watcher.heap_peak
    run.workers_peak = watcher.workers_peak
    return run


def mllib_curve(kind: str, frame, args, iterations: int) -> list[tuple[float, float]]:
    """MLlib's (fit seconds, final objective) at ``args.mllib_curve`` iteration counts
    below ``iterations`` (see the module's docstring)."""
    points = []
    counts = np.linspace(0, iterations, args.mllib_curve + 2)[1:-1]
    for k in sorted({max(int(round(c)), 1) for c in counts}):
        started = time.time()
        model = estimator("mllib", kind, args, k).fit(frame)
        points.append((time.time() - started, model.summary.objectiveHistory[-1]))
        print(f"  MLlib maxIter={k}: {points[-1][0]:.1f} s", file=sys.stderr, flush=True)
    return points
