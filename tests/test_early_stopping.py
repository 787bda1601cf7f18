"""Early stopping on partitions run as threads: every partition stops after the same epoch,
the best epoch's weights are the ones returned, and checkpoints carry the count across a
resume. The data overfits on purpose: the validation targets follow another line than the
training targets, so the validation loss falls, then rises as the model fits the training rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import raise_first, train_on_threads

from allreduce_param import ConfigurationError, FitSettings, models, optim
from allreduce_param.engine import AllReduceParameter
from allreduce_param.train import EarlyStopping
from allreduce_param.train.checkpoint import CheckpointSettings, newest
from allreduce_param.train.result import STEP_FIELDS, History
from allreduce_param.train.start import StartPoint
from allreduce_param.train.task.job import TrainingJob

STEPS_PER_EPOCH = 5  # 80 training rows, batches of 16


def parts_of(partitions: int) -> list:
    """(X, y, split) per partition: 120 rows, every third one a validation row."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((120, 2)).astype(np.float32)
    split = (np.arange(120) % 3 == 0).astype(np.int32)
    y = np.where(
        split == 1,
        X @ np.array([1.0, -0.5]),
        X @ np.array([2.0, -1.0]) + 0.1 * rng.standard_normal(120),
    )
    return [(X[i::partitions], y[i::partitions], split[i::partitions]) for i in range(partitions)]


def job_for(
    parts, epochs=30, patience=2, min_delta=0.0, directory=None, resume=None, **settings
) -> TrainingJob:
    model = models.LinearRegression(2)
    param = AllReduceParameter(len(parts), model.size, codec="raw", timeout=60)
    checkpoints = None if directory is None else CheckpointSettings(str(directory), "epoch", 100)
    early = None if patience is None else EarlyStopping(patience, min_delta)
    return TrainingJob(
        model,
        optim.SGD(lr=0.05),
        param,
        FitSettings(
            batch_size=16, epochs=epochs, seed=1, threads=None, early_stopping=early, **settings
        ),
        n_features=2,
        has_validation=True,
        checkpoints=checkpoints,
        start=StartPoint() if resume is None else StartPoint.of_checkpoint(resume),
    )


def fit(job: TrainingJob, parts) -> tuple[np.ndarray, History, list[dict]]:
    """The returned weights, the merged history, each partition's records."""
    outputs = raise_first(train_on_threads(job, parts))
    steps = [np.frombuffer(o["steps"], np.float64).reshape(-1, len(STEP_FIELDS)) for o in outputs]
    history = History.from_records(
        steps, [share for o in outputs for share in json.loads(o["epochs"])], 0.0
    )
    return np.frombuffer(outputs[0]["weights"], np.float32), history, outputs


def test_the_fit_stops_once_the_validation_loss_stops_improving_and_keeps_the_best_weights():
    parts = parts_of(2)
    weights, history, outputs = fit(job_for(parts, patience=2), parts)
    losses = [epoch["val_loss"] for epoch in history.epochs]
    best = int(np.argmin(losses))
    assert history.stopped_early and history.best_epoch == best
    # it improved for a while, then stopped well before the end
    assert 0 < best < len(losses) - 1 < 29
    assert len(losses) == best + 3  # two epochs without improvement: patience=2
    assert all(loss > losses[best] for loss in losses[best + 1 :])
    assert [epoch["best_epoch"] for epoch in history.epochs] == [
        int(np.argmin(losses[: e + 1])) for e in range(len(losses))
    ]
    for output in outputs:  # every partition stopped at the same step
        assert len(np.frombuffer(output["steps"], np.float64)) == len(
            losses
        ) * STEPS_PER_EPOCH * len(STEP_FIELDS)
    # the weights are exactly those of a fit that ran to the best epoch and no further
    shorter, shorter_history, _ = fit(job_for(parts, epochs=best + 1, patience=None), parts)
    assert np.array_equal(weights, shorter)
    assert shorter_history.best_epoch is None and not shorter_history.stopped_early
    # and the final training metrics are theirs
    X, y = (np.concatenate([part[k][part[2] == 0] for part in parts]) for k in range(2))
    loss_sum, _, count = models.LinearRegression(2).loss_and_grad(weights, X, y)
    assert history.epochs[-1]["train_loss"] == pytest.approx(loss_sum / count, rel=1e-6)


def test_a_fit_that_runs_all_its_epochs_still_returns_the_best_ones():
    parts = parts_of(2)
    weights, history, _ = fit(job_for(parts, epochs=6, patience=10), parts)
    assert len(history.epochs) == 6 and not history.stopped_early
    best = history.best_epoch
    assert best == int(np.argmin([epoch["val_loss"] for epoch in history.epochs])) < 5
    shorter, _, _ = fit(job_for(parts, epochs=best + 1, patience=None), parts)
    assert np.array_equal(weights, shorter)


def test_min_delta_asks_for_a_real_improvement():
    parts = parts_of(2)
    # nothing beats epoch 0 by that
    _, history, _ = fit(job_for(parts, patience=1, min_delta=1e9), parts)
    assert history.best_epoch == 0 and history.stopped_early and len(history.epochs) == 2


def test_local_sgd_stops_at_a_sync_with_the_best_synced_weights():
    parts = parts_of(2)
    weights, history, _ = fit(job_for(parts, patience=2, sync_every="epoch"), parts)
    assert history.stopped_early and len(history.epochs) == history.best_epoch + 3
    shorter, _, _ = fit(
        job_for(parts, epochs=history.best_epoch + 1, patience=None, sync_every="epoch"), parts
    )
    assert np.array_equal(weights, shorter)


@pytest.mark.parametrize("workers", [2, 3])
def test_a_fit_resumed_from_a_checkpoint_after_its_best_epoch_stops_alike(tmp_path, workers):
    parts = parts_of(2)
    whole_weights, whole, _ = fit(job_for(parts, directory=tmp_path / "whole", patience=3), parts)
    best = whole.best_epoch
    assert whole.stopped_early and len(whole.epochs) == best + 4
    # a BSP checkpoint at an epoch's end comes before that epoch's evaluation: the one after
    # epoch best+2 has seen best+1 fail to improve, once
    after = newest(str(tmp_path / "whole" / f"step-{(best + 3) * STEPS_PER_EPOCH:010d}"))
    assert after.early_stopping == {
        "best_loss": pytest.approx(whole.epochs[best]["val_loss"], rel=1e-6),
        "best_epoch": best,
        "since_best": 1,
    }
    others = parts_of(workers)
    weights, history, _ = fit(
        job_for(others, directory=tmp_path / "resumed", patience=3, resume=after), others
    )
    assert history.stopped_early and history.best_epoch == best
    assert history.epochs[-1]["epoch"] == whole.epochs[-1]["epoch"]
    # the best weights came back from the checkpoint's parts
    assert np.array_equal(weights, whole_weights)


def test_settings_are_checked_where_they_are_made():
    for patience in (0, -1, 1.5, True, "3"):
        with pytest.raises(
            ConfigurationError, match="early_stopping_patience must be a whole number"
        ):
            FitSettings(early_stopping=EarlyStopping(patience))
    for delta in (-0.1, float("nan"), float("inf"), "0"):
        with pytest.raises(
            ConfigurationError, match="early_stopping_min_delta must be a finite number >= 0"
        ):
            FitSettings(early_stopping=EarlyStopping(2, delta))
    with pytest.raises(
        ConfigurationError,
        match=r"goes with strategy='bsp' and no backup workers .* "
        r"strategy='ssp'",
    ):
        FitSettings(early_stopping=EarlyStopping(2), strategy="ssp", staleness=1)
    with pytest.raises(ConfigurationError, match=r"strategy='bsp', backup_workers=1"):
        FitSettings(early_stopping=EarlyStopping(2), backup_workers=1)
    local_sgd = FitSettings(early_stopping=EarlyStopping(2), sync_every="epoch")
    assert local_sgd.early_stopping.patience == 2
