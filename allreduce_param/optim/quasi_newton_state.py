"""Where one partition's quasi-Newton run stands: the current point, the kept pairs (own
slices) with their summed dot products, and Breeze's bookkeeping (the objective's history, the
window the stopping rule reads, the failures in a row). ``SolverState.to_arrays`` and
``from_arrays`` turn it into plain arrays and back, so a checkpoint holds data only, and a run
resumed from it takes the same steps as the run that wrote it."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Point:
    """One evaluated point: the own slices of x, of the gradient and of the pseudo-gradient
    (the gradient itself without L1), the summed value and the value with the L1 part."""

    x: np.ndarray
    value: float
    grad: np.ndarray
    adjusted_value: float
    adjusted_grad: np.ndarray


@dataclass
class History:
    """The own slices of the kept pairs, newest first, and their dot products summed over
    all partitions: ``ss[i, j] = s_i . s_j``, ``sy[i, j] = s_i . y_j``, ``yy[i, j] = y_i . y_j``."""

    steps: list[np.ndarray] = field(default_factory=list)
    grad_deltas: list[np.ndarray] = field(default_factory=list)
    ss: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    sy: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    yy: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))

    @property
    def length(self) -> int:
        return len(self.steps)

    def drop_oldest(self) -> None:
        """Forget the oldest pair (the tables keep the newest pair's row for it to fill)."""
        self.steps.pop()
        self.grad_deltas.pop()
        self.ss, self.sy, self.yy = self.ss[:-1, :-1], self.sy[:-1, :-1], self.yy[:-1, :-1]


@dataclass
class SolverState:
    """One partition's side of a run between two iterations. ``dots`` are the gradient's
    summed products with the kept vectors (q.s, q.y, q.q, g.g); ``values`` the objective's
    history (its first entry the start's, also the stopping rule's reference); ``window`` the
    values the stopping rule compares (+inf until 20 iterations have passed)."""

    point: Point
    history: History
    dots: np.ndarray
    values: list[float]
    window: list[float]
    iteration: int = 0
    failed_once: bool = False
    search_failed: bool = False

    def copy(self) -> SolverState:
        return copy.deepcopy(self)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The state as named float64 arrays (a checkpoint's part, no pickle needed)."""
        p, h = self.point, self.history
        own = p.x.size
        return {
            "x": p.x,
            "grad": p.grad,
            "adjusted_grad": p.adjusted_grad,
            "values": np.array([p.value, p.adjusted_value]),
            "steps": np.array(h.steps).reshape(h.length, own),
            "grad_deltas": np.array(h.grad_deltas).reshape(h.length, own),
            "ss": h.ss,
            "sy": h.sy,
            "yy": h.yy,
            "dots": self.dots,
            "history": np.array(self.values),
            "window": np.array(self.window),
            "flags": np.array([self.iteration, self.failed_once, self.search_failed], np.float64),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> SolverState:
        """The state ``to_arrays`` gave."""
        value, adjusted_value = (float(v) for v in arrays["values"])
        point = Point(
            np.array(arrays["x"], np.float64),
            value,
            np.array(arrays["grad"], np.float64),
            adjusted_value,
            np.array(arrays["adjusted_grad"], np.float64),
        )
        history = History(
            [np.array(row) for row in arrays["steps"]],
            [np.array(row) for row in arrays["grad_deltas"]],
            np.array(arrays["ss"]),
            np.array(arrays["sy"]),
            np.array(arrays["yy"]),
        )
        iteration, failed_once, search_failed = (float(v) for v in arrays["flags"])
        return cls(
            point,
            history,
            np.array(arrays["dots"]),
            [float(v) for v in arrays["history"]],
            [float(v) for v in arrays["window"]],
            int(iteration),
            bool(failed_once),
            bool(search_failed),
        )
