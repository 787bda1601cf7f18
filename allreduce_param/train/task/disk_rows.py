"""A partition's rows of one split in a row file (``train.row_file``), as the fit reads them:
the same calls as ``memory_rows.Rows`` (``take``, ``rows_between``, ``epoch_order``), each reading
the blocks it needs.

An epoch's order is a seeded permutation of the blocks, then of the rows within each block
(``block_epoch_order``), so a step's rows come from one block, or two, read in turn: the
disk reads stay sequential within a block and the page cache or the disk serves the rest.
Where the rows fit in one block the order is ``batching.epoch_order``'s exactly, and a fit
gives the same bits as with the rows in memory.
"""

from __future__ import annotations

import os

import numpy as np

from allreduce_param.train.regularisation import local_moments
from allreduce_param.train.row_file import Block, RowFile
from allreduce_param.train.task.batching import epoch_order
from allreduce_param.train.task.memory_rows import Rows


def block_epoch_order(
    rows: int, block_rows: int, seed: int, epoch: int, partition_id: int
) -> np.ndarray:
    """The order of ``rows`` rows in blocks of ``block_rows`` during ``epoch``: the blocks in
    a seeded order, each block's rows in a seeded order of their own. One block: exactly
    ``batching.epoch_order``."""
    if rows <= block_rows:
        return epoch_order(rows, seed, epoch, partition_id)
    rng = np.random.default_rng([seed, epoch, partition_id])
    blocks = -(-rows // block_rows)
    order = np.empty(rows, np.int32 if rows < 2**31 else np.int64)  # a file's rows: half
    at = 0
    for block in rng.permutation(blocks):
        start = int(block) * block_rows
        size = min(block_rows, rows - start)
        order[at : at + size] = start + rng.permutation(size)
        at += size
    return order


class _Reused:
    """Arrays for a file's dense rows, filled again by each read: grown to the most rows
    asked for, never shrunk (a batch's size varies by a row within an epoch)."""

    def __init__(self, file: RowFile) -> None:
        self.file, self.block = file, file.buffers(0)

    def rows(self, count: int) -> Block | None:
        """Room for ``count`` rows (sparse rows: None, ``RowFile.take`` builds them)."""
        if self.file.sparse:
            return None
        if self.block.X.shape[0] < count:
            self.block = self.file.buffers(count)
        return self.block

    def clear(self) -> None:
        self.block = self.file.buffers(0)


class DiskRows:
    """One split of a partition's rows in a row file. ``release`` deletes the file (the task
    calls it on every way out).

    ``take`` and ``rows_between`` answer with views of a buffer of their own (one each),
    which their next call fills again: the fit's step and evaluation use each batch or chunk
    before they ask for the next, and so copy a step's rows into memory it already holds
    (fresh pages are faulted in and zeroed, a cost as large as the copy itself)."""

    def __init__(self, file: RowFile) -> None:
        self.file = file
        self._batch, self._chunk = _Reused(file), _Reused(file)

    @property
    def row_count(self) -> int:
        return self.file.rows

    @property
    def n_features(self) -> int:
        return self.file.n_features

    @property
    def sparse(self) -> bool:
        return self.file.sparse

    @property
    def weighted(self) -> bool:
        return self.file.weighted

    def take(self, index: np.ndarray) -> Rows:
        """The rows at ``index``, in that order (views of this object's batch buffer)."""
        return Rows(*self.file.take(index, self._batch.rows(len(index))))

    def rows_between(self, start: int, stop: int) -> Rows:
        """Rows ``start:stop``, in order (views of this object's chunk buffer)."""
        count = max(0, min(stop, self.row_count) - start)
        return Rows(*self.file.range(start, stop, self._chunk.rows(count)))

    def epoch_order(self, seed: int, epoch: int, partition_id: int) -> np.ndarray:
        return block_epoch_order(self.row_count, self.file.block_rows, seed, epoch, partition_id)

    def moments(self) -> tuple[np.ndarray, np.ndarray, float, float]:
        """``regularisation.local_moments`` summed block by block (one block: the same bits
        as over the rows in memory)."""
        total = None
        for block in range(self.file.block_count):
            rows = self.file.block(block)
            part = local_moments(rows.X, rows.weight)
            total = part if total is None else tuple(a + b for a, b in zip(total, part))
        return total if total is not None else local_moments(self.file.range(0, 0).X, None)

    def close(self) -> None:
        self.file.close()
        self._batch.clear()
        self._chunk.clear()

    def release(self) -> None:
        """Close the file and delete it (gone already: nothing to do)."""
        self.close()
        try:
            os.unlink(self.file.path)
        except FileNotFoundError:
            pass
