"""jobs/bench_sparse.py at a tiny size: its tables have their rows and sane figures (never a
timing assert: speed belongs in the benchmark's own runs); its data is fixed by the seed."""

from __future__ import annotations

from pathlib import Path

import bench_sparse
import numpy as np
import pytest
from benchkit import sparse_data, sparse_runs, sparse_steps, sparse_tables

pytestmark = [pytest.mark.slow, pytest.mark.spark]

REPO = Path(__file__).resolve().parents[1]


def tables(out: str) -> list[list[list[str]]]:
    """Each markdown table's data rows (cells stripped), in order."""
    found, current = [], None
    for line in out.splitlines():
        if line.startswith("|"):
            if current is None:
                current = []
                found.append(current)
            current.append([cell.strip() for cell in line.strip("|").split("|")])
        else:
            current = None
    return [table[2:] for table in found]  # without the header and the rule


def number(text: str) -> float:
    return float(text.split()[0].replace(",", ""))


def test_the_job_prints_both_contenders_sizes_and_steps_for_each_problem(capsys):
    """The job's ``main`` in this process: its session starts in the driver JVM that this
    process's sessions share (``local_spark`` starts a JVM only where none runs) instead of
    a Python and a JVM of its own, seconds of a 2-core machine."""
    status = bench_sparse.main(
        [
            *(
                "--text-rows",
                "1500",
                "--text-features",
                "10",
                "--vocabulary",
                "2000",
                "--tilted",
                "200",
            ),
            *("--click-rows", "2000", "--click-features", "12", "--max-levels", "1000"),
            *("--rounds", "1", "--epochs", "2", "--batch-size", "256", "--mllib-iters", "2"),
            "--no-breakdown",
        ]
    )
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    assert "memory copy:" in out and "machine:" in out
    results, sizes, steps = tables(out)
    assert [(row[0], row[1]) for row in results] == [
        ("text 2^10", "allreduce-param softmax"),
        ("text 2^10", "MLlib LogisticRegression"),
        ("clicks 2^12", "allreduce-param softmax"),
        ("clicks 2^12", "MLlib LogisticRegression"),
    ]
    for row in results:
        assert number(row[2]) > 0  # fit s
        assert 0.3 < number(row[3]) <= 1  # test accuracy, of two balanced-ish classes
        assert number(row[7]) > 100 and number(row[8]) > 10  # driver and workers peak MB
    for ours in results[::2]:
        assert ours[4]  # s to MLlib's accuracy, or "not reached (best ...)"
        assert number(ours[5]) > 0  # MLlib fit / ours fit
    assert [row[0] for row in sizes] == ["text 2^10", "clicks 2^12"]
    for _, _, rows, nonzeros, per_row, partitions, csr, dense in sizes:
        assert number(rows) > 1000 and number(nonzeros) > number(rows)
        assert abs(number(per_row) - number(nonzeros) / number(rows)) < 0.1
        assert number(csr) * 2**20 < number(dense) * 2**30  # non-zeros, not N x d
        assert number(partitions) == 2
    assert number(sizes[1][4]) <= 26  # one non-zero per field at most (collisions add up)
    assert [row[0] for row in steps] == ["text 2^10", "clicks 2^12"]
    for row in steps:
        assert number(row[2]) >= 2  # steps: 2 epochs at least
        assert all(number(cell) >= 0 for cell in row[3:])


def test_the_step_breakdown_names_its_parts_without_spark():
    steps = sparse_steps
    lines = steps.breakdown([2**10, 2**14], rows=64, repeats=1, seed=0)
    assert [line[0] for line in lines] == ["2^10", "2^14"]
    for line in lines:
        assert len(line) == len(steps.HEADER)
        assert number(line[3]) <= 64 * 26 and number(line[4]) <= number(line[3])


def test_the_touched_rows_product_is_the_dense_one_on_those_rows():
    steps = sparse_steps
    values = np.random.default_rng(0).integers(0, 500, (40, 6))
    X = steps.hashed_batch(values, 2**12)
    delta = np.random.default_rng(1).standard_normal((40, 2)).astype(np.float32)
    columns, product = steps.touched_product(X, delta)
    dense = X.T @ delta
    np.testing.assert_allclose(product, dense[columns], rtol=1e-5)
    assert not np.delete(dense, columns, axis=0).any()


def test_the_data_is_fixed_by_the_seed_and_learnable():
    data = sparse_data
    text = data.TextData(3000, vocabulary=2000, tilted=200, seed=4)
    documents, labels, is_test = text.block(0, text.word_probabilities())
    again = text.block(0, text.word_probabilities())
    assert all(np.array_equal(a, b) for a, b in zip(documents, again[0]))
    assert np.array_equal(labels, again[1]) and np.array_equal(is_test, again[2])
    assert 0.6 < text.bayes_accuracy() < 1
    clicks = data.ClickData(3000, max_levels=1000, seed=4)
    values, labels, _, p = clicks.block(0)
    assert np.array_equal(values, clicks.block(0)[0]) and values.shape == (3000, 26)
    assert values.min() >= 0 and (values.max(axis=0) < clicks.levels()).all()
    assert 0.2 < labels.mean() < 0.8 and 0.6 < clicks.bayes_accuracy() < 1


def test_a_failed_fit_is_named_in_a_few_words():
    runs = sparse_runs
    assert (
        runs.failure_text(RuntimeError("java.lang.OutOfMemoryError: Java heap space"), False)
        == "OutOfMemoryError (driver JVM)"
    )
    assert "maxResultSize" in runs.failure_text(
        RuntimeError("Total size of serialized results is bigger than spark.driver.maxResultSize"),
        False,
    )
    assert runs.failure_text(RuntimeError("cancelled"), True) == "budget ran out"


def test_the_sync_comparison_has_a_row_per_sync_and_the_rounds_ratio():
    """``--compare-syncs``' table from made-up runs (no Spark): medians, and the dense /
    touched ratio of each round's median step on the touched row; a failed run's reason
    where its figures would be."""

    def run(step_s: float, seconds: float) -> object:
        steps = [dict.fromkeys(sparse_tables.STEP_PHASES, step_s / 6) for _ in range(3)]
        return sparse_runs.Run("ours", 0.0, seconds=seconds, accuracy=0.7, steps=steps)

    runs = {"dense": [run(0.6, 10), run(0.3, 8)], "touched": [run(0.2, 5), run(0.15, 4)]}
    rows = sparse_tables.sync_rows("clicks 2^24", 2**24, runs)
    assert [row[:4] for row in rows] == [
        ("clicks 2^24", "dense", "16,777,216", "6"),
        ("clicks 2^24", "touched", "16,777,216", "6"),
    ]
    assert len(rows[0]) == len(sparse_tables.SYNC_HEADER)
    assert rows[0][10] == "450.0" and rows[1][10] == "175.0"  # the rounds' median steps
    assert rows[0][13] == "" and rows[1][13] == "2.50 (2.00-3.00)"
    failed = {"dense": [sparse_runs.Run("ours", 0.0, problem="budget ran out")], "touched": []}
    assert sparse_tables.sync_rows("clicks 2^24", 2**24, failed)[0][3] == "budget ran out"


def test_the_sync_step_comparison_runs_both_syncs_without_spark():
    steps = sparse_steps
    lines = steps.sync_comparison([2**10, 2**12], rows=128, partitions=2, repeats=1, seed=0)
    assert [line[0] for line in lines] == ["2^10", "2^12"]
    for line in lines:
        assert len(line) == len(steps.SYNC_HEADER)
        assert 0 < number(line[2]) <= 128 * 26 * 2 + 2  # touched elements: 2 a column, + biases
        assert all(number(cell) >= 0 for cell in line[3:7])
        assert number(line[7]) > 0
