"""Which rows each worker trains on: the data-partition schemes, placed by Spark itself.

The fit's barrier stage runs ``workers`` tasks, and task k trains on partition k of its
input. These functions build that input: a DataFrame (or RDD) of exactly ``workers``
partitions whose partition k holds the rows a scheme gives worker k, in a deterministic
order, so that a fit is reproducible and a retried task sees the very same rows. The
schemes follow SystemML's parameter server (DC, DRR, DR, OR), plus Spark's own round robin:

- ``as_is``: the data's own partitions, one per worker, where that needs no shuffle: the
  data is cached (``df.cache()``), has exactly ``workers`` partitions and no validation rows,
  and Spark lets a barrier stage read it (not a union or a coalesce: SPARK-24820);
  otherwise each input partition's rows dealt out to the workers in turn, like Spark's
  ``repartition(workers)`` (which is what an RDD of pairs gets);
- ``contiguous`` (DC): disjoint contiguous ranges of the training rows;
- ``round_robin`` (DRR): training row i to worker ``i mod workers``;
- ``random`` (DR): each training row to a worker chosen by a seeded hash;
- ``overlap_reshuffle`` (OR): every training row to every worker, each in its own order.

i is a row's index in the input's own order (partition by partition, row by row), counted
separately for training and validation rows. Validation rows are never copied: outside
``as_is`` (which deals them out as it does the training rows), validation row i goes to
worker ``i mod workers``.

Rows move with one Spark shuffle by a computed key, their weights with them where the
data has them (``weight_col``); the driver sees only counts. The
order inside a partition travels as key columns (``data.ORDER_COLUMNS``) and the task
sorts by them, for less than Spark's sort of whole rows would cost. The DataFrame path
uses DataFrame functions only (it must also run under Spark Connect): a row's
index comes from ``monotonically_increasing_id()`` and the per-partition counts ``prepare``
took (``DataSummary.partition_counts``), and ``repartition(workers, key)`` sends it to
partition ``pmod(murmur3(key), workers)``, so each worker gets a key computed here whose
hash lands on it. Hashes of (seed, i) are Spark's ``xxhash64``, computed the same way in
Python for RDDs, so both paths place rows alike.
"""

from __future__ import annotations

import json
import operator
import weakref
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from itertools import accumulate
from typing import TYPE_CHECKING

import mmh3
import xxhash

from allreduce_param.errors import ConfigurationError
from allreduce_param.train.columns import ORDER_COLUMNS, TRAIN, VALIDATION, prepared_columns
from allreduce_param.train.driver.data import DataSummary, PartitionCount
from allreduce_param.train.settings import check_scheme

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import Column, DataFrame

#: monotonically_increasing_id() holds the partition index above this many bits, the row's
#: position in its partition below.
_POSITION_BITS = 33
_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1


def place_rows(
    prepared: DataFrame,
    workers: int,
    scheme: str,
    seed: int,
    partition_counts: Sequence[PartitionCount],
    *,
    weighted: bool = False,
) -> DataFrame:
    """The rows of ``prepared`` placed on ``workers`` partitions by ``scheme``.

    ``prepared`` is the DataFrame ``data.prepare`` returned (``features array<float>,
    label double, split int``, then ``weight double`` if prepared with ``weight_col``) and
    ``partition_counts`` its ``DataSummary.partition_counts``, counted by the same job that
    checked the data: pass that very DataFrame, not one derived from it, since a row's index
    comes from its partition and position in it. If the rows read now do not match those
    counts (a source that is not deterministic), the shuffle fails with a message saying so.
    ``weighted`` is its ``DataSummary.weighted``: whether the rows carry the weight column
    (the summary knows; asking the DataFrame would cost a round trip under Spark Connect).

    The result has the prepared columns (``columns.prepared_columns(weighted)``: a row's weight
    goes wherever the row goes, copies too), then ``data.ORDER_COLUMNS``, and exactly ``workers``
    partitions (some empty when there are fewer rows than workers); partition k holds worker
    k's rows, which sorted by (split, _order, _i) are in the order (split, i), or for
    ``overlap_reshuffle`` the training rows in the order of a seeded hash of (seed, k, i).
    ``random`` gives each worker about, not exactly, ``n / workers`` rows;
    ``overlap_reshuffle`` copies the training data ``workers`` times. The same input and
    seed give the same partitions, rows and order. ``as_is`` here deals each input
    partition's rows out in turn (see ``rows_in_place`` for when it keeps the data's own
    partitions instead). Runs no Spark job of its own.
    """
    from pyspark.sql import functions as F

    scheme = check_scheme(scheme)
    _check_workers(workers)
    seed = _check_seed(seed)
    names = prepared_columns(weighted)
    columns = [F.col(name) for name in names]
    indexed = prepared.select(*columns, F.monotonically_increasing_id().alias("_row"))
    keys = _constant_array(partition_keys(workers), "int")
    if scheme == "as_is":
        # Row p of input partition q to worker (q * 2**33 + p) mod workers: each partition's
        # rows in turn, without the index table (cheaper to plan), and the id orders them.
        row = F.col("_row")
        return indexed.repartition(
            workers, F.get(keys, F.pmod(row, F.lit(workers)).cast("int"))
        ).select(*names, row.alias(ORDER_COLUMNS[0]), row.alias(ORDER_COLUMNS[1]))

    table = _IndexTable(partition_counts)
    split = F.col("split")
    part = F.shiftright("_row", _POSITION_BITS).cast("int")
    pos = F.col("_row").bitwiseAND(F.lit((1 << _POSITION_BITS) - 1))
    start = F.when(split == TRAIN, table.lookup(TRAIN, "start", part)).otherwise(
        table.lookup(VALIDATION, "start", part)
    )
    end = F.when(split == TRAIN, table.lookup(TRAIN, "end", part)).otherwise(
        table.lookup(VALIDATION, "end", part)
    )
    base = F.when(split == TRAIN, table.lookup(TRAIN, "base", part)).otherwise(
        table.lookup(VALIDATION, "base", part)
    )
    mismatch = F.format_string(
        "row %d of partition %d of the prepared data is not among the rows prepare() counted "
        "there: the data changed between the two reads (a source that is not deterministic); "
        "make it deterministic first, e.g. df = df.localCheckpoint()",
        pos,
        part,
    )
    index = F.when(
        start.isNull() | (pos < start) | (pos >= end), F.raise_error(mismatch)
    ).otherwise(pos + base)
    with_index = indexed.select(*columns, index.cast("long").alias("_i"))

    i = F.col("_i")
    spread = F.pmod(i, F.lit(workers)).cast("int")  # validation rows: i mod workers
    seed_column = F.lit(seed).cast("long")
    if (
        scheme == "overlap_reshuffle"
    ):  # every training row to every worker: explode makes the copies
        targets = F.when(split == TRAIN, F.sequence(F.lit(0), F.lit(workers - 1))).otherwise(
            F.array(spread)
        )
        placed = with_index.select(*columns, "_i", F.explode(targets).alias("_worker"))
        order = F.when(
            split == TRAIN, F.xxhash64(seed_column, F.col("_worker").cast("long"), i)
        ).otherwise(i)
    else:
        if scheme == "contiguous":
            scaled, n_train = i * F.lit(workers), F.lit(max(table.rows(TRAIN), 1)).cast("long")
            # exact floor division
            target = ((scaled - F.pmod(scaled, n_train)) / n_train).cast("int")
        elif scheme == "round_robin":
            target = spread
        else:  # random
            target = F.pmod(F.xxhash64(seed_column, i), F.lit(workers)).cast("int")
        placed = with_index.select(
            *columns, "_i", F.when(split == TRAIN, target).otherwise(spread).alias("_worker")
        )
        order = i
    keyed = placed.select(
        *columns, "_i", order.alias("_order"), F.get(keys, F.col("_worker")).alias("_key")
    )
    return keyed.repartition(workers, "_key").select(*names, *ORDER_COLUMNS)


def rows_in_place(
    prepared: DataFrame, workers: int, scheme: str, summary: DataSummary
) -> DataFrame | None:
    """``prepared`` itself, when ``scheme`` is ``as_is`` and worker k may train on its
    partition k as it lies, with no shuffle: the data was cached when checked, has exactly
    ``workers`` partitions and no validation rows. Otherwise None: use ``place_rows``.

    Spark may still refuse a barrier stage over it (a union or coalesce in its lineage,
    SPARK-24820); the caller then calls ``refused_in_place`` and uses ``place_rows``.
    """
    if (
        check_scheme(scheme) != "as_is"
        or not summary.cached
        or summary.partition_num != workers
        or summary.rows(VALIDATION)
        or summary in _refused
    ):
        return None
    return prepared


def place_pairs(rdd: RDD, workers: int, scheme: str, seed: int) -> RDD:
    """An RDD of ``(features, label)`` pairs (all training rows) placed on ``workers`` partitions.

    The same schemes and orders as ``place_rows``, with the same seeded hashes, so both
    paths give a worker the same rows. ``as_is`` is ``rdd.repartition(workers)`` with the
    order inside each partition by i; the other schemes count the rows of each input
    partition (one small Spark job, as ``zipWithIndex`` runs) and shuffle the rows with an
    exact partitioner. ``random`` gives each worker about, not exactly,
    ``n / workers`` rows; ``overlap_reshuffle`` copies the data ``workers`` times.
    """
    scheme = check_scheme(scheme)
    _check_workers(workers)
    seed = _check_seed(seed)
    if scheme == "as_is":
        # (input partition, position) orders rows as i does, without a job to count them.
        positioned = rdd.mapPartitionsWithIndex(_positioned)
        return positioned.repartition(workers).mapPartitions(
            _sorted_values, preservesPartitioning=True
        )
    counts = rdd.mapPartitions(_count).collect()  # one small job: rows per input partition
    offsets, n = [0, *accumulate(counts)][:-1], sum(counts)

    def keyed(partition: int, rows: Iterable) -> Iterator:
        return _keyed(rows, offsets[partition], scheme, workers, seed, n)

    placed = rdd.mapPartitionsWithIndex(keyed).repartitionAndSortWithinPartitions(
        workers, partitionFunc=operator.itemgetter(0)
    )
    return placed.values()


#: For checked cached data: its placed DataFrames by (workers, scheme, seed).
_placed: weakref.WeakKeyDictionary[DataSummary, dict[tuple, DataFrame]] = (
    weakref.WeakKeyDictionary()
)


def place_rows_once(
    prepared: DataFrame, workers: int, scheme: str, seed: int, summary: DataSummary
) -> DataFrame:
    """``place_rows`` of data ``summary`` describes, built once per (workers, scheme, seed)
    where the data is cached, as ``prepare_once`` checks it once: several fits on the same
    cached data (a tuning loop) build the placement's query once, not its py4j calls each
    time. Spark still shuffles the rows on every fit; only the plan is kept. The rows carry
    their weights where the summary says the data has them (``DataSummary.weighted``)."""
    if not summary.cached:
        return place_rows(
            prepared, workers, scheme, seed, summary.partition_counts, weighted=summary.weighted
        )
    plans = _placed.setdefault(summary, {})
    key = (workers, check_scheme(scheme), seed)
    if key not in plans:
        plans[key] = place_rows(
            prepared, workers, scheme, seed, summary.partition_counts, weighted=summary.weighted
        )
    return plans[key]


#: Checked data whose own partitions Spark refused to a barrier stage: ``rows_in_place``
#: no longer offers them, so a fit on such data tries (and Spark warns) once.
_refused: weakref.WeakSet[DataSummary] = weakref.WeakSet()


def refused_in_place(summary: DataSummary) -> None:
    """Spark refused a barrier stage over the data ``summary`` describes, as it lies."""
    _refused.add(summary)


@lru_cache(maxsize=64)
def partition_keys(workers: int) -> tuple[int, ...]:
    """For each partition k < ``workers``, the smallest int whose Spark hash partitioning lands on k.

    ``repartition(workers, key)`` sends a row to ``pmod(murmur3_32(key, seed 42), workers)``
    (Spark's ``hash()``); computed here, so placing rows needs no Spark job.
    """
    _check_workers(workers)
    keys: list[int | None] = [None] * workers
    missing, value = workers, 0
    while missing:
        target = murmur3_int(value) % workers
        if keys[target] is None:
            keys[target] = value
            missing -= 1
        value += 1
    return tuple(keys)  # type: ignore[arg-type]


def murmur3_int(value: int, seed: int = 42) -> int:
    """Spark's ``hash()`` of one int column (Murmur3_x86_32 of its 4 little-endian bytes), signed."""
    return mmh3.hash((value & _MASK32).to_bytes(4, "little"), seed, signed=True)


def xxhash64(*values: int) -> int:
    """Spark's ``xxhash64()`` of long columns (seed 42): XXH64 of each value's 8 little-endian
    bytes, seeded with the hash so far; as a signed 64-bit int."""
    hashed = 42
    for value in values:
        hashed = xxhash.xxh64_intdigest((value & _MASK64).to_bytes(8, "little"), seed=hashed)
    return hashed - (1 << 64) if hashed >= 1 << 63 else hashed


def _check_workers(workers: int) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigurationError(f"num_workers must be a positive whole number, got {workers!r}")


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 63:
        raise ConfigurationError(f"seed must be a whole number that fits in 64 bits, got {seed!r}")
    return seed


class _IndexTable:
    """From the per-(split, partition) counts, per split and input partition: where its rows
    start and end in the partition, and what to add to a row's position to get its index i."""

    def __init__(self, partition_counts: Sequence[PartitionCount]) -> None:
        counts = sorted(PartitionCount(*count) for count in partition_counts)
        if not counts:
            raise ConfigurationError(
                "partition_counts is empty; pass the DataSummary.partition_counts that prepare() "
                "returned with the prepared DataFrame"
            )
        size = max(count.partition for count in counts) + 1
        self._rows = {TRAIN: 0, VALIDATION: 0}
        self._arrays: dict[tuple[int, str], list] = {
            (split, kind): [None] * size
            for split in (TRAIN, VALIDATION)
            for kind in ("start", "end", "base")
        }
        for count in counts:  # sorted: by split, then partition, i.e. in the input's order
            if count.split not in self._rows or count.partition < 0 or count.rows < 0:
                raise ConfigurationError(
                    f"partition_counts holds {count!r}, which prepare() does not make"
                )
            self._arrays[count.split, "start"][count.partition] = count.start
            self._arrays[count.split, "end"][count.partition] = count.start + count.rows
            self._arrays[count.split, "base"][count.partition] = (
                self._rows[count.split] - count.start
            )
            self._rows[count.split] += count.rows

    def rows(self, split: int) -> int:
        return self._rows[split]

    def lookup(self, split: int, kind: str, part: Column) -> Column:
        """The value for the row's input partition; null where the split has no rows there."""
        from pyspark.sql import functions as F

        return F.get(_constant_array(self._arrays[split, kind], "bigint"), part)


def _constant_array(values: Sequence[int | None], element: str) -> Column:
    """An array literal, made as one JSON string that Spark folds into a constant: one
    expression however long, where ``F.lit(list)`` makes one per element (slow to build)."""
    from pyspark.sql import functions as F

    return F.from_json(F.lit(json.dumps(list(values))), f"array<{element}>")


def _positioned(partition: int, rows: Iterable) -> Iterator:
    for position, row in enumerate(rows):
        yield (partition, position), row


def _sorted_values(pairs: Iterable) -> Iterator:
    for _, row in sorted(pairs, key=operator.itemgetter(0)):
        yield row


def _count(rows: Iterable) -> Iterator[int]:
    yield sum(1 for _ in rows)


def _keyed(rows: Iterable, first: int, scheme: str, workers: int, seed: int, n: int) -> Iterator:
    """``((worker, order, i), row)`` for each place a scheme gives row i; ``first`` is the
    index of the partition's first row."""
    for i, row in enumerate(rows, first):
        if scheme == "contiguous":
            yield (i * workers // n, i, i), row
        elif scheme == "round_robin":
            yield (i % workers, i, i), row
        elif scheme == "random":
            yield (xxhash64(seed, i) % workers, i, i), row
        else:
            for worker in range(workers):
                yield (worker, xxhash64(seed, worker, i), i), row
