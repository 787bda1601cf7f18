"""Strategies, sync frequencies and partition schemes in real fits on Spark (local[2], as a
laptop runs it): each trains the main job's digits model to 0.95; BSP is reproducible
under every scheme; wrong combinations fail on the driver, naming the setting."""

from __future__ import annotations

import numpy as np
import pytest

from allreduce_param import ConfigurationError, DistriOptimizer, models, optim
from allreduce_param.cli import load_data

#: Epochs of the fits that must reach 0.95 on the held-out digits: measured, every strategy,
#: frequency and scheme below holds 0.956 or more on every epoch from the 8th to the 20th,
#: 0.960-0.978 at the 12th (overlap_reshuffle, with half the epochs, 0.971 at the 6th); and
#: int8 and bf16 end within a tenth of a point of raw.
EPOCHS = 12


SPARK_MASTER = "local[2]"


@pytest.fixture(scope="module")
def digits(spark):
    train, test = load_data(spark, {"source": "digits", "test_fraction": 0.25, "seed": 0})
    train, test = train.cache(), test.cache()
    yield train, test
    train.unpersist()
    test.unpersist()


def trainer(**settings) -> DistriOptimizer:
    defaults = dict(batch_size=64, epochs=EPOCHS, codec="lz4", seed=0, progress=False)
    return DistriOptimizer(
        models.MLP([64, 128, 10]), optim.Adam(lr=2e-3), **{**defaults, **settings}
    )


SETTINGS = {
    "bsp": {},
    "bsp, backup_workers=1": {"backup_workers": 1},
    "ssp, staleness=3": {"strategy": "ssp", "staleness": 3},
    "asp": {"strategy": "asp"},
    "sync_every=4, models averaged": {"sync_every": 4},
    "sync_every='epoch', models averaged": {"sync_every": "epoch"},
    "sync_every=4, updates summed": {"sync_every": 4, "model_averaging": False},
    "contiguous": {"partition_scheme": "contiguous"},
    "round_robin": {"partition_scheme": "round_robin"},
    "random": {"partition_scheme": "random"},
    "overlap_reshuffle": {"partition_scheme": "overlap_reshuffle", "epochs": EPOCHS // 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_strategy_frequency_and_scheme_trains_digits_to_095(digits, name):
    train, test = digits
    result = trainer(**SETTINGS[name]).fit(train, validation=test)
    final = result.history.epochs[-1]
    assert final["val_accuracy"] >= 0.95, final
    assert len(result.history.epochs) == SETTINGS[name].get("epochs", EPOCHS)
    if name.startswith("ssp"):
        assert max(step["staleness"] for step in result.history.steps) <= 3
    if "backup" in name:  # each step went on with one of the two partitions' gradients
        assert all(step["dropped"] == 1 for step in result.history.steps)
        assert sum(result.history.dropped.values()) == len(result.history.steps)


@pytest.mark.parametrize(
    "scheme", ["as_is", "contiguous", "round_robin", "random", "overlap_reshuffle"]
)
def test_bsp_is_reproducible_under_every_scheme(digits, scheme):
    train, _ = digits
    fits = [trainer(epochs=2, codec="raw", partition_scheme=scheme).fit(train) for _ in range(2)]
    assert np.array_equal(fits[0].weights, fits[1].weights)
    assert fits[0].history.steps[-1]["loss"] == fits[1].history.steps[-1]["loss"]


def test_sync_every_1_is_the_default_bsp_bit_for_bit(digits):
    train, _ = digits
    default = trainer(epochs=2, codec="raw").fit(train)
    explicit = trainer(
        epochs=2, codec="raw", strategy="bsp", sync_every=1, partition_scheme="as_is"
    ).fit(train)
    assert np.array_equal(default.weights, explicit.weights)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"staleness": 2}, "staleness=2 goes with strategy='ssp', not strategy='bsp'"),
        ({"strategy": "ssp"}, "strategy='ssp' needs staleness=s"),
        ({"strategy": "asp", "backup_workers": 1}, "backup_workers=1 goes with strategy='bsp'"),
        (
            {"strategy": "asp", "sync_every": 4},
            "sync_every=4 \\(local SGD\\) goes with strategy='bsp'",
        ),
        (
            {"backup_workers": 1, "sync_every": "epoch"},
            "sync_every='epoch' .* not with strategy='bsp', backup_workers=1",
        ),
        ({"model_averaging": False}, "model_averaging goes with sync_every=k or 'epoch'"),
        (
            {"sync_every": 0},
            "sync_every must be a positive whole number of steps or 'epoch', got 0",
        ),
        (
            {"partition_scheme": "striped"},
            "partition_scheme='striped' is not a data-partition scheme",
        ),
        (
            {"codec": "topk"},
            "codec='topk' keeps only some values: .* pass codec='int8' .* gradient_codec='topk'",
        ),
        ({"gradient_codec": "top1"}, "unknown codec 'top1'"),
    ],
)
def test_wrong_combinations_fail_when_the_optimizer_is_made(settings, message):
    with pytest.raises(ConfigurationError, match=message):
        trainer(**settings)


def test_more_backup_workers_than_the_fit_has_fails_before_any_task(digits):
    train, _ = digits
    with pytest.raises(
        ConfigurationError, match="backup_workers=2 needs more than 2 workers, this fit has 2"
    ):
        trainer(backup_workers=2).fit(train)


@pytest.mark.slow
def test_lossy_codecs_with_error_feedback_train_digits_as_well_as_raw(digits):
    """The issue's bar: int8 (and bf16) within half a point of raw on the held-out digits."""
    train, test = digits
    accuracy = {
        codec: trainer(codec=codec).fit(train, validation=test).history.epochs[-1]["val_accuracy"]
        for codec in ("raw", "bf16", "int8")
    }
    assert accuracy["raw"] >= 0.95, accuracy
    assert accuracy["bf16"] >= accuracy["raw"] - 0.005, accuracy
    assert accuracy["int8"] >= accuracy["raw"] - 0.005, accuracy


@pytest.mark.slow
def test_top_k_gradients_with_error_feedback_train_digits_given_more_epochs(digits):
    """1 % of each gradient part per step, the rest carried over: slower per epoch, yet it
    learns (measured: about twice the epochs of int8 to 0.95 and to 0.97)."""
    train, test = digits
    history = (
        trainer(codec="int8", gradient_codec="topk", epochs=30).fit(train, validation=test).history
    )
    assert history.epochs[-1]["val_accuracy"] >= 0.95, history.epochs[-1]
