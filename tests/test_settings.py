"""FitSettings: the one list of a fit's settings that DistriOptimizer, the job files and the
Estimators share, each checked once."""

from __future__ import annotations

import dataclasses

import pytest

from allreduce_param import ConfigurationError, DistriOptimizer, FitSettings, models, optim
from allreduce_param.ml import AllReduceClassifier, AllReduceRegressor
from allreduce_param.train import (
    Checkpoints,
    EarlyStopping,
    NetworkSettings,
    Regularization,
)
from allreduce_param.train.settings import FLAT, estimator_params, flat_names


def test_defaults_and_changes_by_name():
    settings = FitSettings()
    assert (settings.batch_size, settings.epochs, settings.codec, settings.strategy) == (
        256,
        10,
        "lz4",
        "bsp",
    )
    changed = settings.replace(batch_size=64, strategy="ssp", staleness=2)
    assert (changed.batch_size, changed.strategy, changed.staleness) == (64, "ssp", 2)
    assert settings.batch_size == 256  # frozen: a change is a new object
    assert FitSettings.of(changed.as_dict()) == changed


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"epochs": 0}, "epochs must be a positive whole number, got 0"),
        ({"batch_size": True}, "batch_size must be a positive whole number, got True"),
        ({"codec": "zip"}, "zip"),
        (
            {"sync_every": 4, "strategy": "asp"},
            "sync_every=4 \\(local SGD\\) goes with strategy='bsp'",
        ),
        ({"checkpoints": {"dir": "ckpt"}}, "checkpoints must be a Checkpoints or None, got"),
        ({"network": None}, "network must be a NetworkSettings, got None"),
        ({"overlap": "sometimes"}, "overlap must be True, False or 'auto'"),
        ({"data_in": "ssd"}, "data_in must be 'memory', 'disk' or 'auto', got 'ssd'"),
        (
            {"partition_scheme": "hashed"},
            "partition_scheme='hashed' is not a data-partition scheme",
        ),
        (
            {"topology": "ring"},
            "topology must be one of 'auto', 'hierarchical', 'flat', got 'ring'",
        ),
        ({"topology": None}, "topology must be one of 'auto', 'hierarchical', 'flat', got None"),
        ({"fetch_threads": 0}, "fetch_threads must be a positive whole number, got 0"),
        ({"fetch_threads": -2}, "fetch_threads must be a positive whole number, got -2"),
        ({"fetch_threads": True}, "fetch_threads must be a positive whole number, got True"),
        ({"fetch_threads": 1.5}, "fetch_threads must be a positive whole number, got 1.5"),
        ({"fit_intercept": 0}, "fit_intercept must be True or False, got 0"),
    ],
)
def test_a_bad_setting_fails_when_made_naming_it(changes, message):
    with pytest.raises(ConfigurationError, match=message):
        FitSettings().replace(**changes)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Checkpoints("ckpt", every=0), "checkpoint_every must be a positive whole number"),
        (lambda: Checkpoints("ckpt", keep=0), "checkpoint_keep must be a whole number >= 1, got 0"),
        (lambda: Checkpoints(None), "checkpoint_dir must be a folder's path or URL, got None"),
        (lambda: EarlyStopping(0), "early_stopping_patience must be a whole number of epochs"),
        (lambda: EarlyStopping(None), "early_stopping_patience must be a whole number of epochs"),
        (lambda: EarlyStopping(2, -1.0), "early_stopping_min_delta must be a finite number >= 0"),
        (lambda: Regularization(-1.0), "reg_param must be a finite number >= 0, got -1.0"),
        (lambda: Regularization("0.1"), "reg_param must be a finite number >= 0, got '0.1'"),
        (
            lambda: Regularization(0.1, 1.2),
            "elastic_net_param must be a finite number in \\[0, 1\\]",
        ),
        (
            lambda: Regularization(standardization=1),
            "standardization must be True or False, got 1",
        ),
        (lambda: NetworkSettings(port_range="9-1"), "port_range='9-1'"),
        (lambda: NetworkSettings(connect_timeout=0), "connect_timeout must be a positive number"),
    ],
)
def test_each_group_checks_its_own_values_when_made(make, message):
    with pytest.raises(ConfigurationError, match=message):
        make()


def test_the_groups_hold_what_belongs_together_and_reach_the_trainer():
    settings = FitSettings(
        checkpoints=Checkpoints("ckpt", every=5),
        early_stopping=EarlyStopping(patience=3, min_delta=0.01),
        regularization=Regularization(reg_param=0.1, elastic_net_param=0.5),
        network=NetworkSettings(port_range="40000-40009"),
    )
    assert (settings.checkpoints.dir, settings.checkpoints.every, settings.checkpoints.keep) == (
        "ckpt",
        5,
        2,
    )
    assert Checkpoints("ckpt").every == "epoch" and Checkpoints("ckpt", every=None).every == "epoch"
    assert settings.early_stopping == EarlyStopping(3, 0.01)
    assert settings.regularization.penalty() == optim.ElasticNet(0.1, 0.5)
    # unset network settings stay unset: the fit reads them from Spark's settings
    assert settings.network.port_range == (40000, 40009) and settings.network.encrypt is None
    resolved = settings.network.resolved({"spark.allreduce.connectTimeout": "4"}.get)
    assert (resolved.connect_timeout, resolved.encrypt) == (4.0, False)
    trainer = DistriOptimizer(models.MLP([4, 8, 2]), optim.Adam(), settings)
    assert trainer.checkpoints == Checkpoints("ckpt", every=5)
    assert trainer.settings.replace(checkpoints=None).checkpoints is None


def test_the_flat_names_map_into_the_groups_in_one_place():
    """The job files' keys and the Estimators' Params are flat; ``of_flat`` groups them, with
    the messages the flat names have always had."""
    settings = FitSettings.of_flat(
        {
            "epochs": 3,
            "checkpoint_dir": "ckpt",
            "checkpoint_keep": 4,
            "early_stopping_patience": 2,
            "reg_param": 0.1,
            "standardization": False,
            "fit_intercept": False,
            "connect_timeout": 4,
            "encrypt": False,
        }
    )
    assert settings == FitSettings(
        epochs=3,
        checkpoints=Checkpoints("ckpt", keep=4),
        early_stopping=EarlyStopping(2),
        regularization=Regularization(0.1, standardization=False),
        fit_intercept=False,
        network=NetworkSettings(connect_timeout=4.0, encrypt=False),
    )
    # an optional group is left out where its first setting is unset
    assert FitSettings.of_flat({"checkpoint_keep": 3, "early_stopping_min_delta": 0.5}) == (
        FitSettings()
    )
    for flat, message in (
        ({"checkpoint_every": 5}, "checkpoint_every=5 goes with checkpoint_dir"),
        ({"early_stopping_min_delta": -1}, "early_stopping_min_delta must be a finite number"),
        ({"reg_param": -1.0}, "reg_param must be a finite number >= 0, got -1.0"),
        ({"encrypt": "on"}, "encrypt must be True, False or None"),
    ):
        with pytest.raises(ConfigurationError, match=message):
            FitSettings.of_flat(flat)
    grouped = {name for name in flat_names() if name in FLAT}
    assert grouped == set(FLAT) and not grouped & {f.name for f in dataclasses.fields(FitSettings)}


def test_an_unknown_name_is_refused_with_the_names_there_are():
    with pytest.raises(
        ConfigurationError, match="\\[train\\]: 'epoch' is not a setting; the settings are .*epochs"
    ):
        FitSettings.of_flat({"epoch": 3}, where="[train]")
    with pytest.raises(ConfigurationError, match="DistriOptimizer: 'bogus', 'lr' are not settings"):
        DistriOptimizer(models.MLP([4, 8, 2]), optim.Adam(), bogus=1, lr=0.1)
    # a flat name given where the groups are says which group holds it
    with pytest.raises(
        ConfigurationError,
        match="'checkpoint_dir' is not a setting; checkpoint_dir is checkpoints=Checkpoints"
        "\\(dir=...\\); the settings are",
    ):
        DistriOptimizer(models.MLP([4, 8, 2]), optim.Adam(), checkpoint_dir="ckpt")


def test_distri_optimizer_takes_a_settings_object_with_changes_by_name():
    settings = FitSettings(batch_size=32, epochs=3)
    trainer = DistriOptimizer(models.MLP([4, 8, 2]), optim.Adam(), settings, epochs=5, codec="raw")
    assert (trainer.batch_size, trainer.epochs, trainer.codec) == (32, 5, "raw")
    assert trainer.settings == settings.replace(epochs=5, codec="raw")
    with pytest.raises(ConfigurationError, match="settings must be a FitSettings, got dict"):
        DistriOptimizer(models.MLP([4, 8, 2]), optim.Adam(), {"epochs": 5})


def test_the_optimizers_settings_read_through_and_change_as_checked_copies():
    from allreduce_param.engine import Strategy

    trainer = DistriOptimizer(
        models.MLP([4, 8, 2]), optim.Adam(), gradient_codec=None, sync_every=2, strategy="bsp"
    )
    assert (trainer.codec, trainer.gradient_codec) == ("lz4", "lz4")
    assert isinstance(trainer.strategy, Strategy) and trainer.strategy.name == "bsp"
    assert trainer.model_averaging is True and trainer.checkpoints is None
    trainer.epochs = 7  # a new settings object, checked as one is made
    assert trainer.settings.epochs == 7 and trainer.epochs == 7
    with pytest.raises(ConfigurationError, match="epochs must be a positive whole number, got 0"):
        trainer.epochs = 0
    assert trainer.settings.epochs == 7
    with pytest.raises(AttributeError, match="no attribute 'bogus'"):
        trainer.bogus  # noqa: B018


def test_every_setting_the_estimators_have_is_a_param_with_its_default_getter_and_setter():
    specs = list(estimator_params())
    fields = {item.name: item for item in dataclasses.fields(FitSettings)}
    assert {spec.setting for spec in specs} == {
        name for name, item in fields.items() if item.metadata["estimator"]
    } | set(FLAT)
    defaults = {name: item.default for name, item in fields.items()}
    defaults.update({name: flat.default for name, flat in FLAT.items()})
    for estimator in (AllReduceClassifier(), AllReduceRegressor()):
        for spec in specs:
            title = spec.name[0].upper() + spec.name[1:]
            assert estimator.hasParam(spec.name), spec.name
            assert getattr(estimator, f"get{title}")() == defaults[spec.setting]
            assert getattr(estimator, f"set{title}") is not None
    assert {"maxEpochs", "showProgress", "batchSize", "checkpointKeep", "gradientCodec"} <= {
        s.name for s in specs
    }


def test_the_params_are_declared_in_class_bodies_as_the_generator_writes_them():
    """``ml_params.py`` is what ``python -m allreduce_param._params_source`` writes from the
    settings as they are (run it after changing a setting), and every setting with a Param
    is declared there, in a class body: none is made at import."""
    from allreduce_param import _params_source, ml_params

    assert _params_source.TARGET.read_text() == _params_source.source(), (
        "allreduce_param/ml_params.py is not current: run python -m allreduce_param._params_source"
    )
    for spec in estimator_params():
        title = spec.name[0].upper() + spec.name[1:]
        holder = getattr(ml_params, f"Has{title}")
        assert spec.name in vars(holder) and f"get{title}" in vars(holder), spec.name
        assert vars(holder)[spec.name].doc == spec.doc
        assert f"set{title}" in vars(ml_params.FitSettingSetters), spec.name
        assert issubclass(AllReduceClassifier, holder)


def test_the_estimators_params_reach_the_distri_optimizer():
    classifier = AllReduceClassifier(
        maxEpochs=3,
        codec="raw",
        timeout=60.0,
        verbose=True,
        numWorkers=2,
        stepSize=0.05,
        optimizer="sgd",
    )
    trainer = classifier._trainer(models.SoftmaxRegression(4, 3))
    assert trainer.settings == FitSettings(
        epochs=3, codec="raw", timeout=60.0, verbose=True, num_workers=2
    )
    assert trainer.optimizer == optim.SGD(lr=0.05)
    with pytest.raises(
        ConfigurationError, match="AllReduceClassifier has no Param 'epochs'; its Params are"
    ):
        AllReduceClassifier(epochs=3)
    with pytest.raises(
        ConfigurationError, match="AllReduceClassifier: maxEpochs must be a positive whole number"
    ):
        AllReduceClassifier(maxEpochs=0)._trainer(models.SoftmaxRegression(4, 3))


def test_topology_and_fetch_threads_are_settings_the_engine_gets_as_given():
    settings = FitSettings()
    # the engine's own defaults
    assert (settings.topology, settings.fetch_threads) == (
        "auto",
        None,
    )
    trainer = DistriOptimizer(models.MLP([4, 8, 2]), optim.Adam(), topology="flat", fetch_threads=2)
    assert (trainer.topology, trainer.fetch_threads) == ("flat", 2)
    assert FitSettings(topology="hierarchical", strategy="bsp").topology == "hierarchical"
    classifier = AllReduceClassifier(topology="hierarchical", fetchThreads=4)
    assert (classifier.getTopology(), classifier.getFetchThreads()) == ("hierarchical", 4)
    assert classifier._trainer(models.SoftmaxRegression(4, 3)).settings == FitSettings(
        topology="hierarchical", fetch_threads=4
    )
    with pytest.raises(
        ConfigurationError,
        match="AllReduceClassifier: fetchThreads must be a positive whole number, got 0",
    ):
        AllReduceClassifier(fetchThreads=0)._settings()


@pytest.mark.parametrize(
    "strategy, named, fix",
    [
        ({"strategy": "ssp", "staleness": 2}, "strategy='ssp'", "strategy='bsp'"),
        ({"strategy": "asp"}, "strategy='asp'", "strategy='bsp'"),
        ({"backup_workers": 1}, "strategy='bsp', backup_workers=1", "backup_workers=0"),
    ],
)
def test_a_hierarchical_topology_under_another_strategy_than_plain_bsp_fails_on_the_driver(
    strategy, named, fix
):
    """Refused when the settings are made, in the driver's process, naming the strategy
    setting that conflicts and what to change; "auto" under the same strategy is fine."""
    expected = (
        f"topology='hierarchical' goes with strategy='bsp' and no backup workers, not with {named}: .*"
        f"Leave topology='auto' \\(flat under {named}\\) or set {fix}$"
    )
    with pytest.raises(ConfigurationError, match=expected):
        FitSettings(topology="hierarchical", **strategy)
    with pytest.raises(ConfigurationError, match=expected):
        DistriOptimizer(models.MLP([4, 8, 2]), optim.Adam(), topology="hierarchical", **strategy)
    assert FitSettings(topology="auto", **strategy).topology == "auto"
    assert FitSettings(topology="flat", **strategy).topology == "flat"
    params = {"strategy": "strategy", "staleness": "staleness", "backup_workers": "backupWorkers"}
    classifier = AllReduceClassifier(
        topology="hierarchical", **{params[k]: v for k, v in strategy.items()}
    )
    with pytest.raises(
        ConfigurationError,
        match="AllReduceClassifier: topology='hierarchical' goes with "
        "strategy='bsp' and no backup workers, not with strategy=.*"
        f"or set {fix.replace('backup_workers', 'backupWorkers')}$",
    ):
        classifier._settings()


@pytest.mark.parametrize(
    "params, message",
    [
        ({"regParam": -0.5}, "AllReduceRegressor: regParam must be a finite number >= 0, got -0.5"),
        (
            {"elasticNetParam": 2.0},
            "AllReduceRegressor: elasticNetParam must be a finite number in \\[0, 1\\], got 2.0",
        ),
    ],
)
def test_a_bad_regularisation_param_is_named_as_the_estimators_param(params, message):
    with pytest.raises(ConfigurationError, match=message):
        AllReduceRegressor(**params)._settings()


def test_the_regularisation_params_are_mllibs_and_reach_the_settings():
    regressor = AllReduceRegressor(
        regParam=0.1, elasticNetParam=0.5, fitIntercept=False, standardization=False
    )
    assert (regressor.getRegParam(), regressor.getElasticNetParam()) == (0.1, 0.5)
    settings = regressor._settings()
    rule = settings.regularization
    assert (rule.reg_param, rule.elastic_net_param, settings.fit_intercept) == (0.1, 0.5, False)
    assert rule.penalty() == optim.ElasticNet(0.1, 0.5)
    defaults = AllReduceClassifier()
    assert (
        defaults.getRegParam(),
        defaults.getElasticNetParam(),
        defaults.getFitIntercept(),
        defaults.getStandardization(),
    ) == (0.0, 0.0, True, True)  # MLlib's defaults: no penalty
    assert defaults._settings().regularization.penalty() is None


def test_a_model_that_cannot_take_the_regularisation_is_refused_naming_the_setting():
    from allreduce_param.train import regularisation

    class Bare(models.MLP):  # no penalized(), no penalty_factors()
        penalized = None
        penalty_factors = None

    model = Bare([4, 8, 2])
    with pytest.raises(
        ConfigurationError, match="fit_intercept=False: the model .* has no penalized"
    ):
        regularisation.check_model(model, Regularization(), False, model.size)
    with pytest.raises(
        ConfigurationError, match="standardization=True with reg_param=0.1: .* no penalty_factors"
    ):
        regularisation.check_model(model, Regularization(0.1), True, model.size)
    # without standardization every coordinate is penalised, which needs nothing of the model
    regularisation.check_model(model, Regularization(0.1, standardization=False), True, model.size)
