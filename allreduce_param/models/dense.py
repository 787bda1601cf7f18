"""A stack of dense layers with a loss head: the one implementation behind every model.

Linear, logistic and softmax regression are one dense layer with a squared-error, sigmoid
or softmax head; an MLP is several layers with an activation between them. They share this
code for validation, initialisation, the forward pass and the backward pass.

Performance, because ``loss_and_grad`` runs on every step inside Spark tasks, possibly on
several threads at once: everything is vectorised float32 numpy (BLAS matmuls and ufuncs,
which release the GIL); the weight tensors are views into the flat vector, and the gradient
tensors views into one flat float32 vector allocated per call, written in place with
``out=``. The only other allocations are one activation array per layer and one delta array
per hidden layer. A model holds no mutable state, so threads can share it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from allreduce_param.engine.layout import TensorLayout
from allreduce_param.engine.vectors import SparseGradient, writable_output
from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.models.base import (
    batch_count,
    is_sparse_matrix,
    part_bounds,
    takes_part,
    weight_keywords,
)


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


def positive_int(value, what: str, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, or a ConfigurationError (a ValueError) saying so."""
    if isinstance(value, bool):
        raise ConfigurationError(f"{what} must be a whole number >= {minimum}, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ConfigurationError(
            f"{what} must be a whole number >= {minimum}, got {value!r}"
        ) from None
    if number < minimum:
        raise ConfigurationError(f"{what} must be a whole number >= {minimum}, got {number}")
    return number


class DenseNetwork:
    """Dense layers ``layers[0] -> layers[1] -> ... -> layers[-1]`` and a loss head.

    Layer ``i`` (1-based) computes ``a_i = act(a_{i-1} @ w_i + b_i)``, with ``w_i`` of shape
    (layers[i-1], layers[i]); the last layer has no activation: its output goes to the
    head. Parameters lie in the flat vector as ``w1, b1, w2, b2, ...`` (see ``layout``).

    Subclasses set the architecture in their constructor and name their constructor
    arguments in ``_arguments`` (used by ``repr``, equality and pickling).
    """

    def __init__(self, layers: Sequence[int], activation: str | None, head) -> None:
        head.check_outputs(layers[-1])
        self._layers = tuple(layers)
        self._activation = activation
        self._head = head
        self._names = tuple((f"w{i}", f"b{i}") for i in range(1, len(layers)))
        tensors = []
        for (weight, bias), fan_in, fan_out in zip(self._names, layers[:-1], layers[1:]):
            tensors += [(weight, (fan_in, fan_out)), (bias, (fan_out,))]
        self.layout = TensorLayout(tensors)

    # -- what the trainer sees ------------------------------------------------------------

    #: ``X`` may be a ``scipy.sparse`` CSR matrix: the first layer's products are then
    #: sparse-dense, a row costing its non-zeros (see ``Model``).
    takes_sparse = True

    @property
    def task(self) -> str:
        """``"classification"`` or ``"regression"``, from the head."""
        return self._head.task

    @property
    def num_classes(self) -> int | None:
        """How many classes the labels may name (ids ``0..num_classes-1``), from the head: the
        outputs of a softmax head, 2 for the logistic head; None for regression. The trainer
        checks the labels against it on the driver, before any task starts."""
        return self._head.classes(self._layers[-1])

    @property
    def size(self) -> int:
        """The number of parameters: the length of the flat vector."""
        return self.layout.size

    @property
    def n_features(self) -> int:
        """The number of input columns that ``X`` must have."""
        return self._layers[0]

    def init(self, rng: np.random.Generator) -> np.ndarray:
        """Random weights, zero biases, as one flat float32 vector; deterministic per rng.

        Weights feeding a ReLU get He-normal init (std ``sqrt(2 / fan_in)``); the others
        (tanh layers and the output layer) Glorot-uniform (``+-sqrt(6 / (fan_in + fan_out))``).
        """
        flat = np.zeros(self.size, dtype=np.float32)
        tensors = self.layout.views(flat)
        last = len(self._names) - 1
        for index, (weight, _) in enumerate(self._names):
            w = tensors[weight]
            fan_in, fan_out = w.shape
            if index < last and ACTIVATIONS[self._activation].init == "he":
                rng.standard_normal(dtype=np.float32, out=w)
                w *= np.float32(np.sqrt(2.0 / fan_in))
            else:
                limit = np.float32(np.sqrt(6.0 / (fan_in + fan_out)))
                rng.random(dtype=np.float32, out=w)
                w *= 2 * limit
                w -= limit
        return flat

    def loss_and_grad(
        self,
        weights: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        sample_weight: np.ndarray | None = None,
    ) -> tuple[float, np.ndarray, float]:
        """``(loss_sum, grad_sum, count)`` over the rows of ``X``; see ``Model``. With
        ``sample_weight`` (one weight >= 0 per row), each row's loss and gradient count its
        weight times, and ``count`` is the weights' sum."""
        grad = np.empty(self.size, dtype=np.float32)
        # a subclass's loss_and_grad_into without sample_weight still serves unweighted calls
        loss, count = self.loss_and_grad_into(weights, X, y, grad, **weight_keywords(sample_weight))
        return loss, grad, count

    def loss_and_grad_into(
        self,
        weights: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        out: np.ndarray,
        ready: Callable[[int, int], None] | None = None,
        sample_weight: np.ndarray | None = None,
    ) -> tuple[float, float]:
        """``(loss_sum, count)``, the gradient sum written into ``out``; ``ready(start, stop)``
        is called as each layer's gradient (its weights and bias, which lie side by side)
        is final, last layer first, so that it can be sent while the layers below are
        computed. ``sample_weight`` as in ``loss_and_grad``. See ``Model``."""
        weights = self._check_weights(weights)
        X = self._check_features(X)
        writable_output(out, self.size, f"{self!r}: loss_and_grad_into(out=)")
        rows = X.shape[0]
        sample_weight = self._check_sample_weight(sample_weight, rows)
        if rows == 0:  # an empty partition: any empty label array will do
            if np.size(y) != 0:
                raise InputError(f"{self!r}: X has 0 rows but there are {np.size(y)} labels")
            out[:] = 0
            return 0.0, 0
        params, outputs, targets = self._forward_with_targets(weights, X, y)
        loss = self._head.loss_and_delta(outputs[-1], targets, sample_weight)
        self._backward(params, outputs, out, ready)
        return loss, batch_count(rows, sample_weight)

    def loss_and_touched_grad(
        self,
        weights: np.ndarray,
        X,
        y: np.ndarray,
        sample_weight: np.ndarray | None = None,
    ) -> tuple[float, SparseGradient, float]:
        """``loss_and_grad`` for CSR rows, the gradient as a ``SparseGradient``: the rows of
        ``w1`` whose columns ``X`` holds, and every later tensor (``b1``, ``w2``, ...) in full;
        the other rows of ``w1`` are zero. The same values the dense gradient holds there,
        bit for bit (``X^T delta`` summed in the same order), without writing the
        ``n_features`` x ``layers[1]`` rows a wide first layer has; what a put of only the
        touched elements takes (``ConnectedParameter.put_gradients``)."""
        weights = self._check_weights(weights)
        X = self._check_features(X)
        if not is_sparse_matrix(X):
            raise InputError(f"{self!r}: loss_and_touched_grad takes CSR rows, got a dense X")
        rows = X.shape[0]
        sample_weight = self._check_sample_weight(sample_weight, rows)
        first = self.layout.offset(self._names[0][1])  # the tensors after w1 start here
        tail = np.zeros(self.size - first, np.float32)
        rest = np.arange(first, self.size, dtype=np.int64)
        if rows == 0:
            if np.size(y) != 0:
                raise InputError(f"{self!r}: X has 0 rows but there are {np.size(y)} labels")
            return 0.0, SparseGradient(rest, tail), 0
        params, outputs, targets = self._forward_with_targets(weights, X, y)
        loss = self._head.loss_and_delta(outputs[-1], targets, sample_weight)
        grads = {
            name: tail[self.layout.offset(name) - first :][
                : int(np.prod(self.layout.shape(name)))
            ].reshape(self.layout.shape(name))
            for names in self._names
            for name in names
            if name != self._names[0][0]
        }
        touched: list = []
        self._backward_views(
            params,
            outputs,
            grads,
            first=lambda X, delta: touched.extend(_touched_product(X, delta)),
        )
        columns, product = touched
        width = self._layers[1]
        indices = (columns.astype(np.int64)[:, None] * width + np.arange(width)).ravel()
        gradient = SparseGradient(
            np.concatenate((indices, rest)), np.concatenate((product.ravel(), tail))
        )
        return loss, gradient, batch_count(rows, sample_weight)

    def loss_and_predictions(
        self,
        weights: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        sample_weight: np.ndarray | None = None,
    ) -> tuple[float, np.ndarray, float]:
        """``(loss_sum, predictions, count)``: the loss ``loss_and_grad`` gives and what
        ``predict`` gives, from one forward pass and no backward one (for evaluation)."""
        weights = self._check_weights(weights)
        X = self._check_features(X)
        sample_weight = self._check_sample_weight(sample_weight, X.shape[0])
        if X.shape[0] == 0:
            return 0.0, self.predict(weights, X), 0
        _, outputs, targets = self._forward_with_targets(weights, X, y)
        z = outputs[-1]
        predictions = np.array(self._head.predict(z))  # a copy: the loss overwrites z
        return (
            self._head.loss_and_delta(z, targets, sample_weight),
            predictions,
            batch_count(X.shape[0], sample_weight),
        )

    def _forward_with_targets(
        self, weights: np.ndarray, X, y: np.ndarray
    ) -> tuple[dict[str, np.ndarray], list[np.ndarray], np.ndarray]:
        """What every call with labels starts with, on checked ``weights`` and ``X`` of at
        least one row: ``(the parameters' views, _forward's outputs, the head's targets for
        y)``. The head's loss then turns the last outputs into its delta, in place."""
        targets = self._head.targets(y, X.shape[0], self._layers[-1])
        params = self.layout.views(weights)
        return params, self._forward(params, X), targets

    def predict(self, weights: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class ids (int64) for classification, float32 values for regression."""
        weights = self._check_weights(weights)
        X = self._check_features(X)
        return self._head.predict(self._forward(self.layout.views(weights), X)[-1])

    def predict_raw(self, weights: np.ndarray, X: np.ndarray) -> np.ndarray:
        """The last layer's outputs, before the head: float32 (rows, outputs). The class
        scores (logits) of a softmax head, the logit of the logistic one, the predicted
        values of a regression."""
        weights = self._check_weights(weights)
        X = self._check_features(X)
        return self._forward(self.layout.views(weights), X)[-1]

    def tensors(self, weights: np.ndarray) -> dict[str, np.ndarray]:
        """``name -> view`` of a flat parameter vector (``w1``, ``b1``, ...), for inspection."""
        return self.layout.views(self._check_weights(weights))

    def penalized(self, part: slice | None = None) -> np.ndarray:
        """Which coordinates the regularisation applies to: the weights ``w1``, ``w2``, ...
        (True), not the biases ``b1``, ``b2``, ... (False); see ``Model``. ``part``: only
        that slice of the flat vector (None: all of it)."""
        start, stop = part_bounds(part, self.size, f"{self!r}.penalized")
        mask = np.zeros(stop - start, dtype=bool)
        for weight, _ in self._names:
            first = self.layout.offset(weight)
            last = first + int(np.prod(self.layout.shape(weight)))
            mask[max(first, start) - start : max(min(last, stop), start) - start] = True
        return mask

    def penalty_factors(self, feature_std: np.ndarray, part: slice | None = None) -> np.ndarray:
        """Each coordinate's factor of a standardized penalty: ``feature_std[j]`` for row ``j``
        of ``w1`` (the weights of input feature ``j``), 1 for the deeper weights, 0 for the
        biases; see ``Model``. ``part``: only that slice of the flat vector (None: all of
        it), the same bits as the whole vector's slice."""
        std = np.asarray(feature_std, dtype=np.float32)
        if std.shape != (self.n_features,):
            raise InputError(
                f"{self!r}: feature_std must hold one value per feature, shape "
                f"({self.n_features},), got {std.shape}"
            )
        start, stop = part_bounds(part, self.size, f"{self!r}.penalty_factors")
        penalized = self.penalized
        if takes_part(penalized):
            factors = penalized(slice(start, stop)).astype(np.float32)
        else:  # a subclass's penalized() of the whole vector
            factors = penalized()[start:stop].astype(np.float32)
        width = self.layout.shape("w1")[1]
        w1 = self.layout.offset("w1")  # w1 is (n_features, width), row j: feature j
        first, last = max(w1, start), min(w1 + self.n_features * width, stop)
        if first < last:  # the rows of w1 this part cuts, partly at either end
            top, bottom = (first - w1) // width, (last - 1 - w1) // width
            rows = np.repeat(std[top : bottom + 1], width)
            skip = first - w1 - top * width
            factors[first - start : last - start] *= rows[skip : skip + last - first]
        return factors

    # -- the math -------------------------------------------------------------------------

    def _forward(self, params: dict[str, np.ndarray], X: np.ndarray) -> list[np.ndarray]:
        """The input and every layer's output; the last is the pre-head output ``z``."""
        outputs = [X]
        last = len(self._names) - 1
        for index, (weight, bias) in enumerate(self._names):
            z = outputs[-1] @ params[weight]
            z += params[bias]
            if index < last:
                ACTIVATIONS[self._activation].forward(z)
            outputs.append(z)
        return outputs

    def _backward(
        self,
        params: dict[str, np.ndarray],
        outputs: list[np.ndarray],
        grad: np.ndarray,
        ready: Callable[[int, int], None] | None = None,
    ) -> None:
        """The flat gradient into ``grad``, given ``outputs[-1]`` already holding ``d loss / d z``;
        ``ready(start, stop)`` after each layer's part of it.

        Every tensor view of the result is written in full by a ``out=`` matmul or sum, so
        ``grad`` may start uninitialised.
        """
        self._backward_views(params, outputs, self.layout.views(grad), ready)

    def _backward_views(
        self,
        params: dict[str, np.ndarray],
        outputs: list[np.ndarray],
        grads: dict[str, np.ndarray],
        ready: Callable[[int, int], None] | None = None,
        first: Callable[[np.ndarray, np.ndarray], None] | None = None,
    ) -> None:
        """``_backward`` into the tensors ``grads``; ``first(X, delta)``, when given, takes
        the first layer's weight gradient instead (``grads`` then needs no ``w1``)."""
        delta = outputs[-1]
        for index in range(len(self._names) - 1, -1, -1):
            weight, bias = self._names[index]
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
                ACTIVATIONS[self._activation].backward(delta, below)

    # -- checks ---------------------------------------------------------------------------

    def _check_weights(self, weights) -> np.ndarray:
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        if weights.shape != (self.size,):
            raise InputError(
                f"{self!r}: weights must be a flat vector of {self.size} parameters, "
                f"got shape {weights.shape}"
            )
        return weights

    def _check_sample_weight(self, sample_weight, rows: int) -> np.ndarray | None:
        """``sample_weight`` as float64, one finite weight >= 0 per row; None stays None."""
        if sample_weight is None:
            return None
        weight = np.asarray(sample_weight, dtype=np.float64)
        if weight.shape != (rows,):
            raise InputError(
                f"{self!r}: sample_weight has shape {weight.shape}; it needs one weight per row of "
                f"X, shape ({rows},)"
            )
        if not (np.isfinite(weight).all() and (weight >= 0).all()):
            raise InputError(
                f"{self!r}: sample_weight holds a negative, NaN or infinite weight; each must be a "
                "finite number >= 0"
            )
        return weight

    def _check_features(self, X) -> np.ndarray:
        if is_sparse_matrix(X):
            X = X.tocsr()
            if X.dtype != np.float32:
                X = X.astype(np.float32)
            if X.shape[1] != self.n_features:
                raise InputError(
                    f"{self!r}: X has {X.shape[1]} features, expected {self.n_features}"
                )
            return X
        X = np.asarray(X, dtype=np.float32)
        if X.ndim == 1 and X.size == 0:
            return X.reshape(0, self.n_features)
        if X.ndim != 2:
            raise InputError(f"{self!r}: X must be 2-D (rows, features), got shape {X.shape}")
        if X.shape[1] != self.n_features:
            raise InputError(f"{self!r}: X has {X.shape[1]} features, expected {self.n_features}")
        return X

    # -- identity -------------------------------------------------------------------------

    def _arguments(self) -> dict:
        """The constructor arguments that rebuild this model."""
        raise NotImplementedError

    def __repr__(self) -> str:
        arguments = ", ".join(f"{name}={value!r}" for name, value in self._arguments().items())
        return f"{type(self).__name__}({arguments})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._arguments() == other._arguments()

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self)))

    def __reduce_ex__(self, protocol):
        # Rebuild through the constructor: a pickle holds only the arguments, and the
        # rebuilt model is validated like a new one. A user's subclass with a constructor
        # of its own pickles as any object does (its constructor takes other arguments).
        if not type(self).__init__.__module__.startswith(__name__.rsplit(".", 1)[0]):
            return object.__reduce_ex__(self, protocol)
        return (_rebuild, (type(self), self._arguments()))


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


def _touched_product(X, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def _rebuild(cls: type, arguments: dict) -> DenseNetwork:
    return cls(**arguments)
