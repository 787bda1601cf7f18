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
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import sparse_data  # jobs/, beside this file
import sparse_steps
from bench_allreduce import CONF_DIR, machine, render
from bench_growth import copy_bandwidth
from pyspark import cloudpickle
from sparse_data import BAYES_ROWS, ClickData, TextData, csr_sizes, hashed_frame

# the executors cannot import jobs/: the generators travel with their module's code
cloudpickle.register_pickle_by_value(sparse_data)
#: phases of a step as History.steps names them, and as the step table heads them
STEP_PHASES = ("get_s", "compute_s", "put_s", "aggregate_s", "update_s", "send_s")


# ---- measuring ------------------------------------------------------------------------------


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def python_workers(root: int) -> list[int]:
    """The processes under ``root`` (the driver's JVM) whose command line names PySpark's
    daemon or worker: the Python workers and the daemon that forks them."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                commands[int(entry)] = cmdline.read().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent:
                frontier.append(pid)
                if "pyspark.daemon" in commands[pid] or "pyspark.worker" in commands[pid]:
                    found.append(pid)
    return found


class Watcher:
    """During a fit, in a background thread: the peak RSS of the driver (JVM + Python) and
    of the Python workers under the JVM (summed), every ``interval`` s; and, for ours, the
    epoch events of a ``logPath`` file stamped with ``time.time()`` as they appear."""

    def __init__(self, jvm_pid: int, log: Path | None = None, interval: float = 0.1) -> None:
        self.jvm_pid, self.log, self.interval = jvm_pid, log, interval
        self.driver_peak = self.workers_peak = 0
        self.epochs: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-watcher", daemon=True)
        self._read = 0

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(time.monotonic(), refresh=True)
        self._tail()

    def _run(self) -> None:
        workers_at = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            self._sample(now, refresh=now - workers_at > 0.5)
            if now - workers_at > 0.5:
                workers_at = now
            self._tail()
            self._stop.wait(self.interval)

    def _sample(self, now: float, refresh: bool) -> None:
        if refresh or not hasattr(self, "_workers"):
            self._workers = python_workers(self.jvm_pid)
        self.driver_peak = max(self.driver_peak, _rss_bytes(self.jvm_pid) + _rss_bytes(os.getpid()))
        self.workers_peak = max(self.workers_peak, sum(_rss_bytes(pid) for pid in self._workers))

    def _tail(self) -> None:
        if self.log is None or not self.log.exists():
            return
        with open(self.log) as lines:
            lines.seek(self._read)
            text = lines.read()
        whole = text[: text.rfind("\n") + 1]
        self._read += len(whole.encode())
        for line in whole.splitlines():
            event = json.loads(line)
            if event.get("kind") == "epoch":
                self.epochs.append((time.time(), event))


@dataclass
class Run:
    """One fit: its clock, its test accuracy, the per-epoch test accuracy (ours), peaks."""

    contender: str
    started: float
    seconds: float | None = None
    accuracy: float | None = None
    #: ours: (time.time() the epoch appeared, test accuracy after it)
    epochs: list[tuple[float, float]] = field(default_factory=list)
    driver_peak: int = 0
    workers_peak: int = 0
    problem: str = ""  # instead of figures: why it did not finish
    failed_after: float | None = None  # seconds from its start to the failure
    steps: list[dict] = field(default_factory=list)  # ours: History.steps

    def reached(self, target: float | None) -> float | None:
        """Seconds from the start to the first epoch at or above ``target``, or None."""
        if target is None:
            return None
        for at, accuracy in self.epochs:
            if accuracy is not None and accuracy >= target:
                return at - self.started
        return None


def failure_text(error: BaseException, budget_fired: bool) -> str:
    """Why a fit did not finish, in a few words for the table."""
    text = f"{type(error).__name__}: {error}"
    if budget_fired:
        return "budget ran out"
    for needle, said in (
        ("maxResultSize", "spark.driver.maxResultSize exceeded"),
        ("OutOfMemoryError", "OutOfMemoryError (driver JVM)"),
        ("Python worker exited unexpectedly", "a Python worker died"),
        ("MemoryError", "MemoryError (Python worker)"),
        ("SparkContext was shut down", "the driver JVM ended"),
    ):
        if needle in text:
            return said
    lines = text.splitlines()
    java = [line[2:] for line in lines if line.startswith(": ")]  # a Py4JJavaError's cause
    return (java or lines)[0][:100]


def run_ours(
    spark, frame, settings: argparse.Namespace, jvm_pid: int, sparse_sync: str = "auto"
) -> Run:
    """``AllReduceClassifier(hiddenLayers=[])`` on ``frame``, the test rows its validation;
    ``sparse_sync``: its ``sparseSync`` (how the gradients travel)."""
    from bench_train import BudgetGuard

    from allreduce_param.ml import AllReduceClassifier

    folder = Path(tempfile.mkdtemp(prefix="bench-sparse-"))
    log = folder / "fit.jsonl"
    params = dict(
        hiddenLayers=[],
        optimizer=settings.optimizer,
        stepSize=settings.lr,
        batchSize=settings.batch_size,
        maxEpochs=settings.epochs,
        codec="raw",
        seed=settings.seed,
        showProgress=False,
        logPath=str(log),
        validationIndicatorCol="is_test",
        sparseSync=sparse_sync,
    )
    if settings.reg_param:
        params.update(regParam=settings.reg_param, elasticNetParam=0.0)
    classifier = AllReduceClassifier(**params)
    run = Run("ours" if sparse_sync == "auto" else f"ours, {sparse_sync} sync", time.time())
    watcher = Watcher(jvm_pid, log)
    guard = BudgetGuard(spark, "bench-sparse-ours", run.started + settings.budget)
    try:
        with watcher, guard:
            model = classifier.fit(frame)
            run.seconds = time.time() - run.started
            run.accuracy = model.history.epochs[-1].get("val_accuracy")
            run.steps = model.history.steps
        if guard.cut_short:
            run.problem = "budget ran out"
    except Exception as error:  # the table says why
        run.problem = failure_text(error, guard.fired)
        run.failed_after = time.time() - run.started
        traceback.print_exc(file=sys.stderr)
    run.epochs = [(at, event.get("val_accuracy")) for at, event in watcher.epochs]
    run.driver_peak, run.workers_peak = watcher.driver_peak, watcher.workers_peak
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    return run


def run_mllib(spark, train, test, settings: argparse.Namespace, jvm_pid: int) -> Run:
    """MLlib's ``LogisticRegression`` on ``train``; its test accuracy after the clock."""
    from bench_train import BudgetGuard
    from pyspark.ml.classification import LogisticRegression
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    classifier = LogisticRegression(
        maxIter=settings.mllib_iters, regParam=settings.reg_param, elasticNetParam=0.0
    )
    run = Run("mllib", time.time())
    watcher = Watcher(jvm_pid)
    guard = BudgetGuard(spark, "bench-sparse-mllib", run.started + settings.budget)
    try:
        with watcher, guard:
            model = classifier.fit(train)
            run.seconds = time.time() - run.started
        if guard.cut_short:
            run.problem = "budget ran out"
        else:
            evaluator = MulticlassClassificationEvaluator(metricName="accuracy")
            run.accuracy = evaluator.evaluate(model.transform(test))
    except Exception as error:
        run.problem = failure_text(error, guard.fired)
        run.failed_after = time.time() - run.started
        traceback.print_exc(file=sys.stderr)
    run.driver_peak, run.workers_peak = watcher.driver_peak, watcher.workers_peak
    return run


# ---- the tables ------------------------------------------------------------------------------


def mb(value: float) -> str:
    return f"{value / 2**20:,.0f}"


def ratio_text(ratios: list[float]) -> str:
    if not ratios:
        return ""
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def result_rows(name: str, ours: list[Run], mllib: list[Run]) -> list[tuple]:
    """Two table rows (ours, MLlib) of one problem: medians over the rounds."""
    lines = []
    for runs, label in ((ours, "allreduce-param softmax"), (mllib, "MLlib LogisticRegression")):
        done = [run for run in runs if not run.problem]
        problems = sorted({run.problem for run in runs if run.problem})
        if not done:  # why, when, and the peaks until then
            afters = [run.failed_after for run in runs if run.failed_after is not None]
            if afters:
                problems[0] += f" (after {statistics.median(afters):.0f} s)"
            peaks = [
                mb(max(run.driver_peak for run in runs)),
                mb(max(run.workers_peak for run in runs)),
            ]
            lines.append((name, label, "; ".join(problems), "", "", "", "", *peaks))
            continue
        seconds = statistics.median(run.seconds for run in done)
        accuracies = [run.accuracy for run in done if run.accuracy is not None]
        to_target, ratio_fit, ratio_target = "", "", ""
        if runs is ours:
            hits, fit_ratios, target_ratios = [], [], []
            for our, their in zip(ours, mllib):
                if our.problem:
                    continue
                hit = our.reached(their.accuracy if not their.problem else None)
                if hit is not None:
                    hits.append(hit)
                if not their.problem:
                    fit_ratios.append(their.seconds / our.seconds)
                    if hit is not None:
                        target_ratios.append(their.seconds / hit)
            if hits:
                to_target = f"{statistics.median(hits):.1f}"
                if len(hits) < len(done):
                    to_target += f" ({len(hits)} of {len(done)})"
            elif any(not run.problem for run in mllib):
                best = max(
                    (a for run in done for _, a in run.epochs if a is not None), default=None
                )
                to_target = f"not reached (best {best:.4f})" if best is not None else "not reached"
            ratio_fit, ratio_target = ratio_text(fit_ratios), ratio_text(target_ratios)
        text = f"{seconds:.1f}" + (
            f" ({len(done)} of {len(runs)})" if len(done) < len(runs) else ""
        )
        if problems:
            text += "; " + "; ".join(problems)
        lines.append(
            (
                name,
                label,
                text,
                f"{statistics.median(accuracies):.4f}" if accuracies else "",
                to_target,
                ratio_fit,
                ratio_target,
                mb(max(run.driver_peak for run in runs)),
                mb(max(run.workers_peak for run in runs)),
            )
        )
    return lines


RESULT_HEADER = (
    "problem",
    "contender",
    "fit s",
    "test accuracy",
    "s to MLlib's accuracy",
    "MLlib fit / ours fit",
    "MLlib fit / ours to its accuracy",
    "driver peak MB",
    "workers peak MB",
)


def size_text(value: float) -> str:
    """One decimal from 1 on, three significant digits below (a tiny run's sizes)."""
    return f"{value:,.1f}" if value >= 1 else f"{value:.3g}"


def size_row(name: str, features: int, sizes: list[tuple[int, int]]) -> tuple:
    """The training rows' non-zeros against the dense-equivalent, per partition."""
    rows = sum(r for r, _ in sizes)
    nonzeros = sum(n for _, n in sizes)
    largest_rows, largest_nonzeros = max(sizes, key=lambda size: size[1])
    csr = largest_nonzeros * (4 + 4) + (largest_rows + 1) * 4  # float32 values, int32 indices
    return (
        name,
        f"{features:,}",
        f"{rows:,}",
        f"{nonzeros:,}",
        f"{nonzeros / max(rows, 1):.1f}",
        f"{len(sizes)}",
        size_text(csr / 2**20),
        size_text(largest_rows * features * 4 / 2**30),
    )


SIZE_HEADER = (
    "problem",
    "features d",
    "train rows N",
    "non-zeros",
    "per row",
    "partitions",
    "CSR MB, largest partition",
    "dense N x d GiB, same partition",
)


def step_row(name: str, features: int, runs: list[Run], partitions: int) -> tuple:
    """Ours' step phases on one problem: medians over every step of every round (ms)."""
    steps = [step for run in runs for step in run.steps]
    if not steps:
        return (name, f"{features:,}", "", *("" for _ in STEP_PHASES), "")
    medians = [
        statistics.median(step.get(phase, 0.0) for step in steps) * 1e3 for phase in STEP_PHASES
    ]
    return (
        name,
        f"{features:,}",
        f"{len(steps):,}",
        *(f"{value:.1f}" for value in medians),
        f"{sum(medians):.1f}",
    )


STEP_HEADER = (
    "problem",
    "features d",
    "steps",
    *(f"{phase[:-2]} ms" for phase in STEP_PHASES),
    "sum ms",
)


def step_seconds(run: Run) -> float | None:
    """A run's median step: over its steps, the sum of each step's phases."""
    if not run.steps:
        return None
    return statistics.median(
        sum(step.get(phase, 0.0) for phase in STEP_PHASES) for step in run.steps
    )


def sync_rows(name: str, features: int, runs: dict[str, list[Run]]) -> list[tuple]:
    """One row per sync on one problem: step phases (medians over every step of every round),
    the median step, fit time and test accuracy (medians of the rounds), and on the touched
    row the rounds' dense / touched ratios of their median steps."""
    rows = []
    for sync, done in runs.items():
        done = [run for run in done if not run.problem]
        steps = [step for run in done for step in run.steps]
        if not steps:
            problems = "; ".join(run.problem for run in runs[sync] if run.problem)
            rows.append((name, sync, f"{features:,}", problems, *("" for _ in range(10))))
            continue
        medians = [
            statistics.median(step.get(phase, 0.0) for step in steps) * 1e3 for phase in STEP_PHASES
        ]
        ratios = [
            step_seconds(dense) / step_seconds(touched)
            for dense, touched in zip(runs["dense"], runs["touched"])
            if sync == "touched" and step_seconds(dense) and step_seconds(touched)
        ]
        rows.append(
            (
                name,
                sync,
                f"{features:,}",
                f"{len(steps):,}",
                *(f"{value:.1f}" for value in medians),
                f"{statistics.median(step_seconds(run) for run in done) * 1e3:.1f}",
                f"{statistics.median(run.seconds for run in done):.1f}",
                f"{statistics.median(run.accuracy for run in done):.4f}",
                ratio_text(ratios),
            )
        )
    return rows


SYNC_HEADER = (
    "problem",
    "sync",
    "features d",
    "steps",
    *(f"{phase[:-2]} ms" for phase in STEP_PHASES),
    "step ms",
    "fit s",
    "test accuracy",
    "dense / touched step",
)


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
