"""The errors allreduce-param raises, all of them, here.

Every error names what went wrong (the partition, the peer, the block, the version) and
what to do about it, so that the one line a Spark driver shows is enough to act on. None
is an ``OSError``: code that catches socket errors never catches ours by mistake. Each
answer a block server can give has its own type.
"""

from __future__ import annotations


class AllReduceError(RuntimeError):
    """Base class of every error allreduce-param raises on purpose."""


class ConfigurationError(AllReduceError, ValueError):
    """A setting or an argument is wrong before any data moves (size, codec, partitions)."""


class UsageError(AllReduceError):
    """A call came out of order, e.g. ``get_weights`` before ``init``."""


class CorruptBlockError(AllReduceError):
    """A block's header or checksum does not match its bytes."""


class CodecOverflowError(AllReduceError, OverflowError):
    """A value cannot be represented by the chosen codec (fp16 holds at most 65504)."""


class NonFiniteGradientError(AllReduceError, FloatingPointError):
    """A gradient holds NaN or Inf and the parameter does not allow it."""


class FetchTimeoutError(AllReduceError):
    """A peer did not publish the asked-for version of a block within the timeout."""


class PeerLostError(AllReduceError):
    """A peer closed its connection, shut down, or could not be reached: its task failed or ended."""


def peer_lost(text: str, said: str = "") -> PeerLostError:
    """The one wording of "this peer is gone": ``text`` names the peer and what was awaited
    from it; ``said``, the reason it gave as it failed, when it could give one. Without a
    reason the message says what usually happened and what to change: the process's memory,
    which under Spark is the Python worker's (not ``spark.executor.memory``, the JVM's heap);
    the driver reads "without a word" to name the dead worker and gives the same settings
    (``train.driver.failures.OUT_OF_MEMORY_ADVICE``)."""
    if said:
        return PeerLostError(f"{text}; it said: {said}")
    return PeerLostError(
        f"{text}, without a word: it failed, or its process was killed, most often for using "
        "more memory than it may (by the kernel's OOM killer, or a container's limit; see its "
        "log). Give that process more memory (under Spark, the Python workers': "
        "spark.executor.pyspark.memory where it is set, else spark.executor.memoryOverhead), "
        "or give it less to hold"
    )


class AuthenticationError(AllReduceError):
    """A connection could not prove it knows the parameter's secret."""


class StaleVersionError(AllReduceError):
    """The asked-for version of a block has already been replaced by newer ones."""


class StoreClosedError(AllReduceError):
    """This partition is shutting down: its block store closed, or its connections were cut,
    while a call waited or before it began."""


class TrainingError(AllReduceError):
    """A task of the fit failed; the message names the partition, epoch and step."""


class ProtocolError(AllReduceError):
    """A frame on the wire was malformed or larger than its block can be."""


class InputError(AllReduceError, ValueError):
    """A vector handed to the engine has the wrong length, shape or dtype."""


class CollectiveMismatchError(AllReduceError, ValueError):
    """Partitions made one collective call with different arguments (another length, dtype
    or op): every partition must make the same calls in the same order."""


class DamagedCheckpointError(InputError):
    """A checkpoint's file is missing, cut short, or not what its manifest says (size,
    checksum, contents); ``file`` names it and ``problem`` says what is wrong with it."""

    def __init__(self, message: str, file: str = "", problem: str = "") -> None:
        super().__init__(message)
        self.file, self.problem = file, problem


class NetworkError(AllReduceError):
    """A server could not listen: no free port in the allowed range, or an address this
    host does not have."""
