"""One ``model_path`` belongs to one streaming query: a second query on it is refused before
it publishes anything, every publish checks the owner again, the published pointer never
goes back, and a reader loading the newest model while publishing prunes old ones gets a
whole model every time."""

from __future__ import annotations

import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from allreduce_param import (
    ConfigurationError,
    DistriOptimizer,
    InputError,
    TrainedModel,
    models,
    optim,
)
from allreduce_param.train.publish import OWNER, PublishedModels

SCHEMA = "features array<float>, label double"


def model_of(value: float, size: int = 4) -> TrainedModel:
    """A model whose weights are all ``value``: a reader can tell which publish it read."""
    return TrainedModel(models.LinearRegression(size - 1), np.full(size, value, np.float32))


def test_a_folder_belongs_to_the_query_that_claimed_it_and_every_publish_checks(tmp_path):
    folder = tmp_path / "models"
    first, second = PublishedModels(folder), PublishedModels(folder)
    first.claim("/queries/a")
    first.publish(model_of(0), 0, "/queries/a", {})
    first.claim("/queries/a")  # the same query, restarted: still its folder
    refusal = r"model_path=.*models' belongs to another streaming query, the one with "
    refusal += r"checkpoint_location='/queries/a' \(OWNER.json there says so\)"
    with pytest.raises(InputError, match=refusal):
        second.claim("/queries/b")
    with pytest.raises(InputError, match=refusal):
        second.publish(model_of(1), 1, "/queries/b", {})
    assert first.latest().batch_id == 0  # nothing of the refused publish left
    assert not [
        name for name in os.listdir(folder) if name.startswith((".tmp", "batch-0000000001"))
    ]

    # the owner record removed by hand and claimed by the other query: the first query's
    # next publish is refused, naming the new owner
    (folder / OWNER).unlink()
    second.claim("/queries/b")
    with pytest.raises(InputError, match="the one with checkpoint_location='/queries/b'"):
        first.publish(model_of(1), 1, "/queries/a", {})
    # and the pointer never goes back to an older micro-batch
    with pytest.raises(InputError, match="after micro-batch 0; publishing micro-batch 0 would"):
        second.publish(model_of(5), 0, "/queries/b", {})
    assert TrainedModel.load(folder).weights[0] == 0


def test_a_model_path_that_cannot_be_written_is_refused_before_anything_trains(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(ConfigurationError, match=r"model_path=.*a-file/models' cannot hold"):
        PublishedModels(tmp_path / "a-file" / "models").claim("/queries/a")


@pytest.mark.slow
def test_a_reader_loading_while_publishing_prunes_gets_the_newest_whole_model(tmp_path):
    folder, publishes, errors, seen = tmp_path / "models", 60, [], [[], [], []]
    published = PublishedModels(folder)
    published.claim("/queries/a")
    published.publish(model_of(0, 1 << 16), 0, "/queries/a", {})
    done = threading.Event()

    def read_all(loads: list) -> None:  # serving jobs' readers, while the fit publishes
        while not done.is_set():
            try:
                weights = TrainedModel.load(folder).weights
            except Exception as error:  # what a reader met, reported below
                errors.append(error)
                continue
            assert np.all(weights == weights[0])  # whole: one publish's weights
            loads.append(int(weights[0]))

    readers = [threading.Thread(target=read_all, args=(loads,)) for loads in seen]
    for reader in readers:
        reader.start()
    try:
        for batch in range(1, publishes):
            published.publish(model_of(batch, 1 << 16), batch, "/queries/a", {})
    finally:
        done.set()
        for reader in readers:
            reader.join(60)
    assert not errors, errors[:3]
    for loads in seen:  # each reader: never went back
        assert loads == sorted(loads) and len(loads) > 1


def write_batch(folder, index: int) -> None:
    """Micro-batch ``index``: 12 rows of 2 features, one parquet file, in file order."""
    rng = np.random.default_rng(index)
    features = rng.standard_normal((12, 2)).astype(np.float32)
    table = pa.table(
        {
            "features": pa.array([row.tolist() for row in features], pa.list_(pa.float32())),
            "label": pa.array((features[:, 0] > 0).astype(np.float64)),
        }
    )
    path = folder / f"batch-{index}.parquet"
    pq.write_table(table, path)
    os.utime(path, (1_700_000_000 + index, 1_700_000_000 + index))


@pytest.mark.slow
def test_a_second_query_on_a_model_path_stops_before_publishing_and_the_model_never_goes_back(
    spark, tmp_path
):
    source, folder = tmp_path / "in", tmp_path / "models"
    source.mkdir()
    for index in range(2):
        write_batch(source, index)
    trainer = DistriOptimizer(
        models.SoftmaxRegression(2, 2),
        optim.SGD(lr=0.1),
        batch_size=6,
        num_workers=2,
        progress=False,
    )
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(source))
    steps, errors, stop = [], [], threading.Event()

    def read_loop() -> None:  # a serving job's reader, while the first query publishes
        while not stop.wait(0.02):  # paced: the fit's driver thread needs the GIL too
            if (folder / "LATEST.json").exists():
                try:
                    steps.append(TrainedModel.load(folder).steps_done)
                except Exception as error:  # what the reader met, reported below
                    errors.append(error)

    reader = threading.Thread(target=read_loop)
    reader.start()
    first = trainer.fit_stream(
        stream, str(folder), str(tmp_path / "query-a"), trigger={"availableNow": True}
    )
    try:
        with pytest.raises(InputError, match=r"belongs to another streaming query, the one with "):
            trainer.fit_stream(
                stream, str(folder), str(tmp_path / "query-b"), trigger={"availableNow": True}
            )
        with pytest.raises(ConfigurationError, match="model_path=.* cannot hold"):
            trainer.fit_stream(
                stream, str(source / "batch-0.parquet" / "m"), str(tmp_path / "query-c")
            )
        assert first.awaitTermination(600)  # bounded: a query still running fails here
    finally:
        first.stop()
        stop.set()
        reader.join(30)
    assert [query.id for query in spark.streams.active] == []
    assert PublishedModels(folder).latest().batch_id == 1
    assert not errors, errors[:3]
    assert steps and steps == sorted(steps)  # the reader saw models, never going back
