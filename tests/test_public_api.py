"""The public API survives the move into layer folders: names, Params, job keys, old paths.

The lists below were read off the package before the redesign (commit 57978c3); the API may
grow, never shrink. Spark-free: the Estimators' Params are read from their classes.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pickle

import pytest

import allreduce_param
from allreduce_param._old_paths import MOVED

PUBLIC = """AllReduceError AllReduceParameter AuthenticationError BarrierRendezvous CODECS
CodecOverflowError ConfigurationError ConnectedParameter CorruptBlockError DamagedCheckpointError
DistriOptimizer EncodedStream FetchTimeoutError FitSettings GradientPutPlan GradientStream History
InputError LocalRendezvous NetworkError
NetworkSettings NonFiniteGradientError PeerLostError ProtocolError Rendezvous STRATEGIES
SliceLayout SparseGradient StaleVersionError StaticRendezvous StoreClosedError Strategy TrainedModel
TrainingError UsageError models optim""".split()

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

CONNECTED_CALLS = """aggregate_gradient_partition allreduce allreduce_exact close connections
finish_updates get_weights gradient_buffer gradient_partition gradient_put_plan hierarchical
host_arena hosts init last_read_version put_encoded_gradients put_gradients remote_peers
send_weight_partition serve_updates signal
stream_encoded_gradients stream_gradients updates wait_for_signals weight_partition""".split()

PARAMETER_KEYWORDS = """partition_num size codec timeout fetch_threads allow_nonfinite
unix_sockets shared_memory param_id strategy gradient_codec bind_address advertise_address
port_range connect_timeout encrypt topology host_arena""".split()

FIT_ARGUMENTS = "data features_col label_col validation resume_from weight_col initial".split()

FIT_STREAM_ARGUMENTS = """stream model_path checkpoint_location features_col label_col weight_col
initial on_model trigger query_name empty_batches""".split()

#: what a TrainedModel holds for a later fit to continue from
TRAINED_MODEL_FIELDS = "steps_done epochs_done optimizer_state optimizer_kind".split()

#: TorchModel's keywords (needs torch; checked where it is installed)
TORCH_MODEL_KEYWORDS = "module loss device precision encode_on_device".split()


def test_every_public_name_is_still_exported():
    missing = sorted(set(PUBLIC) - set(allreduce_param.__all__))
    assert not missing, f"names dropped from allreduce_param.__all__: {missing}"
    for name in allreduce_param.__all__:
        assert hasattr(allreduce_param, name), name


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


def test_engine_calls_and_signatures_are_kept():
    calls = {name for name in dir(allreduce_param.ConnectedParameter) if not name.startswith("_")}
    assert not set(CONNECTED_CALLS) - calls, sorted(set(CONNECTED_CALLS) - calls)
    keywords = inspect.signature(allreduce_param.AllReduceParameter).parameters
    assert not set(PARAMETER_KEYWORDS) - set(keywords), sorted(
        set(PARAMETER_KEYWORDS) - set(keywords)
    )
    fit = inspect.signature(allreduce_param.DistriOptimizer.fit).parameters
    assert list(fit)[1:] == FIT_ARGUMENTS
    stream = inspect.signature(allreduce_param.DistriOptimizer.fit_stream).parameters
    assert list(stream)[1:] == FIT_STREAM_ARGUMENTS


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_new_module(old):
    module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_a_trained_model_keeps_where_training_stopped():
    trained = allreduce_param.TrainedModel(allreduce_param.models.LinearRegression(2), None)
    for name in TRAINED_MODEL_FIELDS:
        assert hasattr(trained, name), name


def test_old_paths_of_public_names_import():
    from allreduce_param.codec import CODECS
    from allreduce_param.network import NetworkSettings
    from allreduce_param.parameter import AllReduceParameter, ConnectedParameter
    from allreduce_param.rendezvous import LocalRendezvous, StaticRendezvous
    from allreduce_param.strategy import Strategy
    from allreduce_param.train.distri import DistriOptimizer
    from allreduce_param.train.result import TrainedModel

    assert CODECS is allreduce_param.CODECS
    assert NetworkSettings is allreduce_param.NetworkSettings
    assert AllReduceParameter is allreduce_param.AllReduceParameter
    assert ConnectedParameter is allreduce_param.ConnectedParameter
    assert (LocalRendezvous, StaticRendezvous) == (
        allreduce_param.LocalRendezvous,
        allreduce_param.StaticRendezvous,
    )
    assert Strategy is allreduce_param.Strategy
    assert DistriOptimizer is allreduce_param.DistriOptimizer
    assert TrainedModel is allreduce_param.TrainedModel


def test_a_pickle_that_names_an_old_module_loads():
    # what pickle wrote for a Strategy before the move: the class by its old module's name
    # (protocol 0 names it in a line of text, so the name can be swapped)
    old = pickle.dumps(allreduce_param.Strategy("ssp", staleness=2), protocol=0).replace(
        allreduce_param.Strategy.__module__.encode(), b"allreduce_param.strategy"
    )
    assert b"allreduce_param.strategy" in old
    strategy = pickle.loads(old)
    assert isinstance(strategy, allreduce_param.Strategy) and strategy.staleness == 2


def test_torch_models_keywords_are_kept():
    pytest.importorskip("torch", reason="TorchModel needs PyTorch: pip install -e '.[torch]'")
    keywords = inspect.signature(allreduce_param.models.TorchModel).parameters
    assert list(keywords) == TORCH_MODEL_KEYWORDS
