"""The block protocol's frames: what a ``PeerClient`` asks and a ``BlockServer`` answers.

Wire format (little-endian):

* Handshake: ``handshake.py``'s (each side proves the parameter's secret over fresh nonces);
  the client's ids are the parameter id and its own partition. With ``encrypt``, a TCP
  connection is a ``sealing.SealedConnection`` from then on: the frames below travel in
  encrypted records; Unix sockets and shared memory stay as they are.
* Request: op, block kind, source, destination, part, version, timeout in ms (fixed size).
  The op's ``FLAG_NEWEST`` bit asks for the newest version at or above ``version``.
  ``OP_ADDRESS`` (the rest zeros) asks for the server's advertised address instead: the
  answer's bytes are its JSON (at most ``MAX_ADDRESS_TEXT``), and the server then ends the
  connection; such a connection never counts as the peer's "done". ``OP_ARENA`` (over
  the Unix socket only) asks a host's leader for the host arena (``blocks/arena.py``):
  the answer's bytes are its description (JSON) and its descriptors ride with them
  (SCM_RIGHTS); the connection then ends as after ``OP_ADDRESS``.
* Response: status, length, the version served; then ``length`` bytes (the encoded block,
  or an error text). A peer on this host that asked for shared answers gets, for a block
  in shared memory, where its header and its payload lie instead (segment ids, offsets,
  the header's length; with the descriptor of a segment it has not been passed yet): the
  two may lie apart, when a vector was published where it lies (``store.SplitBlock``).

Every length is checked against what the block can be before a byte of it is read; a
malformed frame closes that connection with a logged reason, never the server. A client
sends one request at a time on a connection and reads its answer before the next.
"""

from __future__ import annotations

import struct

from allreduce_param.engine.wire.handshake import HELLO_REFUSED

#: magic (the handshake's), op, kind, source, destination, part, version, timeout in ms
REQUEST = struct.Struct("<4sBBIIIQI")
RESPONSE = struct.Struct("<BQQ")  # status, length, version served

OP_GET = 1
OP_DONE = 2  # "I have fetched everything I need from you": the closing handshake
OP_GET_SHARED = 3  # as GET, but a block in shared memory is answered with where it lies
#: "where can I reach you": answered with the server's advertised address as JSON (what a
#: meeting that only knows ``(host, port)``, e.g. a fixed list, cannot tell), then the end
OP_ADDRESS = 4
#: "map the host arena": a same-host peer asks the host's leader for the arena's
#: description and descriptors (the segment, every partition's doorbell), then the end
OP_ARENA = 5
FLAG_NEWEST = 0x10  # with a get: the newest version at or above the one asked for
OPS = (OP_GET, OP_DONE, OP_GET_SHARED, OP_ADDRESS, OP_ARENA)

STATUS_OK = 0
STATUS_TIMEOUT = 1
STATUS_STALE = 2
STATUS_CLOSING = 3
STATUS_REFUSED = HELLO_REFUSED  # the handshake's refusal (handshake.py): one byte, nothing after
STATUS_SHARED = 5  # the block lies in shared segments: where follows (and, once each, their fds)

#: After STATUS_SHARED: the header's segment id, offset and length, the payload's segment id
#: and offset (the payload's length is the response's length less the header's).
SHARED_PLACE = struct.Struct("<QQQQQ")

MAX_ERROR_TEXT = 64 * 1024
MAX_ADDRESS_TEXT = 4096
