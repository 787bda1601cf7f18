"""``bench_sparse.py``'s run: a linear classifier on wide, sparse feature vectors, ours against
MLlib's ``LogisticRegression`` (the script says how).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchkit import sparse_steps
from benchkit.machine import CONF_DIR, copy_bandwidth, machine
from benchkit.sparse_data import BAYES_ROWS, ClickData, TextData, csr_sizes, hashed_frame
from benchkit.sparse_runs import Run, run_mllib, run_ours
from benchkit.sparse_tables import (
    RESULT_HEADER,
    SIZE_HEADER,
    STEP_HEADER,
    SYNC_HEADER,
    result_rows,
    size_row,
    step_row,
    sync_rows,
)
from benchkit.tables import render


def compare_syncs(bench: Bench, args: argparse.Namespace) -> list[tuple]:
    """Ours alone on each problem, ``sparseSync`` dense and touched alternating for
    ``--rounds`` rounds on the same cached rows: the table's rows."""
    rows = []
    for name, data, features in make_problems(args):
        frame, _, _ = bench.prepare(data, features)
        runs: dict[str, list[Run]] = {"dense": [], "touched": []}
        for round_number in range(args.rounds):
            for sync in runs:
                runs[sync].append(run_ours(bench.spark, frame, args, bench.jvm_pid, sync))
                log_run(name, round_number, runs[sync][-1])
        rows += sync_rows(name, features, runs)
    return rows


def print_breakdown(args: argparse.Namespace, partitions: int) -> None:
    rows = max(1, args.batch_size // partitions)
    print(
        f"\none step's parts on one thread (medians of {args.breakdown_repeats}), softmax regression, "
        f"2 classes, a batch of {rows:,} click-log rows ({args.batch_size} / {partitions} partitions):"
    )
    print(
        render(
            sparse_steps.HEADER,
            sparse_steps.breakdown([2**20, 2**24], rows, args.breakdown_repeats, args.seed),
            left=1,
        )
    )
    print(
        f"\na BSP step's compute, put and aggregate, the dense sync against the touched one "
        f"alternating ({args.breakdown_repeats} repeats, medians of the slowest partition's; "
        f"ratio: median (range) of the repeats' own), softmax regression, 2 classes, a global "
        f"batch of {args.batch_size:,} click-log rows over {partitions} partitions (threads of "
        "this process), codec raw:"
    )
    print(
        render(
            sparse_steps.SYNC_HEADER,
            sparse_steps.sync_comparison(
                [2**20, 2**22, 2**24],
                args.batch_size,
                partitions,
                args.breakdown_repeats,
                args.seed,
            ),
            left=1,
        )
    )
    sys.stdout.flush()


def make_problems(args: argparse.Namespace) -> list[tuple[str, object, int]]:
    """(name, data, features) of each problem the arguments ask for."""
    problems: list[tuple[str, object, int]] = []
    if "text" in args.problem_names:
        text = TextData(
            args.text_rows,
            args.classes,
            args.vocabulary,
            args.tilted,
            args.tilt,
            args.doc_words,
            args.test_fraction,
            args.seed,
        )
        problems.append((f"text 2^{args.text_features}", text, 2**args.text_features))
    if "clicks" in args.problem_names:
        clicks = ClickData(
            args.click_rows,
            args.fields,
            args.informative,
            args.max_levels,
            test_fraction=args.test_fraction,
            seed=args.seed,
        )
        problems += [(f"clicks 2^{power}", clicks, 2**power) for power in args.click_powers]
    return problems


class Bench:
    """The Spark session and one problem's cached frames; a session whose JVM died (MLlib's
    OutOfMemoryError ends a local JVM) is started again, and the frames cached again."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.spark = None
        self.cached: list = []

    def start(self) -> None:
        from allreduce_param.spark.session import local_spark

        # the JVM marks an OutOfMemoryError (which ends a local JVM) for the table to name
        self.marker = Path(tempfile.mkdtemp(prefix="bench-sparse-jvm-")) / "out-of-memory"
        script = self.marker.with_name("on-oom.sh")
        script.write_text('#!/bin/sh\ntouch "$(dirname "$0")/out-of-memory"\n')
        script.chmod(0o755)
        options = os.environ.get("SPARK_SUBMIT_OPTS", "")
        os.environ["SPARK_SUBMIT_OPTS"] = f"{options} -XX:OnOutOfMemoryError={script}".strip()
        try:
            self.spark = local_spark(
                self.args.master,
                "allreduce-param sparse benchmark",
                CONF_DIR,
                **{"spark.driver.memory": self.args.driver_memory},
            )
        finally:
            os.environ["SPARK_SUBMIT_OPTS"] = options
        context = self.spark.sparkContext
        self.partitions = context.defaultParallelism
        self.jvm_pid = int(context._jvm.java.lang.ProcessHandle.current().pid())

    def name_out_of_memory(self, run: Run) -> None:
        """Name an OutOfMemoryError of the JVM's (since the last call) as ``run``'s problem."""
        if self.marker.exists():
            self.marker.unlink()
            run.problem = (
                f"OutOfMemoryError (driver JVM, spark.driver.memory {self.args.driver_memory})"
            )

    def alive(self) -> bool:
        try:
            return not self.spark.sparkContext._jsc.sc().isStopped()
        except Exception:  # the gateway is gone with the JVM
            return False

    def restart(self) -> None:
        try:
            self.spark.stop()
        except Exception:
            pass
        self.marker.unlink(missing_ok=True)
        self.marker.with_name("on-oom.sh").unlink()
        self.marker.parent.rmdir()
        from pyspark import SparkContext
        from pyspark.sql import SparkSession

        # the dead JVM's gateway and context forgotten, so that the next session starts a JVM
        SparkContext._active_spark_context = SparkContext._gateway = SparkContext._jvm = None
        SparkSession._instantiatedSession = SparkSession._activeSession = None
        self.cached = []  # went with the JVM
        self.start()

    def prepare(self, data, features: int) -> tuple:
        """(frame, train, test), generated, hashed and cached before any clock."""
        for frame in self.cached:
            frame.unpersist()
        frame = hashed_frame(self.spark, data, features).cache()
        train = frame.filter(~frame.is_test).select("features", "label").cache()
        test = frame.filter(frame.is_test).select("features", "label").cache()
        frame.count(), train.count(), test.count()
        self.cached = [frame, train, test]
        return frame, train, test

    def stop(self) -> None:
        if self.spark is not None and self.alive():
            self.spark.stop()
        if self.spark is not None:
            self.marker.unlink(missing_ok=True)
            self.marker.with_name("on-oom.sh").unlink()
            self.marker.parent.rmdir()


def log_run(name: str, round_number: int, run: Run) -> None:
    print(
        f"{name}, round {round_number + 1}, {run.contender}: "
        + (run.problem or f"{run.seconds:.1f} s, test accuracy {run.accuracy:.4f}")
        + "".join(
            f", epoch@{at - run.started:.1f}s {a:.4f}" for at, a in run.epochs if a is not None
        ),
        file=sys.stderr,
        flush=True,
    )


def run_problem(bench: Bench, name: str, data, features: int) -> tuple[list[Run], list[Run], tuple]:
    """Alternating rounds on one problem: (ours' runs, MLlib's runs, the size row). Once
    MLlib's fit has ended the JVM, Spark starts again and MLlib is not run again on it."""
    args = bench.args
    frame, train, test = bench.prepare(data, features)
    sizes = size_row(name, features, csr_sizes(train))
    ours: list[Run] = []
    mllib: list[Run] = []
    fatal = ""
    for round_number in range(args.rounds):
        ours.append(run_ours(bench.spark, frame, args, bench.jvm_pid))
        bench.name_out_of_memory(ours[-1])
        log_run(name, round_number, ours[-1])
        if not bench.alive():
            bench.restart()
            frame, train, test = bench.prepare(data, features)
        if fatal:
            mllib.append(Run("mllib", time.time(), problem=fatal))
            continue
        mllib.append(run_mllib(bench.spark, train, test, args, bench.jvm_pid))
        bench.name_out_of_memory(mllib[-1])
        log_run(name, round_number, mllib[-1])
        if not bench.alive():
            fatal = f"not run again: the JVM ended in round {round_number + 1}"
            bench.restart()
            frame, train, test = bench.prepare(data, features)
    return ours, mllib, sizes


def run(args: argparse.Namespace) -> int:
    """Measure as the command line (``bench_sparse.py``'s, checked there) says; the exit status."""
    bandwidth = copy_bandwidth()
    header = (
        f"machine: {machine()}\nmemory copy: {bandwidth / 1e9:.2f} GB/s (one core, np.copyto of "
        "40 MB, median of 5)"
    )
    partitions = int(args.master[6:-1]) if args.master[6:-1].isdigit() else os.cpu_count() or 1
    if args.breakdown_only:
        print(header)
        print_breakdown(args, partitions)
        return 0

    from allreduce_param.spark.session import java_problem

    problem = java_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.compare_syncs:
        return run_compare_syncs(args, header)
    bench = Bench(args)
    results, sizes, steps, described = [], [], [], {}
    ours_failed = False
    try:
        bench.start()
        partitions = bench.partitions
        for name, data, features in make_problems(args):
            ours, mllib, size = run_problem(bench, name, data, features)
            described[type(data).__name__] = data
            ours_failed |= any(run.problem for run in ours)
            results += result_rows(name, ours, mllib)
            sizes.append(size)
            steps.append(step_row(name, features, ours, partitions))
    finally:
        bench.stop()

    print(header)
    for data in described.values():
        print(
            f"data: {data.describe()}; Bayes accuracy {data.bayes_accuracy():.4f} (on the first "
            f"{min(BAYES_ROWS, data.rows):,} rows); test fraction {data.test_fraction:g}"
        )
    print(
        f"ours: AllReduceClassifier(hiddenLayers=[]), {args.optimizer} lr {args.lr:g}, batch {args.batch_size}, "
        f"{args.epochs} epochs, codec raw, test accuracy evaluated after each epoch (in its fit "
        f"time); MLlib: LogisticRegression(maxIter={args.mllib_iters}) (L-BFGS); regParam "
        f"{args.reg_param:g} for both; {partitions} partitions on {args.master}, driver memory "
        f"{args.driver_memory}; medians of {args.rounds} alternating rounds (ratios: median "
        f"(range) of the rounds' own); budget {args.budget:g} s a fit"
    )
    print(render(RESULT_HEADER, results))
    print("\nthe training rows as ours holds them (CSR: float32 values, int32 indices):")
    print(render(SIZE_HEADER, sizes, left=1))
    print(
        "\nours' step phases (medians over every step, the slowest partition's), batch "
        f"{args.batch_size}:"
    )
    print(render(STEP_HEADER, steps, left=1))
    sys.stdout.flush()
    if args.breakdown:
        print_breakdown(args, partitions)
    return 1 if ours_failed else 0


def run_compare_syncs(args: argparse.Namespace, header: str) -> int:
    """``--compare-syncs``: the dense sync against the touched one, one table."""
    bench = Bench(args)
    try:
        bench.start()
        rows = compare_syncs(bench, args)
        partitions = bench.partitions
    finally:
        bench.stop()
    print(header)
    print(
        f"ours: AllReduceClassifier(hiddenLayers=[]), {args.optimizer} lr {args.lr:g}, batch "
        f"{args.batch_size}, {args.epochs} epochs, codec raw, regParam {args.reg_param:g}; "
        f"{partitions} partitions on "
        f"{args.master}; sparseSync dense and touched alternating, {args.rounds} rounds; phases: "
        "medians over every step (the slowest partition's); step ms: the median step (the sum of "
        "its phases), medians of the rounds; ratio: median (range) of the rounds' own"
    )
    print(render(SYNC_HEADER, rows, left=2))
    sys.stdout.flush()
    if args.breakdown:
        print_breakdown(args, partitions)
    return 1 if any(row[3] and not row[3][0].isdigit() for row in rows) else 0
