"""allreduce-param: Spark-native AllReduce parameter sync for data-parallel training.

Inside one barrier ``mapPartitions`` stage each partition owns a slice of the flattened
parameter vector; gradients are reduce-scattered to the owners and weights all-gathered
back through compressed blocks that the partitions serve to each other, without the driver.
"""

from . import models, optim
from .codec import CODECS
from .errors import (
    AllReduceError,
    AuthenticationError,
    CodecOverflowError,
    ConfigurationError,
    CorruptBlockError,
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
from .layout import SliceLayout
from .network import NetworkSettings
from .parameter import AllReduceParameter, ConnectedParameter
from .rendezvous import BarrierRendezvous, LocalRendezvous, Rendezvous, StaticRendezvous
from .strategy import STRATEGIES, Strategy
from .stream import GradientStream
from .train import DistriOptimizer, FitSettings, History, TrainedModel

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
