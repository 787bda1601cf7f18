"""L-BFGS and OWL-QN with the vector and its history sharded over the partitions.

Each partition holds only its slice of the iterate x, of the gradient, and of the last m
pairs (s_i = x_{i+1} - x_i, y_i = g_{i+1} - g_i); nobody holds a whole vector of the history.
The two-loop recursion is run *vector-free* (Chen, Wang and Zhou, NIPS 2014): the direction
is a combination of the kept vectors and the gradient q,

    d = sum_i a_i s_i + sum_i b_i y_i + c q,

whose coefficients follow from the dot products among those 2m + 1 vectors alone. Each
iteration computes the products of the newest pair and of the new gradient with the kept
vectors on the own slices and sums them with ONE ``sum_scalars`` of O(m) numbers; the
recursion then runs on a (2m+1) x (2m+1) table that is bit-for-bit the same on every
partition, and each partition forms its slice of d from its own slices. Every decision
(step sizes, convergence, a reset of the history) is made from such sums, so all partitions
take the same path and make the same collective calls in the same order.

The rules are Breeze's (what MLlib's LinearRegression and LogisticRegression run): L-BFGS
with the strong Wolfe search (first step 1/|d|, then 1); OWL-QN for a non-zero L1 part, with
the pseudo-gradient, the direction kept in its orthant and steps projected on it, and the
backtracking search (first step 0.5/|g|, shrinking by 0.1, then 1 and 0.5); a failed step
clears the history once and stops on a second failure in a row; stopping on ``max_iter``, on
the objective improving by at most ``tol`` times the first value over the last 20 values
(Breeze keeps 20), or on |gradient| <= max(tol * |value|, 1e-8). The objective history holds
every state's value, the first at the start (MLlib's ``objectiveHistory``); its length less
one is MLlib's ``totalIterations``.

Spark-free and engine-free: the solver works through ``ShardSums`` (three sums across the
partitions) and a ``ShardObjective`` (this partition's part of the objective at the own
slice of x); ``LocalSums`` is the one-partition case, used for the normal equations' L1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from allreduce_param.optim.line_search import SearchFailure, backtracking, strong_wolfe
from allreduce_param.optim.quasi_newton_state import History, Point, SolverState

#: the values Breeze's convergence check keeps to judge the improvement of the objective
IMPROVEMENT_WINDOW = 20


class ShardSums(Protocol):
    """The sums across partitions that the solver needs; every partition calls each one
    in the same order, and all get the same bits."""

    def sum_scalars(self, values: np.ndarray) -> np.ndarray:
        """Sum a small float64 vector over the partitions, exactly (the same bits everywhere)."""

    def gather(self, own: np.ndarray) -> np.ndarray:
        """The whole vector from every partition's slice of it."""

    def reduce_scatter(self, whole: np.ndarray) -> np.ndarray:
        """This partition's slice of the float64 sum of every partition's whole vector."""


class LocalSums:
    """``ShardSums`` of a single partition that owns the whole vector."""

    def sum_scalars(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values, dtype=np.float64).copy()

    def gather(self, own: np.ndarray) -> np.ndarray:
        return np.asarray(own, dtype=np.float64).copy()

    def reduce_scatter(self, whole: np.ndarray) -> np.ndarray:
        return np.asarray(whole, dtype=np.float64).copy()


#: x_own -> (this partition's share of the objective value, own slice of the whole gradient);
#: the shares summed over the partitions are the value. It may call the ShardSums itself.
ShardObjective = Callable[[np.ndarray], tuple[float, np.ndarray]]


@dataclass(frozen=True)
class QuasiNewtonSettings:
    """MLlib's maxIter, tol and L-BFGS's memory m (``history``; MLlib: 10)."""

    max_iter: int = 100
    tol: float = 1e-6
    history: int = 10


@dataclass
class QuasiNewtonResult:
    """Where the solver stopped: the own slice of x, MLlib's objective history and
    iteration count, and Breeze's reason for stopping. ``times``: the wall clock
    (``time.time()``) at which each value of the history was reached on this partition
    (NaN for those a resumed run did not compute itself): what a benchmark plots."""

    x: np.ndarray
    objective_history: list[float]
    iterations: int
    reason: str
    times: list[float] = field(default_factory=list)


class QuasiNewton:
    """One partition's side of a sharded L-BFGS (``l1`` None or all zero) or OWL-QN run."""

    def __init__(
        self,
        objective: ShardObjective,
        sums: ShardSums,
        settings: QuasiNewtonSettings,
        l1: np.ndarray | None = None,
    ) -> None:
        self._objective = objective
        self._sums = sums
        self._settings = settings
        self._l1 = None if l1 is None else np.asarray(l1, np.float64)
        if self._l1 is not None and np.any(self._l1 < 0):
            raise ValueError("the L1 weights must be >= 0")

    # -- evaluations -------------------------------------------------------------------

    def _adjust(self, x: np.ndarray, grad: np.ndarray) -> tuple[float, np.ndarray]:
        """This partition's L1 share and its slice of OWL-QN's pseudo-gradient."""
        if self._l1 is None:
            return 0.0, grad
        l1 = self._l1
        at_zero = np.where(grad - l1 > 0, grad - l1, np.where(grad + l1 < 0, grad + l1, 0.0))
        pseudo = np.where(x == 0.0, at_zero, grad + np.sign(x) * l1)
        pseudo = np.where(l1 == 0.0, grad, pseudo)
        return float(np.sum(np.abs(l1 * x))), pseudo

    def _evaluate(self, x: np.ndarray, direction: np.ndarray | None = None) -> tuple[Point, float]:
        """The point at ``x`` and the slope of the objective along ``direction`` there
        (0 without one), from one sum of three scalars."""
        share, grad = self._objective(x)
        l1_share, pseudo = self._adjust(x, grad)
        slope = float(np.dot(pseudo, direction)) if direction is not None else 0.0
        value, l1_value, total_slope = self._sums.sum_scalars(
            np.array([share, l1_share, slope], np.float64)
        )
        return Point(x, float(value), grad, float(value + l1_value), pseudo), float(total_slope)

    # -- the direction -----------------------------------------------------------------

    def _gradient_dots(self, point: Point, history: History, new_pair: bool) -> np.ndarray:
        """One sum: the newest pair's products with the kept pairs (when ``new_pair``) and
        the products of the search gradient q with every kept vector, q . q and g . g."""
        q = point.adjusted_grad
        if history.length == 0:
            local = np.array([np.dot(q, q), np.dot(point.grad, point.grad)])
        else:
            # one matrix product over the store for every kept vector's products
            if new_pair:
                newest = history.store[[history.step_slots[0], history.delta_slots[0]]]
                products = history.products(np.vstack([newest, q]))
            else:
                products = history.products(q[None, :])
            parts = []
            for column in range(products.shape[1]):
                parts += [products[history.step_slots, column]]
                parts += [products[history.delta_slots, column]]
            parts += [[np.dot(q, q), np.dot(point.grad, point.grad)]]
            local = np.concatenate(parts).astype(np.float64)
        total = self._sums.sum_scalars(local)
        k = history.length
        if new_pair:
            s_s, s_y, y_s, y_y = (total[i * k : (i + 1) * k] for i in range(4))
            history.ss = _prepend(history.ss, s_s)
            history.yy = _prepend(history.yy, y_y)
            history.sy = _prepend_cross(history.sy, s_y, y_s)
            total = total[4 * k :]
        return total  # q.s (k), q.y (k), q.q, g.g

    def _direction(
        self, point: Point, history: History, dots: np.ndarray
    ) -> tuple[np.ndarray, float, float]:
        """The own slice of the two-loop recursion's direction d, from the summed products;
        with d . q and |d|, which follow from them too."""
        k = history.length
        if k == 0:
            return -point.adjusted_grad.copy(), -dots[-2], math.sqrt(dots[-2])
        # the basis: s_0..s_{k-1}, y_0..y_{k-1}, q; its table of dot products
        gram = np.empty((2 * k + 1, 2 * k + 1))
        gram[:k, :k], gram[:k, k : 2 * k] = history.ss, history.sy
        gram[k : 2 * k, :k], gram[k : 2 * k, k : 2 * k] = history.sy.T, history.yy
        gram[2 * k, : 2 * k] = gram[: 2 * k, 2 * k] = dots[: 2 * k]
        gram[2 * k, 2 * k] = dots[2 * k]
        sy, yy = history.sy[0, 0], history.yy[0, 0]
        if sy < 0 or math.isnan(sy):
            raise SearchFailure("the history's curvature s.y is negative or NaN")
        scale = sy / yy
        delta = np.zeros(2 * k + 1)
        delta[2 * k] = 1.0
        alphas = np.empty(k)
        rho = np.diag(history.sy).copy()
        for i in range(k):
            alphas[i] = gram[i] @ delta / rho[i]
            if math.isnan(alphas[i]):
                raise SearchFailure("NaN in the two-loop recursion")
            delta[k + i] -= alphas[i]
        delta *= scale
        for i in range(k - 1, -1, -1):
            beta = gram[k + i] @ delta / rho[i]
            delta[i] += alphas[i] - beta
        delta *= -1.0
        out = history.combination(delta[:k], delta[k : 2 * k])
        out += delta[2 * k] * point.adjusted_grad
        slope = float(delta @ gram[:, 2 * k])
        return out, slope, math.sqrt(max(float(delta @ gram @ delta), 0.0))

    # -- the loop ----------------------------------------------------------------------

    def minimize(
        self,
        x0: np.ndarray,
        resume: SolverState | None = None,
        on_iteration: Callable[[SolverState], None] | None = None,
    ) -> QuasiNewtonResult:
        """Minimize from the own slice ``x0``, or go on from ``resume`` (a state that
        ``on_iteration`` was given, on every partition the same iteration's): every partition
        calls it at once. ``on_iteration`` sees the state after each iteration (to keep a
        checkpoint of it); a run resumed from it takes the same steps as the run that made it."""
        # OWL-QN where any partition's slice has an L1 weight (all must take the same path)
        local_l1 = 0.0 if self._l1 is None else float(np.count_nonzero(self._l1))
        if self._sums.sum_scalars(np.array([local_l1]))[0] == 0:
            self._l1 = None
        if resume is not None:
            state = resume.copy()
            times = [math.nan] * len(state.values)
        else:
            point, _ = self._evaluate(np.asarray(x0, np.float64).copy())
            history = History()
            dots = self._gradient_dots(point, history, new_pair=False)
            state = SolverState(point, history, dots, [point.adjusted_value], [math.inf])
            times = [time.time()]
        while True:
            reason = self._stop_reason(state)
            if reason is not None:
                point = state.point
                iterations = len(state.values) - 1
                return QuasiNewtonResult(point.x, state.values, iterations, reason, times)
            self._iterate(state)
            times.append(time.time())
            if on_iteration is not None:
                on_iteration(state)

    def _iterate(self, state: SolverState) -> None:
        """One of Breeze's iterations on ``state``: a step, or a reset of the history after a
        failed one (a second failure in a row marks the search failed)."""
        point, history = state.point, state.history
        try:
            new_point = self._step(point, history, state.dots, state.iteration)
        except SearchFailure:
            if state.failed_once:
                state.search_failed = True
            else:
                state.failed_once = True
                state.history = History()
                state.dots = state.dots[-2:].copy()
            state.values.append(point.adjusted_value)
            return
        state.failed_once = False
        history.add(new_point.x - point.x, new_point.grad - point.grad, self._settings.history)
        state.point = new_point
        state.dots = self._gradient_dots(new_point, history, new_pair=True)
        state.iteration += 1
        state.values.append(new_point.adjusted_value)
        state.window = (state.window + [new_point.adjusted_value])[-IMPROVEMENT_WINDOW:]

    def _stop_reason(self, state: SolverState) -> str | None:
        """Breeze's default convergence check, in its order."""
        tol, value = self._settings.tol, state.point.adjusted_value
        if state.iteration >= self._settings.max_iter:
            return "max iterations reached"
        window = state.window
        if len(window) >= 2 and abs(value - max(window)) <= tol * abs(state.values[0]):
            return "function values converged"
        if math.sqrt(state.dots[-2]) <= max(tol * abs(value), 1e-8):
            return "gradient converged"
        if state.search_failed:
            return "line search failed"
        return None

    def _step(self, point: Point, history: History, dots: np.ndarray, iteration: int) -> Point:
        """One iteration's direction and line search; the new point."""
        direction, slope0, norm = self._direction(point, history, dots)
        tried: dict[float, Point] = {}
        if self._l1 is None:

            def take(t: float) -> np.ndarray:
                return point.x + t * direction

        else:  # OWL-QN: the direction kept in the pseudo-gradient's orthant, steps projected
            direction = np.where(direction * point.adjusted_grad < 0, direction, 0.0)
            orthant = np.where(point.x != 0, np.sign(point.x), np.sign(-point.adjusted_grad))
            slope0 = float(self._sums.sum_scalars(np.array([direction @ point.adjusted_grad]))[0])

            def take(t: float) -> np.ndarray:
                stepped = point.x + t * direction
                return np.where(np.sign(stepped) == orthant, stepped, 0.0)

        def phi(t: float) -> tuple[float, float]:
            new, slope = self._evaluate(take(t), direction)
            tried[t] = new
            return new.adjusted_value, slope

        if self._l1 is None:
            first = 1.0 / norm if iteration == 0 else 1.0
            step = strong_wolfe(phi, first, (point.adjusted_value, slope0))
            if step * math.sqrt(dots[-1]) < 1e-10:
                raise SearchFailure("step size underflow")
        else:
            first = 0.5 / math.sqrt(dots[-1]) if iteration < 1 else 1.0
            shrink = 0.1 if iteration < 1 else 0.5
            at_zero = (point.adjusted_value, slope0)
            step = backtracking(phi, first, at_zero, point.value, shrink=shrink)
        if step in tried:
            return tried[step]
        return self._evaluate(take(step))[0]


def _prepend(table: np.ndarray, row: np.ndarray) -> np.ndarray:
    """A symmetric table of products with a new vector's products ``row`` as row and
    column 0 (``row[0]`` its product with itself)."""
    k = row.size
    out = np.empty((k, k))
    out[0, :] = row
    out[:, 0] = row
    out[1:, 1:] = table[: k - 1, : k - 1]
    return out


def _prepend_cross(table: np.ndarray, s_row: np.ndarray, y_row: np.ndarray) -> np.ndarray:
    """The s.y table with a new pair at 0: ``s_row[j] = s_0 . y_j``, ``y_row[i] = y_0 . s_i``."""
    k = s_row.size
    out = np.empty((k, k))
    out[0, :] = s_row
    out[:, 0] = y_row
    out[0, 0] = s_row[0]
    out[1:, 1:] = table[: k - 1, : k - 1]
    return out


def minimize(
    objective: ShardObjective,
    x0: np.ndarray,
    sums: ShardSums,
    settings: QuasiNewtonSettings,
    l1: np.ndarray | None = None,
    resume: SolverState | None = None,
    on_iteration: Callable[[SolverState], None] | None = None,
) -> QuasiNewtonResult:
    """Minimize ``objective`` (plus ``sum_j l1_j |x_j|`` over the own slice's weights ``l1``,
    by OWL-QN, when any is non-zero) from the own slice ``x0``; see the module's docstring
    and ``QuasiNewton.minimize`` for ``resume`` and ``on_iteration``."""
    return QuasiNewton(objective, sums, settings, l1).minimize(x0, resume, on_iteration)
