"""A partition's rows of one split held in memory (``Rows``); the fit takes its steps' rows
from them, as from a row file's (``disk_rows.DiskRows``)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from allreduce_param.models.base import is_sparse_matrix
from allreduce_param.train.regularisation import local_moments
from allreduce_param.train.task.batching import epoch_order


class Rows(NamedTuple):
    """A partition's rows of one split: features (a float32 matrix, dense or CSR), labels,
    sample weights (or None)."""

    X: np.ndarray
    y: np.ndarray
    weight: np.ndarray | None

    @property
    def row_count(self) -> int:
        """How many rows (``X`` may be a sparse matrix, whose ``len`` is ambiguous)."""
        return self.X.shape[0]

    @property
    def n_features(self) -> int:
        return self.X.shape[1]

    @property
    def sparse(self) -> bool:
        """Whether ``X`` is a CSR matrix."""
        return is_sparse_matrix(self.X)

    def take(self, index: np.ndarray, room: Rows | None = None) -> Rows:
        """The rows at ``index``, in that order: in fresh arrays, or, dense rows given a
        ``room`` (``room_for``) of at least ``len(index)`` rows, in views of its arrays, which
        the next such call fills again (a fit's step uses its rows before it asks for the
        next: no fresh pages, faulted in and zeroed, each step)."""
        if room is None or self.sparse:
            return Rows(
                self.X[index], self.y[index], None if self.weight is None else self.weight[index]
            )
        count = len(index)
        X, y = room.X[:count], room.y[:count]
        # "clip": unbuffered (numpy buffers ``out`` under "raise"); an epoch order's indices
        # are in range
        np.take(self.X, index, axis=0, out=X, mode="clip")
        np.take(self.y, index, out=y, mode="clip")
        weight = None
        if self.weight is not None:
            weight = room.weight[:count]
            np.take(self.weight, index, out=weight, mode="clip")
        return Rows(X, y, weight)

    def room_for(self, count: int) -> Rows:
        """Arrays for ``count`` of these rows, of their dtypes (``take``'s ``room``)."""
        return Rows(
            np.empty((count, *self.X.shape[1:]), self.X.dtype),
            np.empty(count, self.y.dtype),
            None if self.weight is None else np.empty(count, self.weight.dtype),
        )

    def rows_between(self, start: int, stop: int) -> Rows:
        """Rows ``start:stop``, in order (views where numpy makes them)."""
        weight = None if self.weight is None else self.weight[start:stop]
        return Rows(self.X[start:stop], self.y[start:stop], weight)

    def epoch_order(self, seed: int, epoch: int, partition_id: int) -> np.ndarray:
        """The order the rows train in during ``epoch`` (``batching.epoch_order``)."""
        return epoch_order(self.row_count, seed, epoch, partition_id)

    def moments(self) -> tuple[np.ndarray, np.ndarray, float, float]:
        """The rows' ``regularisation.local_moments``."""
        return local_moments(self.X, self.weight)

    def release(self) -> None:
        """Nothing to let go of (rows in a file, ``disk_rows.DiskRows``, delete it)."""
