"""A linear model's fit on the driver (``LogisticRegression``, ``LinearRegression``): the
problem made from what the driver learns without reading the rows (``glm_start``), then ONE
barrier stage whose tasks check the rows as they read them and solve MLlib's objective
together (``task.glm_partition``), and the solution partition 0 returned (or, where the
stage refused the data, the data checks' error, made from its tasks' figures); a stage whose task was
lost runs again, from the fit's newest checkpoint where it writes them (``glm_attempts``).

The driver holds no model-sized vector while the tasks solve: the coefficients, the
gradient and the L-BFGS history live sliced on the partitions (the engine's vector of
``glm_parameter_size(problem)`` values); only the solution comes back, at the end. A failed
stage (after its last run) is one clear error (``failures.stage_error``); a setting or an
input a task refuses comes back as that task's ``ConfigurationError`` or ``InputError``,
after the first run.
"""

from __future__ import annotations

from collections.abc import Callable

from allreduce_param.engine.parameter import AllReduceParameter
from allreduce_param.errors import TrainingError
from allreduce_param.models.glm import GlmProblem, GlmSolution
from allreduce_param.spark.info import SparkInfo
from allreduce_param.spark.jobs import fit_jobs
from allreduce_param.spark.slots import check_no_dynamic_allocation
from allreduce_param.train.checkpoint import Checkpoints, Manifest, remove_incomplete
from allreduce_param.train.driver.checks import worker_count
from allreduce_param.train.driver.data import checked_class_count, shape_training
from allreduce_param.train.driver.failures import (
    UNSUPPORTED_CHAIN,
    stage_attempts,
    with_checkpoint_advice,
)
from allreduce_param.train.driver.glm_attempts import run_attempts
from allreduce_param.train.driver.glm_start import (
    GlmFacts,
    refuse_checked,
    stage_rows,
    start_facts,
)
from allreduce_param.train.driver.resume import resume_point
from allreduce_param.train.driver.row_checks import row_checks
from allreduce_param.train.records import STAGE_SCHEMA
from allreduce_param.train.settings import FitSettings
from allreduce_param.train.task.glm_checkpoint import (
    OTHER_CHECKPOINT,
    check_same_problem,
    describe,
)
from allreduce_param.train.task.glm_checks import RowRules
from allreduce_param.train.task.glm_partition import (
    ARRAYS,
    FIGURES,
    GlmRun,
    decode_solution,
    solve_partition,
)
from allreduce_param.train.task.glm_solve import glm_parameter_size

#: The engine's codec for the solver's vector: lossless, so every partition holds the same
#: iterate bit for bit (the solver's sums are exact allreduces of their own).
CODEC = "raw"
#: How a failed fit's error says to continue from its newest checkpoint.
RESUME = (
    "the linear Estimators' resumeFrom={folder!r} (fit_glm's and DistriOptimizer(solver=\"lbfgs\")"
    ".fit's resume_from)"
)


def fit_glm(
    data,
    features_col: str,
    label_col: str,
    weight_col: str | None,
    classification: bool,
    problem_for: Callable[[GlmFacts], GlmProblem],
    num_classes: int | None = None,
    checkpoints: Checkpoints | None = None,
    data_in: str = "memory",
    after_iteration: Callable[[int, int], None] | None = None,
    resume_from: str | None = None,
) -> GlmSolution:
    """Solve the linear model ``problem_for(facts)`` describes over ``data``.

    The columns checked and shaped on the driver, ``problem_for`` makes the problem from
    the ``GlmFacts`` the driver finds without a pass over the rows (``glm_start``: the
    features' width, a classifier's largest label); then the one barrier stage, a task per
    partition of the data (within Spark's task slots: more partitions are shuffled into as
    many as there are slots), which checks the rows as it reads them (``glm_checks``: nulls,
    NaN and Inf, vectors' widths, weights finite and >= 0 summing to more than 0; with
    ``classification`` the labels class ids 0, 1, 2, ... and below ``num_classes`` where
    the model or the label's metadata says it). Data the checks refuse is an
    ``InputError`` naming the column, the count of bad rows and the first, as
    DistriOptimizer's check job says it, and is not run again.

    ``checkpoints``: where and every how many iterations the slice owners write the
    solver's state (``Checkpoints``; each fit in a new folder under its ``dir``), which a
    run of the stage after a lost task resumes from. ``data_in``: where each task keeps its
    rows while it solves ("memory"; "disk": a row file read a block at a time at every
    pass, for partitions larger than memory; "auto": as DistriOptimizer's fits choose,
    ``task.glm_rows``). ``after_iteration(partition, iteration)``: called in every task
    after each iteration (a progress hook; the tests fail a task with it). ``resume_from``:
    a checkpoint of a fit of this very problem (its step folder, or a fit's folder: its
    newest intact one) to continue from, as ``DistriOptimizer.fit(resume_from=...)``: a
    fit that failed in every run goes on from where it was, to the uninterrupted fit's
    answer; one of another problem is an ``InputError`` naming what differs."""
    spark = SparkInfo.of(data)
    kind = "logistic" if classification else "linear"
    # its jobs in one group, named in the Spark UI; cancelled, their tasks gone, if interrupted
    with fit_jobs(spark, f"allreduce-param {kind} regression (MLlib's objective)") as jobs:
        jobs.phase("checking the data")
        check_no_dynamic_allocation(spark)
        settings = None if checkpoints is None else checkpoints.for_new_fit()
        if settings is not None:
            settings.probe()  # before any job: a folder the tasks cannot write fails here
            # a failed or interrupted fit leaves no step folder without its manifest
            jobs.on_failure(lambda: remove_incomplete(settings.directory))
        first = None if resume_from is None else resume_point(resume_from)
        told = checked_class_count(num_classes) if classification else None
        prepared = shape_training(data, features_col, label_col, weight_col)
        indexed = stage_rows(prepared, weight_col is not None)
        facts, partitions = start_facts(
            spark,
            data,
            prepared,
            indexed,
            features_col,
            label_col,
            classification,
            told,
            weight_col,
        )
        problem = problem_for(facts)
        partitions = partitions or 1
        workers = worker_count(spark, None, partitions)
        network = FitSettings().network.resolved(spark.session_setting)  # read once, here
        param = AllReduceParameter(
            workers,
            glm_parameter_size(problem),
            CODEC,
            timeout=FitSettings().timeout,
            network=network,
        )
        rows = indexed if partitions == workers else indexed.repartition(workers)
        jobs.phase(
            "training",
            f"allreduce-param {kind} regression on {workers} partitions, "
            f"at most {problem.max_iter} iterations",
        )
        checks = row_checks(classification, told, weight_col)
        rules = RowRules(
            tuple(check.name for check in checks),
            told,
            weight_col is not None,
            problem.num_features,
        )
        description = describe(problem, workers)
        if first is not None:
            check_same_problem(first, description, OTHER_CHECKPOINT)
        placed = [rows]

        def attempt(resume: Manifest | None) -> dict[str, bytes]:
            run = GlmRun(settings, description, resume, after_iteration, data_in)

            def task(batches):
                yield from solve_partition(batches, param, problem, rules, run)

            try:
                return _run(placed[0], task)
            except Exception as error:
                if placed[0] is not indexed or UNSUPPORTED_CHAIN not in str(error):
                    raise
            # Spark refuses a barrier stage over a union or a coalesce (SPARK-24820): shuffle
            placed[0] = indexed.repartition(workers)
            return _run(placed[0], task)

        try:
            records = run_attempts(attempt, stage_attempts(spark), settings, description, first)
        except TrainingError as error:
            if settings is None:
                raise
            raise with_checkpoint_advice(error, settings, spark, RESUME) from error.__cause__
        # a refused stage's tasks returned their checks' figures: the error they call for
        refuse_checked(
            records, features_col, label_col, checks, told, weight_col, problem.num_features
        )
        if ARRAYS not in records or FIGURES not in records:
            raise TrainingError(
                "the linear model's stage ended without partition 0's solution; its tasks "
                f"returned {sorted(records)}"
            )
        return decode_solution(records[ARRAYS], records[FIGURES])


def _run(rows, task) -> dict[str, bytes]:
    """The barrier stage over ``rows``: the records its tasks returned, by kind."""
    frame = rows.mapInArrow(task, STAGE_SCHEMA, barrier=True)
    return {row["kind"]: bytes(row["payload"]) for row in frame.collect()}
