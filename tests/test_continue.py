"""A fit continued from a TrainedModel (``fit(initial=...)``): the same bits as one longer
fit under BSP, through memory and through save/load; the start point that checkpoints
and models share; and bad starts refused on the driver, naming the argument."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import blobs
from pyspark import cloudpickle

from allreduce_param import (
    ConfigurationError,
    DistriOptimizer,
    FitSettings,
    InputError,
    TrainedModel,
    models,
    optim,
)
from allreduce_param.train import Checkpoints

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def data(spark):
    X, y = blobs(96, 5, 3, seed=4)
    return spark.createDataFrame(
        [(row.tolist(), float(label)) for row, label in zip(X, y)],
        "features array<float>, label double",
    ).repartition(3)


def trainer(epochs: int, **settings) -> DistriOptimizer:
    """Adam with a step schedule (the step count must go on across fits) on 3 workers."""
    schedule = optim.StepLR(step_size=5, gamma=0.5)
    return DistriOptimizer(
        models.SoftmaxRegression(5, 3),
        settings.pop("optimizer", optim.Adam(lr=0.05, schedule=schedule)),
        batch_size=16,
        epochs=epochs,
        num_workers=3,
        partition_scheme="round_robin",
        seed=7,
        progress=False,
        keep_optimizer_state=settings.pop("keep_optimizer_state", True),
        **settings,
    )


@pytest.fixture(scope="module")
def first(data):
    """A fit of 2 epochs that keeps its optimizer state: what the tests continue from."""
    return trainer(2).fit(data)


@pytest.fixture(scope="module")
def continued(data, first, tmp_path_factory):
    """``first`` saved and loaded, and a fit of 2 epochs more from the loaded model, keeping
    checkpoints: the continued fit that the tests compare with one longer fit and resume."""
    folder = tmp_path_factory.mktemp("continued")
    first.save(folder / "first")
    loaded = TrainedModel.load(folder / "first")
    keeping = trainer(2, checkpoints=Checkpoints(str(folder / "checkpoints"), keep=5))
    return loaded, keeping.fit(data, initial=loaded)


@pytest.mark.slow
def test_two_fits_of_k_epochs_are_one_fit_of_2k_bit_for_bit(data, first, continued):
    whole = trainer(4).fit(data)
    assert (first.steps_done, first.epochs_done) == (12, 2)
    assert sorted(first.optimizer_state) == ["exp_avg", "exp_avg_sq"]
    loaded, second = continued
    assert (loaded.steps_done, loaded.epochs_done, loaded.optimizer_kind) == (12, 2, "Adam")
    for name, value in first.optimizer_state.items():
        assert np.array_equal(loaded.optimizer_state[name], value)
    assert np.array_equal(second.weights, whole.weights)
    for name, value in whole.optimizer_state.items():
        assert np.array_equal(second.optimizer_state[name], value)
    assert (second.steps_done, second.epochs_done) == (24, 4)
    # the epochs are numbered on, and each step's loss is the longer fit's
    assert [e["epoch"] for e in second.history.epochs] == [2, 3]
    assert [s["loss"] for s in first.history.steps + second.history.steps] == [
        s["loss"] for s in whole.history.steps
    ]
    # without the optimizer's state the fit goes on from the weights, with a fresh one
    fresh = trainer(2, keep_optimizer_state=False).fit(data, initial=first)
    assert fresh.optimizer_state is None and not np.array_equal(fresh.weights, whole.weights)
    assert fresh.epochs_done == 4


@pytest.mark.slow
def test_a_continued_fits_checkpoint_resumes_as_that_fit(continued, data):
    """resume_from and initial are one mechanism: a checkpoint of a continued fit keeps its
    start's steps and epochs, so resuming from it ends where the continued fit ends."""
    _, second = continued
    middle = f"{second.history.checkpoints}/step-{6:010d}"  # after its first epoch
    resumed = trainer(2).fit(data, resume_from=middle)
    assert np.array_equal(resumed.weights, second.weights)
    assert (resumed.steps_done, resumed.epochs_done) == (24, 4)
    assert resumed.history.resumed == [6]


def test_bad_starts_are_refused_on_the_driver_naming_the_argument(data, first, tmp_path):
    with pytest.raises(InputError, match="both resume_from=.* and initial=: pass one"):
        trainer(1).fit(data, resume_from=str(tmp_path), initial=first)
    with pytest.raises(InputError, match="initial must be a TrainedModel .* got ndarray"):
        trainer(1).fit(data, initial=first.weights)
    other_kind = DistriOptimizer(models.MLP([5, 4, 3]), optim.Adam(lr=0.1), progress=False)
    with pytest.raises(InputError, match="initial holds a SoftmaxRegression model, this fit "):
        other_kind.fit(data, initial=first)
    with pytest.raises(InputError, match="initial holds 18 weights, this fit's model has 24"):
        DistriOptimizer(models.SoftmaxRegression(5, 4), optim.Adam(), progress=False).fit(
            data.selectExpr("features", "label"), initial=first
        )
    with pytest.raises(InputError, match="initial holds the state of a Adam optimizer"):
        trainer(1, optimizer=optim.SGD(lr=0.1, momentum=0.9)).fit(data, initial=first)
    unkept = TrainedModel(first.model, first.weights, first.history)  # no optimizer state
    with pytest.raises(InputError, match="keep_optimizer_state=True .* initial holds none"):
        trainer(1).fit(data, initial=unkept)
    with pytest.raises(ConfigurationError, match="keep_optimizer_state must be True or False"):
        FitSettings(keep_optimizer_state="yes")


@pytest.mark.slow
def test_an_estimator_continues_from_its_initial_model_saved_or_not(spark, tmp_path):
    from pyspark.ml.linalg import Vectors

    from allreduce_param.ml import AllReduceRegressionModel, AllReduceRegressor

    rng = np.random.default_rng(2)
    X = rng.standard_normal((80, 3))
    df = spark.createDataFrame(
        [(Vectors.dense(row), float(row @ [1.5, -2.0, 0.5] + 3)) for row in X],
        ["features", "label"],
    ).repartition(2)
    params = dict(stepSize=0.05, batchSize=20, seed=1, showProgress=False, numWorkers=2)
    regressor = AllReduceRegressor(keepOptimizerState=True, **params)
    whole = regressor.copy({regressor.maxEpochs: 2}).fit(df)
    first = regressor.copy({regressor.maxEpochs: 1}).fit(df)
    first.save(str(tmp_path / "first"))
    loaded = AllReduceRegressionModel.load(str(tmp_path / "first"))
    assert sorted(loaded.trained.optimizer_state) == ["exp_avg", "exp_avg_sq"]
    second = regressor.copy({regressor.maxEpochs: 1}).setInitialModel(loaded).fit(df)
    assert np.array_equal(second.weights, whole.weights)
    # the Estimator saves without its initial model (a Model is no JSON value)
    regressor.setInitialModel(first).save(str(tmp_path / "estimator"))
    assert AllReduceRegressor.load(str(tmp_path / "estimator")).getInitialModel() is None
    unkept = AllReduceRegressionModel(TrainedModel(first.trained.model, first.weights))
    with pytest.raises(InputError, match="keepOptimizerState=True .* but initialModel holds none"):
        regressor.copy({regressor.maxEpochs: 1}).setInitialModel(unkept).fit(df)


@pytest.mark.parametrize(
    "settings", [{}, {"strategy": "ssp", "staleness": 1}, {"sync_every": 2}], ids=str
)
def test_partitions_on_threads_continue_under_every_loop(settings):
    """Without Spark: the task's records of a kept state and of how far it came become the
    next fit's start. Plain BSP gives the longer fit's bits; the background owner's and
    local SGD's loops number their epochs and count their steps on alike."""
    from conftest import train_on_threads

    from allreduce_param.engine import AllReduceParameter
    from allreduce_param.train.records import OptimizerState, Reached, Steps
    from allreduce_param.train.start import StartPoint
    from allreduce_param.train.task.job import TrainingJob

    X, y = blobs(60, 5, 3, seed=1)
    parts = [(X[i::3], y[i::3]) for i in range(3)]
    model = models.SoftmaxRegression(5, 3)

    def run(epochs, start=None):
        fit = FitSettings(
            batch_size=12,
            epochs=epochs,
            seed=3,
            keep_optimizer_state=True,
            progress=False,
            **settings,
        )
        param = AllReduceParameter(
            3, model.size, codec="raw", timeout=60, strategy=fit.synchronisation
        )
        job = TrainingJob(
            model, optim.Adam(lr=0.05), param, fit, 5, False, start=start or StartPoint()
        )
        outputs = train_on_threads(job, parts)
        for output in outputs:
            assert isinstance(output, dict), output
        slices = [OptimizerState.decode(output["optimizer_state"]).state for output in outputs]
        state = {name: np.concatenate([s[name] for s in slices]) for name in slices[0]}
        reached = Reached.decode(outputs[0]["reached"], 3)
        weights = np.frombuffer(outputs[0]["weights"], np.float32).copy()
        epochs_seen = sorted({int(row[0]) for row in Steps.decode(outputs[0]["steps"], 3).table})
        return StartPoint(reached.steps, reached.epochs, weights=weights, state=state), epochs_seen

    whole, _ = run(4)
    first, seen = run(2)
    assert (first.steps_before, first.epochs_before, seen) == (10, 2, [0, 1])
    second, seen = run(2, first)
    assert (second.steps_before, second.epochs_before, seen) == (20, 4, [2, 3])
    if not settings:
        assert np.array_equal(second.weights, whole.weights)
        for name, value in whole.state.items():
            assert np.array_equal(second.state[name], value)


def test_continuing_into_fit_intercept_false_warns_of_the_intercepts_it_drops():
    """The task starts them at 0 (as MLlib's initialModel under fitIntercept=false); the
    driver says so where the initial model's were not 0, and only there."""
    import warnings

    from allreduce_param.train.driver.checks import check_initial
    from allreduce_param.train.result import TrainedModel

    model = models.MLP([5, 8, 3])
    weights = np.ones(model.size, np.float32)
    without = FitSettings(fit_intercept=False)
    with pytest.warns(UserWarning, match=r"fit_intercept=False: initial's 11 non-zero intercept"):
        check_initial(TrainedModel(model, weights), model, optim.SGD(lr=0.1), without)
    weights[~model.penalized()] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_initial(TrainedModel(model, weights), model, optim.SGD(lr=0.1), without)
        check_initial(TrainedModel(model, weights + 1), model, optim.SGD(lr=0.1), FitSettings())
