"""``bench_strategies.py``'s run: the update strategies with one partition made slow, on the
digits job, one table (the script says how).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from statistics import median

from allreduce_param import DistriOptimizer, models, optim
from allreduce_param.cli import load_data
from allreduce_param.spark.session import java_problem, local_spark
from benchkit.machine import CONF_DIR

#: name -> DistriOptimizer settings
STRATEGIES = {
    "bsp": {},
    "bsp backup_workers=1": {"backup_workers": 1},
    "ssp staleness=4": {"strategy": "ssp", "staleness": 4},
    "asp": {"strategy": "asp"},
    "bsp sync_every=8": {"sync_every": 8},
}


class SlowPartition:
    """A model whose every gradient on one partition comes ``delay`` seconds late: a slow executor."""

    def __init__(self, model, partition: int, delay: float) -> None:
        self.model, self.partition, self.delay = model, partition, delay
        self.task = model.task

    def init(self, rng):
        return self.model.init(rng)

    def predict(self, weights, X):
        return self.model.predict(weights, X)

    def loss_and_grad(self, weights, X, y):
        from pyspark import TaskContext

        context = TaskContext.get()  # None on the driver, which checks the model on one row
        if context is not None and context.partitionId() == self.partition:
            time.sleep(self.delay)
        return self.model.loss_and_grad(weights, X, y)


def fit(model, train, test, args, settings: dict) -> tuple:
    """One fit: its seconds, steps, seconds until an epoch reached the target (or None),
    final test accuracy, and steps that left the slow partition's gradient out."""
    reached = []
    started = time.perf_counter()

    def listen(kind, fields):
        if kind == "epoch" and not reached and (fields.get("val_accuracy") or 0) >= args.target:
            reached.append(time.perf_counter() - started)

    result = DistriOptimizer(
        model,
        optim.Adam(lr=2e-3),
        batch_size=64,
        epochs=args.epochs,
        codec="raw",
        num_workers=args.workers,
        progress=False,
        listener=listen,
        **settings,
    ).fit(train, validation=test)
    seconds = time.perf_counter() - started
    return (
        seconds,
        len(result.history.steps),
        reached[0] if reached else None,
        result.history.epochs[-1]["val_accuracy"],
        result.history.dropped.get(args.slow_partition, 0),
    )


def machine() -> str:
    import pyspark

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {memory:.0f} GiB, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
        f"PySpark {pyspark.__version__}"
    )


def run(args: argparse.Namespace) -> int:
    """Measure as the command line (``bench_strategies.py``'s, checked there) says; the exit status."""
    problem = java_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    chosen = [name.strip() for name in args.strategies.split(",")]
    spark = local_spark(args.master, "allreduce-param strategies benchmark", CONF_DIR)
    try:
        train, test = load_data(spark, {"source": "digits", "test_fraction": 0.25, "seed": 0})
        train, test = train.cache(), test.cache()
        train.count(), test.count()
        model = SlowPartition(models.MLP([64, 128, 10]), args.slow_partition, args.slow_ms / 1000)
        warm = DistriOptimizer(
            model,
            optim.Adam(lr=2e-3),
            batch_size=64,
            epochs=1,
            num_workers=args.workers,
            progress=False,
        )
        # the first fit of a session pays for Python workers and JIT
        warm.fit(train, validation=test)
        results: dict[str, list[tuple]] = {name: [] for name in chosen}
        for _ in range(args.rounds):
            for name in chosen:
                results[name].append(fit(model, train, test, args, STRATEGIES[name]))
    finally:
        spark.stop()
    rows = []
    for name in chosen:
        seconds, steps, reached, accuracy, dropped = zip(*results[name])
        to_target = [r for r in reached if r is not None]
        versus = [s / b for s, (b, *_) in zip(seconds, results["bsp"])] if "bsp" in results else []
        rows.append(
            (
                name,
                f"{median(seconds):.2f}",
                f"{median(st / s for st, s in zip(steps, seconds)):.0f}",
                f"{median(to_target):.2f}" if len(to_target) == len(reached) else "not always",
                f"{median(accuracy):.4f}",
                f"{median(versus):.2f}" if versus else "",
                f"{median(dropped):.0f} of {steps[0]}"
                if "backup_workers" in STRATEGIES[name]
                else "",
            )
        )
    print(machine())
    print(
        f"digits, MLP 64-128-10, Adam 2e-3, batch 64, {args.epochs} epochs, {args.workers} partitions on "
        f"{args.master}; partition {args.slow_partition} sleeps {args.slow_ms:g} ms a step; "
        f"medians of {args.rounds} alternating rounds"
    )
    header = (
        "strategy",
        "fit s",
        "steps/s",
        f"s to {args.target:g}",
        "test accuracy",
        "x bsp time",
        "slow one dropped",
    )
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(
            "| "
            + row[0].ljust(widths[0])
            + " | "
            + " | ".join(v.rjust(w) for v, w in zip(row[1:], widths[1:]))
            + " |"
        )
    return 0
