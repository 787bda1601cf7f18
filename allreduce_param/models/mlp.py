"""A multi-layer perceptron: dense layers with ReLU or tanh between them."""

from __future__ import annotations

from collections.abc import Sequence

from allreduce_param.errors import ConfigurationError
from allreduce_param.models.base import CLASSIFICATION, REGRESSION, TASKS
from allreduce_param.models.dense import DenseNetwork, positive_int
from allreduce_param.models.dense_stack import ACTIVATIONS
from allreduce_param.models.losses import SoftmaxCrossEntropy, SquaredError


class MLP(DenseNetwork):
    """``MLP([64, 128, 10])``: 64 inputs, a hidden layer of 128, 10 outputs.

    ``layers`` lists the layer widths, inputs first, outputs last (at least two entries);
    ``activation`` (``"relu"`` or ``"tanh"``) follows every hidden layer. For
    ``task="classification"`` the outputs are logits of a softmax cross-entropy (labels:
    class ids in ``0..layers[-1]-1``, at least 2 outputs); for ``task="regression"`` they
    are values under squared error (targets: shape (rows,) for one output, else
    (rows, outputs)). ReLU layers start He-normal, the others Glorot-uniform; biases zero.
    """

    def __init__(
        self, layers: Sequence[int], activation: str = "relu", task: str = CLASSIFICATION
    ) -> None:
        try:
            widths = list(layers)
        except TypeError:
            raise ConfigurationError(
                f"MLP layers must be a list of layer widths, got {layers!r}"
            ) from None
        if len(widths) < 2:
            raise ConfigurationError(
                f"MLP needs at least 2 layer widths (inputs and outputs), got {widths!r}"
            )
        widths = [positive_int(width, f"MLP layer width #{i}") for i, width in enumerate(widths)]
        if activation not in ACTIVATIONS:
            raise ConfigurationError(
                f"unknown activation {activation!r}; choose one of {', '.join(map(repr, ACTIVATIONS))}"
            )
        if task not in TASKS:
            raise ConfigurationError(
                f"unknown task {task!r}; choose one of {', '.join(map(repr, TASKS))}"
            )
        if task == CLASSIFICATION and widths[-1] < 2:
            raise ConfigurationError(
                f"a classification MLP needs at least 2 outputs (one per class), got {widths[-1]}; "
                "use 2 outputs for binary labels, or task='regression'"
            )
        head = SquaredError() if task == REGRESSION else SoftmaxCrossEntropy()
        super().__init__(widths, activation, head)

    @property
    def layers(self) -> list[int]:
        """The layer widths, inputs first."""
        return list(self._layers)

    @property
    def activation(self) -> str:
        """The hidden-layer activation."""
        return self._activation

    def _arguments(self) -> dict:
        return {"layers": self.layers, "activation": self._activation, "task": self.task}
