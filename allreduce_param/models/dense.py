"""A stack of dense layers with a loss head: the one implementation behind every model.

Linear, logistic and softmax regression are one dense layer with a squared-error, sigmoid
or softmax head; an MLP is several layers with an activation between them. They share this
code: the checks of what a caller passes, the loss head on the layers' output, and the
model's identity (``repr``, equality, pickling, ``to_config``). The layers' arithmetic is
``models.dense_stack``'s, vectorised float32 numpy that holds no mutable state, so threads
can share a model.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from allreduce_param.engine.vectors import SparseGradient, writable_output
from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.models.base import (
    batch_count,
    is_sparse_matrix,
    part_bounds,
    takes_part,
    weight_keywords,
)
from allreduce_param.models.dense_stack import DenseStack, touched_product
from allreduce_param.models.inputs import checked_features, checked_sample_weight, checked_weights


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
    arguments in ``_arguments`` (used by ``repr``, equality, pickling and ``to_config``).
    """

    def __init__(self, layers: Sequence[int], activation: str | None, head) -> None:
        head.check_outputs(layers[-1])
        self._layers = tuple(layers)
        self._activation = activation
        self._head = head
        self._stack = DenseStack(layers, activation)
        self.layout = self._stack.layout

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
        """Random weights, zero biases, as one flat float32 vector; deterministic per rng:
        He-normal for weights feeding a ReLU, else Glorot-uniform (``DenseStack.init``)."""
        return self._stack.init(rng)

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
        weights = checked_weights(self, weights)
        X = checked_features(self, X)
        writable_output(out, self.size, f"{self!r}: loss_and_grad_into(out=)")
        rows = X.shape[0]
        sample_weight = checked_sample_weight(self, sample_weight, rows)
        if rows == 0:  # an empty partition: any empty label array will do
            if np.size(y) != 0:
                raise InputError(f"{self!r}: X has 0 rows but there are {np.size(y)} labels")
            out[:] = 0
            return 0.0, 0
        params, outputs, targets = self._forward_with_targets(weights, X, y)
        loss = self._head.loss_and_delta(outputs[-1], targets, sample_weight)
        self._stack.backward(params, outputs, self.layout.views(out), ready)
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
        weights = checked_weights(self, weights)
        X = checked_features(self, X)
        if not is_sparse_matrix(X):
            raise InputError(f"{self!r}: loss_and_touched_grad takes CSR rows, got a dense X")
        rows = X.shape[0]
        sample_weight = checked_sample_weight(self, sample_weight, rows)
        first = self.layout.offset(self._stack.names[0][1])  # the tensors after w1 start here
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
            for names in self._stack.names
            for name in names
            if name != self._stack.names[0][0]
        }
        touched: list = []
        self._stack.backward(
            params,
            outputs,
            grads,
            first=lambda X, delta: touched.extend(touched_product(X, delta)),
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
        weights = checked_weights(self, weights)
        X = checked_features(self, X)
        sample_weight = checked_sample_weight(self, sample_weight, X.shape[0])
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
        least one row: ``(the parameters' views, the stack's outputs, the head's targets for
        y)``. The head's loss then turns the last outputs into its delta, in place."""
        targets = self._head.targets(y, X.shape[0], self._layers[-1])
        params = self.layout.views(weights)
        return params, self._stack.forward(params, X), targets

    def predict(self, weights: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class ids (int64) for classification, float32 values for regression."""
        weights = checked_weights(self, weights)
        X = checked_features(self, X)
        return self._head.predict(self._stack.forward(self.layout.views(weights), X)[-1])

    def predict_raw(self, weights: np.ndarray, X: np.ndarray) -> np.ndarray:
        """The last layer's outputs, before the head: float32 (rows, outputs). The class
        scores (logits) of a softmax head, the logit of the logistic one, the predicted
        values of a regression."""
        weights = checked_weights(self, weights)
        X = checked_features(self, X)
        return self._stack.forward(self.layout.views(weights), X)[-1]

    def tensors(self, weights: np.ndarray) -> dict[str, np.ndarray]:
        """``name -> view`` of a flat parameter vector (``w1``, ``b1``, ...), for inspection."""
        return self.layout.views(checked_weights(self, weights))

    def penalized(self, part: slice | None = None) -> np.ndarray:
        """Which coordinates the regularisation applies to: the weights ``w1``, ``w2``, ...
        (True), not the biases ``b1``, ``b2``, ... (False); see ``Model``. ``part``: only
        that slice of the flat vector (None: all of it)."""
        return self._stack.penalized(*part_bounds(part, self.size, f"{self!r}.penalized"))

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

    # -- identity -------------------------------------------------------------------------

    def _arguments(self) -> dict:
        """The constructor arguments that rebuild this model."""
        raise NotImplementedError

    def to_config(self) -> dict:
        """The constructor arguments that rebuild this model, as JSON holds them: what
        ``TrainedModel.save`` writes of it, and ``from_config`` reads back."""
        return dict(self._arguments())

    @classmethod
    def from_config(cls, config: Mapping) -> DenseNetwork:
        """The model ``to_config`` described, made by its constructor and so checked as a
        new one; an ``InputError`` where ``config`` names arguments it does not take."""
        try:
            return cls(**config)
        except TypeError as error:
            raise InputError(
                f"{cls.__name__} cannot be made from the saved config {dict(config)!r} "
                f"({error}); it was not written by {cls.__name__}.to_config"
            ) from None

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


def _rebuild(cls: type, arguments: dict) -> DenseNetwork:
    return cls(**arguments)
