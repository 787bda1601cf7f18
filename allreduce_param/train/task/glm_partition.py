"""One barrier task of a linear model's fit (``LogisticRegression``, ``LinearRegression``):
its partition's rows read as float64 numpy (or CSR), the engine's vector of the model's
coefficients joined, ``solve_glm`` run over them; partition 0 returns the solution.

Every partition calls ``solve_glm`` with its own rows, none with zero rows left out: the
solver's allreduces need every partition. The solution travels back as two records of the
stage's ``kind, payload`` schema: the arrays as an ``.npz`` without pickles, the rest as JSON.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from allreduce_param.engine.parameter import AllReduceParameter
from allreduce_param.errors import TrainingError
from allreduce_param.models.glm import GlmProblem, GlmSolution
from allreduce_param.spark.arrow import fit_the_address_space_limit, record_batch, values
from allreduce_param.train.columns import WEIGHT_COLUMN
from allreduce_param.train.features import VectorParts
from allreduce_param.train.records import task_failure
from allreduce_param.train.task.glm_solve import solve_glm

#: The record kinds a partition returns: the solution's arrays, and its figures.
ARRAYS, FIGURES = "glm-arrays", "glm-figures"


def partition_arrays(batches, n_features: int, sparse: bool) -> tuple[Any, np.ndarray, Any]:
    """A partition's prepared Arrow batches (``features``, ``label`` and maybe ``weight``) as
    ``(features, labels, weights or None)``: float64, CSR where ``sparse`` (the driver found
    the data sparse), else dense; zero rows where the partition has none."""
    features, labels, weights = [], [], []
    for batch in batches:
        names = batch.schema.names
        parts = VectorParts.from_arrow(batch.column(names.index("features")))
        features.append(
            parts.to_csr(n_features, np.float64)
            if sparse
            else parts.to_dense(n_features, np.float64)
        )
        labels.append(np.asarray(values(batch.column(names.index("label"))), np.float64))
        if WEIGHT_COLUMN in names:
            weights.append(np.asarray(values(batch.column(names.index(WEIGHT_COLUMN))), np.float64))
    if sparse:
        from scipy.sparse import csr_matrix, vstack

        X = vstack(features, format="csr") if features else csr_matrix((0, n_features))
    else:
        X = np.concatenate(features) if features else np.zeros((0, n_features))
    y = np.concatenate(labels) if labels else np.zeros(0)
    w = np.concatenate(weights) if weights else None
    return X, y, w


def solve_partition(
    batches, param: AllReduceParameter, problem: GlmProblem, sparse: bool, weighted: bool
) -> Iterator[Any]:
    """A barrier task's whole work (``mapInArrow``'s function): read the rows, join the
    engine's vector, solve; partition 0 yields the solution's two records. Any failure
    comes back as ``records.task_failure``'s error, naming the partition and where."""
    fit_the_address_space_limit()  # before the first row is read
    X, y, w = partition_arrays(batches, problem.num_features, sparse)
    if weighted and w is None:
        w = np.zeros(0)  # a partition without rows of a weighted fit
    try:
        with param.connect() as p:
            partition = p.info.partition_id
            try:
                solution = solve_glm(p, X, y, w, problem)
            except Exception as error:
                raise task_failure(partition, ", solving the linear model", error) from error
    except TrainingError:
        raise
    except Exception as error:  # joining the peers failed
        raise task_failure(_partition(), ", meeting its peers", error) from error
    if partition == 0:
        arrays, figures = encode_solution(solution)
        yield record_batch(kind=[ARRAYS], payload=[arrays])
        yield record_batch(kind=[FIGURES], payload=[figures])


def encode_solution(solution: GlmSolution) -> tuple[bytes, bytes]:
    """A solution as (its arrays as ``.npz`` bytes, its figures as JSON bytes)."""
    buffer = io.BytesIO()
    np.savez(buffer, coefficients=solution.coefficients, intercepts=solution.intercepts)
    figures = {
        "objective_history": [float(value) for value in solution.objective_history],
        "iterations": int(solution.iterations),
        "note": getattr(solution, "note", None),
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
        objective_scale=told.get("objective_scale", 1.0),
    )


def _partition() -> int | str:
    """This task's partition, for an error before the handle that knows it exists."""
    try:
        from pyspark import TaskContext

        return TaskContext.get().partitionId()
    except Exception:  # not in a task: say so rather than guess
        return "(outside a Spark task)"
