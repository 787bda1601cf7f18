"""Collectives on vectors of any numeric dtype: reduce_scatter, all_gather, broadcast.

What a ``torch.distributed`` process group, an exact solver (float64 sums) or a count of
integers needs beside the float32 steps. The values travel as their bytes (each partition's
piece padded to whole 4-byte words) in raw blocks of two kinds of their own
(``BlockKind.TYPED_CHUNK``: a chunk for its owner; ``TYPED_SLICE``: a slice for every
partition), so no codec ever rounds them, and they never meet a step's blocks.

- ``reduce_scatter``: every partition publishes chunk ``j`` of its vector for owner ``j``;
  the owner fetches its chunk from everyone and combines them itself, in the vector's dtype,
  in partition order (0, 1, ..., N-1): every run gives the same bits, float64 stays float64
  and integers wrap as numpy's do.
- ``all_gather``: every partition publishes its slice; everyone fetches every slice.
- ``broadcast``: the root publishes piece ``j`` of its vector for partition ``j``, which then
  all-gather the pieces: the root sends the vector once, not once per partition.

Every block carries, in its header's ``count`` (a float64, exact below 2**53), the call's
signature: the dtype, the op and the vector's length. A partition whose call differs from
its peers' (another length, dtype or op) gets a ``CollectiveMismatchError`` naming both,
never another partition's bytes read as its own.

Flat topology only: under a hierarchical handle (``p.info.hierarchical``) these calls are
refused with a ``UsageError``, as a partition there reaches only its host and its leader.
``Collectives`` hands the calls here (``p.collectives.reduce_scatter``, ...); the order rules
are the collectives': every partition makes the same calls in the same order.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from allreduce_param.engine.blocks.store import BlockKind
from allreduce_param.engine.layout import SliceLayout
from allreduce_param.engine.movement.fetches import part_plan
from allreduce_param.engine.movement.movements import Movements
from allreduce_param.engine.strategy import WeightRead
from allreduce_param.errors import (
    CollectiveMismatchError,
    CorruptBlockError,
    InputError,
    ProtocolError,
    UsageError,
)

#: The dtypes the typed collectives carry, by name; the index goes in a block's signature
#: (append only). ``bfloat16`` is ml_dtypes' (what a torch bfloat16 tensor's bits become).
DTYPES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
)

#: How ``reduce_scatter`` combines two chunks, by op name; the index goes in the signature.
OPS = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum}

_LENGTH_BITS = 40  # a signature: dtype << 44 | op << 40 | length (below 2**53, so exact)


class TypedCollectives:
    """One partition's typed collectives through its ``Movements``: the calls behind
    ``p.collectives.reduce_scatter``, ``all_gather`` and ``broadcast``."""

    def __init__(self, moves: Movements) -> None:
        self._moves = moves
        self._peers = moves.peers
        self.partition_id = moves.partition_id
        self.partition_num = moves.partition_num
        self._chunk_versions = -1  # versions of TYPED_CHUNK taken so far
        self._slice_versions = -1

    def reduce_scatter(
        self, values: np.ndarray, op: str = "sum", layout: SliceLayout | None = None
    ) -> np.ndarray:
        """This partition's slice of ``layout`` (default: ``SliceLayout(values.size, N)``)
        of the elementwise ``op`` ("sum", "product", "min" or "max") of every partition's
        ``values``, combined in partition order in ``values``' dtype."""
        vector = self.checked(values, op, "reduce_scatter")
        layout = self._layout(layout, vector.size, "reduce_scatter")
        return self._reduce_scatter(vector, op, layout)

    def checked(self, values: np.ndarray, op: str, call: str) -> np.ndarray:
        """``values`` as a combining ``call`` takes them (a contiguous 1-D array of a carried
        dtype, ``op`` one of ``OPS``, a flat handle), or the ``InputError`` or
        ``UsageError`` saying what is wrong."""
        vector = self._vector(values, f"{call}(values) on partition {self.partition_id}")
        if op not in OPS:
            raise InputError(f"{call}(op={op!r}): op must be one of {', '.join(map(repr, OPS))}")
        self._refuse_hierarchical(call)
        return vector

    def all_gather(
        self, own: np.ndarray, layout: SliceLayout, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The whole vector of ``layout``, every partition's slice in its place; ``own`` is
        this partition's slice. Every partition gets the same. ``out``: where to put it (a
        contiguous 1-D array of ``own``'s dtype, ``layout.size`` long), which is returned;
        the peers' slices are then fetched straight into it where no padding is needed."""
        what = f"all_gather(own) on partition {self.partition_id}"
        vector = self._vector(own, what, empty=True)
        layout = self._layout(layout, None, "all_gather")
        if vector.size != layout.length(self.partition_id):
            raise InputError(
                f"{what}: got {vector.size} elements, but this partition's slice of the "
                f"layout holds {layout.length(self.partition_id)}: pass "
                f"values[layout.bounds({self.partition_id})]"
            )
        if out is not None and not (
            isinstance(out, np.ndarray)
            and out.dtype == vector.dtype
            and out.shape == (layout.size,)
            and out.flags.c_contiguous
            and out.flags.writeable
        ):
            raise InputError(
                f"all_gather(out=...) on partition {self.partition_id}: out must be a writeable "
                f"contiguous 1-D array of {vector.dtype} with {layout.size} elements, got "
                f"{getattr(out, 'dtype', type(out).__name__)} of shape {getattr(out, 'shape', '?')}"
            )
        self._refuse_hierarchical("all_gather")
        return self._all_gather(vector, layout, "all_gather", out=out)

    def broadcast(self, values: np.ndarray, root: int) -> np.ndarray:
        """Partition ``root``'s ``values``, on every partition (each passes an array of the
        same length and dtype; only the root's contents count)."""
        what = f"broadcast(values) on partition {self.partition_id}"
        vector = self._vector(values, what)
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.partition_num:
            raise InputError(
                f"broadcast(root={root!r}): root must be a partition, 0..{self.partition_num - 1}"
            )
        root = int(root)
        self._refuse_hierarchical("broadcast")
        layout = SliceLayout(vector.size, self.partition_num)
        signature = call_signature(vector.dtype, None, vector.size)
        words = _words(layout, vector.dtype)
        version = self._next_chunk()
        me, moves = self.partition_id, self._moves
        if me == root:
            padded = _padded(vector, layout, words)
            moves.scatter(
                BlockKind.TYPED_CHUNK, version, padded, words, float(signature), own=False
            )
            piece = vector[layout.bounds(me)]
        else:
            pending = moves.fetcher.fetch_all(
                self._peers.worker,
                BlockKind.TYPED_CHUNK,
                WeightRead(version, exact=True),
                words,
                destination=me,
                sources=[root],
                at_once=True,
            )
            piece = np.empty(layout.length(me), vector.dtype)
            parts = self._fetched(pending[root], words, me, signature, root, "broadcast")
            _combine(parts, piece, None)
        return self._all_gather(piece, layout, "broadcast", signature)

    def _reduce_scatter(self, vector: np.ndarray, op: str, layout: SliceLayout) -> np.ndarray:
        """``reduce_scatter`` once its arguments are checked."""
        me, moves = self.partition_id, self._moves
        signature = call_signature(vector.dtype, op, vector.size)
        words = _words(layout, vector.dtype)
        padded = _padded(vector, layout, words)
        version = self._next_chunk()
        moves.scatter(BlockKind.TYPED_CHUNK, version, padded, words, float(signature), own=False)
        peers = [j for j in range(self.partition_num) if j != me]
        pending = moves.fetcher.fetch_own_chunks(
            BlockKind.TYPED_CHUNK, version, words, peers, at_once=True
        )
        result = np.empty(layout.length(me), vector.dtype)
        for source in range(self.partition_num):  # the one order: partition order
            if source == me:
                parts = [(0, padded[words.bounds(me)], None)]
            else:
                parts = self._fetched(
                    pending[source], words, me, signature, source, "reduce_scatter"
                )
            _combine(parts, result, None if source == 0 else OPS[op])
        return result

    def _all_gather(
        self,
        own: np.ndarray,
        layout: SliceLayout,
        call: str,
        signature: int | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Publish ``own`` (this partition's slice of ``layout``) and fetch everyone's (into
        ``out`` where given)."""
        dtype = own.dtype
        signature = call_signature(dtype, None, layout.size) if signature is None else signature
        words = _words(layout, dtype)
        if own.nbytes == 4 * words.length(0):  # whole words already: published as they lie
            mine = own.view(np.float32)
        else:
            mine = np.zeros(words.length(0), np.float32)
            mine.view(np.uint8)[: own.nbytes] = own.view(np.uint8)
        version = self._next_slice()
        self._moves.publish(BlockKind.TYPED_SLICE, version, mine, count=float(signature))
        unpadded = _unpadded(layout, dtype)
        if out is not None and unpadded and layout.size:  # the words are out's bytes
            gathered = out.view(np.float32)
        else:
            gathered = np.empty(words.size, np.float32)
        pending = self._moves.fetcher.fetch_slices(
            BlockKind.TYPED_SLICE,
            WeightRead(version, exact=True),
            words,
            gathered,
            via=self._peers.server_of,
            at_once=True,
        )
        if unpadded:  # the words are the values: gather straight into them
            result = gathered.view(dtype) if out is None else out
            for owner in range(self.partition_num):
                parts = self._fetched(pending[owner], words, owner, signature, owner, call)
                _combine(parts, result[layout.bounds(owner)], None)
            return result
        result = np.empty(layout.size, dtype) if out is None else out
        for owner in range(self.partition_num):
            room = gathered[words.bounds(owner)]
            for start, values, recheck in self._fetched(
                pending[owner], words, owner, signature, owner, call
            ):
                if not np.shares_memory(values, room):
                    np.copyto(room[start : start + values.size], values)
                if recheck is not None:
                    recheck()
            nbytes = layout.length(owner) * dtype.itemsize
            result[layout.bounds(owner)] = room.view(np.uint8)[:nbytes].view(dtype)
        return result

    def _fetched(
        self,
        futures: list[Future],
        words: SliceLayout,
        slice_of: int,
        signature: int,
        source: int,
        call: str,
    ):
        """Each fetched part of ``source``'s block of slice ``slice_of`` of ``words``, as
        ``(first word, values, recheck)``, once it came and its signature is checked."""
        for future, (start, _) in zip(futures, part_plan(words)[slice_of]):
            _, count, values, recheck = self._wait(future, source, call)
            self._check(count, signature, source, call)
            yield start, values, recheck

    def _wait(self, future: Future, source: int, call: str) -> tuple:
        """A fetched part, or the error a block of another length becomes: a mismatch."""
        try:
            return future.result()
        except (CorruptBlockError, ProtocolError) as error:  # longer or shorter than asked
            raise CollectiveMismatchError(
                f"{call} on partition {self.partition_id}: partition {source}'s block does not "
                f"fit this partition's call ({error}); every partition must pass the same "
                "length and dtype"
            ) from error

    def _check(self, count: float, signature: int, source: int, call: str) -> None:
        """Raise if ``source``'s block carries another call's signature."""
        if int(count) != signature:
            raise CollectiveMismatchError(
                f"{call} on partition {self.partition_id}: partition {source} called it with "
                f"{describe_signature(int(count))}, this partition with {describe_signature(signature)}; every "
                "partition must pass the same length, dtype and op"
            )

    def _vector(self, values, what: str, empty: bool = False) -> np.ndarray:
        """``values`` as a contiguous 1-D array of a supported dtype, or an InputError."""
        if not isinstance(values, np.ndarray):
            raise InputError(f"{what}: expected a numpy array, got {type(values).__name__}")
        if values.ndim != 1 or (values.size == 0 and not empty):
            raise InputError(
                f"{what}: expected a {'' if empty else 'non-empty '}1-D array, "
                f"got shape {values.shape}"
            )
        if values.dtype.name not in DTYPES:
            raise InputError(
                f"{what}: dtype {values.dtype} is not carried; use one of {', '.join(DTYPES)}"
            )
        return np.ascontiguousarray(values)

    def _layout(self, layout: SliceLayout | None, size: int | None, call: str) -> SliceLayout:
        """The call's layout (default: ``size`` over the partitions), checked."""
        if layout is None:
            return SliceLayout(size, self.partition_num)
        if not isinstance(layout, SliceLayout) or layout.partition_num != self.partition_num:
            raise InputError(
                f"{call}(layout={layout!r}): expected a SliceLayout over the "
                f"{self.partition_num} partitions"
            )
        if size is not None and layout.size != size:
            raise InputError(
                f"{call}(layout={layout!r}): the layout is of {layout.size} elements, the "
                f"values hold {size}"
            )
        return layout

    def _refuse_hierarchical(self, call: str) -> None:
        """Raise a UsageError under a hierarchical handle (see the module's docstring)."""
        if self._peers.hierarchical:
            raise UsageError(
                f"{call}() needs the flat topology: this handle is hierarchical (a partition "
                "reaches only its host and its leader); make the AllReduceParameter with "
                'topology="flat" for the typed collectives'
            )

    def _next_chunk(self) -> int:
        self._chunk_versions += 1
        return self._chunk_versions

    def _next_slice(self) -> int:
        self._slice_versions += 1
        return self._slice_versions


def call_signature(dtype: np.dtype, op: str | None, size: int) -> int:
    """What a block says of its call: dtype, op (None: a gather, a broadcast) and length."""
    op_code = 0 if op is None else 1 + list(OPS).index(op)
    return DTYPES.index(dtype.name) << (_LENGTH_BITS + 4) | op_code << _LENGTH_BITS | size


def describe_signature(signature: int) -> str:
    """A signature in words, for a mismatch's message."""
    size = signature & ((1 << _LENGTH_BITS) - 1)
    op_code = (signature >> _LENGTH_BITS) & 0xF
    dtype_code = signature >> (_LENGTH_BITS + 4)
    dtype = DTYPES[dtype_code] if dtype_code < len(DTYPES) else f"dtype #{dtype_code}"
    text = f"{size} elements of {dtype}"
    return text if op_code == 0 else f"{text}, op {list(OPS)[op_code - 1]!r}"


def _words(layout: SliceLayout, dtype: np.dtype) -> SliceLayout:
    """The blocks' layout in float32 words: every slice of ``layout`` as bytes, padded to
    the longest slice's whole words (at least one), so that all are as long."""
    width = max(1, -(-layout.max_length * dtype.itemsize // 4))
    return SliceLayout(width * layout.partition_num, layout.partition_num)


def _unpadded(layout: SliceLayout, dtype: np.dtype) -> bool:
    """Whether every slice of ``layout`` is already whole words of one width (no padding)."""
    return layout.size % layout.partition_num == 0 and (layout.length(0) * dtype.itemsize % 4 == 0)


def _padded(vector: np.ndarray, layout: SliceLayout, words: SliceLayout) -> np.ndarray:
    """``vector``'s bytes as the float32 words of ``words``: each slice at its word's place,
    zero-padded; the vector itself (viewed) where no padding is needed."""
    if _unpadded(layout, vector.dtype):
        return vector.view(np.float32)
    width = words.length(0) * 4
    out = np.zeros(words.size * 4, np.uint8)
    for j in range(layout.partition_num):
        piece = vector[layout.bounds(j)].view(np.uint8)
        out[j * width : j * width + piece.size] = piece
    return out.view(np.float32)


def _combine(parts, into: np.ndarray, op) -> None:
    """Fold one source's parts ``(first word, values, recheck)`` into ``into``: copied when
    ``op`` is None, else ``op(into, part)`` in place. A part starts at a whole element:
    ``PART_LENGTH`` is even, and no dtype is wider than two words."""
    itemsize = into.dtype.itemsize
    for start, values, recheck in parts:
        first = 4 * start // itemsize
        stop = min(into.size, first + values.nbytes // itemsize)
        chunk = values.view(np.uint8)[: (stop - first) * itemsize].view(into.dtype)
        if op is None:
            target = into[first:stop]
            if _address(chunk) != _address(target):  # else fetched into its place already
                np.copyto(target, chunk)
        else:
            with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN, as numpy's
                op(into[first:stop], chunk, out=into[first:stop])
        if recheck is not None:
            recheck()


def _address(array: np.ndarray) -> int:
    """Where ``array``'s first element lies in memory."""
    return array.__array_interface__["data"][0]
