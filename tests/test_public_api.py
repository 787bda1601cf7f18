"""The public API: the top level's names (the trainer's, at most 20), the engine's API page,
a handle's calls (at most 12), Params, job keys.

The lists of settings and Params were read off the package before the redesign (commit
57978c3) and may grow, never shrink; the names are those of issue 39's smaller surface.
Spark-free: the Estimators' Params are read from their classes.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

import allreduce_param
from allreduce_param.engine import (
    AllReduceParameter,
    ConnectedParameter,
    LocalRendezvous,
)

#: the top level: the trainer's names and the errors a fit's caller catches (at most 20)
PUBLIC = """DistriOptimizer FitSettings Checkpoints EarlyStopping Regularization NetworkSettings
TrainedModel History models optim ml AllReduceError
TrainingError InputError ConfigurationError UsageError DamagedCheckpointError PeerLostError
FetchTimeoutError NetworkError""".split()

#: the engine's API page, allreduce_param.engine
ENGINE = """AllReduceParameter ConnectedParameter GradientStream EncodedStream SparseGradient
EncodedGradient GradientPutPlan CODECS Strategy STRATEGIES SliceLayout NetworkSettings Rendezvous
StaticRendezvous LocalRendezvous AllReduceError AuthenticationError CodecOverflowError
ConfigurationError CorruptBlockError FetchTimeoutError InputError NetworkError
NonFiniteGradientError PeerLostError ProtocolError StaleVersionError StoreClosedError
UsageError""".split()

FIT_SETTINGS = """batch_size epochs codec gradient_codec num_workers threads seed timeout progress
log_path listener strategy staleness backup_workers sync_every model_averaging partition_scheme
checkpoints verbose overlap data_in network topology fetch_threads early_stopping
regularization fit_intercept gpus_per_task sparse_sync keep_optimizer_state""".split()

#: the job files' keys: FitSettings.of_flat's names (a group's settings flat)
JOB_FILE_KEYS = """batch_size epochs codec gradient_codec num_workers threads seed timeout progress
log_path listener strategy staleness backup_workers sync_every model_averaging partition_scheme
checkpoint_dir checkpoint_every checkpoint_keep verbose overlap data_in bind_address advertise_address
port_range connect_timeout encrypt topology fetch_threads early_stopping_patience
early_stopping_min_delta reg_param elastic_net_param fit_intercept standardization
gpus_per_task sparse_sync keep_optimizer_state""".split()

REGRESSOR_PARAMS = """advertiseAddress backupWorkers batchSize bindAddress checkpointDir
checkpointEvery checkpointKeep codec connectTimeout dataIn earlyStoppingMinDelta earlyStoppingPatience
elasticNetParam fitIntercept regParam standardization encrypt featuresCol fetchThreads
gradientCodec hiddenLayers labelCol logPath maxEpochs
modelAveraging numWorkers optimizer overlap partitionScheme portRange predictionCol seed
showProgress sparseSync staleness stepSize strategy syncEvery timeout topology validationIndicatorCol
verbose weightCol gpusPerTask keepOptimizerState initialModel""".split()
CLASSIFIER_PARAMS = REGRESSOR_PARAMS + "probabilityCol rawPredictionCol thresholds".split()

#: a handle's public members, all of them (methods, properties, attributes): at most 12
CONNECTED_CALLS = """init get_weights put_gradients aggregate_gradient_partition
send_weight_partition weight_partition gradient_buffer stream_gradients close info collectives
background""".split()
#: what the objects a handle hands out hold
HANDED_OUT = {
    "info": """partition_id partition_num layout strategy slice_start slice_length
    last_read_version remote_peers hosts connections host_arena hierarchical
    gradient_put_plan""".split(),
    "collectives": "allreduce allreduce_exact signal wait_for_signals".split(),
    "background": "serve_updates finish_updates updates".split(),
}

#: AllReduceParameter's parameters, all of them: the network's five are one NetworkSettings
PARAMETER_KEYWORDS = """partition_num size codec timeout fetch_threads allow_nonfinite
unix_sockets shared_memory host_arena param_id strategy gradient_codec topology network""".split()

FIT_ARGUMENTS = "data features_col label_col validation resume_from weight_col initial".split()

FIT_STREAM_ARGUMENTS = """stream model_path checkpoint_location features_col label_col weight_col
initial on_model trigger query_name empty_batches allow_pickle""".split()

#: what a TrainedModel holds for a later fit to continue from
TRAINED_MODEL_FIELDS = "steps_done epochs_done optimizer_state optimizer_kind".split()

#: TorchModel's keywords (needs torch; checked where it is installed)
TORCH_MODEL_KEYWORDS = "module loss device precision encode_on_device".split()


def test_the_top_level_is_the_trainers_and_small():
    assert sorted(PUBLIC) == sorted(set(PUBLIC) & set(allreduce_param.__all__))
    assert len(allreduce_param.__all__) <= 20, allreduce_param.__all__
    engine_only = set(ENGINE) - set(PUBLIC)
    assert not engine_only & set(allreduce_param.__all__), "the engine's names are its own"
    for name in allreduce_param.__all__:
        assert hasattr(allreduce_param, name), name


def test_the_engines_names_are_its_api_page():
    import allreduce_param.engine as engine

    missing = sorted(set(ENGINE) - set(engine.__all__))
    assert not missing, f"names dropped from allreduce_param.engine.__all__: {missing}"
    for name in engine.__all__:
        assert hasattr(engine, name), name
    assert "BSP" in engine.__doc__ and "p.collectives" in engine.__doc__  # it reads as a reference


@pytest.mark.slow
def test_importing_the_package_loads_no_pyspark_until_ml_is_named():
    """Nor the trainer: a barrier task's worker imports the package and ``train.task``, and
    the driver's side (``train.driver``) only when a name of it is asked for; then the
    top level's names are the modules' own objects."""
    code = (
        "import sys, allreduce_param\n"
        "assert 'pyspark' not in sys.modules, 'import allreduce_param loaded pyspark'\n"
        "assert 'torch' not in sys.modules, 'import allreduce_param loaded torch'\n"
        "import allreduce_param.train.task.worker\n"
        "driver = sorted(m for m in sys.modules if m.startswith('allreduce_param.train.driver'))\n"
        "assert not driver, f'a task imported the driver side: {driver}'\n"
        "from allreduce_param import DistriOptimizer, FitSettings, models, optim\n"
        "from allreduce_param.train.driver.distri import DistriOptimizer as defined\n"
        "assert DistriOptimizer is defined and allreduce_param.train.DistriOptimizer is defined\n"
        "assert models.MLP and optim.Adam and FitSettings is allreduce_param.FitSettings\n"
        "assert {'DistriOptimizer', 'ml'} <= set(dir(allreduce_param))\n"
        "from allreduce_param import ml\n"
        "assert 'pyspark' in sys.modules and ml.AllReduceRegressor\n"
        "try:\n"
        "    allreduce_param.DistriOptimiser\n"
        "except AttributeError as error:\n"
        "    assert 'DistriOptimiser' in str(error)\n"
        "else:\n"
        "    raise AssertionError('a misspelt name was found')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


OPTIM = """Optimizer SGD Adam AdamW Adagrad RMSprop Schedule StepLR CosineLR LinearWarmup
clip_scale squared_norm ElasticNet""".split()


def test_the_optimizers_names_are_kept():
    missing = sorted(set(OPTIM) - set(allreduce_param.optim.__all__))
    assert not missing, f"names dropped from allreduce_param.optim.__all__: {missing}"


def test_job_file_keys_and_estimator_params_are_kept():
    from allreduce_param.ml import AllReduceClassifier, AllReduceRegressor
    from allreduce_param.train.settings import flat_names

    fields = [item.name for item in dataclasses.fields(allreduce_param.FitSettings)]
    assert not set(FIT_SETTINGS) - set(fields), sorted(set(FIT_SETTINGS) - set(fields))
    keys = set(flat_names())
    assert not set(JOB_FILE_KEYS) - keys, sorted(set(JOB_FILE_KEYS) - keys)
    for estimator, expected in (
        (AllReduceRegressor, REGRESSOR_PARAMS),
        (AllReduceClassifier, CLASSIFIER_PARAMS),
    ):
        names = {param.name for param in estimator().params}
        assert not set(expected) - names, (estimator.__name__, sorted(set(expected) - names))


def test_a_handle_has_at_most_twelve_public_members():
    param = AllReduceParameter(1, 10, codec="raw", timeout=10)
    with param.connect(LocalRendezvous(1).member(0)) as p:
        members = {name for name in dir(p) if not name.startswith("_")}
        assert members == set(CONNECTED_CALLS), sorted(members ^ set(CONNECTED_CALLS))
        assert len(members) <= 12
        for name, expected in HANDED_OUT.items():
            held = {member for member in dir(getattr(p, name)) if not member.startswith("_")}
            assert set(expected) <= held, (name, sorted(set(expected) - held))
        assert p.info.partition_id == 0 and p.info.slice_length == 10
        assert p.info.gradient_put_plan.refusal is not None  # raw: nothing encoded elsewhere


def test_engine_calls_and_signatures_are_kept():
    calls = {name for name in dir(ConnectedParameter) if not name.startswith("_")}
    assert calls <= set(CONNECTED_CALLS), sorted(calls - set(CONNECTED_CALLS))
    keywords = inspect.signature(AllReduceParameter).parameters
    assert set(keywords) == set(PARAMETER_KEYWORDS), sorted(set(keywords) ^ set(PARAMETER_KEYWORDS))
    fit = inspect.signature(allreduce_param.DistriOptimizer.fit).parameters
    assert list(fit)[1:] == FIT_ARGUMENTS
    stream = inspect.signature(allreduce_param.DistriOptimizer.fit_stream).parameters
    assert list(stream)[1:] == FIT_STREAM_ARGUMENTS


def test_a_trained_model_keeps_where_training_stopped():
    trained = allreduce_param.TrainedModel(allreduce_param.models.LinearRegression(2), None)
    for name in TRAINED_MODEL_FIELDS:
        assert hasattr(trained, name), name


def test_torch_models_keywords_are_kept():
    pytest.importorskip("torch", reason="TorchModel needs PyTorch: pip install -e '.[torch]'")
    keywords = inspect.signature(allreduce_param.models.TorchModel).parameters
    assert list(keywords) == TORCH_MODEL_KEYWORDS


def test_the_handle_and_its_puts_are_small_classes():
    from allreduce_param.engine.gradients import GradientPuts

    for cls in (ConnectedParameter, GradientPuts):
        lines, _ = inspect.getsourcelines(cls)
        assert len(lines) < 300, f"{cls.__name__} has {len(lines)} lines"
