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


#: columns of the history per block of its products (20 rows x 8192 float64: about 1.3 MB)
PRODUCT_BLOCK = 8192


@dataclass
class History:
    """The own slices of the kept pairs, newest first, and their dot products summed over
    all partitions: ``ss[i, j] = s_i . s_j``, ``sy[i, j] = s_i . y_j``, ``yy[i, j] = y_i . y_j``.

    The slices live as rows of ONE contiguous matrix ``store`` (2m rows of the own slice's
    length): the products of a vector with every kept one are one matrix product, and the
    direction one combination of its rows, each reading the history once instead of once
    per vector. ``step_slots`` and ``delta_slots`` name the rows of s_0, s_1, ... and of
    y_0, y_1, ... (newest first); a row not in use is zero."""

    store: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    step_slots: list[int] = field(default_factory=list)
    delta_slots: list[int] = field(default_factory=list)
    ss: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    sy: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    yy: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))

    @property
    def length(self) -> int:
        return len(self.step_slots)

    @property
    def steps(self) -> list[np.ndarray]:
        """The kept s_i (views of ``store``'s rows), newest first."""
        return [self.store[slot] for slot in self.step_slots]

    @property
    def grad_deltas(self) -> list[np.ndarray]:
        """The kept y_i (views of ``store``'s rows), newest first."""
        return [self.store[slot] for slot in self.delta_slots]

    def add(self, step: np.ndarray, grad_delta: np.ndarray, capacity: int) -> None:
        """Keep a new pair as the newest, forgetting the oldest when ``capacity`` are kept.
        The tables are not extended here: the caller prepends the new pair's products."""
        if self.store.shape != (2 * capacity, step.size):  # the first pair, or resumed
            kept = self.steps + self.grad_deltas
            self.store = np.zeros((2 * capacity, step.size))
            if kept:
                self.store[: len(kept)] = kept
            self.step_slots = list(range(self.length))
            self.delta_slots = list(range(self.length, 2 * self.length))
        if self.length >= capacity:
            self.drop_oldest()
        free = sorted(set(range(2 * capacity)) - set(self.step_slots) - set(self.delta_slots))
        self.store[free[0]] = step
        self.store[free[1]] = grad_delta
        self.step_slots.insert(0, free[0])
        self.delta_slots.insert(0, free[1])

    def drop_oldest(self) -> None:
        """Forget the oldest pair (its rows zeroed; the tables keep the newest pair's row for
        it to fill)."""
        self.store[self.step_slots.pop()] = 0.0
        self.store[self.delta_slots.pop()] = 0.0
        self.ss, self.sy, self.yy = self.ss[:-1, :-1], self.sy[:-1, :-1], self.yy[:-1, :-1]

    def products(self, vectors: np.ndarray) -> np.ndarray:
        """Every store row's dot products with each of ``vectors`` (rows): (2m, len(vectors)),
        summed over blocks of ``PRODUCT_BLOCK`` columns (a block of the store stays in the
        cache while it meets every vector: ~1.5x faster than one product at 2^18)."""
        out = np.zeros((self.store.shape[0], vectors.shape[0]))
        for start in range(0, self.store.shape[1], PRODUCT_BLOCK):
            end = start + PRODUCT_BLOCK
            out += self.store[:, start:end] @ vectors[:, start:end].T
        return out

    def combination(self, step_weights: np.ndarray, delta_weights: np.ndarray) -> np.ndarray:
        """sum_i step_weights[i] s_i + sum_i delta_weights[i] y_i, in one pass over the store."""
        weights = np.zeros(self.store.shape[0])
        weights[self.step_slots] = step_weights
        weights[self.delta_slots] = delta_weights
        return weights @ self.store


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
            # where they lie in the store, so a resumed run's products take the same bits
            "slots": np.array([h.store.shape[0], *h.step_slots, *h.delta_slots], np.float64),
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
        steps, grad_deltas = np.asarray(arrays["steps"]), np.asarray(arrays["grad_deltas"])
        k = len(steps)
        told = arrays.get("slots")  # absent from a state saved before the store existed
        rows, *slots = [2 * k, *range(2 * k)] if told is None else (int(v) for v in told)
        store = np.zeros((rows, point.x.size))
        store[slots[:k]] = steps
        store[slots[k:]] = grad_deltas
        history = History(
            store,
            slots[:k],
            slots[k:],
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
