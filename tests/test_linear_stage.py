"""The linear models' Spark stage (``train/driver/glm_stage.py``): it survives a lost task (the
stage runs again and resumes from the slice owners' newest checkpoint, ending with the
uninterrupted fit's coefficients and objective history, bit for bit); a fit that fails in
every run says why, how many runs, and which checkpoint to resume from (``resume_from`` it
continues to the same answer); and it solves from rows on
disk (``data_in="disk"``: row files read a block at a time) to the in-memory answer, leaving
no row file behind."""

from __future__ import annotations

import contextlib
import glob
import os
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from pyspark import cloudpickle
from pyspark.ml.linalg import Vectors

from allreduce_param.errors import InputError, TrainingError
from allreduce_param.models.glm import GlmProblem
from allreduce_param.train.checkpoint import Checkpoints, find
from allreduce_param.train.driver.glm_stage import fit_glm

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def frame(spark):
    rng = np.random.default_rng(7)
    X = rng.standard_normal((60, 4)) * np.array([1.0, 5.0, 0.2, 2.0])
    y = (X @ rng.standard_normal(4) + rng.standard_normal(60) > 0).astype(float)
    rows = [(Vectors.dense(x.tolist()), float(label)) for x, label in zip(X, y)]
    data = spark.createDataFrame(rows, ["features", "label"]).repartition(2).cache()
    data.count()
    yield data
    data.unpersist()


def _problem(summary) -> GlmProblem:
    return GlmProblem(
        "binomial", summary.n_features, num_classes=2, reg_param=0.02, max_iter=12, tol=1e-12
    )


def _fit(frame, **options):
    return fit_glm(frame, "features", "label", None, True, _problem, **options)


@pytest.fixture(scope="module")
def uninterrupted(frame):
    return _fit(frame)


class FailsOnce:
    """Partition 1 fails once, after iteration ``at``: a file marks the failure as done, so
    the stage's next run (maybe in another Python worker) goes through."""

    def __init__(self, folder: str, at: int) -> None:
        self.folder, self.at = folder, at

    def __call__(self, partition: int, iteration: int) -> None:
        done = os.path.join(self.folder, "failed")
        if partition == 1 and iteration == self.at and not os.path.exists(done):
            open(done, "w").close()
            raise ValueError(f"a fault injected after iteration {iteration}")


@pytest.mark.slow
def test_a_lost_task_resumes_from_the_newest_checkpoint_with_the_same_result(
    frame, uninterrupted, tmp_path
):
    marks = tmp_path / "marks"
    marks.mkdir()
    folder = tmp_path / "checkpoints"
    with pytest.warns(RuntimeWarning, match="from its checkpoint after iteration 4") as warned:
        resumed = _fit(
            frame,
            checkpoints=Checkpoints(str(folder), every=2),
            after_iteration=FailsOnce(str(marks), at=5),
        )
    assert (marks / "failed").exists()  # the fault did happen
    assert "a fault injected after iteration 5" in str(warned[0].message)
    assert resumed.iterations == uninterrupted.iterations > 5
    assert np.array_equal(resumed.coefficients, uninterrupted.coefficients)
    assert np.array_equal(resumed.intercepts, uninterrupted.intercepts)
    assert resumed.objective_history == uninterrupted.objective_history
    (fit_folder,) = folder.iterdir()
    last = resumed.iterations // 2 * 2  # it went on writing after the resume; 2 kept
    assert find(str(fit_folder)).manifest.step == last
    assert sorted(p.name for p in fit_folder.iterdir()) == [
        f"step-{last - 2:010d}",
        f"step-{last:010d}",
    ]
    # resume_from a checkpoint of another problem: refused by name (a fit that failed in
    # every run resumed from its own, below)
    older = str(fit_folder / f"step-{last - 2:010d}")
    with pytest.raises(InputError, match=r"regParam: 0\.02 there, 0\.5 here.*resume_from="):
        fit_glm(frame, "features", "label", None, True, _other_problem, resume_from=older)


class FailsAlways:
    """Partition 1 fails after iteration ``at`` in every run of the stage."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, partition: int, iteration: int) -> None:
        if partition == 1 and iteration == self.at:
            raise ValueError(f"a fault injected after iteration {iteration}")


@contextlib.contextmanager
def runs_at_most(spark, runs: int) -> Iterator[None]:
    """The running application's ``spark.stage.maxConsecutiveAttempts`` (which a linear fit
    reads when it starts) set to ``runs``, and put back after."""
    conf, key = spark.sparkContext._conf, "spark.stage.maxConsecutiveAttempts"
    before = conf.get(key, None)
    conf.set(key, str(runs))
    try:
        yield
    finally:
        if before is None:
            conf._jconf.remove(key)
        else:
            conf.set(key, before)


@pytest.mark.slow
def test_a_fit_that_fails_in_every_run_names_the_failure_the_runs_and_the_checkpoint(
    spark, frame, uninterrupted, tmp_path
):
    runs = 2  # the application's setting, read at each fit: 2 runs, not the default 4
    folder = tmp_path / "checkpoints"
    with (
        runs_at_most(spark, runs),
        pytest.warns(RuntimeWarning, match=f"stage failed, run 1 of at most {runs} ") as warned,
        pytest.raises(TrainingError) as failed,
    ):
        _fit(frame, checkpoints=Checkpoints(str(folder), every=1), after_iteration=FailsAlways(2))
    (fit_folder,) = folder.iterdir()
    message = str(failed.value)
    assert "partition 1" in message and "a fault injected after iteration 2" in message
    assert f"the fit ran its stage {runs} times, as spark.stage.maxConsecutiveAttempts" in message
    newest = fit_folder / f"step-{1:010d}"  # every run resumed from it and failed after it
    assert f"Its newest checkpoint, of step 1, is {newest}: " in message
    assert f"resumeFrom={str(newest)!r}" in message
    assert len(warned) == runs - 1  # each run again announced, at the caller's line
    assert {w.filename for w in warned} == {__file__}
    assert "from its checkpoint after iteration 1" in str(warned[-1].message)
    # what the message says to do: resume_from that checkpoint continues, without the
    # fault, to the uninterrupted answer, bit for bit
    continued = _fit(frame, resume_from=str(newest))
    assert continued.iterations == uninterrupted.iterations
    assert np.array_equal(continued.coefficients, uninterrupted.coefficients)
    assert continued.objective_history == uninterrupted.objective_history


def _other_problem(summary) -> GlmProblem:
    return GlmProblem("binomial", summary.n_features, num_classes=2, reg_param=0.5, max_iter=12)


class RowFilesSeen:
    """After the first iteration, each task notes the fit's row files in its local
    directories (``SPARK_LOCAL_DIRS``) in a file of ``folder``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, partition: int, iteration: int) -> None:
        if iteration == 1:
            folders = [f for f in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if f]
            seen = [p for f in folders for p in glob.glob(os.path.join(f, "allreduce-rows-*"))]
            with open(os.path.join(self.folder, f"partition-{partition}"), "w") as file:
                file.write("\n".join(seen))


@pytest.mark.slow
def test_rows_on_disk_give_the_in_memory_coefficients_and_leave_no_file(
    frame, uninterrupted, tmp_path
):
    solution = _fit(frame, data_in="disk", after_iteration=RowFilesSeen(str(tmp_path)))
    seen = [(tmp_path / f"partition-{i}").read_text().split("\n") for i in range(2)]
    files = sorted({path for paths in seen for path in paths if path.endswith(".rows")})
    assert [os.path.basename(path).split("-")[3] for path in files] == ["p0", "p1"], seen
    assert not any(os.path.exists(path) for path in files)
    fit_prefix = os.path.basename(files[0]).split("-p")[0]
    folder = os.path.dirname(files[0])
    assert glob.glob(os.path.join(glob.escape(folder), fit_prefix + "*")) == []
    assert solution.iterations == uninterrupted.iterations
    np.testing.assert_allclose(
        solution.coefficients, uninterrupted.coefficients, rtol=1e-12, atol=1e-14
    )
    np.testing.assert_allclose(solution.intercepts, uninterrupted.intercepts, rtol=1e-12)
    np.testing.assert_allclose(
        solution.objective_history, uninterrupted.objective_history, rtol=1e-13
    )


@pytest.mark.slow
def test_the_stage_refuses_bad_rows_with_the_check_jobs_error(spark):
    """The stage checks the rows as it reads them (no check job before it; the width and
    the classes from the columns' metadata: no job at all before the stage): bad rows in
    two partitions are one InputError with the check job's words, count and first row over
    both, from a stage that ran once (it failed no task); a width the column's ML
    metadata says but its vectors lack is refused by name."""
    import warnings

    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    def rows(count: int, partitions: int, width: int):
        """Rows of 3 features (a NaN in row 2, an Inf in row 6), in order, their width
        ``width`` by the column's metadata."""
        i = F.col("id")
        features = F.array(
            i.cast("double"),
            F.when(i == 2, float("nan")).otherwise(1.0),
            F.when(i == 6, float("inf")).otherwise(2.0),
        )
        said = {"ml_attr": {"num_attrs": width}}
        return spark.range(0, count, 1, partitions).select(
            array_to_vector(features).alias("features", metadata=said),
            (i % 2).cast("double").alias("label"),
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a run again would warn
        with pytest.raises(InputError) as refused:
            fit_glm(rows(8, 2, 3), "features", "label", None, True, _problem, num_classes=2)
    assert str(refused.value).startswith(
        "the training column 'features' holds NaN, Inf or null in 2 rows (e.g. row 2: NaN at "
        "element 1); drop or fill them before training"
    ), refused.value
    with pytest.raises(
        InputError, match=r"vectors of 3 elements, but its ML metadata \(ml_attr num_attrs\) says 5"
    ):
        fit_glm(rows(2, 1, 5), "features", "label", None, True, _problem, num_classes=2)
