"""``bench_train.py``'s run: time to a target test accuracy, start-up included, for four ways
to train an MLP from PySpark (the script says how).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from allreduce_param import DistriOptimizer, models, optim
from allreduce_param.spark.session import java_problem, local_spark
from allreduce_param.spark.versions import to_arrow
from benchkit import baselines
from benchkit.machine import CONF_DIR, machine
from benchkit.tables import render

#: --contenders names -> the row's label in the table
CONTENDERS = {
    "mlp": "allreduce-param MLP (numpy)",
    "torchmodel": "allreduce-param TorchModel",
    "mllib": "MLlib MultilayerPerceptron (L-BFGS)",
    "torchdistributor": "TorchDistributor DDP (gloo)",
}
#: the contenders that need torch
NEEDS_TORCH = ("torchmodel", "torchdistributor")
#: rows per generator block: row i's values come from the generator of block i // BLOCK_ROWS
BLOCK_ROWS = 10_000
#: rows of the generator on which the Bayes accuracy is computed
BAYES_ROWS = 100_000


# ---- the data --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    """A seeded classification problem with overlapping classes and pure-noise features."""

    rows: int
    classes: int = 10
    clusters: int = 2
    informative: int = 30
    noise: int = 20
    spread: float = 0.55
    test_fraction: float = 0.1
    seed: int = 0

    @property
    def features(self) -> int:
        return self.informative + self.noise

    def centres(self) -> np.ndarray:
        """(classes x clusters, informative) cluster centres; cluster c of class k is row k * clusters + c."""
        rng = np.random.default_rng([self.seed, 0])
        return (
            rng.standard_normal((self.classes * self.clusters, self.informative)) * self.spread
        ).astype(np.float32)

    def block(self, index: int, centres: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ``index * BLOCK_ROWS`` onwards (up to BLOCK_ROWS, fewer at the end): features
        float32, labels int64, and whether each row is a test row."""
        count = min(BLOCK_ROWS, self.rows - index * BLOCK_ROWS)
        rng = np.random.default_rng([self.seed, 1, index])
        labels = rng.integers(0, self.classes, count)
        cluster = rng.integers(0, self.clusters, count)
        X = np.empty((count, self.features), np.float32)
        X[:, : self.informative] = centres[labels * self.clusters + cluster]
        X[:, : self.informative] += rng.standard_normal((count, self.informative), dtype=np.float32)
        X[:, self.informative :] = rng.standard_normal((count, self.noise), dtype=np.float32)
        is_test = rng.random(count) < self.test_fraction
        return X, labels, is_test

    def bayes_accuracy(self, rows: int = BAYES_ROWS) -> float:
        """The Bayes-optimal classifier's accuracy on the generator's first ``rows`` rows: it
        picks the class of highest density, a mixture of unit Gaussians (the noise features
        carry nothing)."""
        centres = self.centres()
        right = total = 0
        for index in range(min(rows, self.rows) // BLOCK_ROWS or 1):
            X, labels, _ = self.block(index, centres)
            informative = X[:, : self.informative].astype(np.float64)
            squared = ((informative[:, None, :] - centres[None, :, :]) ** 2).sum(axis=2)
            per_class = np.logaddexp.reduce(
                -0.5 * squared.reshape(len(X), self.classes, self.clusters), axis=2
            )
            right += int(np.sum(per_class.argmax(axis=1) == labels))
            total += len(X)
        return right / total

    def describe(self) -> str:
        return (
            f"{self.rows:,} rows generated in the executors (seed {self.seed}): {self.classes} classes, each "
            f"{self.clusters} Gaussian clusters (unit variance, centres N(0, {self.spread:g}^2)) in "
            f"{self.informative} informative features, + {self.noise} pure-noise features; "
            f"test fraction {self.test_fraction:g}"
        )


def generated_frames(spark, data: Dataset):
    """(train, test) DataFrames of ``features array<float>, label double``, generated in the
    executors, as many partitions as Spark's default parallelism; not cached."""
    import pyarrow as pa

    centres = data.centres()

    def generate(batches):
        for batch in batches:
            ids = batch.column(0).to_numpy()
            if len(ids) == 0:
                continue
            pieces = []
            for index in np.unique(ids // BLOCK_ROWS):
                X, labels, is_test = data.block(int(index), centres)
                offsets = ids[ids // BLOCK_ROWS == index] - index * BLOCK_ROWS
                pieces.append((X[offsets], labels[offsets], is_test[offsets]))
            X = np.concatenate([p[0] for p in pieces])
            values = pa.array(X.reshape(-1), pa.float32())
            offsets = pa.array(np.arange(0, X.size + 1, data.features, dtype=np.int32))
            yield pa.RecordBatch.from_arrays(
                [
                    pa.ListArray.from_arrays(offsets, values),
                    pa.array(np.concatenate([p[1] for p in pieces]).astype(np.float64)),
                    pa.array(np.concatenate([p[2] for p in pieces])),
                ],
                ["features", "label", "test"],
            )

    numbers = spark.range(0, data.rows, numPartitions=spark.sparkContext.defaultParallelism)
    rows = numbers.mapInArrow(generate, "features array<float>, label double, test boolean")
    return rows.filter(~rows.test).drop("test"), rows.filter(rows.test).drop("test")


def warm_up(frame) -> None:
    """One untimed barrier stage after a shuffle, over ``frame``'s Arrow batches: Spark's own
    first-time costs (JIT of the shuffle and barrier paths) paid before any clock starts, so
    that they do not all land on whichever contender runs first. It warms no contender's own code."""
    import pyarrow as pa

    def count_rows(batches):
        yield pa.RecordBatch.from_pydict({"rows": [sum(batch.num_rows for batch in batches)]})

    partitions = frame.rdd.getNumPartitions()
    frame.repartition(partitions).mapInArrow(count_rows, "rows long", barrier=True).collect()


def write_npy(frame, folder: Path, name: str) -> int:
    """``frame``'s rows as ``<name>_features.npy`` (float32, rows x features) and
    ``<name>_labels.npy`` (int64) in ``folder``; the row count."""
    table = to_arrow(frame)
    if table.num_rows == 0:
        raise ValueError(
            f"no {name} rows to write for TorchDistributor: raise --rows or --test-fraction"
        )
    features = table.column("features").combine_chunks()
    width = len(features[0])
    X = (
        features.flatten()
        .to_numpy(zero_copy_only=False)
        .astype(np.float32, copy=False)
        .reshape(-1, width)
    )
    y = table.column("label").to_numpy().astype(np.int64)
    np.save(folder / f"{name}_features.npy", X)
    np.save(folder / f"{name}_labels.npy", y)
    return len(y)


# ---- one contender's run -----------------------------------------------------------------------


@dataclass
class Run:
    """One contender's run: when it evaluated what, and how it ended."""

    contender: str
    unit: str  # what `done` counts: "epochs" or "iterations"
    started: float  # time.time() at its start
    #: (time.time(), epochs or iterations done, test accuracy), in order
    evaluations: list[tuple[float, int, float]] = field(default_factory=list)
    ended: float | None = None
    stopped: str = ""  # why it ended: "target", "epochs", "budget", "converged"
    problem: str = ""  # set instead of figures: "torch not installed", or the error

    def reached(self, target: float, budget: float) -> tuple[float, int] | None:
        """(seconds from the start, epochs or iterations) at the first evaluation at or above
        ``target`` within ``budget``, or None."""
        for at, done, accuracy in self.evaluations:
            if accuracy >= target and at - self.started <= budget:
                return at - self.started, done
        return None

    def best(self, budget: float) -> float | None:
        within = [accuracy for at, _, accuracy in self.evaluations if at - self.started <= budget]
        return max(within) if within else None

    def total(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


class BudgetGuard:
    """Cancels the Spark jobs this thread starts inside the ``with`` once ``deadline``
    (``time.time()``) has passed; ``fired`` says whether it did, and ``cut_short`` whether
    that ended the block (whose error, of the cancel's making, is then swallowed)."""

    def __init__(self, spark, tag: str, deadline: float) -> None:
        self.context = spark.sparkContext
        self.tag, self.deadline = tag, deadline
        self.fired = False
        self.cut_short = False  # the run was ended by the cancel (its error swallowed)
        self._timer: threading.Timer | None = None

    def _cancel(self) -> None:
        self.fired = True
        self.context.cancelJobsWithTag(self.tag)

    def __enter__(self) -> BudgetGuard:
        self.context.setInterruptOnCancel(True)
        self.context.addJobTag(self.tag)
        self._timer = threading.Timer(max(0.0, self.deadline - time.time()), self._cancel)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        self._timer.cancel()
        self.context.removeJobTag(self.tag)
        self.context.setInterruptOnCancel(False)
        self.cut_short = exc is not None and self.fired
        return self.cut_short  # an error of the cancel's making ends the run; any other is raised


@dataclass(frozen=True)
class Settings:
    """What every contender trains with."""

    layers: list[int]  # inputs, hidden..., classes
    lr: float
    batch_size: int
    epochs: int
    seed: int
    target: float
    budget: float
    codec: str
    mllib_iters_per_round: int
    mllib_block_size: int
    partitions: int


def torch_mlp(layers: list[int]):
    """``torch.nn.Sequential``: Linear, ReLU, ..., Linear, of the layer widths (inputs first)."""
    import torch

    parts: list = []
    for i, (width_in, width_out) in enumerate(zip(layers[:-1], layers[1:])):
        parts.append(torch.nn.Linear(width_in, width_out))
        if i < len(layers) - 2:
            parts.append(torch.nn.ReLU())
    return torch.nn.Sequential(*parts)


def run_ours(spark, name: str, model, train, test, settings: Settings) -> Run:
    """One ``DistriOptimizer`` fit with validation; each epoch event stamped as it comes."""
    run = Run(name, "epochs", time.time())

    def listen(kind: str, fields: dict) -> None:
        if kind == "epoch" and fields.get("val_accuracy") is not None:
            run.evaluations.append(
                (time.time(), int(fields["epoch"]) + 1, float(fields["val_accuracy"]))
            )

    with BudgetGuard(spark, f"bench-train-{name}", run.started + settings.budget) as guard:
        DistriOptimizer(
            model,
            optim.Adam(lr=settings.lr),
            batch_size=settings.batch_size,
            epochs=settings.epochs,
            codec=settings.codec,
            seed=settings.seed,
            progress=False,
            listener=listen,
        ).fit(train, validation=test)
        run.stopped = "epochs"
    if guard.cut_short:
        run.stopped = "budget"
    run.ended = time.time()
    return run


def run_mllib(spark, train, test, settings: Settings) -> Run:
    """Chained MLlib fits of ``mllib_iters_per_round`` L-BFGS iterations each, each from the
    previous weights, evaluated after each; until the target, the budget, or convergence."""
    from pyspark.ml.classification import MultilayerPerceptronClassifier
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.functions import array_to_vector

    run = Run("mllib", "iterations", time.time())
    evaluator = MulticlassClassificationEvaluator(metricName="accuracy")
    with BudgetGuard(spark, "bench-train-mllib", run.started + settings.budget) as guard:
        vectors = train.select(array_to_vector("features").alias("features"), "label")
        test_vectors = test.select(array_to_vector("features").alias("features"), "label")
        weights, iterations = None, 0
        while True:
            classifier = MultilayerPerceptronClassifier(
                layers=settings.layers,
                seed=settings.seed,
                maxIter=settings.mllib_iters_per_round,
                blockSize=settings.mllib_block_size,
            )
            if weights is not None:
                classifier.setInitialWeights(weights)
            fitted = classifier.fit(vectors)
            done = fitted.summary().totalIterations
            iterations += done
            weights = fitted.weights
            accuracy = evaluator.evaluate(fitted.transform(test_vectors))
            run.evaluations.append((time.time(), iterations, accuracy))
            if accuracy >= settings.target:
                run.stopped = "target"
                break
            if done < settings.mllib_iters_per_round:
                run.stopped = "converged"
                break
    if guard.cut_short:
        run.stopped = "budget"
    run.ended = time.time()
    return run


def distributed_training(
    folder: str,
    layers: list[int],
    lr: float,
    batch_size: int,
    epochs: int,
    seed: int,
    target: float,
    threads: int,
    interface: str | None,
) -> list[tuple[float, int, float]]:
    """TorchDistributor's training function, in each torchrun worker: DDP over gloo on the
    rows in ``folder``, each rank on its contiguous share of the training rows, with
    ``batch_size`` / world size rows per step. After each epoch rank 0 evaluates the test
    accuracy, appends ``(time.time(), epochs done, accuracy)`` to ``folder/evaluations.jsonl``
    (read if the run is cancelled) and tells the ranks whether to stop; rank 0 returns the list.
    ``interface``: the network interface gloo listens on (loopback on one machine; None: torch's choice)."""
    import json as json_lines
    import os as os_env
    import time as clock

    import numpy
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if interface:  # else gloo listens on the address of the host's name
        os_env.environ["GLOO_SOCKET_IFNAME"] = interface
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        X = numpy.load(os_env.path.join(folder, "train_features.npy"), mmap_mode="r")
        y = numpy.load(os_env.path.join(folder, "train_labels.npy"), mmap_mode="r")
        share = len(X) // world
        X, y = X[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        if rank == 0:
            X_test = torch.from_numpy(numpy.load(os_env.path.join(folder, "test_features.npy")))
            y_test = torch.from_numpy(numpy.load(os_env.path.join(folder, "test_labels.npy")))
        model = DistributedDataParallel(torch_mlp(layers))
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        loss_fn = torch.nn.CrossEntropyLoss()
        local_batch = batch_size // world
        steps = -(-share // local_batch)  # the same on every rank: the shares are equal
        evaluations: list[tuple[float, int, float]] = []
        stop = torch.zeros(1)
        for epoch in range(epochs):
            order = numpy.random.default_rng([seed, epoch, rank]).permutation(share)
            model.train()
            for step in range(steps):
                rows = numpy.sort(order[step * local_batch : (step + 1) * local_batch])
                features, labels = torch.from_numpy(X[rows]), torch.from_numpy(y[rows])
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(features), labels).backward()
                optimizer.step()
            if rank == 0:
                model.eval()
                with torch.no_grad():
                    right = sum(
                        int(
                            (
                                model.module(X_test[i : i + 65536]).argmax(dim=1)
                                == y_test[i : i + 65536]
                            ).sum()
                        )
                        for i in range(0, len(X_test), 65536)
                    )
                accuracy = right / len(X_test)
                evaluations.append((clock.time(), epoch + 1, accuracy))
                with open(os_env.path.join(folder, "evaluations.jsonl"), "a") as log:
                    log.write(json_lines.dumps(evaluations[-1]) + "\n")
                stop.fill_(1.0 if accuracy >= target else 0.0)
            dist.broadcast(stop, src=0)
            if stop.item():
                break
        return evaluations
    finally:
        dist.destroy_process_group()


def run_torch_distributor(spark, folder: Path, settings: Settings, one_machine: bool) -> Run:
    """TorchDistributor on the .npy files in ``folder``, one process per partition; with
    ``one_machine``, gloo on the loopback interface and the cores shared by the processes."""
    from pyspark.ml.torch.distributor import TorchDistributor

    log = folder / "evaluations.jsonl"
    log.unlink(missing_ok=True)
    threads = max(1, (os.cpu_count() or 1) // settings.partitions) if one_machine else 1
    interface = baselines._loopback_interface() if one_machine else None
    run = Run("torchdistributor", "epochs", time.time())
    with BudgetGuard(spark, "bench-train-torchdistributor", run.started + settings.budget) as guard:
        evaluations = TorchDistributor(
            num_processes=settings.partitions, local_mode=False, use_gpu=False
        ).run(
            distributed_training,
            str(folder),
            settings.layers,
            settings.lr,
            settings.batch_size,
            settings.epochs,
            settings.seed,
            settings.target,
            threads,
            interface,
        )
        run.evaluations = [tuple(entry) for entry in evaluations]
        run.stopped = (
            "target" if run.evaluations and run.evaluations[-1][2] >= settings.target else "epochs"
        )
    if guard.cut_short:
        run.stopped = "budget"
        if log.exists():  # what rank 0 evaluated before the cancel
            run.evaluations = [
                tuple(json.loads(line)) for line in log.read_text().splitlines() if line
            ]
    run.ended = time.time()
    return run


# ---- the table ---------------------------------------------------------------------------------


def summary_row(name: str, runs: list[Run], target: float, budget: float) -> tuple[str, ...]:
    """One table row from a contender's runs (medians over the rounds)."""
    label = CONTENDERS[name]
    if runs[0].problem:
        return (label, runs[0].problem, "", "", "", "")
    reached = [run.reached(target, budget) for run in runs]
    hits = [hit for hit in reached if hit is not None]
    bests = [best for best in (run.best(budget) for run in runs) if best is not None]
    best_text = accuracy_text(statistics.median(bests) if bests else None)
    if hits:
        seconds = f"{statistics.median(s for s, _ in hits):.1f}"
        if len(hits) < len(runs):
            seconds += f" ({len(hits)} of {len(runs)} rounds)"
        count = statistics.median(done for _, done in hits)
        to_target = f"{count:g} {runs[0].unit[:-1] if count == 1 else runs[0].unit}"
    else:
        seconds, to_target = f"not reached ({best_text})", ""
    totals = [run.total() for run in runs if run.total() is not None]
    ended = "/".join(dict.fromkeys(run.stopped for run in runs))
    return (
        label,
        seconds,
        to_target,
        best_text,
        f"{statistics.median(totals):.1f}" if totals else "",
        ended,
    )


def progress_line(run: Run, target: float, budget: float) -> str:
    """What a run did, for stderr: ``mlp: 0.8 at 7.6 s, best ..., 1:0.7990@6.0s 2:...`` (done:accuracy@seconds)."""
    if run.problem:
        return f"{run.contender}: {run.problem}"
    hit = run.reached(target, budget)
    return (
        f"{run.contender}: "
        + (f"{target:g} at {hit[0]:.1f} s" if hit else "target not reached")
        + f", best {accuracy_text(run.best(budget))}, {run.total():.1f} s in all ({run.stopped}); {run.unit} "
        + " ".join(
            f"{done}:{accuracy:.4f}@{at - run.started:.1f}s"
            for at, done, accuracy in run.evaluations
        )
    )


def accuracy_text(accuracy: float | None) -> str:
    return "none" if accuracy is None else f"{accuracy:.4f}"


def header(target: float) -> tuple[str, ...]:
    return (
        "contender",
        f"s to {target:g}",
        "to target",
        "best test accuracy",
        "total s",
        "ended at",
    )


# ---- main --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Race the contenders as the command line (``bench_train.py``'s, checked there) says; the
    exit status."""
    problem = java_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    data = Dataset(
        args.rows,
        args.classes,
        args.clusters,
        args.informative,
        args.noise,
        args.spread,
        args.test_fraction,
        args.seed,
    )
    torch_installed = importlib.util.find_spec("torch") is not None
    spark = local_spark(
        args.master,
        "allreduce-param train benchmark",
        CONF_DIR,
        **{"spark.driver.memory": args.driver_memory},
    )
    folder: Path | None = None
    try:
        train, test, counts, settings = prepare(spark, args, data)
        if torch_installed and "torchdistributor" in args.contender_names:
            # written once, not counted
            folder = Path(tempfile.mkdtemp(prefix="bench-train-", dir=args.scratch))
            write_npy(train, folder, "train")
            write_npy(test, folder, "test")
        contenders = contenders_of(spark, args, settings, train, test, folder)
        runs, failures = race(args, contenders, torch_installed)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        spark.stop()
    print_results(args, data, settings, counts, runs)
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0


def prepare(
    spark, args: argparse.Namespace, data: Dataset
) -> tuple[object, object, tuple[int, int], Settings]:
    """The train and test frames, generated and cached before any clock (and Spark's first-time
    costs paid, unless ``--no-warmup``), their row counts, and the contenders' settings."""
    partitions = spark.sparkContext.defaultParallelism
    train, test = generated_frames(spark, data)
    train, test = train.cache(), test.cache()
    counts = (train.count(), test.count())
    if counts[0] < args.batch_size:
        raise SystemExit(
            f"error: {counts[0]} training rows, fewer than --batch-size {args.batch_size}"
        )
    if not args.no_warmup:
        warm_up(train)
    settings = Settings(
        [data.features, *args.hidden_layers, data.classes],
        args.lr,
        args.batch_size,
        args.epochs,
        args.seed,
        args.target,
        args.budget,
        args.codec,
        args.mllib_iters_per_round,
        args.mllib_block_size,
        partitions,
    )
    return train, test, counts, settings


def contenders_of(
    spark, args: argparse.Namespace, settings: Settings, train, test, folder: Path | None
) -> dict[str, Callable[[], Run]]:
    """Each contender by name: a call that runs it once."""
    return {
        "mlp": lambda: run_ours(spark, "mlp", models.MLP(settings.layers), train, test, settings),
        "torchmodel": lambda: run_ours(
            spark,
            "torchmodel",
            models.TorchModel(torch_mlp(settings.layers)),
            train,
            test,
            settings,
        ),
        "mllib": lambda: run_mllib(spark, train, test, settings),
        "torchdistributor": lambda: run_torch_distributor(
            spark, folder, settings, one_machine=args.master.startswith("local")
        ),
    }


def race(
    args: argparse.Namespace, contenders: dict[str, Callable[[], Run]], torch_installed: bool
) -> tuple[dict[str, list[Run]], list[str]]:
    """``--rounds`` rounds of the contenders, each round starting one contender later: each
    one's runs by name, and the failures (a failed contender leaves the others running)."""
    names = args.contender_names
    runs: dict[str, list[Run]] = {name: [] for name in names}
    failures: list[str] = []
    for round_number in range(args.rounds):
        order = names[round_number % len(names) :] + names[: round_number % len(names)]
        for name in order:
            if name in NEEDS_TORCH and not torch_installed:
                runs[name].append(Run(name, "", time.time(), problem="torch not installed"))
                continue
            try:
                run = contenders[name]()
            except Exception as error:  # the others still run; the row and the exit status say so
                failures.append(f"{name}, round {round_number + 1}: {traceback.format_exc()}")
                run = Run(name, "", time.time(), problem=f"failed: {type(error).__name__}")
            runs[name].append(run)
            print(
                f"round {round_number + 1}, {progress_line(run, args.target, args.budget)}",
                file=sys.stderr,
                flush=True,
            )
    return runs, failures


def print_results(
    args: argparse.Namespace,
    data: Dataset,
    settings: Settings,
    counts: tuple[int, int],
    runs: dict[str, list[Run]],
) -> None:
    """The machine, the data, the model and the table: a row per contender."""
    train_rows, test_rows = counts
    print(f"machine: {machine()}")
    print(
        f"data: {data.describe()}; {train_rows:,} train / {test_rows:,} test rows, cached before timing; "
        f"Bayes accuracy {data.bayes_accuracy():.4f} (on the generator's first {min(BAYES_ROWS, data.rows):,} rows)"
    )
    layers = "-".join(map(str, settings.layers))
    print(
        f"model: MLP {layers} (ReLU); Adam lr {args.lr:g}, global batch {args.batch_size}, {args.epochs} epochs "
        f"at most, seed {args.seed}; MLlib L-BFGS in rounds of {args.mllib_iters_per_round} iterations, blockSize "
        f"{args.mllib_block_size}; "
        f"{settings.partitions} partitions / processes on {args.master}; codec {args.codec}"
    )
    print(
        f"time to test accuracy {args.target:g} from each contender's start (start-up included), budget "
        f"{args.budget:g} s each"
        + (
            f"; medians of {args.rounds} rounds, each starting one contender later"
            if args.rounds > 1
            else ""
        )
    )
    print(
        render(
            header(args.target),
            [
                summary_row(name, runs[name], args.target, args.budget)
                for name in args.contender_names
            ],
            left=1,
        )
    )
    sys.stdout.flush()
