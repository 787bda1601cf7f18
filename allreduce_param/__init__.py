"""allreduce-param: Spark-native AllReduce parameter sync for data-parallel training.

Inside one barrier ``mapPartitions`` stage each partition owns a slice of the flattened
parameter vector; gradients are reduce-scattered to the owners and weights all-gathered
back through compressed blocks that the partitions serve to each other, without the driver.
"""

from allreduce_param import models, optim
from allreduce_param.engine.blocks.codec import CODECS
from allreduce_param.engine.encoded import GradientPutPlan
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.rendezvous import LocalRendezvous, Rendezvous, StaticRendezvous
from allreduce_param.engine.parameter import AllReduceParameter, ConnectedParameter
from allreduce_param.engine.strategy import STRATEGIES, Strategy
from allreduce_param.engine.stream import EncodedStream, GradientStream
from allreduce_param.engine.vectors import SparseGradient
from allreduce_param.engine.wire.settings import NetworkSettings
from allreduce_param.errors import (
    AllReduceError,
    AuthenticationError,
    CodecOverflowError,
    ConfigurationError,
    CorruptBlockError,
    DamagedCheckpointError,
    FetchTimeoutError,
    InputError,
    NetworkError,
    NonFiniteGradientError,
    PeerLostError,
    ProtocolError,
    StaleVersionError,
    StoreClosedError,
    TrainingError,
    UsageError,
)
from allreduce_param.spark import surroundings as _spark_surroundings
from allreduce_param.spark.rendezvous import BarrierRendezvous
from allreduce_param.train import DistriOptimizer, FitSettings, History, TrainedModel

_spark_surroundings.install()

__version__ = "0.1.0"

__all__ = [
    "DistriOptimizer",
    "FitSettings",
    "TrainedModel",
    "History",
    "TrainingError",
    "models",
    "optim",
    "AllReduceParameter",
    "ConnectedParameter",
    "GradientStream",
    "EncodedStream",
    "GradientPutPlan",
    "SparseGradient",
    "CODECS",
    "Strategy",
    "STRATEGIES",
    "SliceLayout",
    "NetworkSettings",
    "Rendezvous",
    "BarrierRendezvous",
    "StaticRendezvous",
    "LocalRendezvous",
    "AllReduceError",
    "AuthenticationError",
    "CodecOverflowError",
    "ConfigurationError",
    "CorruptBlockError",
    "DamagedCheckpointError",
    "FetchTimeoutError",
    "InputError",
    "NetworkError",
    "NonFiniteGradientError",
    "PeerLostError",
    "ProtocolError",
    "StaleVersionError",
    "StoreClosedError",
    "UsageError",
]
