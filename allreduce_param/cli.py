"""The ``allreduce-param`` command: ``allreduce-param train --conf conf/digits.toml``, and
``allreduce-param stream --conf conf/stream.toml`` (a file source's micro-batches, each a
continued fit, published to a folder: ``DistriOptimizer.fit_stream``).

A job file (TOML) names the Spark master and its folder of Spark settings, the data, the
model, the optimizer and the training settings; see ``conf/digits.toml``. ``jobs/train.py``
runs the same with ``spark-submit`` or plain ``python``. Under ``spark-submit`` its own
settings apply (``--master``, ``--properties-file``, ``SPARK_CONF_DIR``), not the job
file's ``[spark] master`` and ``conf_dir``: that is how the same job file runs on this
machine and on a cluster.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from allreduce_param import models, optim
from allreduce_param.errors import AllReduceError, ConfigurationError
from allreduce_param.spark.arrow import float_lists
from allreduce_param.spark.info import SparkInfo
from allreduce_param.spark.session import local_spark, start_python_workers, under_spark_submit
from allreduce_param.spark.versions import from_arrow

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DATA_SOURCES = ("digits", "synthetic", "libsvm", "parquet")
#: the file formats a job file's [stream] reads as they arrive
STREAM_SOURCES = ("parquet", "json", "orc", "csv")
#: a job file's [stream] keys: those it needs, then those it may have
STREAM_NEEDS = ("source", "path", "schema", "model_path", "checkpoint_location")
STREAM_MAY = (
    "max_files_per_trigger",
    "interval",
    "features_col",
    "label_col",
    "weight_col",
    "empty_batches",
)


def load_job(path: str | Path) -> dict:
    """Read a job file; a missing file or bad TOML is a ConfigurationError naming it."""
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise ConfigurationError(f"no job file at {path}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigurationError(f"{path} is not valid TOML: {error}") from None


def apply_overrides(job: dict, overrides: list[str]) -> dict:
    """``section.key=value`` settings (the value in TOML syntax) laid over the job file."""
    for override in overrides:
        name, _, value = override.partition("=")
        section, _, key = name.strip().rpartition(".")
        if not section or not key or not value:
            raise ConfigurationError(
                f"--set {override!r}: write SECTION.KEY=VALUE, e.g. train.epochs=5"
            )
        try:
            parsed = tomllib.loads(f"value = {value}")["value"]
        except tomllib.TOMLDecodeError:
            parsed = value  # a bare word: take it as text
        job.setdefault(section, {})[key] = parsed
    return job


def build(namespace, section: dict, what: str) -> Any:
    """``section['kind']`` looked up in ``namespace`` and called with the other keys."""
    settings = dict(section)
    kind = settings.pop("kind", None)
    factory = getattr(namespace, str(kind), None)
    if kind is None or factory is None or kind.startswith("_"):
        choices = [name for name in getattr(namespace, "__all__", []) if name[0].isupper()]
        raise ConfigurationError(f"[{what}] kind = {kind!r} is not one of {choices}")
    schedule = settings.pop("schedule", None)
    if schedule is not None:
        settings["schedule"] = build(namespace, schedule, f"{what}.schedule")
    try:
        return factory(**settings)
    except TypeError as error:
        raise ConfigurationError(f"[{what}] {kind}: {error}") from None


def load_data(spark, section: dict):
    """(train, test) DataFrames with ``features`` and ``label`` columns, from the job's [data]."""
    source = section.get("source", "digits")
    seed = int(section.get("seed", 0))
    test_fraction = float(section.get("test_fraction", 0.25))
    if source == "digits":
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        X = (digits.data / 16.0).astype(np.float32)
        X_train, X_test, y_train, y_test = train_test_split(
            X, digits.target, test_size=test_fraction, random_state=seed, stratify=digits.target
        )
        return arrow_frame(spark, X_train, y_train), arrow_frame(spark, X_test, y_test)
    if source == "synthetic":
        frame = synthetic(
            spark,
            int(section.get("rows", 1_000_000)),
            int(section.get("features", 100)),
            int(section.get("classes", 10)),
            seed,
            int(section.get("partitions", 0)) or None,
        )
        return frame.randomSplit([1 - test_fraction, test_fraction], seed=seed)
    if source in ("libsvm", "parquet"):
        if "path" not in section:
            raise ConfigurationError(f"[data] source = {source!r} needs a path")
        frame = spark.read.format(source).load(section["path"])
        if "features_col" in section or "label_col" in section:
            frame = frame.withColumnRenamed(
                section.get("features_col", "features"), "features"
            ).withColumnRenamed(section.get("label_col", "label"), "label")
        return frame.randomSplit([1 - test_fraction, test_fraction], seed=seed)
    raise ConfigurationError(f"[data] source = {source!r} is not one of {DATA_SOURCES}")


def arrow_frame(spark, X: np.ndarray, y: np.ndarray):
    """A DataFrame ``features array<float>, label double`` of the rows of ``X`` and ``y``.

    Sent to Spark as Arrow: a DataFrame made from Python rows is read through Python workers
    every time a job scans it, and its first scan starts a Python daemon of its own.
    """
    import pyarrow as pa

    return from_arrow(
        spark, pa.table({"features": float_lists(X), "label": pa.array(np.asarray(y, np.float64))})
    )


def synthetic(
    spark, rows: int, features: int, classes: int, seed: int, partitions: int | None = None
):
    """A classification problem generated in the executors: Gaussian blobs, one per class."""
    import pyarrow as pa

    centres = np.random.default_rng(seed).standard_normal((classes, features)).astype(np.float32)

    def generate(batches):
        for batch in batches:
            ids = batch.column(0).to_numpy()
            if len(ids) == 0:
                continue
            rng = np.random.default_rng([seed, int(ids[0])])
            labels = rng.integers(0, classes, len(ids))
            X = centres[labels] + rng.standard_normal((len(ids), features)).astype(np.float32)
            yield pa.RecordBatch.from_arrays(
                [float_lists(X), pa.array(labels.astype(np.float64))], ["features", "label"]
            )

    numbers = spark.range(
        0, rows, numPartitions=partitions or SparkInfo(spark).default_parallelism()
    )
    return numbers.mapInArrow(generate, "features array<float>, label double")


def spark_conf_dir(job: dict, job_file: str | Path) -> Path | None:
    """The folder of Spark settings the job file names, or None.

    ``[spark] conf_dir`` (relative to the job file's folder, e.g. ``"local"`` for
    ``conf/local``): a folder with a ``spark-defaults.conf`` that ``local_spark`` reads. None
    when the job names none, and under ``spark-submit``, whose own settings apply: a job file
    made for this machine (loopback addresses) then runs on a cluster unchanged.
    """
    value = job.get("spark", {}).get("conf_dir")
    if value is None or under_spark_submit():
        return None
    if not isinstance(value, str) or not value:
        raise ConfigurationError(
            f"[spark] conf_dir = {value!r} in {job_file}: write a folder's path as text, "
            'relative to the job file\'s folder, e.g. conf_dir = "local"'
        )
    folder = (Path(job_file).resolve().parent / value).resolve()
    if not (folder / "spark-defaults.conf").is_file():
        raise ConfigurationError(
            f"[spark] conf_dir = {value!r} in {job_file}: {folder} has no spark-defaults.conf; "
            'name a folder that has one (relative to the job file\'s folder, e.g. "local" '
            "for conf/local), or remove the setting to start Spark with its defaults"
        )
    return folder


def stream_section(job: dict) -> dict:
    """The job file's ``[stream]``, checked before Spark starts: a ConfigurationError naming
    a missing or unknown key, or a source that is no file format it reads."""
    section = job.get("stream")
    if not isinstance(section, dict):
        raise ConfigurationError(
            "a stream job needs a [stream] section: source, path, schema, model_path and "
            "checkpoint_location (see conf/stream.toml)"
        )
    missing = [key for key in STREAM_NEEDS if not section.get(key)]
    unknown = sorted(set(section) - set(STREAM_NEEDS) - set(STREAM_MAY))
    if missing or unknown:
        problem = f"needs {', '.join(missing)}" if missing else f"has no key {', '.join(unknown)}"
        raise ConfigurationError(
            f"[stream] {problem}; its keys are {', '.join(STREAM_NEEDS + STREAM_MAY)}"
        )
    if section["source"] not in STREAM_SOURCES:
        raise ConfigurationError(
            f"[stream] source = {section['source']!r} is not one of {STREAM_SOURCES} (a file "
            "source; for Kafka, call DistriOptimizer.fit_stream: docs/training.md)"
        )
    return section


def start_stream(spark, job: dict):
    """Start a stream job's query on ``spark``: ``[stream]``'s files read as they arrive
    (``max_files_per_trigger`` a micro-batch), each micro-batch a fit of ``[model]``,
    ``[optimizer]`` and ``[train]`` continued from the last, published to ``model_path``;
    every micro-batch there now (``interval`` unset: Spark's ``availableNow``) or one
    every ``interval`` (``"1 minute"``). The ``StreamingQuery``."""
    from allreduce_param.train import DistriOptimizer, FitSettings

    section = stream_section(job)
    settings = FitSettings.of_flat(job.get("train", {}), where="[train]")
    model = build(models, job.get("model", {"kind": "MLP", "layers": [64, 128, 10]}), "model")
    optimizer = build(optim, job.get("optimizer", {"kind": "Adam", "lr": 1e-3}), "optimizer")
    reader = spark.readStream.schema(section["schema"]).format(section["source"])
    if section.get("max_files_per_trigger"):
        reader = reader.option("maxFilesPerTrigger", int(section["max_files_per_trigger"]))
    interval = section.get("interval")
    model_path = section["model_path"]

    def published(batch_id: int, trained) -> None:
        epoch = trained.history.epochs[-1] if trained.history.epochs else {}
        loss = epoch.get("loss")
        shown = f", loss {loss:.4f}" if isinstance(loss, float) else ""
        print(f"micro-batch {batch_id}: trained{shown}; published to {model_path}", flush=True)

    return DistriOptimizer(model, optimizer, settings).fit_stream(
        reader.load(section["path"]),
        model_path,
        section["checkpoint_location"],
        features_col=section.get("features_col", "features"),
        label_col=section.get("label_col", "label"),
        weight_col=section.get("weight_col"),
        on_model=published,
        empty_batches=section.get("empty_batches", "skip"),
        trigger={"processingTime": interval} if interval else {"availableNow": True},
    )


def stream(job: dict, conf_dir: Path | None, master: str | None = None) -> int:
    """Run a stream job file until its query ends (``availableNow``: when the files there
    now are trained on) or fails; the exit status."""
    from allreduce_param.train import FitSettings

    stream_section(job)  # bad settings fail before Spark starts
    FitSettings.of_flat(job.get("train", {}), where="[train]")
    spark = _session(job, conf_dir, master, "allreduce-param stream")
    try:
        query = start_stream(spark, job)
        try:
            query.awaitTermination()
        except Exception as error:  # the query's failure: one line, the cause ours names
            print(f"error: {query_error(str(error))}", file=sys.stderr)
            return 2
    finally:
        spark.stop()
    return 0


def query_error(text: str) -> str:
    """What a failed streaming query's error says, in one line: the package's error inside
    it (``micro-batch 4 has no rows: ...``), else its first line."""
    ours = re.findall(r"allreduce_param\.errors\.(\w+): ([^\n]*)", text)
    if ours:
        return f"{ours[-1][0]}: {ours[-1][1]}"
    return text.strip().splitlines()[0] if text.strip() else "the streaming query failed"


def _session(job: dict, conf_dir: Path | None, master: str | None, app_name: str):
    """The job's Spark session: ``[spark]``'s master (unless ``master`` or spark-submit's
    wins), app name and class archive, with ``conf_dir``'s settings."""
    spark_section = job.get("spark", {})
    if not master and not under_spark_submit():  # under spark-submit, its --master wins
        master = spark_section.get("master", "local[*]")
    return local_spark(
        master,
        spark_section.get("app_name", app_name),
        conf_dir,
        class_archive=spark_section.get("class_archive", True),
    )


def train(job: dict, conf_dir: Path | None, master: str | None = None) -> int:
    """Run a training job file's fit and print the final table; the exit status.

    ``conf_dir``: the folder of Spark settings (``spark_conf_dir``), or None for Spark's own.
    """
    from allreduce_param.train import DistriOptimizer, FitSettings

    settings = job.get("train", {})
    # a bad setting fails before Spark starts
    fit_settings = FitSettings.of_flat(settings, where="[train]")
    spark = _session(job, conf_dir, master, "allreduce-param train")
    warming = start_python_workers(spark)  # while the data loads on the driver
    try:
        train_df, test_df = load_data(spark, job.get("data", {}))
        model = build(models, job.get("model", {"kind": "MLP", "layers": [64, 128, 10]}), "model")
        optimizer = build(optim, job.get("optimizer", {"kind": "Adam", "lr": 1e-3}), "optimizer")
        trainer = DistriOptimizer(model, optimizer, fit_settings)
        print(f"training {model!r} with {optimizer!r}; {settings}", flush=True)
        started = time.perf_counter()
        result = trainer.fit(train_df, validation=test_df)
        elapsed = time.perf_counter() - started
        final = result.history.epochs[-1]
        metric = "accuracy" if model.task == "classification" else "rmse"
        print_table(
            [
                ("train " + metric, f"{final.get('train_' + metric, float('nan')):.4f}"),
                ("test " + metric, f"{final.get('val_' + metric, float('nan')):.4f}"),
                ("train loss", f"{final.get('train_loss', float('nan')):.4f}"),
                ("epochs", str(len(result.history.epochs))),
                ("steps", str(len(result.history.steps))),
                ("time", f"{elapsed:.1f} s"),
                ("samples/s", f"{result.history.samples_per_second:,.0f}"),
            ]
        )
        output = job.get("output", {})
        if output.get("model_path"):
            result.save(output["model_path"])
            print(f"model written to {output['model_path']}")
        if output.get("loss_curve"):
            print(f"loss curve written to {result.history.plot(output['loss_curve'])}")
    finally:
        warming.join()
        spark.stop()
    return 0


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    value_width = max(len(value) for _, value in rows)
    print("+" + "-" * (width + 2) + "+" + "-" * (value_width + 2) + "+")
    for name, value in rows:
        print(f"| {name.ljust(width)} | {value.rjust(value_width)} |")
    print("+" + "-" * (width + 2) + "+" + "-" * (value_width + 2) + "+")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="allreduce-param", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text, example in (
        ("train", "train a model from a job file", "conf/digits.toml"),
        (
            "stream",
            "train on a stream of files as they arrive, from a job file",
            "conf/stream.toml",
        ),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--conf", required=True, help=f"the job file (TOML), e.g. {example}")
        command.add_argument("--master", help="override the job's Spark master")
        command.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override one setting of the job file, e.g. train.epochs=5 (repeatable)",
        )
    args = parser.parse_args(argv)
    try:  # no Java, bad settings, bad data: one line, no traceback (local_spark checks Java)
        job = apply_overrides(load_job(args.conf), args.set)
        run = stream if args.command == "stream" else train
        return run(job, spark_conf_dir(job, args.conf), args.master)
    except AllReduceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
