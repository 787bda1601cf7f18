"""One barrier task of a linear model's fit (``LogisticRegression``, ``LinearRegression``):
its partition's rows checked as they are read (``glm_checks``: the fit's only data checks)
and held as float64 numpy (or CSR), in memory or in a row file (``glm_rows``), the
engine's vector of the model's coefficients joined, ``solve_glm`` run over them (from a
checkpoint, writing checkpoints: ``glm_checkpoint``); partition 0 returns the solution
(where the data is refused, every partition returns its checks' figures instead).

Every partition calls ``solve_glm`` with its own rows, none with zero rows left out: the
solver's allreduces need every partition. The solution travels back as two records of the
stage's ``kind, payload`` schema: the arrays as an ``.npz`` without pickles, the rest as JSON.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from allreduce_param.engine.parameter import AllReduceParameter
from allreduce_param.errors import TrainingError
from allreduce_param.models.glm import GlmProblem, GlmSolution
from allreduce_param.spark.arrow import fit_the_address_space_limit, record_batch
from allreduce_param.train.checkpoint import CheckpointSettings, Manifest
from allreduce_param.train.records import task_failure
from allreduce_param.train.task.glm_checkpoint import (
    GlmCheckpointKeeper,
    iteration_hooks,
    resume_arrays,
)
from allreduce_param.train.task.glm_checks import CHECKS, RowRules, RowsChecked, in_form
from allreduce_param.train.task.glm_rows import held_rows
from allreduce_param.train.task.glm_solve import solve_glm

#: The record kinds a partition returns: the solution's arrays, and its figures.
ARRAYS, FIGURES = "glm-arrays", "glm-figures"


@dataclass(frozen=True)
class GlmRun:
    """How one run of the stage goes, beyond the problem: where its checkpoints go
    (``checkpoints``, None: none) with the problem's ``description`` for their manifests,
    the checkpoint it resumes from (``resume``, verified on the driver; None: the start),
    ``after_iteration(partition, iteration)``, called in every task after each
    iteration (after its checkpoint, where one is due), and where the task keeps its rows
    (``data_in``: "memory", "disk" or "auto", ``glm_rows.held_rows``)."""

    checkpoints: CheckpointSettings | None = None
    description: dict | None = None
    resume: Manifest | None = None
    after_iteration: Callable[[int, int], None] | None = None
    data_in: str = "memory"


def solve_partition(
    batches,
    param: AllReduceParameter,
    problem: GlmProblem,
    rules: RowRules,
    run: GlmRun | None = None,
) -> Iterator[Any]:
    """A barrier task's whole work (``mapInArrow``'s function): read the rows, checking each
    batch by ``rules`` (``glm_checks``), join the engine's vector, agree with the peers on
    the checks' verdict and the rows' form, solve (from ``run.resume``'s checkpoint where
    given, writing checkpoints where ``run.checkpoints`` asks); partition 0 yields the
    solution's two records. Where the data is refused, every partition yields its checks'
    figures instead (``glm_checks.CHECKS``), for the driver's error. Any failure comes back
    as ``records.task_failure``'s error, naming the partition and where."""
    run = run if run is not None else GlmRun()
    fit_the_address_space_limit()  # before the first row is read
    checked = RowsChecked(rules)
    try:
        guess, passed = checked.read(batches)  # the rows' form guessed from the first
        with (
            held_rows(
                passed,
                problem.num_features,
                guess,
                rules.weighted,
                run.data_in,
                param.secret,
                param.partition_num,
            ) as rows,
            param.connect() as p,
        ):
            partition = p.info.partition_id
            try:
                agreed = checked.agree(p)
                if not agreed.refused:
                    solution = solve_glm(
                        p,
                        in_form(rows, agreed.sparse),
                        None,
                        None,
                        problem,
                        resume=None if run.resume is None else resume_arrays(run.resume, partition),
                        on_iteration=_iteration_hook(p, run),
                    )
            except Exception as error:
                raise task_failure(partition, ", solving the linear model", error) from error
    except TrainingError:
        raise
    except Exception as error:  # holding the rows or joining the peers failed
        raise task_failure(
            _partition(), ", holding its rows or meeting its peers", error
        ) from error
    if agreed.refused:
        yield record_batch(kind=[f"{CHECKS}/{partition}"], payload=[checked.figures_record()])
    elif partition == 0:
        arrays, figures = encode_solution(solution)
        yield record_batch(kind=[ARRAYS], payload=[arrays])
        yield record_batch(kind=[FIGURES], payload=[figures])


def _iteration_hook(p, run: GlmRun) -> Callable[[dict[str, np.ndarray]], None] | None:
    """``solve_glm``'s ``on_iteration`` for ``run``: its checkpoints, then its callback."""
    keeper = (
        None
        if run.checkpoints is None
        else GlmCheckpointKeeper(run.checkpoints, p, run.description or {})
    )
    after = run.after_iteration
    partition = p.info.partition_id
    return iteration_hooks(
        keeper,
        None if after is None else (lambda arrays: after(partition, int(arrays["flags"][0]))),
    )


def encode_solution(solution: GlmSolution) -> tuple[bytes, bytes]:
    """A solution as (its arrays as ``.npz`` bytes, its figures as JSON bytes)."""
    buffer = io.BytesIO()
    np.savez(buffer, coefficients=solution.coefficients, intercepts=solution.intercepts)
    figures = {
        "objective_history": [float(value) for value in solution.objective_history],
        "iterations": int(solution.iterations),
        "note": getattr(solution, "note", None),
        "objective_times": [float(t) for t in solution.objective_times],
        "objective_scale": float(solution.objective_scale),
    }
    return buffer.getvalue(), json.dumps(figures).encode()


def decode_solution(arrays: bytes, figures: bytes) -> GlmSolution:
    """``encode_solution``'s bytes as the ``GlmSolution`` again (no pickle is read)."""
    with np.load(io.BytesIO(arrays), allow_pickle=False) as saved:
        coefficients, intercepts = saved["coefficients"], saved["intercepts"]
    told = json.loads(figures)
    return GlmSolution(
        coefficients=coefficients,
        intercepts=intercepts,
        objective_history=told["objective_history"],
        iterations=told["iterations"],
        note=told["note"],
        objective_times=told.get("objective_times", []),
        objective_scale=told.get("objective_scale", 1.0),
    )


def _partition() -> int | str:
    """This task's partition, for an error before the handle that knows it exists."""
    try:
        from pyspark import TaskContext

        return TaskContext.get().partitionId()
    except Exception:  # not in a task: say so rather than guess
        return "(outside a Spark task)"
