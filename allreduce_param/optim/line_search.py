"""Line searches of the quasi-Newton solver, with Breeze's rules (the ones MLlib runs).

Each works on ``phi(t) -> (value, slope)``: the objective along the search direction and its
derivative there, scalars that every partition computes identically (they are sums over all
partitions), so every partition takes the same steps and returns the same step size.

- ``strong_wolfe``: L-BFGS's search (Breeze's ``StrongWolfeLineSearch``, after Nocedal and
  Wright, p. 60): grow the step by 1.5 until a bracket holds a point with sufficient decrease
  (c1 = 1e-4) and a small slope (c2 = 0.9), then zoom by safeguarded cubic interpolation.
- ``backtracking``: OWL-QN's search (Breeze's ``BacktrackingLineSearch``): shrink or grow the
  step by fixed factors until the Armijo and the strong Wolfe conditions hold. As in Breeze,
  the value it first compares is the one it is given (``first_value``; OWL-QN passes the
  objective at the current point without its L1 part), not the value at the first step.

A search that cannot find its step raises ``SearchFailure``; the solver resets its history
once and stops on a second failure in a row, as Breeze's ``FirstOrderMinimizer`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

#: phi(t): the objective and its slope at step t along the search direction
LineFunction = Callable[[float], tuple[float, float]]

SUFFICIENT_DECREASE = 1e-4  # c1, Armijo's constant
CURVATURE = 0.9  # c2, the (strong) Wolfe constant


class SearchFailure(Exception):
    """The solver's step failed (no step found, a step too small, a history that is not
    positive definite): Breeze's ``FirstOrderException``. Internal to the solver."""


def _cubic_minimum(left: tuple, right: tuple) -> float:
    """The minimum of the cubic through two (t, value, slope) points, kept within the middle
    80% of the interval (left[0] < right[0])."""
    lt, lv, ld = left
    rt, rv, rd = right
    d1 = ld + rd - 3 * (lv - rv) / (lt - rt)
    d2 = math.sqrt(d1 * d1 - ld * rd) if d1 * d1 - ld * rd >= 0 else math.nan
    t = rt - (rt - lt) * (rd + d2 - d1) / (rd - ld + 2 * d2)
    low, high = lt + 0.1 * (rt - lt), lt + 0.9 * (rt - lt)
    if t < low:
        return low
    if t > high:
        return high
    return t  # NaN stays NaN, as Breeze's comparisons leave it


def strong_wolfe(
    phi: LineFunction, first_step: float, at_zero: tuple[float, float], max_zoom: int = 10
) -> float:
    """A step satisfying the strong Wolfe conditions along a descent direction.

    ``at_zero`` is (value, slope) at t = 0, known to the caller; at most 10 trial steps and
    10 zoom steps, as Breeze's L-BFGS sets them."""
    value0, slope0 = at_zero
    if slope0 > 0:
        raise SearchFailure(f"line search along a direction that is not a descent: {slope0}")
    low = (0.0, value0, slope0)
    t = first_step

    def zoom(lo: tuple, hi: tuple) -> float:
        for _ in range(max_zoom):
            trial = _cubic_minimum(hi, lo) if lo[0] > hi[0] else _cubic_minimum(lo, hi)
            if math.isnan(trial):
                raise SearchFailure("line search zoom failed")
            value, slope = phi(trial)
            point = (trial, value, slope)
            if value > value0 + SUFFICIENT_DECREASE * trial * slope0 or value >= lo[1]:
                hi = point
            else:
                if abs(slope) <= CURVATURE * abs(slope0):
                    return trial
                if slope * (hi[0] - lo[0]) >= 0:
                    hi = lo
                lo = point
        raise SearchFailure("line search zoom failed")

    for i in range(10):
        value, slope = phi(t)
        if math.isinf(value) or math.isnan(value):
            t /= 2.0
            continue
        point = (t, value, slope)
        if value > value0 + SUFFICIENT_DECREASE * t * slope0 or (value >= low[1] and i > 0):
            return zoom(low, point)
        if abs(slope) <= CURVATURE * abs(slope0):
            return t
        if slope >= 0:
            return zoom(point, low)
        low = point
        t *= 1.5
    raise SearchFailure("line search failed")


def backtracking(
    phi: LineFunction,
    first_step: float,
    at_zero: tuple[float, float],
    first_value: float,
    shrink: float,
    grow: float = 2.1,
    max_iterations: int = 20,
) -> float:
    """A step by Breeze's backtracking search (Armijo plus strong Wolfe), as OWL-QN runs it.

    ``first_value`` stands for the value at ``first_step`` in the first test (Breeze's
    ``initfval``); the slope there is computed."""
    value0, slope0 = at_zero
    t = first_step
    value, slope = first_value, phi(t)[1]
    for _ in range(max_iterations):
        if value > value0 + t * slope0 * SUFFICIENT_DECREASE:
            factor = shrink
        elif slope < CURVATURE * slope0:
            factor = grow
        elif slope > -CURVATURE * slope0:
            factor = shrink
        else:
            return t
        if t * factor < 1e-10:
            raise SearchFailure("step size underflow")
        if t * factor > 1e10:
            raise SearchFailure("step size overflow")
        if _ == max_iterations - 1:
            break  # Breeze's search stops after its last trial and keeps the step before it
        t *= factor
        value, slope = phi(t)
    return t
