"""jobs/bench_linear.py's parts at a tiny size, in the tests' Spark session: one round of
the dense problem gives both fits' figures (the same answer, ours' iteration times inside
its fit, the memory peaks), a table row each, and a plot (never a timing assert: speed
belongs in the benchmark's own runs). A fit that took its JVM down (in a session of its
own, ``linear_child``: a JVM each, too slow for the tests) gets a row saying why, from the
error and output such a fit really gave, and the table still prints."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from benchkit import linear, linear_child, linear_report


@pytest.mark.slow
@pytest.mark.spark
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


#: What MLlib's dense fit raised in its child when it ran out of a 512m driver's heap
#: (bench_linear --dense-rows 40000 --dense-features 512 --mllib-driver-memory 512m; captured,
#: stack frames cut): the SparkContext went down, and only its JVM's output says why.
MLLIB_ERROR = """Py4JJavaError: An error occurred while calling o1125.fit.
: org.apache.spark.SparkException: Job 7 cancelled because SparkContext was shut down
\tat org.apache.spark.scheduler.DAGScheduler.$anonfun$cleanUpAfterSchedulerStop$1(DAGScheduler.scala:2060)
"""
MLLIB_OUTPUT = "\n".join(
    [
        "03:49:12 WARN BlockManager: Block rdd_45_0 could not be removed as it was not found "
        "on disk or in memory",
        "03:49:12 ERROR Executor: Exception in task 0.0 in stage 10.0 (TID 12)",
        "java.lang.OutOfMemoryError: Java heap space",
        "\tat java.base/java.lang.reflect.Array.newArray(Native Method)",
        "03:49:12 ERROR SparkUncaughtExceptionHandler: Uncaught exception in thread "
        "Thread[Executor task launch worker for task 0.0 in stage 10.0 (TID 12),5,main]",
        "java.lang.OutOfMemoryError: Java heap space",
        "03:49:12 ERROR Instrumentation: org.apache.spark.SparkException: Job 7 cancelled "
        "because SparkContext was shut down",
        "03:49:13 ERROR TaskSetManager: Task 0 in stage 10.0 failed 1 times; aborting job",
    ]
)
#: ...and what a child's session said when its driver memory was too small to start
TOO_SMALL = (
    "SparkIllegalArgumentException: [INVALID_DRIVER_MEMORY.SYSTEM_MEMORY] Insufficient driver "
    "memory: System memory 314572800 must be at least 471859200. Please increase heap size "
    'using the --driver-memory option or "spark.driver.memory" in Spark configuration.'
)


def test_a_fit_that_took_its_jvm_down_gets_a_row_saying_why_and_the_table_prints(tmp_path):
    assert linear_report.failure_phrase(MLLIB_ERROR) == "the SparkContext was shut down"
    assert (
        linear_report.failure_phrase(f"{MLLIB_ERROR}\n{MLLIB_OUTPUT}")
        == "java.lang.OutOfMemoryError: Java heap space"
    )
    assert linear_report.failure_phrase(TOO_SMALL) == (
        "Insufficient driver memory: System memory 314572800 must be at least 471859200"
    )
    # the child's answer as it writes it, read back with its output: the row's reason
    request = linear_child.FitRequest("mllib", "dense", 0, {}, "4g")
    failed = linear.LinearRun("mllib", jvm_peak=5 * 2**30, heap_peak=4 * 2**30, error=MLLIB_ERROR)
    failed.problem = linear_report.failure_phrase(failed.error)
    linear_child.write_answer(failed, tmp_path)
    theirs = linear_child.read_answer(request, tmp_path, MLLIB_OUTPUT, "(not used)")
    assert theirs.problem == "java.lang.OutOfMemoryError: Java heap space, driver 4g"
    assert (theirs.jvm_peak, theirs.heap_peak, theirs.coefficients) == (5 * 2**30, 4 * 2**30, None)
    # a child that died without an answer: the cause in its output, else how it ended
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    ended = "the fit's process ended with exit code -9 and no answer"
    died = linear_child.read_answer(request, nothing, "Killed", ended)
    assert died.problem == f"{ended}, driver 4g"
    ours = linear.LinearRun(
        "ours", seconds=12.5, iterations=7, objective=0.5, history=[1.0, 0.5], times=[9.0, 12.0]
    )
    text = linear_report.table([("dense 9 x 2", "9 rows", [(ours, theirs)])])
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| dense")]
    assert [cell.strip() for cell in rows[0][1:4]] == ["ours", "12.5", "7"]
    assert [cell.strip() for cell in rows[0][5:8]] == ["-", "-", "-"]  # nothing to compare
    assert rows[1][2].strip() == "failed: java.lang.OutOfMemoryError: Java heap space, driver 4g"
    assert rows[1][8].strip() == "5,120 / 4,096 / 0"  # the peaks up to the failure
    assert "failed: java.lang.OutOfMemoryError" in linear_report.fit_line("dense", theirs)
