"""What watches a fit on the driver: the ``tensorboard_dir`` setting's event files, read
back record by record, and a registered tracker, whose failure leaves the fit alone."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from allreduce_param import ConfigurationError, DistriOptimizer, FitSettings, models, optim
from allreduce_param.train.driver.watchers import register_tracker

SPARK_MASTER = "local[2]"


def events(folder):
    """Every scalar in ``folder``'s event files: {tag: [(step, value), ...]}, read as TFRecords
    (length, its CRC, the record, its CRC) of tensorboardX's ``Event`` protos."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


class Recording:
    """A tracker's watcher that keeps what it hears, and fails once the fit has ended."""

    def __init__(self):
        self.heard, self.closed = [], False

    def __call__(self, kind, fields):
        self.heard.append(kind)

    def finished(self, trained, fit):
        raise RuntimeError("the tracking server is down")

    def failed(self, error):
        self.heard.append("failed")

    def close(self):
        self.closed = True


@pytest.mark.slow
def test_tensorboard_events_hold_each_steps_loss_and_each_epochs_metrics(spark, tmp_path):
    pytest.importorskip("tensorboardX")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((48, 3)).astype(np.float32)
    y = X @ np.array([1.0, -2.0, 0.5], np.float32)
    data = spark.createDataFrame(
        [(x.tolist(), float(t)) for x, t in zip(X, y)], "features array<float>, label double"
    )
    watcher = Recording()
    register_tracker("recording", lambda fit: watcher)
    try:
        trained = DistriOptimizer(
            models.LinearRegression(3),
            optim.SGD(lr=0.05),
            batch_size=16,
            epochs=2,
            progress=False,
            tensorboard_dir=str(tmp_path / "tb"),
        ).fit(data, validation=data)
    finally:
        register_tracker("recording", None)
    scalars = events(tmp_path / "tb")
    steps = trained.history.steps
    assert [step for step, _ in scalars["train/loss"]] == list(range(len(steps)))
    np.testing.assert_allclose([v for _, v in scalars["train/loss"]], [s["loss"] for s in steps])
    np.testing.assert_allclose([v for _, v in scalars["train/learning_rate"]], 0.05)
    assert all(v > 0 for _, v in scalars["train/samples_per_s"])
    val = scalars["epoch/val_loss"]
    assert [step for step, _ in val] == [0, 1]
    np.testing.assert_allclose([v for _, v in val], [e["val_loss"] for e in trained.history.epochs])
    np.testing.assert_allclose(
        [v for _, v in scalars["epoch/loss"]],
        [e["loss"] for e in trained.history.epochs],
        rtol=1e-6,
    )
    assert len(scalars["fit/samples_per_s"]) == 1
    # the tracker heard the fit live, and its failure at the end left the fit's result alone
    assert watcher.heard.count("step") == len(steps) and watcher.closed


def test_the_watching_settings_are_checked():
    with pytest.raises(ConfigurationError, match="tracking must be True, False or None"):
        FitSettings(tracking="yes")
    with pytest.raises(ConfigurationError, match="tensorboard_dir must be a folder's path"):
        FitSettings(tensorboard_dir="")
    settings = FitSettings(tensorboard_dir="tb", tracking=False)
    assert FitSettings.of_flat(settings.as_flat()) == settings


MISSING = """
import sys
sys.modules["mlflow"] = sys.modules["tensorboardX"] = None  # as where neither is installed
from allreduce_param import ConfigurationError, FitSettings, models, optim
from allreduce_param.train.driver.watchers import WatchedFit, watchers_of

for changes in ({"tracking": True}, {"tensorboard_dir": sys.argv[1]}):
    fit = WatchedFit(models.LinearRegression(3), optim.SGD(lr=0.1), FitSettings(**changes), None,
                     "features", "label")
    try:
        watchers_of(fit)
    except ConfigurationError as error:
        print(error)
"""


@pytest.mark.slow  # a fresh interpreter's import of the package
def test_a_watching_setting_without_its_package_names_the_extra_to_install(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", MISSING, str(tmp_path / "tb")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "tracking=True logs the fit to mlflow, which is not installed here" in out
    assert "pip install 'allreduce-param[mlflow]', or set tracking=False" in out
    assert "writes TensorBoard event files with tensorboardX, which is not installed here" in out
    assert "pip install 'allreduce-param[tensorboard]'" in out
