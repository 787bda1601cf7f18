"""The output heads: a loss on the last layer's outputs, its gradient, and the prediction.

Every model here is a stack of dense layers ending in one of these heads. A head works on
the output pre-activations ``z`` (rows, outputs) of one batch and overwrites them, in
place, with ``d loss_sum / d z``: the backward pass starts from there without another
allocation. All losses are summed over the rows, accumulated in float64 for a precise sum
even over large batches, and written in numerically stable forms (no ``exp`` of a large
positive number, no ``log`` of 0).
"""

from __future__ import annotations

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.models.base import CLASSIFICATION, REGRESSION


def class_ids(y, rows: int, n_classes: int) -> np.ndarray:
    """``y`` as a vector of ``rows`` class ids in ``0..n_classes-1`` (intp), checked.

    Integer, bool and whole-valued float labels (Spark ML's labels are doubles) are
    accepted; a (rows, 1) column is taken as a vector.
    """
    y = np.asarray(y)
    if y.shape == (rows, 1):
        y = y.reshape(rows)
    if y.shape != (rows,):
        raise InputError(f"labels: expected shape ({rows},) to match the rows of X, got {y.shape}")
    if y.dtype.kind in "biu":
        ids = y.astype(np.intp, copy=False)
    elif y.dtype.kind == "f":
        ids = y.astype(np.intp)
        if not np.array_equal(ids, y):
            raise InputError(
                "labels: class ids must be whole numbers, got fractional or non-finite values"
            )
    else:
        raise InputError(f"labels: class ids must be integers, got dtype {y.dtype}")
    if rows:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= n_classes:
            raise InputError(
                f"labels: class ids must lie in 0..{n_classes - 1}, got values from {low} to {high}"
            )
    return ids


class SquaredError:
    """``0.5 * (z - y)**2`` summed over rows and outputs; predicts ``z``."""

    task = REGRESSION

    def check_outputs(self, n_outputs: int) -> None:
        """Any number of outputs >= 1 is fine (one target per output)."""

    def classes(self, n_outputs: int) -> None:
        """Regression has no classes."""
        return None

    def targets(self, y, rows: int, n_outputs: int) -> np.ndarray:
        """``y`` as float32 of shape (rows, n_outputs); a vector is fine for one output."""
        y = np.asarray(y, dtype=np.float32)
        if n_outputs == 1 and y.shape == (rows,):
            return y.reshape(rows, 1)
        if y.shape != (rows, n_outputs):
            expected = f"({rows},)" if n_outputs == 1 else f"({rows}, {n_outputs})"
            raise InputError(
                f"targets: expected shape {expected} to match the rows of X, got {y.shape}"
            )
        return y

    def loss_and_delta(
        self, z: np.ndarray, targets: np.ndarray, sample_weight: np.ndarray | None = None
    ) -> float:
        """The summed loss; ``z`` becomes the residual ``z - y`` (its gradient). With
        ``sample_weight``, each row's loss and gradient times its weight."""
        np.subtract(z, targets, out=z)
        if sample_weight is None:
            return 0.5 * float(np.square(z).sum(dtype=np.float64))
        loss = 0.5 * float(np.square(z).sum(axis=1, dtype=np.float64) @ sample_weight)
        z *= sample_weight[:, None]
        return loss

    def predict(self, z: np.ndarray) -> np.ndarray:
        """float32 values: a vector for one output, else (rows, outputs)."""
        return z[:, 0] if z.shape[1] == 1 else z


class SigmoidCrossEntropy:
    """Binary log loss on one output logit; labels 0/1; predicts ``z > 0``.

    With ``s = 1 - 2y`` (+1 for label 0, -1 for label 1) the row loss is
    ``softplus(s*z)`` and its gradient ``s * sigmoid(s*z)``, where
    ``sigmoid(t) = exp(t - softplus(t))`` and ``softplus(t) = logaddexp(0, t)``: exact for
    large |z| (no ``log(1 - p)`` cancellation) and free of overflow.
    """

    task = CLASSIFICATION

    def check_outputs(self, n_outputs: int) -> None:
        """The logistic head has exactly one output."""
        if n_outputs != 1:
            raise ConfigurationError(f"the logistic head needs exactly 1 output, got {n_outputs}")

    def classes(self, n_outputs: int) -> int:
        """Two classes, 0 and 1, on its one output."""
        return 2

    def targets(self, y, rows: int, n_outputs: int) -> np.ndarray:
        """The signs ``s = 1 - 2y`` as float32, from labels 0/1."""
        ids = class_ids(y, rows, 2)
        signs = np.ones(rows, dtype=np.float32)
        signs[ids == 1] = -1.0
        return signs

    def loss_and_delta(
        self, z: np.ndarray, signs: np.ndarray, sample_weight: np.ndarray | None = None
    ) -> float:
        """The summed log loss; ``z`` becomes ``sigmoid(z) - y``. With ``sample_weight``,
        each row's loss and gradient times its weight."""
        logits = z[:, 0]
        t = logits * signs
        softplus = np.logaddexp(np.float32(0.0), t)
        loss = float(
            softplus.sum(dtype=np.float64)
            if sample_weight is None
            else softplus.astype(np.float64) @ sample_weight
        )
        np.subtract(t, softplus, out=t)
        np.exp(t, out=t)
        np.multiply(t, signs, out=logits)
        if sample_weight is not None:
            logits *= sample_weight
        return loss

    def predict(self, z: np.ndarray) -> np.ndarray:
        """int64 class ids 0/1."""
        return (z[:, 0] > 0).astype(np.int64)


class SoftmaxCrossEntropy:
    """Multinomial cross-entropy on ``n_classes`` logits; predicts the argmax.

    ``log_softmax(z) = z - max(z) - log(sum(exp(z - max(z))))``: the shift by the row
    maximum keeps every ``exp`` at most 1 and the sum at least 1.
    """

    task = CLASSIFICATION

    def check_outputs(self, n_outputs: int) -> None:
        """Softmax needs one output per class, at least two classes."""
        if n_outputs < 2:
            raise ConfigurationError(
                f"softmax cross-entropy needs at least 2 outputs (one per class), got {n_outputs}"
            )

    def classes(self, n_outputs: int) -> int:
        """One class per output."""
        return n_outputs

    def targets(self, y, rows: int, n_outputs: int) -> np.ndarray:
        """Class ids in ``0..n_outputs-1``."""
        return class_ids(y, rows, n_outputs)

    def loss_and_delta(
        self, z: np.ndarray, ids: np.ndarray, sample_weight: np.ndarray | None = None
    ) -> float:
        """The summed cross-entropy; ``z`` becomes ``softmax(z) - onehot(y)``. With
        ``sample_weight``, each row's loss and gradient times its weight."""
        rows = np.arange(z.shape[0])
        z -= z.max(axis=1, keepdims=True)
        picked = z[rows, ids]
        np.exp(z, out=z)
        total = z.sum(axis=1, keepdims=True)
        if sample_weight is None:
            loss = float(np.log(total).sum(dtype=np.float64) - picked.sum(dtype=np.float64))
        else:
            loss = float((np.log(total[:, 0]).astype(np.float64) - picked) @ sample_weight)
        z /= total
        z[rows, ids] -= 1.0
        if sample_weight is not None:
            z *= sample_weight[:, None]
        return loss

    def predict(self, z: np.ndarray) -> np.ndarray:
        """int64 class ids."""
        return z.argmax(axis=1).astype(np.int64, copy=False)
