"""A partition's rows in a local file, written once block by block and read back one block
at a time: how a partition larger than the Python worker's memory trains.

The file (one per split of a partition; ``spill`` names and places them) is a 64-byte header
and blocks of ``block_rows`` rows each (the last may hold fewer). All integers are
little-endian.

- **Header**: the magic ``ARPROWS1``; u32 flags (1: sparse, 2: weighted, 4: float64
  features); u32 spare; u64
  n_features; u64 block_rows; u64 rows and u64 blocks (written last, when the file is
  complete; 0 before); u64 xxh3_64 of the header's first 48 bytes; padding to 64.
- **Block**: a 48-byte block header: the magic ``ARPB``, u32 its index, u64 rows, u64
  non-zeros (sparse; else 0), u64 payload bytes, u64 xxh3_64 of the payload, u64 spare;
  then the payload, its columns one after another: the labels (float64, one a row), the
  sample weights (float64, where weighted), then the features: dense rows as one float32
  matrix, row by row; sparse rows as CSR parts (indptr int64, rows + 1, from 0; indices
  int32; values float32). With flag 4 the features' values are float64 instead (the linear
  models' fits, which solve in float64). The payload is padded to a multiple of 8 bytes.

A reader never maps the file: it ``pread``s one block, checks its header and checksum, and
hands numpy arrays over those bytes (``spark.executor.pyspark.memory`` limits the Python
worker's address space, which mappings count against). A block cut short or whose bytes no
longer match its checksum (the file changed between epochs: another process, a cleaner of
the local directory, a failing disk) is a ``TrainingError`` naming the file and the block.
"""

from __future__ import annotations

import errno
import os
import struct
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import xxhash

from allreduce_param.errors import AllReduceError, ConfigurationError, TrainingError

MAGIC = b"ARPROWS1"
BLOCK_MAGIC = b"ARPB"
HEADER = struct.Struct(
    "<8sIIQQQQQ"
)  # magic, flags, spare, n_features, block_rows, rows, blocks, xxh3
HEADER_BYTES = 64
BLOCK_HEADER = struct.Struct("<4sIQQQQQ")  # magic, index, rows, nonzeros, payload, xxh3, spare
SPARSE, WEIGHTED, FLOAT64 = 1, 2, 4
#: About how many bytes a block holds: large enough for sequential reads, small enough that
#: the few copies of a block a write or a read makes are a small share of a worker's memory.
BLOCK_BYTES = 1 << 20


def block_rows_for(row_bytes: float, block_bytes: int = BLOCK_BYTES) -> int:
    """How many rows of ``row_bytes`` each make a block of about ``block_bytes``."""
    return max(1, int(block_bytes // max(1.0, row_bytes)))


class Block(NamedTuple):
    """One block's rows: features (a dense float32 matrix or a CSR matrix), labels, weights."""

    X: object
    y: np.ndarray
    weight: np.ndarray | None


def _local_dir_error(path: str, error: OSError, doing: str) -> AllReduceError:
    """A local directory that is full or not writable, as an error naming it and the setting:
    a ``ConfigurationError`` where every run of the stage would fail the same way (full, a
    quota, read-only, no permission), so that the fit does not run it again."""
    folder = os.path.dirname(path) or "."
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    why = "is full" if full else f"is not writable ({error.strerror or error})"
    lasting = error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
    return (ConfigurationError if lasting else TrainingError)(
        f"the local directory {folder} {why}, {doing} {os.path.basename(path)}: a partition "
        "larger than memory is kept there while it trains. Point spark.local.dir (or "
        "SPARK_LOCAL_DIRS; YARN and Kubernetes set their own) at a writable disk with room "
        "for the partition, or train in memory (data_in='memory')"
    )


class RowFileWriter:
    """Writes rows to a new row file as they come (``append``), a block at a time; ``close``
    completes the header. Holds at most a block and the latest appended rows. ``float64``:
    the features' values are kept as float64 (else float32)."""

    def __init__(
        self,
        path: str,
        n_features: int,
        block_rows: int,
        sparse: bool,
        weighted: bool,
        float64: bool = False,
    ) -> None:
        self.path, self.n_features, self.block_rows = path, n_features, int(block_rows)
        self.sparse, self.weighted, self.float64 = sparse, weighted, float64
        self._values = "<f8" if float64 else "<f4"
        self.rows = 0
        self.blocks: list[tuple[int, int]] = []  # each block's (offset, rows)
        self._pending: list[Block] = []
        self._pending_rows = 0
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as error:
            raise _local_dir_error(path, error, "creating") from error
        self._offset = 0
        self._write(self._header(0, 0))

    def _header(self, rows: int, blocks: int) -> bytes:
        flags = (
            (SPARSE if self.sparse else 0)
            | (WEIGHTED if self.weighted else 0)
            | (FLOAT64 if self.float64 else 0)
        )
        fields = (MAGIC, flags, 0, self.n_features, self.block_rows, rows, blocks)
        head = HEADER.pack(*fields, 0)[:48]
        return HEADER.pack(*fields, xxhash.xxh3_64_intdigest(head)).ljust(HEADER_BYTES, b"\0")

    def _write(self, data, offset: int | None = None) -> None:
        try:
            view = memoryview(data).cast("B")
            at = self._offset if offset is None else offset
            while view:
                written = os.pwrite(self._fd, view, at)
                view, at = view[written:], at + written
            if offset is None:
                self._offset = at
        except OSError as error:
            raise _local_dir_error(self.path, error, "writing") from error

    def append(self, X, y: np.ndarray, weight: np.ndarray | None = None) -> None:
        """Add rows (``X`` dense float32 or CSR, in the file's kind), in order."""
        if X.shape[0] == 0:
            return
        self._pending.append(Block(X, np.asarray(y, np.float64), weight))
        self._pending_rows += X.shape[0]
        while self._pending_rows >= self.block_rows:
            self._flush(self.block_rows)

    def _flush(self, rows: int) -> None:
        X, y, weight = _concatenate(self._pending, self.sparse)
        head = Block(X[:rows], y[:rows], None if weight is None else weight[:rows])
        rest = X.shape[0] - rows
        self._pending = (
            [Block(X[rows:], y[rows:], None if weight is None else weight[rows:])] if rest else []
        )
        self._pending_rows = rest
        self._write_block(head)

    def _write_block(self, block: Block) -> None:
        parts = [block.y.astype("<f8", copy=False)]
        if self.weighted:
            parts.append(np.asarray(block.weight, "<f8"))
        nonzeros = 0
        if self.sparse:
            X = block.X
            indptr = (X.indptr - X.indptr[0]).astype("<i8")
            nonzeros = int(indptr[-1])
            start = X.indptr[0]
            parts += [
                indptr,
                X.indices[start : start + nonzeros].astype("<i4"),
                X.data[start : start + nonzeros].astype(self._values),
            ]
        else:
            parts.append(np.ascontiguousarray(block.X, self._values).reshape(-1))
        views = [memoryview(np.ascontiguousarray(p)).cast("B") for p in parts]
        length = sum(len(v) for v in views)
        views.append(memoryview(b"\0" * (-length % 8)))
        digest = xxhash.xxh3_64()  # over the parts in place: no joined copy of the block
        for view in views:
            digest.update(view)
        rows = block.y.shape[0]
        header = BLOCK_HEADER.pack(
            BLOCK_MAGIC,
            len(self.blocks),
            rows,
            nonzeros,
            length + len(views[-1]),
            digest.intdigest(),
            0,
        )
        self.blocks.append((self._offset, rows))
        for view in (memoryview(header), *views):
            self._write(view)
        self.rows += rows

    def close(self) -> RowFile:
        """Write what is pending and the complete header; the file, to read."""
        if self._pending_rows:
            self._flush(self._pending_rows)
        self._write(self._header(self.rows, len(self.blocks)), offset=0)
        os.close(self._fd)
        self._fd = -1
        return RowFile(
            self.path,
            self.n_features,
            self.block_rows,
            self.sparse,
            self.weighted,
            [offset for offset, _ in self.blocks],
            self.rows,
            self.float64,
        )

    def abandon(self) -> None:
        """Close without completing (the caller removes the file)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _concatenate(blocks: list[Block], sparse: bool) -> Block:
    if len(blocks) == 1:
        return blocks[0]
    if sparse:
        from scipy.sparse import vstack

        X = vstack([b.X for b in blocks], format="csr")
    else:
        X = np.concatenate([b.X for b in blocks])
    y = np.concatenate([b.y for b in blocks])
    weight = None if blocks[0].weight is None else np.concatenate([b.weight for b in blocks])
    return Block(X, y, weight)


class RowFile:
    """A complete row file, read a block at a time with its checksum checked; the two blocks
    read last are kept, so a batch's or an evaluation's reads within a block read it once.
    A block's arrays are views of a buffer the next reads reuse: callers copy out (``take``
    and ``range`` do) before reading further blocks."""

    KEEP = 2

    def __init__(
        self,
        path: str,
        n_features: int,
        block_rows: int,
        sparse: bool,
        weighted: bool,
        offsets: list[int],
        rows: int,
        float64: bool = False,
    ) -> None:
        self.path, self.n_features, self.block_rows = path, n_features, block_rows
        self.sparse, self.weighted = sparse, weighted
        self.dtype = np.dtype(np.float64 if float64 else np.float32)  # the features' values
        self.offsets, self.rows = offsets, rows
        self._fd = -1
        self._kept: OrderedDict[int, tuple[Block, bytearray]] = OrderedDict()
        self._spare: list[bytearray] = []  # buffers of blocks no longer kept, to read into

    @property
    def block_count(self) -> int:
        return len(self.offsets)

    def block(self, index: int) -> Block:
        """Block ``index``'s rows, read and checked (or kept from a recent read)."""
        kept = self._kept.get(index)
        if kept is not None:
            self._kept.move_to_end(index)
            return kept[0]
        while len(self._kept) >= self.KEEP:  # its buffer is read into next: callers copy out
            self._spare.append(self._kept.popitem(last=False)[1][1])
        block, buffer = self._read(index)
        self._kept[index] = (block, buffer)
        return block

    def _damaged(self, index: int, what: str) -> TrainingError:
        return TrainingError(
            f"the partition's row file {self.path} is damaged: block {index} {what}. The file "
            "changed after this task wrote it (another process or a cleaner of the local "
            "directory, spark.local.dir, or a failing disk); run the fit again"
        )

    def _read(self, index: int) -> tuple[Block, bytearray]:
        if self._fd < 0:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError as error:
                raise self._damaged(index, f"cannot be read ({error.strerror})") from error
        offset = self.offsets[index]
        head = os.pread(self._fd, BLOCK_HEADER.size, offset)
        if len(head) < BLOCK_HEADER.size:
            raise self._damaged(index, f"is cut short: the file ends before byte {offset + 48}")
        magic, number, rows, nonzeros, length, digest, _ = BLOCK_HEADER.unpack(head)
        expected_rows = min(self.block_rows, self.rows - index * self.block_rows)
        if magic != BLOCK_MAGIC or number != index or rows != expected_rows:
            raise self._damaged(index, "has a header that is not its own")
        # into a buffer of an earlier block: no fresh pages to fault in for every block
        buffer = self._spare.pop() if self._spare else bytearray()
        if len(buffer) < length:
            buffer = bytearray(length)
        payload = memoryview(buffer)[:length]
        got = os.preadv(self._fd, [payload], offset + BLOCK_HEADER.size)
        if got < length:
            end = offset + BLOCK_HEADER.size + length
            raise self._damaged(index, f"is cut short: the file ends before byte {end}")
        if xxhash.xxh3_64_intdigest(payload) != digest:
            raise self._damaged(index, "does not match its checksum")
        return self._decode(payload, rows, nonzeros), buffer

    def _decode(self, payload: memoryview, rows: int, nonzeros: int) -> Block:
        at = 0

        def take(dtype: str, count: int) -> np.ndarray:
            nonlocal at
            array = np.frombuffer(payload, dtype, count, at)
            at += array.nbytes
            return array

        y = take("<f8", rows)
        weight = take("<f8", rows) if self.weighted else None
        if self.sparse:
            from scipy.sparse import csr_matrix

            indptr, indices = take("<i8", rows + 1), take("<i4", nonzeros)
            values = take(self.dtype.newbyteorder("<").str, nonzeros)
            X = csr_matrix((values, indices, indptr), shape=(rows, self.n_features))
        else:
            values = take(self.dtype.newbyteorder("<").str, rows * self.n_features)
            X = values.reshape(rows, self.n_features)
        return Block(X, y, weight)

    def take(self, index: np.ndarray, out: Block | None = None) -> Block:
        """The rows at ``index`` (row numbers of the file), in that order: each block they
        fall in read once. Where each block's rows come together (an epoch's order, a range)
        they are copied straight to their place in the answer: into ``out``'s arrays where
        given (dense rows; at least ``len(index)`` rows each, the answer views of them), so
        a caller that takes batch after batch fills one buffer rather than fresh pages."""
        index = np.asarray(index, np.int64)
        if len(index) == 0:
            return self._empty()
        if index.min() < 0 or index.max() >= self.rows:
            raise IndexError(f"row numbers must lie in 0..{self.rows - 1} of {self.path}")
        blocks = index // self.block_rows
        # where each run of one block's rows starts and stops (a step's batch: two or three
        # runs; Python lists, as small as they are, cost less than numpy's calls on them)
        starts = [0, *(np.flatnonzero(blocks[1:] != blocks[:-1]) + 1).tolist()]
        numbers = blocks[starts].tolist()
        if len(set(numbers)) < len(numbers):  # a block's rows apart: by block
            return self._take_by_block(index, blocks)
        stops = [*starts[1:], len(index)]
        if self.sparse:
            pieces = []
            for start, stop, number in zip(starts, stops, numbers):
                block = self.block(number)
                local = index[start:stop] - number * self.block_rows
                weight = None if block.weight is None else block.weight[local]
                pieces.append(Block(block.X[local], block.y[local], weight))
            return _concatenate(pieces, True)
        if out is None:
            out = self.buffers(len(index))
        count = len(index)
        X, y = out.X[:count], out.y[:count]
        weight = None if out.weight is None else out.weight[:count]
        for start, stop, number in zip(starts, stops, numbers):
            block = self.block(number)
            local = index[start:stop] - number * self.block_rows
            # "clip": unbuffered (numpy buffers ``out`` under "raise"); checked above
            block.X.take(local, axis=0, out=X[start:stop], mode="clip")
            block.y.take(local, out=y[start:stop], mode="clip")
            if weight is not None:
                block.weight.take(local, out=weight[start:stop], mode="clip")
        return Block(X, y, weight)

    def buffers(self, rows: int) -> Block:
        """Fresh arrays for ``rows`` dense rows of this file (``take``'s ``out``)."""
        return Block(
            np.empty((rows, self.n_features), self.dtype),
            np.empty(rows, np.float64),
            np.empty(rows, np.float64) if self.weighted else None,
        )

    def _take_by_block(self, index: np.ndarray, blocks: np.ndarray) -> Block:
        """``take`` where a block's rows are spread over ``index``: grouped by block (each
        read once), then put in ``index``'s order."""
        by_block = np.argsort(blocks, kind="stable")
        joined = self.take(index[by_block])
        place = np.empty_like(by_block)  # row j of the answer is joined row place[j]
        place[by_block] = np.arange(len(index))
        weight = None if joined.weight is None else joined.weight[place]
        return Block(joined.X[place], joined.y[place], weight)

    def range(self, start: int, stop: int, out: Block | None = None) -> Block:
        """Rows ``start:stop``, in order (into ``out`` as ``take``)."""
        return self.take(np.arange(start, min(stop, self.rows), dtype=np.int64), out)

    def _empty(self) -> Block:
        from allreduce_param.train.features import empty_rows

        return Block(
            empty_rows(self.n_features, self.sparse),
            np.zeros(0, np.float64),
            np.zeros(0, np.float64) if self.weighted else None,
        )

    def close(self) -> None:
        """Let go of the file (the kept blocks, the descriptor); reading again reopens it."""
        self._kept.clear()
        self._spare.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_header(path: str) -> dict:
    """A row file's header as a dict (for tools and tests); a damaged one is a TrainingError."""
    with open(path, "rb") as file:
        data = file.read(HEADER_BYTES)
    if len(data) < HEADER_BYTES:
        raise TrainingError(f"the row file {path} is cut short: no whole header")
    magic, flags, _, n_features, block_rows, rows, blocks, digest = HEADER.unpack(data[:56])
    if magic != MAGIC or xxhash.xxh3_64_intdigest(data[:48]) != digest:
        raise TrainingError(f"the row file {path} has a damaged header")
    return {
        "sparse": bool(flags & SPARSE),
        "weighted": bool(flags & WEIGHTED),
        "float64": bool(flags & FLOAT64),
        "n_features": n_features,
        "block_rows": block_rows,
        "rows": rows,
        "blocks": blocks,
    }
