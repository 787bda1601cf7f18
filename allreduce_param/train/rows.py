"""A partition's rows as numpy arrays, and a features column as an array column.

Inside a task, ``arrays_from_arrow`` turns the partition's Arrow batches into one
contiguous float32 matrix, once, with no per-row Python objects, in the order the rows
were placed in; the labels, splits and (weighted data) weights come as arrays in that order.
``pair_chunks`` reads an RDD partition's numpy pairs into such chunks as they arrive,
which ``join_rows`` joins as it joins batches. On the driver, ``features_column`` reads a vector column as it is
(sparse or dense vectors, never densified) or an array column as ``array<float>``: what
the fit trains on and what predictions read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from allreduce_param.errors import InputError
from allreduce_param.spark import arrow
from allreduce_param.train.columns import ORDER_COLUMNS, TRAIN, WEIGHT_COLUMN
from allreduce_param.train.features import VectorParts
from allreduce_param.train.growing import GrowingArray
from allreduce_param.train.row_file import block_rows_for


def features_column(frame, features_col: str, name: str | None = None, role: str = "features_col"):
    """The column ``features_col`` of ``frame`` as the fit and predictions read it: a vector
    column (pyspark.ml.linalg) as it is, its parts reaching a task through Arrow
    (``features.VectorParts``), never densified; an array of numbers as ``array<float>``.
    A missing column or one of another type is an InputError naming ``role`` (the setting
    that named it) and, where given, which data (``name``: "training", "validation")."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, NumericType

    whose = f"the {name} " if name else "the "
    fields = {field.name: field.dataType for field in frame.schema.fields}
    if features_col not in fields:
        raise InputError(
            f"{whose}data has no column {features_col!r} ({role}); its columns are {sorted(fields)}"
        )
    kind = fields[features_col]
    if is_vector_type(kind):
        return F.col(features_col)
    if isinstance(kind, ArrayType) and isinstance(kind.elementType, NumericType):
        return F.col(features_col).cast("array<float>")
    raise InputError(
        f"{whose}column {features_col!r} is {kind.simpleString()}; it must be a vector "
        "(pyspark.ml.linalg) or an array of numbers, e.g. from VectorAssembler"
    )


def is_vector_type(kind) -> bool:
    """Whether a Spark data type is pyspark.ml's vector (``VectorUDT``)."""
    from pyspark.ml.linalg import VectorUDT

    return isinstance(kind, VectorUDT)


class BatchRows(NamedTuple):
    """One prepared Arrow batch's rows as numpy, in the batch's order: features (dense float32
    or CSR), labels, split codes, weights (or None) and the order keys (``ORDER_COLUMNS``'
    arrays, or None where the batch has no such columns)."""

    X: Any
    y: np.ndarray
    split: np.ndarray
    weight: np.ndarray | None
    keys: list[np.ndarray] | None


def batch_arrays(
    batch, n_features: int, sparse: bool = False, dtype: Any = np.float32
) -> BatchRows:
    """One prepared Arrow batch as numpy (``BatchRows``), its features as ``dtype`` (float64:
    the linear models'); ``arrays_from_arrow`` joins them. A batch without a ``split``
    column (the linear models' rows: all train) gets its rows' training code."""
    names = batch.schema.names

    def column(name: str) -> np.ndarray:
        return arrow.values(batch.column(batch.schema.get_field_index(name)))

    parts = VectorParts.from_arrow(batch.column(batch.schema.get_field_index("features")))
    return BatchRows(
        parts.to_csr(n_features, dtype) if sparse else parts.to_dense(n_features, dtype),
        column("label"),
        _splits(names, column, parts.rows),
        column(WEIGHT_COLUMN) if WEIGHT_COLUMN in names else None,
        [column(name) for name in ORDER_COLUMNS] if ORDER_COLUMNS[0] in names else None,
    )


def _splits(names: list[str], column, rows: int) -> np.ndarray:
    """A batch's split codes: its ``split`` column, or ``TRAIN`` for each of its ``rows``
    where it has none (the linear models' rows, which all train)."""
    return column("split") if "split" in names else np.full(rows, TRAIN, np.int32)


def arrays_from_arrow(
    batches, n_features: int, sparse: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The partition's prepared Arrow batches as ``(X [rows, n_features], y, split, weight)``:
    in (split, _order, _i) order where the batches carry ``ORDER_COLUMNS``, else as they came.
    ``X`` is float32, a CSR matrix (``scipy.sparse``) where ``sparse`` (the driver found the
    data sparse: ``features.is_sparse``), else a dense matrix. ``weight`` is the rows'
    float64 weights, in the same order, where the batches carry the ``weight`` column (data
    prepared with ``weight_col``), else None; None too for a partition without batches (no
    rows: nothing to weigh). Each batch is converted into place as it comes
    (``RowGatherer``)."""
    gatherer = RowGatherer(n_features, sparse)
    for batch in batches:
        gatherer.add_batch(batch)
        del batch  # let it go before the next one is read
    return gatherer.finish()


def join_rows(
    chunks: Iterable[BatchRows], n_features: int, sparse: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """A partition's rows, read in chunks (``BatchRows``: an Arrow batch's, or a run of an
    RDD's pairs), as one ``(X, y, split, weight)``: ``arrays_from_arrow``'s, in (split,
    _order, _i) order where the chunks carry order keys, else as they came."""
    gatherer = RowGatherer(n_features, sparse)
    for rows in chunks:
        gatherer.add(rows)
        del rows
    return gatherer.finish()


class RowGatherer:
    """A partition's rows gathered in place as they arrive, chunk by chunk: the features
    (float32, or ``dtype``: float64 for the linear models) in one growing matrix
    (``growing.GrowingArray``; a CSR matrix's values and column indices in two), an Arrow
    batch converted straight into it (``add_batch``), so the partition is never held twice;
    the labels, splits, weights and order keys copied (a view would keep its batch alive).
    Rows that come in (split, _order, _i) order (the stage has Spark sort them) stay where
    they were put; rows that do not are put in that order at the end, which takes a second
    copy of the features (``finish``)."""

    def __init__(self, n_features: int, sparse: bool = False, dtype: Any = np.float32) -> None:
        self.n_features, self.sparse, self.dtype = n_features, sparse, np.dtype(dtype)
        if sparse:
            index_type = np.int32 if n_features < 2**31 else np.int64
            self._values = GrowingArray((), self.dtype)
            self._columns = GrowingArray((), index_type)
            self._lengths: list[np.ndarray] = []
        else:
            self._X = GrowingArray((n_features,), self.dtype)
        self._labels = GrowingArray((), np.float64)
        self._splits = GrowingArray((), np.int32)
        self._weights: GrowingArray | None = None  # made by the first weighted chunk
        self._keys: tuple[GrowingArray, GrowingArray] | None = None  # (_order, _i), likewise
        self._last: tuple | None = None  # the latest row's (split, _order, _i)
        self._in_order = True
        self._row_count = 0
        self.nbytes = 0  # the features', labels' and weights' bytes gathered (``partition_bytes``)

    def add_batch(self, batch) -> None:
        """One prepared Arrow batch's rows, its features converted straight into place."""
        names = batch.schema.names

        def column(name: str) -> np.ndarray:
            return arrow.values(batch.column(batch.schema.get_field_index(name)))

        parts = VectorParts.from_arrow(batch.column(batch.schema.get_field_index("features")))
        if self.sparse:
            self._add_csr(parts.to_csr(self.n_features, self.dtype))
        else:
            parts.to_dense(self.n_features, out=self._X.next_rows(parts.rows))
        keys = [column(name) for name in ORDER_COLUMNS] if ORDER_COLUMNS[0] in names else None
        weight = column(WEIGHT_COLUMN) if WEIGHT_COLUMN in names else None
        self._add_columns(column("label"), _splits(names, column, parts.rows), weight, keys)

    def add(self, rows: BatchRows) -> None:
        """One chunk of rows already in numpy (``BatchRows``), copied into place."""
        if self.sparse:
            self._add_csr(rows.X)
        else:
            self._X.append(rows.X)
        self._add_columns(rows.y, rows.split, rows.weight, rows.keys)

    def _add_csr(self, X) -> None:
        self._values.append(X.data)
        self._columns.append(X.indices)
        self._lengths.append(np.diff(X.indptr))

    def _add_columns(self, y, split, weight, keys) -> None:
        self._labels.append(y)
        self._splits.append(split)
        if weight is not None:
            if self._weights is None:
                self._weights = GrowingArray((), np.float64)
            self._weights.append(weight)
        if keys is not None:
            if self._keys is None:
                self._keys = (GrowingArray((), np.int64), GrowingArray((), np.int64))
            order, index = (np.asarray(key, np.int64) for key in keys)
            for kept, key in zip(self._keys, (order, index)):
                kept.append(key)
            if self._in_order and len(index):
                split = np.asarray(split)
                self._in_order = in_key_order(self._last, split, order, index)
                self._last = (int(split[-1]), int(order[-1]), int(index[-1]))
        self._row_count += len(y)
        row_bytes = 8 * (1 + (weight is not None))
        features = self._values.nbytes + self._columns.nbytes if self.sparse else self._X.nbytes
        self.nbytes = features + row_bytes * self._row_count

    def taken(self) -> BatchRows:
        """The rows gathered so far as one chunk, the gatherer emptied (what it held is the
        chunk's now): to write them to a row file once "auto" finds they will not fit."""
        y, split, weight = self._columns_joined()
        keys = None if self._keys is None else [key.finish() for key in self._keys]
        self._keys = None
        return BatchRows(self._features(), y, split, weight, keys)

    def finish(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray | None]:
        """The partition's ``(X, y, split, weight)`` (``arrays_from_arrow``'s)."""
        y, split, weight = self._columns_joined()
        X = self._features()
        keys, self._keys = self._keys, None
        if keys is None or self._in_order:
            return X, y, split, weight
        order_key, index_key = (key.finish() for key in keys)
        order = np.lexsort((index_key, order_key, split))
        if self.sparse:
            X = X[order]
        else:  # a second copy of the features: rows that did not come sorted
            X = np.take(X, order, axis=0)
        return X, y[order], split[order], None if weight is None else weight[order]

    def _columns_joined(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        weight = None if self._weights is None else self._weights.finish()
        return self._labels.finish(), self._splits.finish(), weight

    def _features(self):
        if not self.sparse:
            return self._X.finish()
        from scipy.sparse import csr_matrix

        values, columns = self._values.finish(), self._columns.finish()
        indptr = np.zeros(sum(map(len, self._lengths)) + 1, np.int64)
        if self._lengths:
            np.cumsum(np.concatenate(self._lengths), out=indptr[1:])
        self._lengths = []
        if len(values) < 2**31 and columns.dtype == np.int32:
            indptr = indptr.astype(np.int32)
        else:
            columns = columns.astype(np.int64)
        return csr_matrix((values, columns, indptr), shape=(len(indptr) - 1, self.n_features))


def in_key_order(
    last: tuple | None, split: np.ndarray, order: np.ndarray, index: np.ndarray
) -> bool:
    """Whether a chunk's rows come in (split, _order, _i) order, after ``last`` (the row
    before them, or None)."""
    split = split.astype(np.int64)
    if last is not None:
        split, order, index = (np.r_[was, now] for was, now in zip(last, (split, order, index)))
    d_split, d_order, d_index = np.diff(split), np.diff(order), np.diff(index)
    ahead = (d_split > 0) | ((d_split == 0) & ((d_order > 0) | ((d_order == 0) & (d_index > 0))))
    return bool(ahead.all())


def pair_chunks(
    pairs: Iterable, n_features: int, chunk_rows: int | None = None
) -> Iterator[BatchRows]:
    """An RDD partition's ``(features, label)`` pairs as they arrive, ``chunk_rows`` at a
    time (by default about a row file's block, 1 MiB of features), each chunk a
    ``BatchRows`` of dense float32 features and float64 labels, all training rows,
    unweighted, without order keys. A pair that is not one, or whose features are not a
    vector of ``n_features`` numbers (the first row's width, which the model was built
    for), is an ``InputError`` naming its row in the partition."""
    if chunk_rows is None:
        chunk_rows = block_rows_for(4 * n_features + 8)
    X, y, filled = None, None, 0
    for row, pair in enumerate(pairs):
        if X is None:
            X, y = np.empty((chunk_rows, n_features), np.float32), np.empty(chunk_rows)
        X[filled], y[filled] = _pair_values(pair, row, n_features)
        filled += 1
        if filled == chunk_rows:
            _check_finite(X, y, row + 1 - filled)
            yield BatchRows(X, y, np.zeros(filled, np.int32), None, None)
            X, filled = None, 0
    if filled:
        _check_finite(X[:filled], y[:filled], row + 1 - filled)
        yield BatchRows(X[:filled], y[:filled], np.zeros(filled, np.int32), None, None)


def _check_finite(X: np.ndarray, y: np.ndarray, first_row: int) -> None:
    """Refuse a chunk of RDD pairs (from row ``first_row`` of the partition) holding NaN or
    Inf, naming the first such row: an RDD has no check pass on the driver, and a NaN would
    otherwise surface only as a NaN gradient a step later. A feature beyond float32's range
    is Inf here (the pairs are read as float32). One pass over the chunk, in cache."""
    if np.isfinite(X).all() and np.isfinite(y).all():
        return
    bad_rows = ~np.isfinite(X).all(axis=1) | ~np.isfinite(y)
    at = int(np.argmax(bad_rows))
    features = np.flatnonzero(~np.isfinite(X[at]))
    where = (
        f"feature {int(features[0])} is {X[at, features[0]]}"
        if features.size
        else f"its label is {y[at]}"
    )
    raise InputError(
        f"row {first_row + at} of this partition's RDD pairs holds NaN or Inf ({where}; a "
        "feature beyond float32's range reads as Inf); clean the pairs first, e.g. "
        "rdd.filter(lambda pair: np.isfinite(pair[0]).all() and np.isfinite(pair[1]))"
    )


def _pair_values(pair, row: int, n_features: int) -> tuple[np.ndarray, float]:
    """One pair's features (float32) and label, checked; ``row``: its place in the partition."""
    try:
        features, label = pair
    except (TypeError, ValueError):
        raise InputError(
            f"row {row} of this partition's RDD pairs is {type(pair).__name__}, not a "
            "(features, label) pair; fit() takes an RDD of (features, label) pairs, e.g. "
            "rdd.map(lambda r: (np.asarray(r[:-1]), r[-1]))"
        ) from None
    try:
        with np.errstate(over="ignore"):  # beyond float32 becomes Inf: refused, named, below
            vector, value = np.asarray(features, dtype=np.float32), float(label)
    except (TypeError, ValueError) as error:
        raise InputError(
            f"row {row} of this partition's RDD pairs holds a value that is not a number "
            f"({error}); a pair's features must be a vector of numbers and its label a number"
        ) from None
    if vector.shape != (n_features,):
        raise InputError(
            f"row {row} of this partition's RDD pairs has features of shape {vector.shape}; "
            f"every row's features must be a vector of {n_features} numbers, as the first "
            "row's (the model's n_features)"
        )
    return vector, value
