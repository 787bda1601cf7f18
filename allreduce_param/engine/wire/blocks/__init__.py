"""The wire between partitions: a block server, a peer client, and the frames between them.

Each partition runs one ``BlockServer`` over its ``BlockStore`` and one ``PeerClient`` per
peer. A client pulls blocks: it names a block and a version, and the server answers when
that version is in its store (or with an error once the wait times out). Both prove the
parameter's secret first (``wire.handshake``).

The frames are in ``protocol``, how a server is named to its peers in ``addresses``, the
two ends in ``server`` (with ``serving``: the frames read from and written to each peer)
and ``client`` (with ``dialing``, ``client_errors``, ``questions``, and ``shared_answers``:
blocks read in place from a peer's shared memory, on one host).
"""

from allreduce_param.engine.wire.blocks.addresses import (
    PeerAddress,
    local_scope,
    parse_address,
    secret_fingerprint,
)
from allreduce_param.engine.wire.blocks.client import AnswerDue, PeerClient
from allreduce_param.engine.wire.blocks.protocol import (
    FLAG_NEWEST,
    MAX_ERROR_TEXT,
    OP_DONE,
    OP_GET,
    OP_GET_SHARED,
    STATUS_CLOSING,
    STATUS_OK,
    STATUS_REFUSED,
    STATUS_SHARED,
    STATUS_STALE,
    STATUS_TIMEOUT,
)
from allreduce_param.engine.wire.blocks.server import SERVE_THREADS, BlockServer
from allreduce_param.engine.wire.blocks.serving import SEND_SLICE

__all__ = [
    "FLAG_NEWEST",
    "MAX_ERROR_TEXT",
    "OP_DONE",
    "OP_GET",
    "OP_GET_SHARED",
    "SEND_SLICE",
    "SERVE_THREADS",
    "STATUS_CLOSING",
    "STATUS_OK",
    "STATUS_REFUSED",
    "STATUS_SHARED",
    "STATUS_STALE",
    "STATUS_TIMEOUT",
    "AnswerDue",
    "BlockServer",
    "PeerAddress",
    "PeerClient",
    "local_scope",
    "parse_address",
    "secret_fingerprint",
]
