"""The engine's API: one float32 vector kept in sync across the partitions of a barrier
stage, Spark-free (``docs/engine.md`` has the guide and examples).

The step, under BSP (the default strategy)::

    param = AllReduceParameter(partition_num, size, codec="lz4")    # on the driver
    with param.connect() as p:                                       # in each task
        p.init(initial_weights)                                      # once
        for batch in batches:
            weights = p.get_weights()                                # all-gather
            p.put_gradients(gradient_sum(weights, batch), count=len(batch))
            gradient = p.aggregate_gradient_partition()              # reduce-scatter
            update(p.weight_partition, gradient)                     # in place: the own slice
            p.send_weight_partition()                                # the next version

What each name is for:

- ``AllReduceParameter``: the driver's description of one vector (size, partitions,
  codec, strategy, topology, network); ``connect()`` in a task gives the handle.
- ``ConnectedParameter``: one partition's handle. Its calls are the step's (``init``,
  ``get_weights``, ``put_gradients``, ``aggregate_gradient_partition``,
  ``send_weight_partition``, ``weight_partition``, ``gradient_buffer``,
  ``stream_gradients``, ``close``), and it hands out three small objects: ``p.info`` (which
  partition, its slice, the strategy, hosts, connections, the gradient put plan),
  ``p.collectives`` (``allreduce``, ``allreduce_exact``, ``reduce_scatter``, ``all_gather``,
  ``broadcast``, ``signal``, ``wait_for_signals``)
  and ``p.background`` (``serve_updates``, ``finish_updates``, ``updates``: the background
  owner of the strategies other than BSP).
- ``GradientStream``: ``p.stream_gradients(g, n)``, each owner's chunk published as soon
  as backward has finished it; ``EncodedStream``: ``p.stream_gradients(count=n,
  encoded=True)``, the same from bytes encoded elsewhere (a GPU).
- ``SparseGradient`` (touched elements only) and ``EncodedGradient`` (a lossy codec's
  streams made elsewhere, cut as ``p.info.gradient_put_plan``, a ``GradientPutPlan``,
  says): what ``put_gradients`` takes besides a dense float32 vector.
- ``CODECS``: the codecs' names (``codec=``, ``gradient_codec=``).
- ``Strategy`` and ``STRATEGIES``: how the partitions synchronise (BSP, backup workers,
  SSP, ASP).
- ``SliceLayout``: which slice each partition owns.
- ``NetworkSettings``: where the servers listen, how long a connection may take, encryption.
- ``Rendezvous``: how the partitions meet; ``StaticRendezvous`` (known addresses: plain
  processes), ``LocalRendezvous`` (threads of one process, for tests). Inside a Spark
  barrier stage ``connect()`` meets through the stage (``allreduce_param.spark``'s
  ``BarrierRendezvous``).
- The errors the engine raises on purpose, all ``AllReduceError``: ``ConfigurationError``
  (a setting), ``InputError`` (a vector), ``UsageError`` (a call out of order),
  ``FetchTimeoutError``, ``PeerLostError``, ``StoreClosedError``, ``NetworkError``,
  ``AuthenticationError``, ``ProtocolError``, ``CorruptBlockError``, ``StaleVersionError``,
  ``CodecOverflowError``, ``NonFiniteGradientError``, ``CollectiveMismatchError`` (partitions
  called one collective with different lengths, dtypes or ops).

The modules, from the top of the engine's layers down, are listed in ``docs/DESIGN.md``.
"""

from allreduce_param.engine.blocks.codec import CODECS
from allreduce_param.engine.encoded import GradientPutPlan
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.rendezvous import LocalRendezvous, Rendezvous, StaticRendezvous
from allreduce_param.engine.parameter import AllReduceParameter, ConnectedParameter
from allreduce_param.engine.strategy import STRATEGIES, Strategy
from allreduce_param.engine.stream import EncodedStream, GradientStream
from allreduce_param.engine.vectors import EncodedGradient, SparseGradient
from allreduce_param.engine.wire.settings import NetworkSettings
from allreduce_param.errors import (
    AllReduceError,
    AuthenticationError,
    CodecOverflowError,
    CollectiveMismatchError,
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
    UsageError,
)

__all__ = [
    "AllReduceParameter",
    "ConnectedParameter",
    "GradientStream",
    "EncodedStream",
    "SparseGradient",
    "EncodedGradient",
    "GradientPutPlan",
    "CODECS",
    "Strategy",
    "STRATEGIES",
    "SliceLayout",
    "NetworkSettings",
    "Rendezvous",
    "StaticRendezvous",
    "LocalRendezvous",
    "AllReduceError",
    "AuthenticationError",
    "CodecOverflowError",
    "CollectiveMismatchError",
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
