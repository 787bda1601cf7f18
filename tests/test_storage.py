"""Where a ``TrainedModel``'s files go (``train/storage.py``): a local path as always, any URL
fsspec opens, and on the driver any URL the SparkSession's Hadoop reaches.

The Hadoop route is tested on ``viewfs://``, a real Hadoop scheme that fsspec does not know:
its mount table, set in the session's Hadoop configuration, maps it to a local folder, so
the files Hadoop writes can be read back both ways on this machine, with no network."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from pyspark import cloudpickle

from allreduce_param import ConfigurationError, History, InputError, TrainedModel, models
from allreduce_param.train.storage import FsspecLocation, HadoopLocation, locate

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: only the driver's Hadoop is used: local[2] shares the session of the other local[2] modules
SPARK_MASTER = "local[2]"
REPO = Path(__file__).resolve().parents[1]


class Shifted:
    """A linear model with one buffer, the shift of its features, so that a save has all four
    files (a model of one's own: saved as a pickle, with ``allow_pickle=True``)."""

    def __init__(self, n_features: int) -> None:
        self.n_features = n_features
        self.shift = np.zeros(n_features)

    def init(self, rng):
        return np.zeros(self.n_features + 1, np.float32)

    def loss_and_grad(self, weights, X, y):
        raise NotImplementedError  # never trained here

    def predict(self, weights, X):
        return (X - self.shift.astype(np.float32)) @ weights[:-1] + weights[-1]

    def buffers(self):
        return {"shift": self.shift.copy()}

    def set_buffers(self, buffers):
        self.shift = np.array(buffers["shift"])


def trained(with_buffers: bool = True) -> TrainedModel:
    """A model as a fit would return it, with a short history."""
    history = History(
        steps=[
            {"epoch": 0, "step": step, "loss": 1.0 / (step + 1), "samples": 8} for step in range(6)
        ],
        epochs=[{"epoch": 0, "loss": 0.4, "val_loss": 0.5}],
        seconds=1.5,
    )
    if with_buffers:
        return TrainedModel(
            Shifted(3),
            np.array([1, 2, 3, 4], np.float32),
            history,
            n_features=3,
            buffers={"shift": np.array([0.5, -1.0, 2.0])},
        )
    return TrainedModel(
        models.LinearRegression(3), np.array([1, 2, 3, 4], np.float32), history, n_features=3
    )


def assert_same(loaded: TrainedModel, saved: TrainedModel) -> None:
    np.testing.assert_array_equal(loaded.weights, saved.weights)
    assert sorted(loaded.buffers) == sorted(saved.buffers)
    for name, value in saved.buffers.items():
        np.testing.assert_array_equal(loaded.buffers[name], value)
    assert (
        loaded.history.steps == saved.history.steps
        and loaded.history.epochs == saved.history.epochs
    )
    assert loaded.n_features == saved.n_features
    X = np.array([[1.0, 0.0, 2.0], [0.5, 0.5, 0.5]], np.float32)
    np.testing.assert_array_equal(loaded.predict_numpy(X), saved.predict_numpy(X))


def files(folder: Path) -> list[str]:
    """The files of a saved model's folder (Hadoop's local file system adds hidden .crc files)."""
    return sorted(name for name in os.listdir(folder) if not name.startswith("."))


@pytest.fixture
def viewfs(spark, tmp_path):
    """A ``viewfs://`` URL whose ``/models`` is ``tmp_path`` (the mount table set in the
    session's Hadoop configuration, under a cluster name of this test's own)."""
    cluster = f"allreduce-{uuid.uuid4().hex[:8]}"
    key = f"fs.viewfs.mounttable.{cluster}.link./models"
    configuration = spark.sparkContext._jsc.hadoopConfiguration()
    configuration.set(key, tmp_path.as_uri())
    yield f"viewfs://{cluster}/models"
    configuration.unset(key)


def test_a_relative_local_path_works_as_before(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = trained()
    model.save("out/model", allow_pickle=True)
    assert files(tmp_path / "out" / "model") == [
        "buffers.npz",
        "meta.json",
        "model.pkl",
        "weights.npy",
    ]
    assert_same(TrainedModel.load("out/model", allow_pickle=True), model)
    absolute = tmp_path / "out" / "model"  # a Path
    assert_same(TrainedModel.load(absolute, allow_pickle=True), model)
    exported = model.export_npz("out/tensors.npz")
    assert exported == Path("out/tensors.npz")
    with np.load(exported) as saved:
        assert sorted(saved.files) == ["shift", "weights"]
    assert model.history.plot("out/curves/loss.png") == Path("out/curves/loss.png")
    assert (tmp_path / "out" / "curves" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # the suffix names the format, as matplotlib's savefig takes it
    model.history.plot("out/curves/loss.svg")
    assert "<svg" in (tmp_path / "out" / "curves" / "loss.svg").read_text()
    trained(with_buffers=False).save("out/model")  # over the earlier save: its buffers go
    assert files(tmp_path / "out" / "model") == ["meta.json", "weights.npy"]
    assert TrainedModel.load("out/model").buffers == {}


def test_a_file_url_round_trip_writes_the_same_folder(tmp_path):
    model = trained()
    url = "file://" + str(tmp_path / "by-url")
    assert isinstance(locate(url, "save the model to"), FsspecLocation)
    model.save(url, allow_pickle=True)
    assert files(tmp_path / "by-url") == ["buffers.npz", "meta.json", "model.pkl", "weights.npy"]
    assert_same(TrainedModel.load(url, allow_pickle=True), model)
    # the same files, read as a local folder
    assert_same(TrainedModel.load(tmp_path / "by-url", allow_pickle=True), model)
    exported = model.export_npz(url + "/export/tensors.npz")
    assert exported == url + "/export/tensors.npz"
    with np.load(tmp_path / "by-url" / "export" / "tensors.npz") as saved:
        np.testing.assert_array_equal(saved["shift"], [0.5, -1.0, 2.0])


def test_a_url_fsspec_holds_in_memory_round_trips():
    model = trained()
    model.save("memory://allreduce-test/model", allow_pickle=True)
    assert_same(TrainedModel.load("memory://allreduce-test/model", allow_pickle=True), model)


def test_hadoop_writes_and_reads_a_scheme_fsspec_does_not_know(viewfs, tmp_path):
    model = trained()
    url = f"{viewfs}/model"
    assert isinstance(locate(url, "save the model to"), HadoopLocation)
    model.save(url, allow_pickle=True)
    assert files(tmp_path / "model") == ["buffers.npz", "meta.json", "model.pkl", "weights.npy"]
    # what Hadoop wrote, read from the disk
    assert_same(TrainedModel.load(tmp_path / "model", allow_pickle=True), model)
    assert_same(TrainedModel.load(url, allow_pickle=True), model)  # and back through Hadoop
    trained(with_buffers=False).save(url)  # over the earlier save: Hadoop removes its buffers
    assert files(tmp_path / "model") == ["meta.json", "weights.npy"]
    model.save(tmp_path / "local", allow_pickle=True)  # a local save, read through Hadoop
    assert_same(TrainedModel.load(f"{viewfs}/local", allow_pickle=True), model)
    assert model.export_npz(f"{viewfs}/export/tensors.npz") == f"{viewfs}/export/tensors.npz"
    with np.load(tmp_path / "export" / "tensors.npz") as saved:
        np.testing.assert_array_equal(saved["weights"], model.weights)
    model.history.plot(f"{viewfs}/loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_weights_larger_than_a_py4j_chunk_cross_whole(viewfs, tmp_path, monkeypatch):
    from allreduce_param.train import storage

    monkeypatch.setattr(storage, "_CHUNK", 1000)  # 100 chunks each way, and a last short one
    model = TrainedModel(models.LinearRegression(3), np.arange(25_001, dtype=np.float32))
    model.save(f"{viewfs}/big")
    np.testing.assert_array_equal(np.load(tmp_path / "big" / "weights.npy"), model.weights)
    np.testing.assert_array_equal(TrainedModel.load(f"{viewfs}/big").weights, model.weights)


def test_loading_what_is_not_there_names_the_path(viewfs, tmp_path):
    with pytest.raises(InputError, match=f"{viewfs}/missing does not exist"):
        TrainedModel.load(f"{viewfs}/missing")
    with pytest.raises(InputError, match="missing does not exist"):
        TrainedModel.load(tmp_path / "missing")
    with pytest.raises(InputError, match=r"/empty holds no saved model \(no meta.json\)"):
        (tmp_path / "empty").mkdir()
        TrainedModel.load(f"{viewfs}/empty")
    trained().save(f"{viewfs}/broken", allow_pickle=True)
    (tmp_path / "broken" / "weights.npy").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"broken/weights.npy: java.io.FileNotFoundException"
    ):
        TrainedModel.load(f"{viewfs}/broken", allow_pickle=True)


def test_a_scheme_nobody_knows_says_so_and_what_would_reach_it(spark, tmp_path, monkeypatch):
    with pytest.raises(
        ConfigurationError,
        match=r"cannot save the model to 'nosuch://x/model': fsspec cannot open it "
        r".*Protocol not known: nosuch.*Hadoop cannot either "
        r".*No FileSystem for scheme \"nosuch\".*connector for nosuch:",
    ):
        trained().save("nosuch://x/model")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigurationError,
        match=r"fsspec takes it for a local path.*No FileSystem for scheme \"dbfs\"",
    ):
        trained().save("dbfs:/models/m")
    assert os.listdir(tmp_path) == []  # not a local folder called "dbfs:"
    if importlib.util.find_spec("s3fs") is None:
        with pytest.raises(
            ConfigurationError,
            match=r"Install s3fs.*S3AFileSystem.*pip install s3fs.*connector for s3a:",
        ):
            TrainedModel.load("s3a://bucket/model")


def test_without_spark_the_error_says_to_install_or_start_one(tmp_path):
    program = (
        "from allreduce_param import TrainedModel\n"
        "for url in ('s3://bucket/model', 'viewfs://cluster/model'):\n"
        "    try:\n"
        "        TrainedModel.load(url)\n"
        "    except Exception as error:\n"
        "        print(type(error).__name__, error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    s3, viewfs = done.stdout.splitlines()
    assert s3.startswith(
        "ConfigurationError cannot load the model from 's3://bucket/model': fsspec cannot open it"
    )
    assert (
        "no classic SparkSession runs in this process" in s3 and "Either pip install s3fs, or" in s3
    )
    assert (
        "Protocol not known: viewfs" in viewfs
        and "a FileSystem for viewfs: (its connector)" in viewfs
    )


@pytest.mark.parametrize("where", ["hadoop", "memory"])
def test_published_models_are_renamed_into_place_and_the_pointer_names_the_newest(viewfs, where):
    from allreduce_param.train.publish import PublishedModels

    root = f"{viewfs}/live" if where == "hadoop" else "memory://allreduce-test/live"
    published = PublishedModels(root)
    assert published.latest() is None
    published.claim("/query")  # the owner record, placed only where none is
    published.claim("/query")
    with pytest.raises(InputError, match="belongs to another streaming query, the one with "):
        PublishedModels(root).claim("/other")
    for batch_id in (0, 1, 2):
        model = trained(with_buffers=False)
        model.weights = model.weights + batch_id
        model.optimizer_state, model.optimizer_kind = {"momentum": model.weights * 2}, "SGD"
        published.publish(model, batch_id, "/query", {"features": "array<float>"})
    latest = published.latest()
    assert (latest.batch_id, latest.folder, latest.query_checkpoint) == (
        2,
        "batch-0000000002",
        "/query",
    )
    assert sorted(published.root.names()) == [
        "LATEST.json",
        "OWNER.json",
        "batch-0000000001",
        "batch-0000000002",
    ]
    loaded = TrainedModel.load(root)  # the folder's newest model
    np.testing.assert_array_equal(loaded.weights, [3, 4, 5, 6])
    np.testing.assert_array_equal(loaded.optimizer_state["momentum"], [6, 8, 10, 12])
    published.root.remove_tree()
    assert not published.root.exists()
