"""Linear models: one dense layer with a squared-error, logistic or softmax head."""

from __future__ import annotations

from allreduce_param.models.dense import DenseNetwork, positive_int
from allreduce_param.models.losses import SigmoidCrossEntropy, SoftmaxCrossEntropy, SquaredError


class LinearRegression(DenseNetwork):
    """Least squares: ``predict = X @ w + b``, row loss ``0.5 * (X @ w + b - y)**2``.

    Targets are floats, shape (rows,). Parameters: ``w1`` (n_features, 1), ``b1`` (1,).
    """

    def __init__(self, n_features: int) -> None:
        super().__init__([positive_int(n_features, "n_features"), 1], None, SquaredError())

    def _arguments(self) -> dict:
        return {"n_features": self.n_features}


class LogisticRegression(DenseNetwork):
    """Binary logistic regression: ``P(y=1) = sigmoid(X @ w + b)``, log loss.

    Labels are 0/1 (int, bool, or whole-valued float); ``predict`` gives int64 0/1.
    Parameters: ``w1`` (n_features, 1), ``b1`` (1,).
    """

    def __init__(self, n_features: int) -> None:
        super().__init__([positive_int(n_features, "n_features"), 1], None, SigmoidCrossEntropy())

    def _arguments(self) -> dict:
        return {"n_features": self.n_features}


class SoftmaxRegression(DenseNetwork):
    """Multinomial logistic regression: ``softmax(X @ w + b)``, cross-entropy.

    Labels are class ids in ``0..n_classes-1``; ``predict`` gives int64 ids.
    Parameters: ``w1`` (n_features, n_classes), ``b1`` (n_classes,).
    """

    def __init__(self, n_features: int, n_classes: int) -> None:
        features = positive_int(n_features, "n_features")
        classes = positive_int(n_classes, "n_classes", minimum=2)
        super().__init__([features, classes], None, SoftmaxCrossEntropy())

    @property
    def n_classes(self) -> int:
        """The number of classes (outputs)."""
        return self._layers[-1]

    def _arguments(self) -> dict:
        return {"n_features": self.n_features, "n_classes": self.n_classes}
