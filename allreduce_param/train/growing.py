"""An array filled a chunk of rows at a time, whose length is known only when the last chunk
has come: a partition's rows as they arrive from Spark.

Joining a list of chunks at the end holds the rows twice (the chunks and the joined array).
A ``GrowingArray`` is one allocation grown in place instead: numpy's ``resize`` is the C
library's ``realloc``, and glibc grows an allocation that has a mapping of its own with
``mremap``, which moves page tables, not bytes. Its first capacity is ``INITIAL_BYTES`` of
address space, above glibc's largest threshold for such mappings (32 MiB), so that it has one
from the start (under an address-space limit less: ``initial_bytes``); pages never written
cost no memory. A partition's labels, splits, weights and order keys are kept so too: kept as
small arrays, one per Arrow batch, they would sit between the batches' freed buffers in
glibc's heap, and each new batch would take fresh pages. It grows by an eighth at a time (numpy
zeroes what a resize adds), and ``finish`` gives back what was never filled. Holding n rows
costs about n rows.
"""

from __future__ import annotations

import math
import os

import numpy as np

#: The first capacity's bytes: address space only, until rows are written to it.
INITIAL_BYTES = 64 << 20
#: The same under an address-space limit (``spark.executor.pyspark.memory``), where every
#: byte of address space counts and a task has glibc map blocks from 1 MiB up on their own
#: (``spark.arrow.fit_the_address_space_limit``).
LIMITED_INITIAL_BYTES = 2 << 20


def initial_bytes() -> int:
    """A new array's first capacity in bytes: ``LIMITED_INITIAL_BYTES`` under an
    address-space limit, else ``INITIAL_BYTES``."""
    return LIMITED_INITIAL_BYTES if os.environ.get("PYSPARK_EXECUTOR_MEMORY_MB") else INITIAL_BYTES


#: Each growth adds at least 1/GROWTH of the capacity.
GROWTH = 8


class GrowingArray:
    """Rows of ``row_shape`` and ``dtype`` appended in place (``next_rows``), then the array
    of exactly those rows (``finish``)."""

    def __init__(self, row_shape: tuple[int, ...], dtype) -> None:
        self._row_shape = tuple(row_shape)
        self._row_bytes = max(1, math.prod(self._row_shape) * np.dtype(dtype).itemsize)
        first = max(1, initial_bytes() // self._row_bytes)
        self._array = _unadvised_empty((first, *self._row_shape), dtype)
        self._rows = 0

    def __len__(self) -> int:
        return self._rows

    @property
    def nbytes(self) -> int:
        """The bytes of the rows appended so far."""
        return self._rows * self._row_bytes

    def next_rows(self, count: int) -> np.ndarray:
        """A view of the next ``count`` rows, counted as appended, for the caller to fill; it
        must be let go of before the next call (a growth may move the array)."""
        needed = self._rows + count
        capacity = len(self._array)
        if needed > capacity:
            capacity = max(needed, capacity + capacity // GROWTH)
            self._array.resize((capacity, *self._row_shape), refcheck=False)
        rows, self._rows = self._array[self._rows : needed], needed
        return rows

    def append(self, rows: np.ndarray) -> None:
        """Append a copy of ``rows`` (cast to this array's dtype)."""
        self.next_rows(len(rows))[...] = rows

    def filled(self) -> np.ndarray:
        """A view of the rows appended so far (let go of it before the next ``next_rows``)."""
        return self._array[: self._rows]

    def finish(self) -> np.ndarray:
        """The rows appended, as an array of their own: the capacity never filled given back."""
        array, self._array = self._array, np.empty((0, *self._row_shape), self._array.dtype)
        array.resize((self._rows, *self._row_shape), refcheck=False)
        return array


def _unadvised_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """``np.empty`` without numpy's advice to back it with huge pages (it gives it from 4 MB
    up, where transparent huge pages are on "madvise"): a 2 MiB page at the first row
    written, in each of a partition's arrays, would cost more than a small partition holds."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:  # numpy 1
        try:
            from numpy.core.multiarray import _set_madvise_hugepage
        except ImportError:
            return np.empty(shape, dtype)
    advised = _set_madvise_hugepage(False)
    try:
        return np.empty(shape, dtype)
    finally:
        _set_madvise_hugepage(advised)
