"""The linear models' rows (``train/task/glm_rows.py``): held in memory, the Arrow batches'
rows gathered in place as float64, exactly; on disk, a partition's rows in a row file of
float64 values, read a block at a time at every pass, give the in-memory solution up to
rounding (the chunks' sums added in block order), dense and CSR.

Partitions run as threads of this process with real handles and real files, no Spark
(``tests/test_linear_stage.py`` fits with ``data_in="disk"`` through Spark)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse
from conftest import run_partitions
from test_sparse import vector_struct

from allreduce_param.engine import AllReduceParameter
from allreduce_param.models.glm import GlmProblem, glm_parameter_size
from allreduce_param.train.row_file import RowFileWriter, read_header
from allreduce_param.train.task.glm_rows import RowChunks, held_rows
from allreduce_param.train.task.glm_solve import solve_glm


def _rows(sparse: bool, rows: int = 50):
    rng = np.random.default_rng(5)
    X = rng.standard_normal((rows, 6)) * np.array([1.0, 7.0, 0.3, 2.0, 1.0, 4.0])
    if sparse:
        X[rng.random(X.shape) < 0.6] = 0.0
    margins = X @ rng.standard_normal((6, 3))
    y = margins.argmax(axis=1).astype(float)
    return (scipy.sparse.csr_matrix(X) if sparse else X), y, rng.uniform(0.5, 2.0, rows)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "csr"])
def test_rows_read_block_by_block_from_disk_give_the_in_memory_solution(tmp_path, sparse):
    X, y, w = _rows(sparse)
    problem = GlmProblem(
        "multinomial", 6, num_classes=3, reg_param=0.01, elastic_net_param=0.2, max_iter=10
    )
    cuts = np.array_split(np.arange(len(y)), 2)

    def solve(on_disk: bool):
        param = AllReduceParameter(partition_num=2, size=glm_parameter_size(problem))

        def body(p):
            i = p.info.partition_id
            rows = cuts[i]
            if not on_disk:
                return solve_glm(p, X[rows], y[rows], w[rows], problem)
            path = str(tmp_path / f"part-{i}.rows")
            writer = RowFileWriter(path, 6, 7, sparse, True, float64=True)  # blocks of 7 rows
            for start in range(0, len(rows), 10):  # appended as batches come
                chunk = rows[start : start + 10]
                writer.append(X[chunk], y[chunk], w[chunk])
            file = writer.close()
            assert read_header(path)["float64"] and file.block_count == 4  # 25 rows
            try:
                return solve_glm(p, RowChunks.of_file(file), None, None, problem)
            finally:
                file.close()

        return run_partitions(param, body)

    memory, disk = solve(False), solve(True)
    for solution in disk:
        assert not isinstance(solution, BaseException), solution
        assert solution.iterations == memory[0].iterations > 5
        np.testing.assert_allclose(
            solution.coefficients, memory[0].coefficients, rtol=1e-12, atol=1e-13
        )
        np.testing.assert_allclose(
            solution.intercepts, memory[0].intercepts, rtol=1e-12, atol=1e-13
        )
        np.testing.assert_allclose(
            solution.objective_history, memory[0].objective_history, rtol=1e-13
        )


def _batches(X, y, w, size: int = 7) -> list:
    """Prepared Arrow batches of ``size`` rows: the features as Spark's vectors (sparse ones
    for a CSR ``X``), the label and the weight."""
    dense = X.toarray() if scipy.sparse.issparse(X) else X
    out = []
    for start in range(0, len(y), size):
        rows = []
        for row in dense[start : start + size]:
            if scipy.sparse.issparse(X):
                (index,) = np.nonzero(row)
                rows.append(("sparse", len(row), index.tolist(), row[index].tolist()))
            else:
                rows.append(("dense", row.tolist()))
        out.append(
            pa.RecordBatch.from_pydict(
                {
                    "features": vector_struct(rows),
                    "label": pa.array(y[start : start + size]),
                    "weight": pa.array(w[start : start + size]),
                }
            )
        )
    return out


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "csr"])
def test_rows_held_are_the_batches_rows_in_memory_and_past_the_budget_on_disk(
    tmp_path, monkeypatch, sparse
):
    """In memory the batches' rows are gathered into one float64 matrix, exactly; "auto"
    past its budget (an address-space limit the worker already passes: a budget of 0)
    writes them to a row file instead, read back alike, removed at the end."""
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path))
    X, y, w = _rows(sparse, rows=23)
    expected = X.toarray() if sparse else X

    def held(data_in: str) -> tuple:
        with held_rows(iter(_batches(X, y, w)), 6, sparse, True, data_in, b"k" * 32, 2) as rows:
            chunks = [tuple(part.copy() for part in chunk) for chunk in rows.chunks()]
            return rows.where, chunks, sorted(p.name for p in tmp_path.iterdir())

    where, ((features, labels, weights),), _ = held("memory")
    assert where == "memory" and features.dtype == np.float64
    assert scipy.sparse.issparse(features) == sparse
    assert np.array_equal(features.toarray() if sparse else features, expected)
    assert np.array_equal(labels, y) and np.array_equal(weights, w)
    monkeypatch.setenv("PYSPARK_EXECUTOR_MEMORY_MB", "1")
    where, blocks, files = held("auto")
    row_files = [name for name in files if name.endswith(".rows")]
    assert where == "disk" and len(row_files) == 1 and row_files[0].endswith("-glm.rows"), files
    stacked = np.concatenate([b[0].toarray() if sparse else b[0] for b in blocks])
    assert np.array_equal(stacked, expected)
    assert np.array_equal(np.concatenate([b[1] for b in blocks]), y)
    assert np.array_equal(np.concatenate([b[2] for b in blocks]), w)
    assert list(tmp_path.iterdir()) == []  # the row file (and the fit's lock) removed after
