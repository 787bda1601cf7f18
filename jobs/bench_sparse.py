"""Benchmark: time to accuracy on wide, sparse features, this project against MLlib's LogisticRegression.

Two generated problems, each regenerated from ``--seed`` in the executors (never collected to
the driver), hashed into sparse vectors by Spark's own transformers, cached and counted once
before any clock starts:

- ``text``: documents whose words follow a Zipf law over a vocabulary of ``--vocabulary``
  words; each class multiplies the frequency of ``--tilted`` words of its own (drawn among
  the middle ranks) by ``--tilt``; a document has 8 + Poisson(``--doc-words`` - 8) words.
  ``Tokenizer`` -> ``HashingTF(numFeatures=--text-features)`` (2^18). The words are drawn
  independently given the class, so naive Bayes over the word counts is the Bayes-optimal
  classifier: its accuracy (on the generator's first 20,000 rows) is printed as the ceiling.
- ``clicks``: a click log of ``--fields`` categorical fields, field f with a number of levels
  spaced log-uniformly from 10 to ``--max-levels``, each value drawn from a power law
  (Zipf, exponent 1.2, folded into the levels). The label is drawn from a hidden logistic
  model: each value of the first ``--informative`` fields has a weight (a normal deviate
  hashed from seed, field and value), the click probability is the sigmoid of their sum. The
  Bayes accuracy, mean(max(p, 1 - p)), is printed. ``FeatureHasher`` (the fields as
  categorical columns) hashes it into 2^20 and 2^24 features (``--click-features``): one
  non-zero per field.

Each row goes to the test set with probability ``--test-fraction``. The contenders, in one
Spark session on the same cached rows, alternating (ours, MLlib, ours, MLlib, ...) for
``--rounds`` rounds on each problem:

- ours: ``allreduce_param.ml.AllReduceClassifier(hiddenLayers=[])``, softmax regression over
  the CSR rows, as a pyspark.ml user writes it: Adam (``--lr``), ``--batch-size``,
  ``--epochs``, the test rows marked by ``validationIndicatorCol`` so that the fit evaluates
  the test accuracy after every epoch. Its ``logPath`` (JSON lines, written by the driver as
  each epoch's event comes in) is read as it grows, and each epoch stamped when it appears:
  "s to MLlib's" is the stamp of the first epoch whose test accuracy reached the MLlib
  run's of the same round. The fit time includes these evaluations.
- MLlib: ``pyspark.ml.classification.LogisticRegression(maxIter=--mllib-iters)``, L-BFGS,
  with the same regularisation (``--reg-param``, elastic net 0, standardized as MLlib's
  default on both; 0 by default), its other settings MLlib's defaults (for two classes its
  binomial family; ours is a softmax over two outputs); fit time, then its test accuracy
  (evaluated after the clock).

Every fit has ``--budget`` seconds: its Spark jobs are cancelled then, and the table says so;
a fit that fails (the driver's ``spark.driver.maxResultSize``, ``OutOfMemoryError``, a
Python worker that died) has its reason in the table instead of figures. An
``OutOfMemoryError`` ends a local JVM: the JVM's ``-XX:OnOutOfMemoryError`` hook (a script
in a temporary folder) marks it for the table, Spark starts again with the rows cached
again, and MLlib is not run again on that problem.

Peak memory, sampled every 0.1 s from /proc during each fit: the driver (its JVM, which in
local mode also runs the executors, plus the Python driver) and the Python workers (the
``pyspark.daemon`` processes under the driver's JVM and the workers they fork; sum of their
RSS, shared pages counted in each). A JVM keeps the heap it has grown, so the driver's peak
after a fit that grew it includes what that fit took.

    python jobs/bench_sparse.py                               # about 7 minutes on 2 cores
    python jobs/bench_sparse.py --problems text --text-rows 200000 --rounds 3
    python jobs/bench_sparse.py --problems clicks --click-rows 1000000 --click-features 24
    python jobs/bench_sparse.py --breakdown-only              # the step breakdown, no Spark
    python jobs/bench_sparse.py --problems clicks --epochs 1 --compare-syncs  # dense vs touched

``--breakdown`` (on by default; ``--breakdown-only`` alone, without Spark or Java) times one
step's parts at 2^20 and 2^24 features in this process, on one thread, for one partition's
share of a batch of the click log (``sparse_steps.py`` says what each column is), and a
BSP step's compute, put and aggregate with the dense sync and the touched one, alternating,
at 2^20, 2^22 and 2^24 (``sparse_steps.sync_comparison``, partitions as threads); each
fit's own step phases (medians over its steps, the slowest partition's) are printed too.

``--compare-syncs`` runs ours alone, ``sparseSync="dense"`` and ``"touched"`` alternating
(dense, touched, dense, ...) for ``--rounds`` rounds on each problem's same cached rows, and
prints one table: each sync's step phases (medians over every step), its median step, fit
time and test accuracy (the same bits either way, so the same accuracy), and the rounds'
dense / touched ratios of their median steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import sparse_data  # jobs/, beside this file
import sparse_steps
from bench_allreduce import CONF_DIR, machine, render
from bench_growth import copy_bandwidth
from pyspark import cloudpickle
from sparse_data import BAYES_ROWS, ClickData, TextData, csr_sizes, hashed_frame
from sparse_runs import Run, run_mllib, run_ours
from sparse_tables import (
    RESULT_HEADER,
    SIZE_HEADER,
    STEP_HEADER,
    SYNC_HEADER,
    result_rows,
    size_row,
    step_row,
    sync_rows,
)

# the executors cannot import jobs/: the generators travel with their module's code
cloudpickle.register_pickle_by_value(sparse_data)


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


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="local[2]", help="Spark master (default: local[2])")
    parser.add_argument("--driver-memory", default="4g", help="spark.driver.memory (default 4g)")
    parser.add_argument(
        "--problems",
        default="text,clicks",
        help="comma-separated: text (hashed documents), clicks (hashed click log)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the data, the split, the weights")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--text-rows", type=int, default=40_000, help="documents")
    parser.add_argument("--text-features", type=int, default=18, help="HashingTF's 2^this")
    parser.add_argument("--classes", type=int, default=2, help="the text's classes")
    parser.add_argument("--vocabulary", type=int, default=20_000)
    parser.add_argument("--tilted", type=int, default=2_000, help="words each class favours")
    parser.add_argument("--tilt", type=float, default=2.5, help="how much it favours them")
    parser.add_argument("--doc-words", type=int, default=40, help="mean words a document")
    parser.add_argument("--click-rows", type=int, default=100_000)
    parser.add_argument(
        "--click-features",
        default="20,24",
        help="FeatureHasher's 2^these, comma-separated (a fit at each)",
    )
    parser.add_argument("--fields", type=int, default=26, help="the click log's fields")
    parser.add_argument("--informative", type=int, default=13, help="fields the label depends on")
    parser.add_argument(
        "--max-levels", type=int, default=1_000_000, help="the widest field's levels"
    )
    parser.add_argument("--lr", type=float, default=0.02, help="ours: the learning rate")
    parser.add_argument(
        "--optimizer", default="adam", help="ours: the optimizer Param (adam, sgd, ...)"
    )
    parser.add_argument("--batch-size", type=int, default=4096, help="ours: the global batch")
    parser.add_argument("--epochs", type=int, default=4, help="ours: maxEpochs")
    parser.add_argument("--mllib-iters", type=int, default=100, help="MLlib: maxIter (its default)")
    parser.add_argument(
        "--reg-param",
        type=float,
        default=0.0,
        help="regParam for both (L2; elastic net 0)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per problem")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds a fit may take")
    parser.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time one step's parts at 2^20 and 2^24 features (no Spark)",
    )
    parser.add_argument(
        "--breakdown-only", action="store_true", help="the step breakdown alone, without Spark"
    )
    parser.add_argument("--breakdown-repeats", type=int, default=5)
    parser.add_argument(
        "--compare-syncs",
        action="store_true",
        help="ours alone, sparseSync dense against touched alternating (no MLlib)",
    )
    args = parser.parse_args(argv)
    args.problem_names = [name.strip() for name in args.problems.split(",") if name.strip()]
    if not args.problem_names or set(args.problem_names) - {"text", "clicks"}:
        parser.error(f"--problems {args.problems!r}: choose of text, clicks")
    try:
        args.click_powers = [int(power) for power in args.click_features.split(",")]
    except ValueError:
        parser.error(f"--click-features {args.click_features!r}: powers of 2, e.g. 20,24")
    for name in ("text_rows", "click_rows", "batch_size", "epochs", "mllib_iters", "rounds"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    if not 0 < args.test_fraction < 1 or args.classes < 2 or args.reg_param < 0:
        parser.error("need 0 < --test-fraction < 1, --classes >= 2 and --reg-param >= 0")
    if args.tilted * args.classes > args.vocabulary // 2:
        parser.error(
            f"--tilted {args.tilted} x --classes {args.classes} is more than half the "
            f"--vocabulary {args.vocabulary}: the classes would favour the same words"
        )
    if args.informative > args.fields:
        parser.error(f"--informative {args.informative} is more than --fields {args.fields}")
    if not all(4 <= power <= 30 for power in [args.text_features, *args.click_powers]):
        parser.error("--text-features and --click-features: powers of 2 from 4 to 30")
    return args


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
        return main_compare_syncs(args, header)
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


def main_compare_syncs(args: argparse.Namespace, header: str) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
