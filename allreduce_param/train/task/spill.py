"""Where a partition's rows live while it trains: in memory as today, or written once to row
files in the executor's local directory (``row_file``) and read back in blocks
(``disk_rows.DiskRows``). ``FitSettings.data_in`` chooses: "memory", "disk", or "auto"
(memory while the partition's Arrow batches, or its RDD pairs' arrays, stay within
``memory_budget``, else disk).

The files go to Spark's local directories for the executor (``SPARK_LOCAL_DIRS``, which
Spark sets for its Python workers from ``spark.local.dir``, or YARN's and Kubernetes' own;
the system's temporary directory outside Spark), one directory chosen by the partition, and
are named by the fit (a digest of its secret), the partition, the stage and the attempt:
``allreduce-rows-<fit>-p<partition>-s<stage>t<task attempt>-<split>.rows``. A task removes its
files on every way out; one killed outright (its Python worker gone) leaves them, and the
next attempt of the same partition removes every file of its fit and partition before
writing its own, and the next task of any fit there removes the files of every fit no
running task holds (``row_claims``: a cancelled fit's, whose Python workers were killed).
What Spark's local directories hold goes with the executor's directory when the
application ends.

Writing reads each Arrow batch as it arrives, so a partition is never whole in memory; an
RDD of ``(features, label)`` pairs is read alike, in chunks of about a block
(``rows.pair_chunks``), and written in arrival order (an RDD has no order keys). Both go
through the same choice, writing and clean-up (``choose_place``, ``_hold``, ``write_partition``).
With ``data_in="disk"`` after a shuffle, the stage has Spark sort each partition by its
order keys (``presorted``), and each batch goes straight to its split's file. Otherwise,
where the batches carry order keys (a placement that shuffled them, ``columns.ORDER_COLUMNS``)
the rows arrive in no fixed order: they go to one arrival file as they come, their keys (9
bytes a row, 17 under ``overlap_reshuffle``) stay in memory, and once all are in, each
split's file is written in key order from it, the arrival file then removed. The rows of
each split are then in the very order the in-memory path gives them.
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain

import numpy as np
import xxhash

from allreduce_param.errors import TrainingError
from allreduce_param.train.columns import TRAIN, VALIDATION
from allreduce_param.train.row_file import RowFile, RowFileWriter, block_rows_for
from allreduce_param.train.rows import BatchRows, batch_arrays, join_rows, pair_chunks
from allreduce_param.train.task.disk_rows import DiskRows
from allreduce_param.train.task.memory_rows import Rows

DATA_IN = ("memory", "disk", "auto")
FILE_PREFIX = "allreduce-rows-"
#: The share of the Python worker's memory limit a partition may take in memory under
#: "auto": the in-memory path holds a partition about twice while it loads (the Arrow
#: batches and the matrix made of them), and the model, its gradient and the blocks need room.
LIMIT_SHARE = 0.25


def pyspark_memory_limit() -> int | None:
    """The Python worker's memory limit in bytes: ``spark.executor.pyspark.memory`` (which
    Spark passes as ``PYSPARK_EXECUTOR_MEMORY_MB`` and the worker sets as RLIMIT_AS), else
    an address-space limit set otherwise; None where there is none."""
    megabytes = os.environ.get("PYSPARK_EXECUTOR_MEMORY_MB")
    if megabytes and megabytes.isdigit():
        return int(megabytes) << 20
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def available_memory() -> int:
    """The machine's available memory in bytes (``MemAvailable``), or its free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_budget(partitions: int) -> int:
    """How many bytes of Arrow batches a partition keeps in memory under "auto": a quarter of
    the Python worker's limit (``pyspark_memory_limit``), or without one the machine's
    available memory shared by ``partitions`` tasks, halved for the copy loading makes."""
    limit = pyspark_memory_limit()
    if limit is not None:
        return int(limit * LIMIT_SHARE)
    return available_memory() // (2 * max(1, partitions))


def local_directory(partition: int) -> str:
    """The local directory a partition's files go to: one of Spark's (``SPARK_LOCAL_DIRS``),
    chosen by the partition, else the system's temporary directory."""
    folders = [f for f in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if f.strip()]
    if not folders:
        return tempfile.gettempdir()
    return folders[partition % len(folders)].strip()


@dataclass(frozen=True)
class Place:
    """Where and under which names one task attempt's files go."""

    directory: str
    fit: str  # the fit's key: a digest of its secret
    partition: int
    attempt: str  # the stage and the task attempt, e.g. "s12t40"

    @property
    def prefix(self) -> str:
        """What every file of this fit's partition is named from, whichever attempt made it."""
        return f"{FILE_PREFIX}{self.fit}-p{self.partition}-"

    def path(self, section: str) -> str:
        return os.path.join(self.directory, f"{self.prefix}{self.attempt}-{section}.rows")

    def remove_leftovers(self) -> list[str]:
        """Remove the files an earlier attempt of this partition left (killed before its own
        clean-up ran); the paths removed."""
        removed = []
        for path in glob.glob(os.path.join(glob.escape(self.directory), self.prefix + "*")):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
        return removed

    @classmethod
    def of_task(cls, secret: bytes) -> Place:
        """This Spark task's place (outside a task: partition 0, attempt "local")."""
        fit = xxhash.xxh3_64_hexdigest(secret)[:12]
        try:
            from pyspark import TaskContext

            context = TaskContext.get()
        except ImportError:
            context = None
        if context is None:
            return cls(local_directory(0), fit, 0, "local")
        partition = context.partitionId()
        attempt = f"s{context.stageId()}t{context.taskAttemptId()}"
        return cls(local_directory(partition), fit, partition, attempt)


def partition_rows(
    batches: Iterable,
    n_features: int,
    sparse: bool,
    data_in: str,
    place: Place | None = None,
    budget: int | None = None,
    presorted: bool = False,
) -> tuple[Rows | DiskRows, Rows | DiskRows]:
    """A partition's prepared Arrow batches as its (training, validation) rows: in memory
    (``memory_rows.Rows``) or in row files at ``place`` (``DiskRows``), as ``data_in`` says
    ("auto": in memory while the batches take at most ``budget`` bytes). ``presorted``: the
    batches come sorted by their order keys (Spark sorted them), so no arrival file. The
    caller ``release``s both on every way out."""

    def arrays(batch) -> BatchRows:
        return batch_arrays(batch, n_features, sparse)

    chosen, held, rest = choose_place(iter(batches), data_in, budget, lambda batch: batch.nbytes)
    return _hold(map(arrays, chain(held, rest)), n_features, sparse, chosen, place, presorted)


def pair_rows(
    pairs: Iterable,
    n_features: int,
    data_in: str,
    place: Place | None = None,
    budget: int | None = None,
) -> tuple[Rows | DiskRows, Rows | DiskRows]:
    """A partition of an RDD of ``(features, label)`` pairs as its (training, validation)
    rows, as ``partition_rows`` holds Arrow batches: read in chunks as the pairs arrive
    (``rows.pair_chunks``, never the whole partition as a list), in memory or written to row
    files at ``place`` in arrival order ("auto": in memory while the chunks' arrays take at
    most ``budget`` bytes). All rows train; the validation rows are empty. The caller
    ``release``s both on every way out."""
    chosen, held, rest = choose_place(pair_chunks(pairs, n_features), data_in, budget, _chunk_bytes)
    return _hold(chain(held, rest), n_features, False, chosen, place)


def choose_place(
    items: Iterator, data_in: str, budget: int | None, size
) -> tuple[str, list, Iterator]:
    """Where a partition's rows go ("memory" or "disk"), the items read to decide, and the
    rest: under "auto", items are read until their ``size`` passes ``budget`` (disk) or
    none are left (memory)."""
    held: list = []
    if data_in != "auto":
        return data_in, held, items
    total = 0
    for item in items:
        held.append(item)
        total += size(item)
        if budget is not None and total > budget:
            return "disk", held, items
    return "memory", held, items


def _hold(
    rows: Iterator[BatchRows],
    n_features: int,
    sparse: bool,
    data_in: str,
    place: Place | None,
    presorted: bool = False,
) -> tuple[Rows | DiskRows, Rows | DiskRows]:
    """A partition's rows, chunk by chunk, in memory or written to row files at ``place``."""
    if data_in == "memory":
        return split_rows(*join_rows(rows, n_features, sparse))
    if place is None:
        raise ValueError("rows on disk need a place for their files")
    return write_partition(rows, n_features, sparse, place, presorted)


def _chunk_bytes(rows: BatchRows) -> int:
    """The bytes a chunk of dense rows holds."""
    return rows.X.nbytes + rows.y.nbytes + rows.split.nbytes


def split_rows(X, y: np.ndarray, split: np.ndarray, weight: np.ndarray | None) -> tuple[Rows, Rows]:
    """A partition's rows in memory as its (training, validation) ``Rows``."""
    # row numbers, not masks: a CSR matrix takes them alike
    train, valid = np.flatnonzero(split == TRAIN), np.flatnonzero(split == VALIDATION)
    return (
        Rows(X[train], y[train], None if weight is None else weight[train]),
        Rows(X[valid], y[valid], None if weight is None else weight[valid]),
    )


def write_partition(
    chunks: Iterator[BatchRows],
    n_features: int,
    sparse: bool,
    place: Place,
    presorted: bool = False,
) -> tuple[Rows | DiskRows, Rows | DiskRows]:
    """A partition's rows, chunk by chunk as they are read (an Arrow batch's, or a run of an
    RDD's pairs), written to row files at ``place`` (an earlier attempt's removed first), as
    (training, validation) ``DiskRows``; a partition without rows stays in memory, empty.
    ``presorted``: chunks with order keys come in key order (checked as they come)."""
    place.remove_leftovers()
    writers: dict[str, RowFileWriter] = {}
    try:
        return _write(chunks, n_features, sparse, place, writers, presorted)
    except BaseException:
        for writer in writers.values():
            writer.abandon()
        place.remove_leftovers()
        raise


def _write(
    chunks: Iterator[BatchRows],
    n_features: int,
    sparse: bool,
    place: Place,
    writers: dict,
    presorted: bool,
) -> tuple:
    keys: list[tuple] = []
    last: tuple | None = None  # presorted: the latest row's keys
    for rows in chunks:
        if rows.y.shape[0] == 0:
            continue
        if presorted and rows.keys is not None:
            last = _check_sorted(rows, last)
        if not writers:
            block_rows = block_rows_for(_row_bytes(rows))
            weighted = rows.weight is not None
            arrival = rows.keys is not None and not presorted
            sections = ("arrival",) if arrival else ("train", "validation")
            for section in sections:
                writers[section] = RowFileWriter(
                    place.path(section), n_features, block_rows, sparse, weighted
                )
        if "arrival" in writers:
            writers["arrival"].append(rows.X, rows.y, rows.weight)
            keys.append(_keys(rows))
            continue
        for code, section in ((TRAIN, "train"), (VALIDATION, "validation")):
            chosen = rows.split == code
            if chosen.all():
                writers[section].append(rows.X, rows.y, rows.weight)
            elif chosen.any():
                index = np.flatnonzero(chosen)
                weight = None if rows.weight is None else rows.weight[index]
                writers[section].append(rows.X[index], rows.y[index], weight)
    if not writers:
        return split_rows(*join_rows([], n_features, sparse))
    if "arrival" not in writers:
        return DiskRows(writers.pop("train").close()), DiskRows(writers.pop("validation").close())
    arrival = writers.pop("arrival").close()
    try:
        return _in_key_order(arrival, keys, place, writers)
    finally:
        DiskRows(arrival).release()


def _check_sorted(rows, last: tuple | None) -> tuple:
    """That a batch's rows come in (split, _order, _i) order after ``last``; its last row's
    keys. Rows out of order are an error (Spark sorted them: a change in that contract)."""
    split = rows.split.astype(np.int64)
    order, index = (np.asarray(k, np.int64) for k in rows.keys)
    if last is not None:
        split, order, index = (np.r_[was, now] for was, now in zip(last, (split, order, index)))
    d_split, d_order, d_index = np.diff(split), np.diff(order), np.diff(index)
    ahead = (d_split > 0) | ((d_split == 0) & ((d_order > 0) | ((d_order == 0) & (d_index > 0))))
    if not ahead.all():
        raise TrainingError(
            "the partition's rows did not arrive sorted by (split, _order, _i) as the stage "
            "asked Spark to sort them (sortWithinPartitions); train with data_in='auto'"
        )
    return int(split[-1]), int(order[-1]), int(index[-1])


def _keys(rows) -> tuple:
    """A batch's order keys as kept until the partition is whole: the split (int8), the
    ``_i`` column, and ``_order`` only where it differs from ``_i`` (every scheme but
    ``overlap_reshuffle`` orders by ``_i``). Copies: a numpy view of an Arrow column keeps
    the batch's whole body alive."""
    order, index = rows.keys
    same = np.array_equal(order, index)
    return rows.split.astype(np.int8), np.array(index), None if same else np.array(order)


def _in_key_order(arrival: RowFile, keys: list, place: Place, writers: dict) -> tuple:
    """Each split's rows of the arrival file written in (split, _order, _i) order: the order
    ``rows.arrays_from_arrow`` sorts them into."""
    split = np.concatenate([k[0] for k in keys])
    index_key = np.concatenate([k[1] for k in keys])
    if all(k[2] is None for k in keys):  # _order is _i: one key
        order_key = None
    else:
        order_key = np.concatenate([k[1] if k[2] is None else k[2] for k in keys])
    del keys[:]
    out = []
    for code, section in ((TRAIN, "train"), (VALIDATION, "validation")):
        chosen = np.flatnonzero(split == code)
        if order_key is None:
            chosen = chosen[np.argsort(index_key[chosen], kind="stable")]
        else:
            chosen = chosen[np.lexsort((index_key[chosen], order_key[chosen]))]
        writer = writers[section] = RowFileWriter(
            place.path(section),
            arrival.n_features,
            arrival.block_rows,
            arrival.sparse,
            arrival.weighted,
        )
        for start in range(0, len(chosen), arrival.block_rows):
            writer.append(*arrival.take(chosen[start : start + arrival.block_rows]))
        out.append(DiskRows(writers.pop(section).close()))
    return tuple(out)


def _row_bytes(rows) -> float:
    """About how many bytes a row of this batch takes in a row file."""
    count = rows.y.shape[0]
    extra = 8 + (8 if rows.weight is not None else 0)
    if hasattr(rows.X, "indptr"):
        return extra + 8 + rows.X.nnz * 8 / count
    return extra + 4 * rows.X.shape[1]
