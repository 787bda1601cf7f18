"""Feature vectors as a task holds them: a dense float32 matrix, or for sparse data one CSR
matrix (``scipy.sparse``), built from a column's parts with no Python loop per row.

A ``VectorUDT`` column reaches Python through Arrow as a struct of ``type`` (0 sparse,
1 dense), ``size`` (a sparse vector's length), ``indices`` (a sparse vector's, int32) and
``values`` (float64). ``VectorParts`` holds a batch of such rows as flat numpy arrays (the
values of all rows one after another, with offsets), read from Arrow (``from_arrow``, in
the fit's tasks and the driver's checks), from the pandas frame a pandas UDF receives
(``from_pandas``, in predictions), or from an ``array<float>`` column (``from_lists``: every
row dense). From the parts: the checks' per-row figures, a CSR matrix or a dense one.

Which a fit trains on follows from the data's density, decided once on the driver
(``is_sparse``): a sparse matrix's rows cost their non-zeros, a dense one's every element,
so wide sparse data (``HashingTF``, ``OneHotEncoder``, ``FeatureHasher``: 2^18 features and
more, a few dozen non-zeros a row) is never densified.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from allreduce_param.spark import arrow

#: Data whose non-zeros are at most this share of its rows x features trains as CSR.
SPARSE_DENSITY = 0.25
#: The largest float32: a feature beyond it would become Inf when cast.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_sparse(nonzeros: int, rows: int, n_features: int) -> bool:
    """Whether data of ``rows`` vectors of ``n_features`` with ``nonzeros`` stored values in
    all trains as a CSR matrix (at most ``SPARSE_DENSITY`` full) rather than a dense one."""
    return nonzeros <= SPARSE_DENSITY * rows * n_features


def empty_rows(n_features: int, sparse: bool):
    """A matrix of no rows: CSR where ``sparse``, else dense (float32)."""
    if not sparse:
        return np.zeros((0, n_features), np.float32)
    from scipy.sparse import csr_matrix

    return csr_matrix((0, n_features), dtype=np.float32)


class VectorParts(NamedTuple):
    """A batch of feature vectors as flat arrays.

    Row ``r`` holds ``values[value_offsets[r]:value_offsets[r+1]]``; a sparse row's columns
    are ``indices[index_offsets[r]:index_offsets[r+1]]``, a dense row's are its positions.
    ``size`` is each row's length (a dense row's: its values' count); a null row has no
    values and size -1.
    """

    null: np.ndarray  # bool per row
    dense: np.ndarray  # bool per row: a dense vector, its values every element
    size: np.ndarray  # int64 per row
    value_offsets: np.ndarray  # int64, rows + 1
    values: np.ndarray  # float64 (float32 from an array<float> column)
    index_offsets: np.ndarray  # int64, rows + 1
    indices: np.ndarray  # int32 or int64
    value_null: np.ndarray | None = None  # bool per value: a null element (an array column's)

    @property
    def rows(self) -> int:
        return len(self.null)

    @classmethod
    def from_arrow(cls, column) -> VectorParts:
        """The parts of a pyarrow array: a vector struct (``VectorUDT`` through Arrow) or a
        list of numbers (an ``array<float>`` column, every row dense)."""
        if not str(column.type).startswith("struct<"):
            return cls.from_lists(column)
        kind, size, indices, values = column.flatten()  # the struct's nulls applied
        null = arrow.nulls(column)
        dense = ~null & (arrow.values(kind) == 1)
        value_offsets, value_list = _compact(values, null)
        index_offsets, index_list = _compact(indices, null | dense)
        lengths = np.diff(value_offsets)
        sizes = np.where(null, -1, np.where(dense, lengths, arrow.values(size).astype(np.int64)))
        return cls(null, dense, sizes, value_offsets, value_list, index_offsets, index_list)

    @classmethod
    def from_lists(cls, column) -> VectorParts:
        """The parts of a pyarrow list array of numbers: each row a dense vector."""
        null = arrow.nulls(column)
        offsets, values = _compact(column, null)
        rows = len(null)
        value_null = arrow.nulls(column.values)
        if value_null.any():  # NaN in their place; value_null still tells them apart
            value_null = _compact_flags(column, null, value_null)
            values = np.where(value_null, np.nan, values)
        else:
            value_null = None
        return cls(
            null,
            ~null,
            np.where(null, -1, np.diff(offsets)),
            offsets,
            values,
            np.zeros(rows + 1, np.int64),
            np.zeros(0, np.int32),
            value_null,
        )

    @classmethod
    def from_pandas(cls, frame) -> VectorParts:
        """The parts of a vector column as a pandas UDF receives it: a frame with columns
        ``type``, ``size``, ``indices``, ``values`` (an array or None per row)."""
        kinds = frame["type"].to_numpy(dtype=np.float64, na_value=np.nan)
        null = np.isnan(kinds)
        dense = ~null & (kinds == 1)
        values = [np.empty(0) if v is None else np.asarray(v) for v in frame["values"]]
        indices = [
            np.empty(0, np.int32) if d or i is None else np.asarray(i)
            for d, i in zip(dense, frame["indices"])
        ]
        value_offsets = _offsets([len(v) for v in values])
        index_offsets = _offsets([len(i) for i in indices])
        sizes = frame["size"].to_numpy(dtype=np.float64, na_value=-1).astype(np.int64)
        sizes = np.where(null, -1, np.where(dense, np.diff(value_offsets), sizes))
        return cls(
            null,
            dense,
            sizes,
            value_offsets,
            np.concatenate(values) if values else np.zeros(0),
            index_offsets,
            np.concatenate(indices).astype(np.int32) if indices else np.zeros(0, np.int32),
        )

    # -- per value --------------------------------------------------------------------

    def value_rows(self) -> np.ndarray:
        """Each value's row (int64)."""
        return np.repeat(np.arange(self.rows), np.diff(self.value_offsets))

    def value_columns(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Each value's column (int64): a sparse row's index, a dense row's position. Only
        sound where ``index_problems`` found none."""
        rows = self.value_rows() if rows is None else rows
        within = np.arange(len(self.values)) - self.value_offsets[rows]
        columns = within.copy()
        sparse = ~self.dense[rows]
        if sparse.any():
            columns[sparse] = self.indices[self.index_offsets[rows[sparse]] + within[sparse]]
        return columns

    def row_columns(self, row: int) -> np.ndarray:
        """The columns of one row's values (int64)."""
        start, stop = self.value_offsets[row], self.value_offsets[row + 1]
        if self.dense[row]:
            return np.arange(stop - start)
        return self.indices[self.index_offsets[row] : self.index_offsets[row + 1]].astype(np.int64)

    # -- per row ------------------------------------------------------------------------

    def row_any(self, flags: np.ndarray) -> np.ndarray:
        """Per row: whether any of its values is flagged (``flags``: one bool per value)."""
        before = np.concatenate([[0], np.cumsum(flags)])
        return before[self.value_offsets[1:]] > before[self.value_offsets[:-1]]

    def nonzeros(self) -> np.ndarray:
        """Per row: how many of its values are not 0 (int64)."""
        before = np.concatenate([[0], np.cumsum(self.values != 0)])
        return before[self.value_offsets[1:]] - before[self.value_offsets[:-1]]

    def bad_values(self) -> np.ndarray:
        """Per value: NaN, +-Inf, or beyond float32's range (Inf once cast)."""
        with np.errstate(invalid="ignore"):
            return ~(np.abs(self.values) <= FLOAT32_MAX)

    def index_problems(self) -> np.ndarray:
        """Per row: a sparse row whose indices do not match its values in number, or are not
        strictly increasing within ``0..size-1``."""
        sparse = ~self.null & ~self.dense
        counts_differ = sparse & (np.diff(self.index_offsets) != np.diff(self.value_offsets))
        rows = np.repeat(np.arange(self.rows), np.diff(self.index_offsets))
        indices = self.indices.astype(np.int64)
        out_of_range = (indices < 0) | (indices >= self.size[rows])
        first = np.zeros(len(indices), bool)
        first[self.index_offsets[:-1][np.diff(self.index_offsets) > 0]] = True
        not_increasing = ~first & (np.diff(indices, prepend=-1) <= 0)
        before = np.concatenate([[0], np.cumsum(out_of_range | not_increasing)])
        bad_indices = before[self.index_offsets[1:]] > before[self.index_offsets[:-1]]
        return counts_differ | bad_indices

    # -- matrices -----------------------------------------------------------------------

    def to_csr(self, n_features: int, dtype: Any = np.float32):
        """The rows as a float32 ``scipy.sparse.csr_matrix`` (rows, n_features); a dense
        row's zeros are not stored. Null rows are empty rows (the driver refuses them).
        ``dtype``: float64 keeps the values as Spark holds them (MLlib's linear models)."""
        from scipy.sparse import csr_matrix

        rows = self.value_rows()
        columns, values = self.value_columns(rows), self.values
        keep = (values != 0) | ~self.dense[rows]
        if not keep.all():
            rows, columns, values = rows[keep], columns[keep], values[keep]
        indptr = np.zeros(self.rows + 1, np.int64)
        np.cumsum(np.bincount(rows, minlength=self.rows), out=indptr[1:])
        index_type = np.int32 if max(len(values), n_features) < 2**31 else np.int64
        return csr_matrix(
            (values.astype(dtype), columns.astype(index_type), indptr.astype(index_type)),
            shape=(self.rows, n_features),
        )

    def to_dense(
        self, n_features: int, dtype: Any = np.float32, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The rows as a dense float32 (or ``dtype``) matrix (rows, n_features); written into
        ``out`` where given (a C-contiguous matrix of that shape: a partition's rows in place)."""
        if out is None:
            X = np.zeros((self.rows, n_features), dtype)
        else:
            X = out
        if self.dense.all() and (self.size == n_features).all():  # one copy, no scatter
            X.reshape(-1)[:] = self.values
            return X
        if out is not None:
            X[...] = 0
        rows = self.value_rows()
        X[rows, self.value_columns(rows)] = self.values
        return X


def _compact(column, null: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A pyarrow list array's ``(offsets from 0, values)`` with the rows in ``null`` empty
    (Arrow lets a null slot span values; they belong to no row)."""
    offsets = arrow.list_offsets(column)
    values = arrow.values(column.values)
    lengths = np.where(null, 0, np.diff(offsets))
    spans = np.diff(offsets)
    if offsets[0] == 0 and (lengths == spans).all() and offsets[-1] == len(values):
        return offsets, values
    keep = np.repeat(~null, spans)
    return _offsets(lengths), values[offsets[0] : offsets[-1]][keep]


def _compact_flags(column, null: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """``flags`` (one per slot of a list array's values) of the values ``_compact`` keeps."""
    offsets = arrow.list_offsets(column)
    keep = np.repeat(~null, np.diff(offsets))
    return flags[offsets[0] : offsets[-1]][keep]


def _offsets(lengths) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def matrix_from_pandas(data, column: str, width: int = 0, dtype: Any = np.float32):
    """The feature rows a pandas UDF receives as one float32 matrix: from a vector column (a
    frame of its parts) a CSR matrix where the batch is sparse (``is_sparse``), else dense;
    from an array column (a series of arrays) a dense one. A null row, or rows of different
    lengths, is an InputError naming ``column``. ``width``: the columns of an empty batch;
    ``dtype``: the values' type (float64 for MLlib's linear models)."""
    from allreduce_param.errors import InputError

    if not hasattr(data, "columns"):  # an array column's series
        if data.isna().any():
            raise InputError(
                f"the column {column!r} is null in {int(data.isna().sum())} of the rows to "
                f"predict; drop them first, e.g. df.dropna(subset=[{column!r}])"
            )
        if not len(data):
            return np.zeros((0, width), dtype)
        try:
            return np.stack(data.to_numpy()).astype(dtype)
        except ValueError:
            raise InputError(
                f"the column {column!r} holds arrays of different lengths; every row needs the "
                "model's number of features"
            ) from None
    parts = VectorParts.from_pandas(data)
    if parts.null.any():
        raise InputError(
            f"the column {column!r} is null in {int(parts.null.sum())} of the rows to predict; "
            f"drop them first, e.g. df.dropna(subset=[{column!r}])"
        )
    sizes = np.unique(parts.size)
    if len(sizes) > 1:
        raise InputError(
            f"the column {column!r} holds vectors of {sizes[0]} to {sizes[-1]} elements; every "
            "row needs the model's number of features"
        )
    width = int(sizes[0]) if len(sizes) else width
    if is_sparse(int(parts.nonzeros().sum()), parts.rows, width):
        return parts.to_csr(width, dtype)
    return parts.to_dense(width, dtype)
