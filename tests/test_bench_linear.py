"""jobs/bench_linear.py's parts at a tiny size, in the tests' Spark session: one round of
the dense problem gives both fits' figures (the same answer, ours' iteration times inside
its fit, the memory peaks), a table row each, and a plot (never a timing assert: speed
belongs in the benchmark's own runs)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from benchkit import linear, linear_report

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_a_round_of_the_dense_problem_gives_both_fits_figures_a_table_and_a_plot(spark, tmp_path):
    args = argparse.Namespace(
        dense_rows=60, dense_features=3, seed=0, reg_param=0.01, max_iter=20, tol=1e-9,
        mllib_curve=1,
    )  # fmt: skip
    frame = linear.frame_of(spark, "dense", 0, args)
    jvm_pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    try:
        ours = linear.fit_once(spark, "ours", "dense", frame, args, jvm_pid)
        theirs = linear.fit_once(spark, "mllib", "dense", frame, args, jvm_pid)
        theirs.curve = linear.mllib_curve("dense", frame, args, theirs.iterations)
    finally:
        frame.unpersist()
    assert ours.problem == theirs.problem == ""
    assert np.abs(ours.coefficients - theirs.coefficients).max() < 1e-6
    assert ours.objective == pytest.approx(theirs.objective, rel=1e-9)
    # ours' values stamped as reached, within its fit; MLlib's curve above its final value
    assert len(ours.times) == len(ours.history) == ours.iterations + 1
    assert 0 < ours.times[0] <= ours.times[-1] <= ours.seconds
    assert 0 < linear_report.reached(ours, theirs) <= ours.seconds
    assert len(theirs.curve) == 1 and theirs.curve[0][1] >= theirs.objective
    for run in (ours, theirs):
        assert run.jvm_peak > run.heap_peak > 0 and run.workers_peak > 0
    text = linear_report.table([("dense 60 x 3", "60 rows", [(ours, theirs)])])
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| dense")]
    assert [cell.strip() for cell in np.array(rows)[:, 1]] == ["ours", "mllib"]
    assert [int(cell) for cell in np.array(rows)[:, 3]] == [ours.iterations, theirs.iterations]
    assert "median of 1 rounds" in text
    (path,) = linear_report.plot([("dense 60 x 3", "60 rows", [(ours, theirs)])], tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
