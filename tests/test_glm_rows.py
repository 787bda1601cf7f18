"""The linear models' rows on disk (``train/task/glm_rows.py``): a partition's rows in a row file
of float64 values, read a block at a time at every pass, give the in-memory solution up to
rounding (the chunks' sums added in block order), dense and CSR.

Partitions run as threads of this process with real handles and real files, no Spark
(``tests/test_linear_stage.py`` fits with ``data_in="disk"`` through Spark)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
from conftest import run_partitions

from allreduce_param.engine import AllReduceParameter
from allreduce_param.models.glm import GlmProblem, glm_parameter_size
from allreduce_param.train.row_file import RowFileWriter, read_header
from allreduce_param.train.task.glm_rows import RowChunks
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
