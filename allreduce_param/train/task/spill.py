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

In memory, each Arrow batch is converted into place as it arrives (``rows.RowGatherer``):
the partition is held once, and its Python worker peaks at most ``PEAK_FACTOR`` times its
rows (``partition_bytes``). "auto" gathers in memory until the rows pass ``memory_budget``
(what the worker may use over ``PEAK_FACTOR``), then writes what it gathered and the rest
to disk, and logs which way it went. Writing reads each Arrow batch as it arrives, so a
partition is never whole in memory; an RDD of ``(features, label)`` pairs is read alike, in
chunks of about a block (``rows.pair_chunks``), and written in arrival order (an RDD has no
order keys). Both go through the same choice, writing and clean-up (``gather``, ``_hold``,
``write_partition``); the linear models' float64 rows go through the same choice
(``gather``, ``glm_rows``). After a shuffle, the stage has Spark sort each partition by its order
keys (``presorted``), and each batch goes straight to its place, in memory or in its
split's file. Where batches with order keys come unsorted (a caller other than the stage)
they go to one arrival file as they come, their keys (9 bytes a row, 17 under
``overlap_reshuffle``) stay in memory, and once all are in, each split's file is written
in key order from it, the arrival file then removed. The rows of each split are then in
the very order the in-memory path gives them.
"""

from __future__ import annotations

import glob
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain

import numpy as np
import xxhash

from allreduce_param.errors import TrainingError
from allreduce_param.train.columns import TRAIN, VALIDATION
from allreduce_param.train.row_file import RowFile, RowFileWriter, block_rows_for
from allreduce_param.train.rows import (
    BatchRows,
    RowGatherer,
    batch_arrays,
    in_key_order,
    join_rows,
    pair_chunks,
)
from allreduce_param.train.task.disk_rows import DiskRows
from allreduce_param.train.task.memory_rows import Rows

DATA_IN = ("memory", "disk", "auto")
FILE_PREFIX = "allreduce-rows-"
#: The in-memory path's peak, at most, in units of its partition (``partition_bytes``): the
#: rows gathered in place (``rows.RowGatherer``), one Arrow batch, the steps' rooms and the
#: order keys. "auto" keeps a partition in memory only where this many times it fits.
PEAK_FACTOR = 1.5

log = logging.getLogger(__name__)


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
    found = _proc_bytes("/proc/meminfo", "MemAvailable:")
    if found is not None:
        return found
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_budget(partitions: int, reserved: int = 0) -> int:
    """How many bytes of rows (``partition_bytes``) a partition keeps in memory under "auto":
    what this worker may use, less ``reserved`` (the model's vectors), over ``PEAK_FACTOR``.
    What it may use is what ``driver.memory.worker_allowance`` reads on the driver: the
    Python worker's limit (``spark.executor.pyspark.memory`` over the executor's cores, an
    address-space limit, so less the address space this worker already maps), else the
    machine's available memory shared by ``partitions`` tasks."""
    limit = pyspark_memory_limit()
    if limit is not None:
        allowance = limit - _address_space()
    else:
        allowance = available_memory() // max(1, partitions)
    return max(0, int((allowance - reserved) / PEAK_FACTOR))


def _address_space() -> int:
    """This process's address space now (``VmSize``), in bytes; 0 where not known."""
    return _proc_bytes("/proc/self/status", "VmSize:") or 0


def _proc_bytes(path: str, key: str) -> int | None:
    """The figure of the line starting with ``key`` in a /proc file of ``kB`` lines, in
    bytes; None where the file or the line is missing."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(key):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


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
    ("auto": in memory while the rows take at most ``budget`` bytes, ``partition_bytes``).
    ``presorted``: the batches come sorted by their order keys (Spark sorted them), so no
    arrival file. The caller ``release``s both on every way out."""

    def arrays(batch) -> BatchRows:
        return batch_arrays(batch, n_features, sparse)

    gatherer = RowGatherer(n_features, sparse)
    return _hold(
        iter(batches), gatherer, gatherer.add_batch, arrays, data_in, place, budget, presorted
    )


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
    files at ``place`` in arrival order ("auto": in memory while the rows take at most
    ``budget`` bytes). All rows train; the validation rows are empty. The caller
    ``release``s both on every way out."""
    gatherer = RowGatherer(n_features, False)
    chunks = pair_chunks(pairs, n_features)
    return _hold(chunks, gatherer, gatherer.add, lambda rows: rows, data_in, place, budget)


def _hold(
    items: Iterator,
    gatherer: RowGatherer,
    add: Callable,
    arrays: Callable,
    data_in: str,
    place: Place | None,
    budget: int | None,
    presorted: bool = False,
) -> tuple[Rows | DiskRows, Rows | DiskRows]:
    """A partition's rows, item by item (an Arrow batch, or a chunk of RDD pairs): gathered
    in memory (``add`` to ``gatherer``), or written to row files at ``place`` (each item's
    ``arrays``), as ``gather`` decides."""
    rest = gather(items, gatherer, add, arrays, data_in, budget, place)
    if rest is None:
        return split_rows(*gatherer.finish())
    return write_partition(rest, *_files(gatherer, place), presorted)


def gather(
    items: Iterator,
    gatherer: RowGatherer,
    add: Callable,
    arrays: Callable,
    data_in: str,
    budget: int | None,
    place: Place | None = None,
) -> Iterator[BatchRows] | None:
    """The one rule for where a partition's rows go, every fit's: None where they are all
    in ``gatherer`` (``add(item)`` for each item: "memory", or "auto" while the rows take
    at most ``budget`` bytes, ``RowGatherer.nbytes``); else the rows to write to disk, as
    ``BatchRows`` (each item's ``arrays``): all of them under "disk", and under "auto" what
    was gathered (taken out of ``gatherer``) then the rest, once they pass ``budget``.
    ``place``: where the files go, for the log."""
    if data_in == "disk":
        return map(arrays, items)
    for item in items:
        add(item)
        del item  # an Arrow batch let go of before the next is read
        if data_in == "auto" and budget is not None and gatherer.nbytes > budget:
            log.info(
                "data_in='auto': this partition's rows pass %.1f MB, more than 1/%s of what "
                "this worker may use: they go to disk (row files in %s)",
                budget / 1e6,
                PEAK_FACTOR,
                None if place is None else place.directory,
            )
            return chain(_taken(gatherer), map(arrays, items))
    if data_in == "auto":
        log.info(
            "data_in='auto': this partition's %.1f MB of rows stay in memory", gatherer.nbytes / 1e6
        )
    return None


def _files(gatherer: RowGatherer, place: Place | None) -> tuple:
    """``write_partition``'s width, sparseness and place for ``gatherer``'s rows."""
    if place is None:
        raise ValueError("rows on disk need a place for their files")
    return gatherer.n_features, gatherer.sparse, place


def _taken(gatherer: RowGatherer) -> Iterator[BatchRows]:
    """What ``gatherer`` holds, as one chunk that is let go of once written."""
    yield gatherer.taken()


def partition_bytes(
    rows: int, n_features: int, sparse_values: int | None = None, weighted: bool = False
) -> int:
    """A partition's size as this page counts it: its rows' bytes in the fit's dtypes, the
    features as float32 (dense: ``n_features`` a row; CSR: ``sparse_values`` values and
    their int32 column indices), a float64 label and, ``weighted``, a float64 weight a row.
    The in-memory path peaks at most ``PEAK_FACTOR`` times this."""
    features = 4 * n_features * rows if sparse_values is None else 8 * sparse_values
    return features + 8 * rows * (1 + weighted)


def split_rows(X, y: np.ndarray, split: np.ndarray, weight: np.ndarray | None) -> tuple[Rows, Rows]:
    """A partition's rows in memory as its (training, validation) ``Rows``: views of
    ``X`` where the training rows come first, then the validation rows (as ``RowGatherer``
    gathers them), else copies."""
    is_train = split == TRAIN
    n_train = int(is_train.sum())
    if is_train[:n_train].all() and (split[n_train:] == VALIDATION).all():
        weights = (None, None) if weight is None else (weight[:n_train], weight[n_train:])
        return (
            Rows(_row_range(X, 0, n_train), y[:n_train], weights[0]),
            Rows(_row_range(X, n_train, len(y)), y[n_train:], weights[1]),
        )
    # row numbers, not masks: a CSR matrix takes them alike
    train, valid = np.flatnonzero(is_train), np.flatnonzero(split == VALIDATION)
    return (
        Rows(X[train], y[train], None if weight is None else weight[train]),
        Rows(X[valid], y[valid], None if weight is None else weight[valid]),
    )


def _row_range(X, start: int, stop: int):
    """Rows ``start:stop`` of a dense or CSR matrix, sharing its memory (scipy's own row
    slice of a CSR matrix copies its values)."""
    if not hasattr(X, "indptr"):
        return X[start:stop]
    if start == 0 and stop == X.shape[0]:
        return X
    from scipy.sparse import csr_matrix

    first, last = X.indptr[start], X.indptr[stop]
    indptr = (X.indptr[start : stop + 1] - first).astype(X.indptr.dtype)
    return csr_matrix(
        (X.data[first:last], X.indices[first:last], indptr), shape=(stop - start, X.shape[1])
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
    order, index = (np.asarray(k, np.int64) for k in rows.keys)
    if not in_key_order(last, rows.split, order, index):
        raise TrainingError(
            "the partition's rows did not arrive sorted by (split, _order, _i) as the stage "
            "asked Spark to sort them (sortWithinPartitions); train with data_in='memory'"
        )
    return int(rows.split[-1]), int(order[-1]), int(index[-1])


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
