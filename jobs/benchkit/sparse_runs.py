"""One fit of each contender of ``bench_sparse.py``, timed and watched.

``run_ours`` fits ``AllReduceClassifier(hiddenLayers=[])``, ``run_mllib`` MLlib's
``LogisticRegression``, each within a budget (``benchkit.training.BudgetGuard``) and under a
``Watcher``, which samples the peak memory of the driver and of the Python workers from
/proc and stamps ours' epochs as its ``logPath`` grows. Each gives a ``Run``: the figures,
or why the fit did not finish (``failure_text``), for ``sparse_tables.py``'s rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path


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
    from allreduce_param.ml import AllReduceClassifier
    from benchkit.training import BudgetGuard

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
    from pyspark.ml.classification import LogisticRegression
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    from benchkit.training import BudgetGuard

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
