"""The layers of a dense network without its head: the parameters' places in the flat vector,
their initialisation, the forward pass and the backward pass.

``DenseNetwork`` (``models.dense``) puts a loss head on a stack and checks what callers
give it; the stack does the arithmetic. Performance, because it runs on every step inside
Spark tasks, possibly on several threads at once: everything is vectorised float32 numpy
(BLAS matmuls and ufuncs, which release the GIL); the weight tensors are views into the flat
vector, and the gradient tensors views into one flat float32 vector, written in place with
``out=``. The only other allocations are one activation array per layer and one delta array
per hidden layer. A stack holds no mutable state, so threads can share it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from allreduce_param.engine.layout import TensorLayout
from allreduce_param.models.base import is_sparse_matrix


class Activation(NamedTuple):
    """A hidden-layer activation: in-place forward, in-place backward, and its init."""

    forward: Callable[[np.ndarray], None]
    """``z -> act(z)``, in place."""
    backward: Callable[[np.ndarray, np.ndarray], None]
    """``(delta, a)``: multiply ``delta`` in place by ``act'`` expressed through ``a = act(z)``."""
    init: str
    """The weight initialisation that suits it: ``"he"`` or ``"glorot"``."""


def _relu(z: np.ndarray) -> None:
    np.maximum(z, 0, out=z)


def _relu_backward(delta: np.ndarray, a: np.ndarray) -> None:
    np.multiply(delta, a > 0, out=delta)


def _tanh(z: np.ndarray) -> None:
    np.tanh(z, out=z)


def _tanh_backward(delta: np.ndarray, a: np.ndarray) -> None:
    slope = np.square(a)
    np.subtract(1, slope, out=slope)
    delta *= slope


ACTIVATIONS: dict[str, Activation] = {
    "relu": Activation(_relu, _relu_backward, "he"),
    "tanh": Activation(_tanh, _tanh_backward, "glorot"),
}


class DenseStack:
    """Dense layers ``layers[0] -> layers[1] -> ... -> layers[-1]``: layer ``i`` (1-based)
    computes ``a_i = act(a_{i-1} @ w_i + b_i)``, with ``w_i`` of shape (layers[i-1],
    layers[i]); the last layer has no activation. Parameters lie in the flat vector as
    ``w1, b1, w2, b2, ...`` (``layout``; ``names`` pairs each layer's weight and bias)."""

    def __init__(self, layers: Sequence[int], activation: str | None) -> None:
        self.layers, self.activation = tuple(layers), activation
        self.names = tuple((f"w{i}", f"b{i}") for i in range(1, len(layers)))
        tensors = []
        for (weight, bias), fan_in, fan_out in zip(self.names, layers[:-1], layers[1:]):
            tensors += [(weight, (fan_in, fan_out)), (bias, (fan_out,))]
        self.layout = TensorLayout(tensors)

    def init(self, rng: np.random.Generator) -> np.ndarray:
        """Random weights, zero biases, as one flat float32 vector; deterministic per rng.

        Weights feeding a ReLU get He-normal init (std ``sqrt(2 / fan_in)``); the others
        (tanh layers and the output layer) Glorot-uniform (``+-sqrt(6 / (fan_in + fan_out))``).
        """
        flat = np.zeros(self.layout.size, dtype=np.float32)
        tensors = self.layout.views(flat)
        last = len(self.names) - 1
        for index, (weight, _) in enumerate(self.names):
            w = tensors[weight]
            fan_in, fan_out = w.shape
            if index < last and ACTIVATIONS[self.activation].init == "he":
                rng.standard_normal(dtype=np.float32, out=w)
                w *= np.float32(np.sqrt(2.0 / fan_in))
            else:
                limit = np.float32(np.sqrt(6.0 / (fan_in + fan_out)))
                rng.random(dtype=np.float32, out=w)
                w *= 2 * limit
                w -= limit
        return flat

    def forward(self, params: dict[str, np.ndarray], X: np.ndarray) -> list[np.ndarray]:
        """The input and every layer's output; the last is the pre-head output ``z``."""
        outputs = [X]
        last = len(self.names) - 1
        for index, (weight, bias) in enumerate(self.names):
            z = outputs[-1] @ params[weight]
            z += params[bias]
            if index < last:
                ACTIVATIONS[self.activation].forward(z)
            outputs.append(z)
        return outputs

    def backward(
        self,
        params: dict[str, np.ndarray],
        outputs: list[np.ndarray],
        grads: dict[str, np.ndarray],
        ready: Callable[[int, int], None] | None = None,
        first: Callable[[np.ndarray, np.ndarray], None] | None = None,
    ) -> None:
        """The gradient into the tensors ``grads``, given ``outputs[-1]`` already holding
        ``d loss / d z``; ``ready(start, stop)`` after each layer's part of the flat vector.
        ``first(X, delta)``, when given, takes the first layer's weight gradient instead
        (``grads`` then needs no ``w1``).

        Every tensor of ``grads`` is written in full by a ``out=`` matmul or sum, so it may
        start uninitialised.
        """
        delta = outputs[-1]
        for index in range(len(self.names) - 1, -1, -1):
            weight, bias = self.names[index]
            below = outputs[index]
            if index == 0 and first is not None:
                first(below, delta)
            elif index == 0 and is_sparse_matrix(below):  # X^T delta, summed in place: O(non-zeros)
                _add_transposed_product(below, delta, grads[weight])
            else:
                np.matmul(below.T, delta, out=grads[weight])
            np.sum(delta, axis=0, out=grads[bias])
            if ready is not None:
                ready(self.layout.offset(weight), self.layout.offset(bias) + grads[bias].size)
            if index > 0:
                delta = delta @ params[weight].T
                ACTIVATIONS[self.activation].backward(delta, below)

    def penalized(self, start: int, stop: int) -> np.ndarray:
        """Of the flat vector's ``start:stop``, which coordinates are weights (True), not
        biases (False)."""
        mask = np.zeros(stop - start, dtype=bool)
        for weight, _ in self.names:
            first = self.layout.offset(weight)
            last = first + int(np.prod(self.layout.shape(weight)))
            mask[max(first, start) - start : max(min(last, stop), start) - start] = True
        return mask


#: Where ``X^T delta`` has more than this many entries per stored product, it is summed in
#: place rather than made by scipy as a temporary (measured on 2 cores: scipy's product is
#: faster up to about 40, the in-place sum beyond, 1.4x at 2^24 features).
IN_PLACE_ABOVE = 48


def _add_transposed_product(X, delta: np.ndarray, out: np.ndarray) -> None:
    """``out = X^T delta`` for a CSR ``X``, written into ``out`` (features, outputs). For a
    wide ``out`` each stored value adds its row's ``delta`` to its column's row of ``out``
    (O(non-zeros), after one fill); scipy's product would first make a (features, outputs)
    temporary, at 2^24 features a fresh 128 MB a step. Both give the same sums, each
    column's added in row order."""
    if out.size <= IN_PLACE_ABOVE * max(1, X.nnz * out.shape[1]):
        out[...] = X.T @ delta
        return
    out.fill(0)
    rows = np.repeat(np.arange(X.shape[0]), np.diff(X.indptr))
    np.add.at(out, X.indices, X.data[:, None] * delta[rows])


def touched_product(X, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``X^T delta`` on the columns ``X`` holds alone: (those columns, increasing; their rows
    of the product). ``X`` with its columns renumbered to those alone, through scipy's
    product: each column's terms added in row order, as in ``_add_transposed_product``
    either way, so the same bits, with no array as wide as ``X``."""
    from scipy.sparse import csr_matrix

    columns, where = np.unique(X.indices, return_inverse=True)
    narrow = csr_matrix(
        (X.data, where.astype(X.indices.dtype, copy=False), X.indptr),
        shape=(X.shape[0], columns.size),
    )
    return columns, np.asarray(narrow.T @ delta, dtype=np.float32)
