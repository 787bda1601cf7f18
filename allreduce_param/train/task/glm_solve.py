"""The solve of MLlib's linear models inside a barrier task: every partition calls
``solve_glm`` with its own rows and all return the same ``GlmSolution``.

What each partition holds: its rows, its slice of the coefficient vector (the handle's slice
of a vector of ``glm_parameter_size(problem)`` elements) and its slices of L-BFGS's last m
pairs. What is summed, all in float64 and the same bits everywhere:

- once: the row checks' verdicts with the first statistics (weight sum, counts, the
  features' weighted sums, the class histogram), then the deviations from the means (both
  reduce-scattered and gathered, ``HandleSums.sum_vector``); for
  solver="normal" instead the weighted Gram matrix of the features and its moments;
- each evaluation of the objective: the whole vector gathered from its slices (every row
  needs every coefficient), the local gradient reduce-scattered to the slices' owners, and
  the value with the slope along the search direction (three scalars);
- each iteration: the new pair's and the new gradient's dot products with the kept pairs
  (O(m) scalars), from which every partition runs the same two-loop recursion.

``HandleSums`` gives the solver those sums over a ``ConnectedParameter``'s exact allreduce.

A partition's rows may also come as ``glm_rows.RowChunks`` (in a row file on disk, read a
block at a time at every pass): each local sum is then the sum of the chunks' in order.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from allreduce_param.engine import ConnectedParameter, SliceLayout
from allreduce_param.errors import InputError
from allreduce_param.models.glm import (
    GlmProblem,
    GlmSolution,
    constant_label_answer,
    first_moments,
    glm_parameter_size,
    row_stats,
    rows_problem,
    second_moments,
)
from allreduce_param.models.glm_loss import GlmObjective
from allreduce_param.models.glm_normal import gram_moments, solve_normal
from allreduce_param.optim.quasi_newton import LocalSums, QuasiNewtonSettings, minimize
from allreduce_param.optim.quasi_newton_state import SolverState
from allreduce_param.train.task.glm_rows import RowChunks

__all__ = ["HandleSums", "glm_parameter_size", "solve_glm"]


class HandleSums:
    """The solver's ``ShardSums`` over a connected handle's collectives: float64 sums in
    partition order, so every partition gets the same bits.

    The vectors go through the typed ``reduce_scatter`` and ``all_gather`` (each partition
    sends and receives about one vector's worth), the scalars through ``allreduce_exact``.
    A hierarchical handle, which the typed collectives refuse, sums the vectors with
    ``allreduce_exact`` instead (exact too, with N copies of each vector on the wire)."""

    def __init__(self, handle: ConnectedParameter) -> None:
        self._collectives = handle.collectives
        self.layout = handle.info.layout
        self.own = self.layout.bounds(handle.info.partition_id)
        self._typed = not handle.info.hierarchical

    def sum_scalars(self, values: np.ndarray) -> np.ndarray:
        return self._collectives.allreduce_exact(np.asarray(values, np.float64))

    def sum_vector(self, values: np.ndarray) -> np.ndarray:
        """The whole float64 sum of a vector every partition needs whole (the features'
        moments, the Gram matrix): reduce-scattered then gathered, about two vectors' worth
        of traffic per partition instead of N; the same bits everywhere."""
        values = np.ascontiguousarray(values, np.float64)
        if not self._typed:
            return self._collectives.allreduce_exact(values)
        layout = SliceLayout(values.size, self.layout.partition_num)
        own = self._collectives.reduce_scatter(values, "sum", layout)
        return self._collectives.all_gather(own, layout)

    def gather(self, own: np.ndarray) -> np.ndarray:
        own = np.ascontiguousarray(own, np.float64)
        if self._typed:
            return self._collectives.all_gather(own, self.layout)
        whole = np.zeros(self.layout.size)
        whole[self.own] = own
        return self._collectives.allreduce_exact(whole)

    def reduce_scatter(self, whole: np.ndarray) -> np.ndarray:
        whole = np.ascontiguousarray(whole, np.float64)
        if self._typed:
            return self._collectives.reduce_scatter(whole, "sum", self.layout)
        return self._collectives.allreduce_exact(whole)[self.own]


def _as_float64(features):
    """The rows as float64 (CSR stays CSR)."""
    if hasattr(features, "tocsr"):
        return features.tocsr().astype(np.float64)
    return np.asarray(features, np.float64)


def _checked_sum(sums: HandleSums, handle, verdict: str | None, values: np.ndarray) -> np.ndarray:
    """Sum ``values`` with every partition's verdict on its rows; where any partition's rows
    are bad, all fail at once, the bad ones with their reason, so no partition waits on one.

    Each signals once it has the sum, and the partitions with good rows raise only after
    every partition has signalled: none stops serving its part of the sum before the bad
    ones have fetched it, so theirs is the error the caller reads (the good ones say that
    another partition's rows failed, or that it stopped, naming its error)."""
    total = sums.sum_vector(np.concatenate([[1.0 if verdict else 0.0], values]))
    if total[0] > 0:
        handle.collectives.signal(0)
        if verdict is not None:
            raise InputError(f"solve_glm: {verdict}")
        handle.collectives.wait_for_signals(0)
        raise InputError(
            f"solve_glm: the rows of {int(total[0])} other partition(s) failed the checks "
            "(their errors say why)"
        )
    return total[1:]


def solve_glm(
    handle: ConnectedParameter,
    features,
    labels: np.ndarray,
    weights: np.ndarray | None,
    problem: GlmProblem,
    *,
    resume: dict[str, np.ndarray] | None = None,
    on_iteration: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> GlmSolution:
    """MLlib's fit of ``problem`` over every partition's rows (see the module's docstring).

    ``features``: a 2-D float array or a scipy.sparse CSR matrix of ``num_features`` columns,
    possibly with zero rows; ``weights`` None for 1 each. Or ``features`` a ``RowChunks``
    (rows, labels and weights in chunks, e.g. from a row file), ``labels`` and ``weights``
    then None. The handle's vector must have
    ``glm_parameter_size(problem)`` elements.

    ``on_iteration(arrays)``: called after each L-BFGS iteration with this partition's state
    as plain float64 arrays (its slices of the iterate and of the history, and the scalars
    every partition shares), to keep as a checkpoint; ``resume``: such arrays, every
    partition's of the same iteration, to go on from there with the same steps and result."""
    sums = HandleSums(handle)
    if sums.layout.size != glm_parameter_size(problem):
        raise InputError(
            f"solve_glm: the handle's vector has {sums.layout.size} elements where the problem "
            f"has {glm_parameter_size(problem)}: make the AllReduceParameter with "
            "size=glm_parameter_size(problem)"
        )
    if isinstance(features, RowChunks):
        rows = features
        verdict = rows.first(lambda X, y, w: rows_problem(X, y, w, problem))
    else:
        verdict = rows_problem(features, labels, weights, problem)
        if verdict is None:
            features = _as_float64(features)
            labels = np.asarray(labels, np.float64)
        rows = RowChunks.in_memory(features, labels, weights)
    if problem.solver == "normal":
        d = problem.num_features
        length = 3 + 2 * d + d * (d + 1) // 2
        local = np.zeros(length) if verdict else rows.total(gram_moments)
        settings = QuasiNewtonSettings(problem.max_iter, problem.tol, problem.history)

        def one_partition(objective, start, l1):
            result = minimize(objective, start, LocalSums(), settings, l1)
            return result.x, result.objective_history, result.iterations

        return solve_normal(problem, _checked_sum(sums, handle, verdict, local), one_partition)
    classes = 0 if problem.family == "gaussian" else max(problem.num_classes, 2)
    length = 4 + problem.num_features + classes
    local = (
        np.zeros(length) if verdict else rows.total(lambda X, y, w: first_moments(X, y, w, classes))
    )
    first = _checked_sum(sums, handle, verdict, local)
    if first[0] <= 0:
        raise InputError(
            "solve_glm: no rows, or their weights (weightCol) sum to 0: nothing to fit"
        )
    means = first[4 : 4 + problem.num_features] / first[0]
    label_mean = first[3] / first[0]
    # partial, not a closure: ``means`` is deleted below, once the iterations start. Summed
    # as the first sum is (reduce-scattered, then gathered: about two vectors' worth of
    # traffic per partition), not as scalars (N whole copies each): the same bits
    second = sums.sum_vector(
        rows.total(partial(second_moments, means=means, label_mean=label_mean))
    )
    stats = row_stats(first, second, problem.num_features)
    special = _special_case(problem, stats)
    if special is not None:
        return special
    objective = GlmObjective(problem, stats)
    l2, l1 = objective.penalty_weights()
    own = sums.own
    own_l2, own_l1 = l2[own], l1[own]
    # model-sized vectors the iterations do not need: not kept for the fit's length (at
    # 2^24 features each is 128 MiB per partition)
    del local, first, means, second, l2, l1

    def evaluate(x_own: np.ndarray) -> tuple[float, np.ndarray]:
        x = sums.gather(x_own)
        loss, grad = rows.total(lambda X, y, w: objective.data_loss(X, y, w, x))
        own_grad = sums.reduce_scatter(grad) / stats.weight_sum + own_l2 * x_own
        share = loss / stats.weight_sum + 0.5 * float(own_l2 @ (x_own * x_own))
        return share, own_grad

    settings = QuasiNewtonSettings(problem.max_iter, problem.tol, problem.history)
    result = minimize(
        evaluate,
        objective.initial()[own],
        sums,
        settings,
        own_l1,
        resume=None if resume is None else SolverState.from_arrays(resume),
        on_iteration=None if on_iteration is None else (lambda s: on_iteration(s.to_arrays())),
    )
    coefficients, intercepts = objective.original(sums.gather(result.x))
    note = None if result.reason != "line search failed" else "the line search failed"
    return GlmSolution(
        coefficients,
        intercepts,
        result.objective_history,
        result.iterations,
        note,
        result.times,
        objective.label_scale**2 if problem.family == "gaussian" else 1.0,
    )


def _special_case(problem: GlmProblem, stats) -> GlmSolution | None:
    """MLlib's answers without training: a constant label (LinearRegression with an
    intercept or a zero label; LogisticRegression with an intercept and one class)."""
    rows, d = problem.rows, problem.num_features
    if problem.family == "gaussian" and stats.label_std == 0.0:
        return constant_label_answer(problem, stats.label_mean)
    if problem.family == "gaussian" or not problem.fit_intercept:
        return None
    present = np.flatnonzero(stats.class_weights)
    if present.size != 1:
        return None
    label = int(present[0])
    if problem.family == "binomial":
        intercepts = np.array([np.inf if label == 1 else -np.inf])
    else:
        intercepts = np.zeros(rows)
        intercepts[label] = np.inf
    return GlmSolution(
        np.zeros((rows, d)),
        intercepts,
        [0.0],
        0,
        f"all labels are {label}: the coefficients are zero and the intercept infinite",
    )
