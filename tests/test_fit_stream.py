"""DistriOptimizer.fit_stream on a file-source stream (parquet files in a temporary folder,
one per micro-batch): a model published after every micro-batch, each the continued fit of
the batches so far; a restart goes on at the next micro-batch and trains none twice; a
micro-batch that cannot train stops the query and publishes nothing."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import blobs
from pyspark import cloudpickle
from pyspark.errors import StreamingQueryException

from allreduce_param import DistriOptimizer, InputError, TrainedModel, models, optim
from allreduce_param.train.driver.streaming import StreamFit
from allreduce_param.train.publish import PublishedModels

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = "features array<float>, label double"
REPO = Path(__file__).resolve().parents[1]


def write_batch(folder, index: int, rows: int = 40) -> None:
    """Micro-batch ``index``'s rows as one parquet file, its modification time after the
    earlier files' (the file source takes files in that order)."""
    X, y = blobs(rows, 4, 3, seed=index) if rows else (np.zeros((0, 4), np.float32), [])
    table = pa.table(
        {
            "features": pa.array([row.tolist() for row in X], pa.list_(pa.float32())),
            "label": pa.array(np.asarray(y, np.float64)),
        }
    )
    path = folder / f"batch-{index}.parquet"
    pq.write_table(table, path)
    os.utime(path, (1_700_000_000 + index, 1_700_000_000 + index))


def trainer() -> DistriOptimizer:
    return DistriOptimizer(
        models.SoftmaxRegression(4, 3),
        optim.Adam(lr=0.05),
        batch_size=10,
        epochs=2,
        num_workers=2,
        partition_scheme="round_robin",
        progress=False,
        keep_optimizer_state=True,
    )


def run_stream(spark, source, published, checkpoint, seen: list, **arguments):
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(source))
    query = trainer().fit_stream(
        stream,
        str(published),
        str(checkpoint),
        on_model=lambda batch_id, trained: seen.append((batch_id, trained.weights.copy())),
        trigger={"availableNow": True},
        **arguments,
    )
    query.awaitTermination(120)
    return query


def chained(spark, source, count: int) -> list[np.ndarray]:
    """The weights after each of the first ``count`` batch files, each a fit continued from
    the last, on static DataFrames."""
    weights, model = [], None
    for index in range(count):
        batch = spark.read.schema(SCHEMA).parquet(str(source / f"batch-{index}.parquet"))
        model = trainer().fit(batch, initial=model)
        weights.append(model.weights)
    return weights


@pytest.mark.slow
def test_each_micro_batch_publishes_the_continued_fit_and_a_restart_trains_none_twice(
    spark, tmp_path
):
    source, published, checkpoint = tmp_path / "in", tmp_path / "models", tmp_path / "query"
    source.mkdir()
    for index in range(3):
        write_batch(source, index)
    seen: list = []
    run_stream(spark, source, published, checkpoint, seen)
    write_batch(source, 3)  # arrives while the query is down
    expected = chained(spark, source, 4)
    assert [batch_id for batch_id, _ in seen] == [0, 1, 2]
    for (_, weights), want in zip(seen, expected):
        assert np.array_equal(weights, want)
    assert np.array_equal(TrainedModel.load(published).weights, expected[2])
    assert PublishedModels(published).latest().batch_id == 2
    assert sorted(p.name for p in published.iterdir()) == [
        ".publish.lock",
        "LATEST.json",
        "OWNER.json",
        "batch-0000000001",
        "batch-0000000002",
    ]

    # restarted with the same query checkpoint: the next micro-batch alone, from the model
    seen.clear()
    run_stream(spark, source, published, checkpoint, seen)
    assert [batch_id for batch_id, _ in seen] == [3]
    assert np.array_equal(seen[0][1], expected[3])

    # killed after publishing micro-batch 3, before Spark recorded it done: Spark runs it
    # again after the restart, and the fit skips it
    for name in ("3", ".3.crc"):  # Hadoop's local file system keeps a checksum beside it
        (checkpoint / "commits" / name).unlink(missing_ok=True)
    seen.clear()
    run_stream(spark, source, published, checkpoint, seen)
    assert seen == []
    latest = PublishedModels(published).latest()
    assert latest.batch_id == 3
    assert np.array_equal(TrainedModel.load(published).weights, expected[3])

    # a micro-batch with no rows publishes nothing: with empty_batches="error" it stops the
    # query, naming it; by default it is passed over with a warning
    write_batch(source, 4, rows=0)
    with pytest.raises(StreamingQueryException, match="InputError: micro-batch 4 has no rows"):
        run_stream(spark, source, published, checkpoint, seen, empty_batches="error")
    assert seen == [] and PublishedModels(published).latest() == latest
    with pytest.warns(UserWarning, match="micro-batch 4 has no rows: .* passed over"):
        run_stream(spark, source, published, checkpoint, seen)
    assert seen == [] and PublishedModels(published).latest() == latest

    # the query checkpoint deleted and made anew: its batch ids would start at 0 again and
    # be passed over as trained, so the fit refuses to go on
    shutil.rmtree(checkpoint)
    with pytest.raises(StreamingQueryException, match="now holds the streaming query .* anew"):
        run_stream(spark, source, published, checkpoint, seen)
    assert seen == [] and PublishedModels(published).latest() == latest


@pytest.mark.slow
def test_bad_streams_and_batches_are_refused_naming_the_argument(spark, tmp_path):
    source = tmp_path / "in"
    source.mkdir()
    write_batch(source, 0)
    static = spark.read.schema(SCHEMA).parquet(str(source))
    with pytest.raises(InputError, match="fit_stream takes a streaming DataFrame"):
        trainer().fit_stream(static, str(tmp_path / "m"), str(tmp_path / "q"))
    stream = spark.readStream.schema(SCHEMA).parquet(str(source))
    with pytest.raises(InputError, match="fit_stream needs checkpoint_location"):
        trainer().fit_stream(stream, str(tmp_path / "m"), None)
    with pytest.raises(InputError, match="empty_batches must be 'skip' .* or 'error'"):
        trainer().fit_stream(stream, str(tmp_path / "m"), str(tmp_path / "q"), empty_batches="x")
    own = trainer()
    own.model = OwnModel(4)
    with pytest.raises(InputError, match=r"OwnModel.* saves only as a pickle.*allow_pickle=True"):
        own.fit_stream(stream, str(tmp_path / "m"), str(tmp_path / "q"))
    assert not (tmp_path / "m").exists()
    # a micro-batch whose columns differ from the model's: refused, nothing published
    published = PublishedModels(tmp_path / "models")
    batch_fit = StreamFit(
        trainer().fit, published, "q", ["features", "label"], {"features_col": "features"}
    )
    batch_fit(static, 0)
    doubles = static.selectExpr("cast(features as array<double>) as features", "label")
    with pytest.raises(InputError, match="micro-batch 1's training columns are .*array<double>"):
        batch_fit(doubles, 1)
    # a micro-batch the data checks refuse: the error says which micro-batch
    unlabelled = static.selectExpr("features", "cast('NaN' as double) as label")
    with pytest.raises(InputError, match=r"^micro-batch 1: the training data has 40 rows whose"):
        batch_fit(unlabelled, 1)
    assert published.latest().batch_id == 0
    # another query's published models, or a model to start from where some are published
    with pytest.raises(InputError, match="holds the models of the streaming query with"):
        trainer().fit_stream(stream, str(tmp_path / "models"), str(tmp_path / "other"))
    with pytest.raises(InputError, match="pass initial= only with a new model_path"):
        StreamFit(trainer().fit, published, "q", ["features"], {}, initial=batch_fit.model)
    shutil.rmtree(tmp_path / "models")


class OwnModel(models.LinearRegression):
    """A model of the caller's own: not one of the built-in classes, so it has no saved form
    without pickle."""


def test_a_model_of_ones_own_is_published_and_read_back_only_with_allow_pickle(tmp_path):
    trained = TrainedModel(OwnModel(3), np.arange(4, dtype=np.float32))
    with pytest.raises(InputError, match="saves only as a pickle"):
        PublishedModels(tmp_path / "refused").publish(trained, 0, "q", {})
    assert not any((tmp_path / "refused").iterdir())  # nothing half-published
    published = PublishedModels(tmp_path / "models", allow_pickle=True)
    published.publish(trained, 0, "q", {})
    loaded = published.load(published.latest())
    assert type(loaded.model) is OwnModel
    np.testing.assert_array_equal(loaded.weights, trained.weights)
    with pytest.raises(InputError, match="allow_pickle=True"):
        PublishedModels(tmp_path / "models").load(published.latest())


@pytest.mark.slow
def test_a_stream_job_file_trains_its_files_into_its_model_path(spark, tmp_path, capsys):
    from allreduce_param.cli import load_job, query_error, start_stream

    source = tmp_path / "in"
    source.mkdir()
    for index in range(2):
        write_batch(source, index)
    job = load_job(REPO / "conf" / "stream.toml")
    job["stream"].update(
        path=str(source),
        model_path=str(tmp_path / "live"),
        checkpoint_location=str(tmp_path / "query"),
    )
    job["model"].update(n_features=4, n_classes=3)
    job["train"]["batch_size"] = 10
    start_stream(spark, job).awaitTermination(120)
    assert PublishedModels(tmp_path / "live").latest().batch_id == 1
    assert TrainedModel.load(tmp_path / "live").epochs_done == 2
    printed = capsys.readouterr().out
    assert "micro-batch 0: trained, loss " in printed and "micro-batch 1: trained" in printed
    assert query_error("x\nE allreduce_param.errors.InputError: micro-batch 4 has no rows\n") == (
        "InputError: micro-batch 4 has no rows"
    )


def test_a_stream_job_files_bad_stream_section_fails_before_spark_starts(monkeypatch, capsys):
    from allreduce_param import cli

    def no_spark(*args, **kwargs):
        raise AssertionError("Spark started for a job whose settings are bad")

    monkeypatch.setattr(cli, "local_spark", no_spark)
    conf = str(REPO / "conf" / "stream.toml")
    assert cli.main(["stream", "--conf", conf, "--set", "stream.source=kafka"]) == 2
    assert "[stream] source = 'kafka' is not one of ('parquet'" in capsys.readouterr().err
    assert cli.main(["stream", "--conf", conf, "--set", "stream.every=3"]) == 2
    assert "[stream] has no key every; its keys are source, path" in capsys.readouterr().err
    assert cli.main(["stream", "--conf", conf, "--set", "stream.model_path=''"]) == 2
    assert "[stream] needs model_path;" in capsys.readouterr().err
