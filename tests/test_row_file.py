"""Partitions on disk, Spark-free: the row file's format and checks, the block-wise epoch
order, a partition's Arrow batches written as they come (in memory and on disk the same
rows), the local directory's errors, leftovers of a killed attempt, and a fit from row files
giving the same bits as from memory."""

import os

import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp
from conftest import blobs

from allreduce_param import (
    ConfigurationError,
    FitSettings,
    InputError,
    TrainingError,
    models,
    optim,
)
from allreduce_param.engine import AllReduceParameter, LocalRendezvous
from allreduce_param.train import Regularization
from allreduce_param.train.row_file import RowFileWriter, read_header
from allreduce_param.train.task.batching import epoch_order
from allreduce_param.train.task.disk_rows import DiskRows, block_epoch_order
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.spill import Place, pair_rows, partition_rows

CSR = pytest.param(True, id="sparse")
DENSE = pytest.param(False, id="dense")


def _matrix(rows: int, features: int, sparse: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    if sparse:
        return sp.random(rows, features, 0.2, "csr", np.float32, rng)
    return rng.standard_normal((rows, features)).astype(np.float32)


def _dense(X):
    return X.toarray() if sp.issparse(X) else X


@pytest.mark.parametrize("sparse", [DENSE, CSR])
def test_rows_read_back_by_index_and_range_as_written(tmp_path, sparse):
    X, rng = _matrix(53, 7, sparse), np.random.default_rng(1)
    y, w = rng.standard_normal(53), rng.random(53)
    writer = RowFileWriter(str(tmp_path / "r.rows"), 7, 10, sparse, weighted=True)
    for start in range(0, 53, 17):  # appends that do not line up with the blocks
        writer.append(X[start : start + 17], y[start : start + 17], w[start : start + 17])
    file = writer.close()
    assert read_header(file.path) == {
        "sparse": sparse,
        "weighted": True,
        "float64": False,
        "n_features": 7,
        "block_rows": 10,
        "rows": 53,
        "blocks": 6,
    }
    index = rng.permutation(53)[:31]
    got = file.take(index)
    np.testing.assert_array_equal(_dense(got.X), _dense(X[index]))
    np.testing.assert_array_equal(got.y, y[index])
    np.testing.assert_array_equal(got.weight, w[index])
    part = file.range(8, 33)
    np.testing.assert_array_equal(_dense(part.X), _dense(X[8:33]))
    epoch = block_epoch_order(53, 10, 0, 1, 0)[5:40]  # whole blocks in turn
    np.testing.assert_array_equal(_dense(file.take(epoch).X), _dense(X[epoch]))
    np.testing.assert_array_equal(file.take(epoch).weight, w[epoch])
    assert file.take(np.zeros(0, np.int64)).X.shape == (0, 7)
    file.close()


def test_batches_of_changing_sizes_from_disk_are_memorys_rows(tmp_path):
    """DiskRows fills one buffer batch after batch: each answer holds exactly its rows."""
    X, y = _matrix(53, 7, False), np.arange(53, dtype=np.float64)
    writer = RowFileWriter(str(tmp_path / "r.rows"), 7, 10, False, weighted=False)
    writer.append(X, y)
    rows, order = DiskRows(writer.close()), block_epoch_order(53, 10, 3, 0, 0)
    for start, stop in ((0, 20), (20, 27), (27, 53)):  # longer, shorter, longer again
        got = rows.take(order[start:stop])
        np.testing.assert_array_equal(got.X, X[order[start:stop]])
        np.testing.assert_array_equal(got.y, y[order[start:stop]])
    for start in range(0, 53, 25):
        np.testing.assert_array_equal(rows.rows_between(start, start + 25).X, X[start : start + 25])
    rows.release()


def test_one_block_orders_as_in_memory_and_blocks_stay_whole():
    np.testing.assert_array_equal(block_epoch_order(90, 90, 7, 2, 1), epoch_order(90, 7, 2, 1))
    order = block_epoch_order(95, 10, 7, 2, 1)
    assert sorted(order) == list(range(95))
    blocks = order // 10
    assert np.count_nonzero(np.diff(blocks)) == 9  # ten blocks, each visited once, whole
    assert not np.array_equal(blocks, np.sort(blocks))  # in a shuffled order
    assert not np.array_equal(order, block_epoch_order(95, 10, 7, 3, 1))  # anew each epoch


def _file(tmp_path, rows=40, block_rows=10):
    writer = RowFileWriter(str(tmp_path / "p.rows"), 4, block_rows, False, weighted=False)
    writer.append(_matrix(rows, 4, False), np.arange(rows, dtype=np.float64))
    return writer.close()


def test_a_block_changed_after_writing_is_an_error_naming_the_file(tmp_path):
    file = _file(tmp_path)
    file.take(np.arange(40))  # fine as written
    file.close()
    with open(file.path, "r+b") as raw:
        raw.seek(file.offsets[2] + 48 + 100)
        byte = raw.read(1)
        raw.seek(-1, os.SEEK_CUR)
        raw.write(bytes([byte[0] ^ 1]))
    file.take(np.arange(20))  # blocks 0 and 1 are intact
    with pytest.raises(TrainingError, match=f"{file.path} is damaged: block 2 does not match"):
        file.take(np.arange(20, 30))


def test_a_file_cut_short_is_an_error_naming_the_file(tmp_path):
    file = _file(tmp_path)
    os.truncate(file.path, file.offsets[3] + 20)
    with pytest.raises(TrainingError, match=f"{file.path} is damaged: block 3 is cut short"):
        file.range(0, 40)


def test_a_local_directory_not_writable_names_it_and_spark_local_dir(tmp_path):
    not_a_folder = tmp_path / "plain-file"
    not_a_folder.write_text("")
    with pytest.raises(TrainingError, match=f"{not_a_folder} is not writable.*spark.local.dir"):
        RowFileWriter(str(not_a_folder / "p.rows"), 4, 10, False, False)


def test_a_full_local_directory_names_it_and_spark_local_dir(tmp_path):
    full = tmp_path / "full.rows"
    full.symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(ConfigurationError, match=f"{tmp_path} is full.*spark.local.dir"):
        writer = RowFileWriter(str(full), 4, 10, False, False)
        writer.append(_matrix(30, 4, False), np.zeros(30))
        writer.close()


def _batches(X, y, split, weight=None, keys=None, size=13, order=None):
    """Prepared Arrow batches of ``size`` rows (``features array<float>``, label, split,
    then weight and ``_order``/``_i`` where given)."""
    out = []
    for start in range(0, len(y), size):
        stop = start + size
        columns = {
            "features": pa.array([row.tolist() for row in X[start:stop]], pa.list_(pa.float32())),
            "label": pa.array(y[start:stop], pa.float64()),
            "split": pa.array(split[start:stop], pa.int32()),
        }
        if weight is not None:
            columns["weight"] = pa.array(weight[start:stop], pa.float64())
        if keys is not None:
            ordered = keys if order is None else order
            columns["_order"] = pa.array(ordered[start:stop], pa.int64())
            columns["_i"] = pa.array(keys[start:stop], pa.int64())
        out.append(pa.RecordBatch.from_pydict(columns))
    return out


@pytest.mark.parametrize(
    "shuffled", ["no", "by _i", "by _order"], ids=["in order", "keys", "keys, _order not _i"]
)
def test_a_partition_on_disk_holds_the_rows_memory_would(tmp_path, shuffled):
    rng = np.random.default_rng(4)
    X, y = _matrix(70, 5, False), rng.standard_normal(70)
    split, weight = (rng.random(70) < 0.3).astype(np.int32), rng.random(70) + 0.5
    keys = None if shuffled == "no" else rng.permutation(70)
    order = rng.integers(0, 9, 70) if shuffled == "by _order" else None  # ties: _i decides
    batches = _batches(X, y, split, weight, keys, order=order)
    memory = partition_rows(batches, 5, False, "memory")
    place = Place(str(tmp_path), "fit", 3, "s1a0t0")
    with pytest.MonkeyPatch.context() as patch:  # blocks of 8 rows: several per split
        patch.setattr("allreduce_param.train.task.spill.block_rows_for", lambda _: 8)
        disk = partition_rows(iter(batches), 5, False, "disk", place)
    assert isinstance(disk[0], DiskRows)
    assert sorted(os.listdir(tmp_path)) == [  # the arrival file is gone
        "allreduce-rows-fit-p3-s1a0t0-train.rows",
        "allreduce-rows-fit-p3-s1a0t0-validation.rows",
    ]
    for in_memory, on_disk in zip(memory, disk):
        got = on_disk.rows_between(0, on_disk.row_count)
        np.testing.assert_array_equal(got.X, in_memory.X)
        np.testing.assert_array_equal(got.y, in_memory.y)
        np.testing.assert_array_equal(got.weight, in_memory.weight)
        on_disk.release()
    assert os.listdir(tmp_path) == []


def test_auto_keeps_a_small_partition_in_memory_and_spills_a_large_one(tmp_path):
    X, y = _matrix(40, 5, False), np.arange(40.0)
    batches = _batches(X, y, np.zeros(40, np.int32))
    place = Place(str(tmp_path), "fit", 0, "s1a0t0")
    small, _ = partition_rows(batches, 5, False, "auto", place, budget=1 << 20)
    large, _ = partition_rows(batches, 5, False, "auto", place, budget=500)
    assert not isinstance(small, DiskRows) and isinstance(large, DiskRows)
    np.testing.assert_array_equal(large.rows_between(0, 40).X, small.X)
    large.release()


def test_a_new_attempt_removes_what_a_killed_one_left(tmp_path):
    left = tmp_path / "allreduce-rows-fit-p2-s4a0t0-train.rows"  # its task was killed
    left.write_bytes(b"x" * 100)
    other = tmp_path / "allreduce-rows-fit-p1-s4a0t0-train.rows"  # another partition's
    other.write_bytes(b"y")
    X, y = _matrix(20, 5, False), np.arange(20.0)
    place = Place(str(tmp_path), "fit", 2, "s4a0t1")
    rows, validation = partition_rows(
        _batches(X, y, np.zeros(20, np.int32)), 5, False, "disk", place
    )
    assert not left.exists() and other.exists()
    rows.release()
    validation.release()


def _pairs(rows: int, features: int = 5, seed: int = 0) -> list:
    X, y = _matrix(rows, features, False, seed), np.random.default_rng(seed).standard_normal(rows)
    return [(X[i].astype(np.float64), y[i]) for i in range(rows)]  # as an RDD holds them


def test_rdd_pairs_on_disk_are_in_arrival_order_and_memorys_rows(tmp_path):
    pairs = _pairs(50)
    memory, _ = pair_rows(iter(pairs), 5, "memory")
    place = Place(str(tmp_path), "fit", 1, "s2t3")
    with pytest.MonkeyPatch.context() as patch:  # chunks of 8 pairs, blocks of 16 rows
        patch.setattr("allreduce_param.train.rows.block_rows_for", lambda _: 8)
        patch.setattr("allreduce_param.train.task.spill.block_rows_for", lambda _: 16)
        rows, validation = pair_rows(iter(pairs), 5, "disk", place)
    assert sorted(os.listdir(tmp_path)) == [
        "allreduce-rows-fit-p1-s2t3-train.rows",
        "allreduce-rows-fit-p1-s2t3-validation.rows",
    ]
    assert read_header(rows.file.path)["blocks"] == 4 and validation.row_count == 0
    got = rows.rows_between(0, 50)
    np.testing.assert_array_equal(got.X, np.asarray([x for x, _ in pairs], np.float32))
    np.testing.assert_array_equal(got.y, [label for _, label in pairs])
    np.testing.assert_array_equal(got.X, memory.X)
    assert got.weight is None and memory.weight is None
    rows.release()
    validation.release()
    assert os.listdir(tmp_path) == []


def test_auto_keeps_few_rdd_pairs_in_memory_and_spills_many(tmp_path):
    place = Place(str(tmp_path), "fit", 0, "s1t1")
    small, _ = pair_rows(iter(_pairs(40)), 5, "auto", place, budget=1 << 20)
    large, empty = pair_rows(iter(_pairs(40)), 5, "auto", place, budget=100)
    assert not isinstance(small, DiskRows) and isinstance(large, DiskRows)
    np.testing.assert_array_equal(large.rows_between(0, 40).X, small.X)
    large.release()
    empty.release()


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            (np.ones(4), 1.0),
            r"row 20 of this partition's RDD pairs has features of shape \(4,\); every "
            r"row's features must be a vector of 5 numbers",
        ),
        ((np.ones((1, 5)), 1.0), r"row 20 .* shape \(1, 5\)"),
        (
            np.ones(5),
            r"row 20 of this partition's RDD pairs is ndarray, not a \(features, label\) pair",
        ),
        (
            (["a"] * 5, 1.0),
            r"row 20 of this partition's RDD pairs holds a value that is not a number",
        ),
        (
            (np.array([1.0, 2.0, np.nan, 4.0, 5.0]), 1.0),
            r"row 20 of this partition's RDD pairs holds NaN or Inf \(feature 2 is nan;",
        ),
        ((np.ones(5), float("inf")), r"row 20 .* holds NaN or Inf \(its label is inf;"),
        ((np.array([1.0, 1e39, 1, 1, 1]), 1.0), r"row 20 .* \(feature 1 is inf; a feature beyond"),
    ],
    ids=["narrow", "a matrix", "not a pair", "not numbers", "NaN", "Inf label", "beyond f32"],
)
def test_a_bad_rdd_pair_is_an_error_naming_its_row_and_leaves_no_file(tmp_path, bad, message):
    pairs = _pairs(30)
    pairs[20] = bad
    place = Place(str(tmp_path), "fit", 0, "s1t1")
    with pytest.MonkeyPatch.context() as patch:  # two chunks written before the bad row
        patch.setattr("allreduce_param.train.rows.block_rows_for", lambda _: 8)
        for data_in in ("memory", "disk"):
            with pytest.raises(InputError, match=message):
                pair_rows(iter(pairs), 5, data_in, place)
    assert os.listdir(tmp_path) == []


def _fit(job, parts):
    """The fit on threads, each partition's (train, validation) rows as given."""
    import threading

    from allreduce_param.train.task.worker import train_rows

    group, outputs = LocalRendezvous(len(parts)), [None] * len(parts)

    def run(i):
        try:
            outputs[i] = dict(train_rows(job, *parts[i], rendezvous=group.member(i)))
        except BaseException as error:  # the test shows it
            outputs[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(parts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(isinstance(o, dict) for o in outputs), outputs
    return np.frombuffer(outputs[0]["weights"], np.float32)


@pytest.mark.parametrize("sparse", [DENSE, CSR])
def test_a_fit_from_row_files_of_one_block_gives_the_bits_of_one_from_memory(tmp_path, sparse):
    X, y = blobs(90, 6, 3, seed=2)
    if sparse:
        X = sp.csr_matrix(np.where(np.abs(X) > 1.5, X, 0).astype(np.float32))
    split = (np.arange(90) % 5 == 0).astype(np.int32)
    model = models.SoftmaxRegression(6, 3)
    settings = FitSettings(
        batch_size=16, epochs=3, seed=9, regularization=Regularization(0.01, standardization=True)
    )
    param = AllReduceParameter(2, model.size, codec="raw", timeout=60)
    job = TrainingJob(model, optim.Adam(lr=0.05), param, settings, 6, has_validation=True)
    from allreduce_param.train.task.spill import split_rows

    halves = [(X[:45], y[:45], split[:45]), (X[45:], y[45:], split[45:])]
    memory = [split_rows(*half, None) for half in halves]
    disk = []
    for i, (train, valid) in enumerate(memory):
        pair = []
        for name, rows in (("train", train), ("validation", valid)):
            writer = RowFileWriter(str(tmp_path / f"{i}{name}"), 6, 1000, sparse, False)
            writer.append(rows.X, rows.y)
            pair.append(DiskRows(writer.close()))
        disk.append(pair)
    np.testing.assert_array_equal(_fit(job, disk), _fit(job, memory))


def test_shared_segments_are_sized_by_the_parameter():
    from allreduce_param.engine.blocks.shm import LARGEST_ARENA, arena_size

    part = 2 << 20  # each encoded part takes a buffer of its own
    assert arena_size(513, 2, part) == 4 * part  # a small model maps 8 MiB, not 256
    assert arena_size(10_000_000, 2, part) == (39 + 3) * part  # 80 MB in parts, and 3 more
    assert arena_size(10**9, 2, part) == LARGEST_ARENA


def test_rows_spark_sorted_are_written_as_they_come_and_out_of_order_refused(tmp_path):
    rng = np.random.default_rng(6)
    X, y = _matrix(60, 5, False), rng.standard_normal(60)
    split = np.r_[np.zeros(45, np.int32), np.ones(15, np.int32)]  # sorted: split first
    keys = np.r_[np.arange(45), np.arange(15)]
    place = Place(str(tmp_path), "fit", 0, "s1t1")
    memory = partition_rows(_batches(X, y, split, keys=keys), 5, False, "memory")
    disk = partition_rows(_batches(X, y, split, keys=keys), 5, False, "disk", place, None, True)
    for in_memory, on_disk in zip(memory, disk):
        np.testing.assert_array_equal(on_disk.rows_between(0, 60).X, in_memory.X)
        on_disk.release()
    shuffled = rng.permutation(60)
    batches = _batches(X[shuffled], y[shuffled], split[shuffled], keys=keys[shuffled])
    with pytest.raises(TrainingError, match="did not arrive sorted by \\(split, _order, _i\\)"):
        partition_rows(batches, 5, False, "disk", place, None, True)
    assert os.listdir(tmp_path) == []  # what it had written is gone
