"""The errors a ``PeerClient`` raises, each worded once: naming the peer, the block and the cause.

``peer_text`` is how a client names its peer ("partition 2 at 10.0.0.5:4711"), ``what``
the block (or question) it was fetching.
"""

from __future__ import annotations

from allreduce_param.engine.wire.blocks.protocol import (
    MAX_ERROR_TEXT,
    STATUS_CLOSING,
    STATUS_STALE,
    STATUS_TIMEOUT,
)
from allreduce_param.engine.wire.sockets import recv_exactly
from allreduce_param.errors import (
    AllReduceError,
    FetchTimeoutError,
    PeerLostError,
    ProtocolError,
    StaleVersionError,
    peer_lost,
)


def lost(peer_text: str, what: str, detail: str, said: str = "") -> PeerLostError:
    """The one wording of 'this peer is gone', naming the peer, the block and the cause.

    ``said`` is the reason the peer gave as it failed, when it could give one.
    """
    return peer_lost(f"{peer_text} {detail} while we fetched {what}", said)


def late(peer_text: str, what: str, waited: float) -> FetchTimeoutError:
    """The peer gave no answer for ``what`` within ``waited`` seconds."""
    return FetchTimeoutError(f"{peer_text} did not answer for {what} within {waited:g} s")


def out_of_memory(what: str, error: OSError) -> MemoryError:
    """This process, not the peer, could not get memory (ENOMEM) for ``what``: most
    often mapping the peer's shared memory under a limit on the address space."""
    return MemoryError(
        f"this partition ran out of memory ({error}) while it fetched {what}: it maps the "
        "shared memory its peers on this host publish blocks in, and a limit on its address "
        "space counts the mappings (under Spark, spark.executor.pyspark.memory sets one on "
        "each Python worker): raise that limit or leave it unset"
    )


def answer_error(peer_text: str, status: int, length: int, sock, what: str) -> AllReduceError:
    """The error a non-OK answer stands for, its text (``length`` bytes) read off ``sock``
    (anything with ``recv_into``)."""
    if length > MAX_ERROR_TEXT:
        raise ProtocolError(f"{peer_text} sent an error text of {length} bytes for {what}")
    text = bytearray(length)
    recv_exactly(sock, memoryview(text))
    reason = text.decode("utf-8", "replace")
    if status == STATUS_TIMEOUT:
        return FetchTimeoutError(
            f"{peer_text} did not publish {what} in time: {reason}. The peer is stuck or "
            "much slower; raise AllReduceParameter(timeout=...) if its steps are this slow"
        )
    if status == STATUS_CLOSING:
        return lost(peer_text, what, "shut down", said=reason)
    if status == STATUS_STALE:
        return StaleVersionError(f"{peer_text} no longer has {what}: {reason}")
    return ProtocolError(f"{peer_text} answered {what} with unknown status {status}")
