"""What the trainer needs from a model: the ``Model`` protocol.

The trainer (``DistriOptimizer``) never looks inside a model. It asks for one flat float32
parameter vector (``init``), and on every step for the loss and gradient *summed* over the
rows of a local batch (``loss_and_grad``). Sums, not means: each partition sends its sums
with its row count, the engine adds the sums over all partitions and divides by the total
count, which gives the exact mean over the global batch however unevenly the rows fall.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

CLASSIFICATION = "classification"
REGRESSION = "regression"
TASKS = (CLASSIFICATION, REGRESSION)


@runtime_checkable
class Model(Protocol):
    """Any object with these members can be trained; the built-in models are examples.

    ``task`` is ``"classification"`` (the trainer reports accuracy; labels are class ids)
    or ``"regression"`` (the trainer reports RMSE; labels are float targets).

    Optional: ``num_classes``, an int, for a classifier whose labels must be class ids
    ``0..num_classes-1`` (the built-in classifiers have it; ``None`` means not known). The
    trainer checks every label against it on the driver before any task starts, so a label
    the model has no output for fails there, not at some step. Without it a classifier's
    labels are checked to be whole numbers >= 0 only. Optional too:
    ``loss_and_predictions(weights, X, y) -> (loss_sum, predictions, count)``, the loss and
    what ``predict`` gives from one forward pass; evaluation uses it when it is there, and
    ``loss_and_grad`` then ``predict`` otherwise. And
    ``loss_and_grad_into(weights, X, y, out, ready=None) -> (loss_sum, count)``: the same
    loss and gradient, the gradient written into ``out`` (float32, ``len(weights)``), with
    ``ready(start, stop)`` called as each range of ``out`` becomes final during backward
    (each element once; every element final on return). The trainer then sends each
    owner's chunk as soon as it is whole, overlapping the sync with the rest of backward;
    the built-in and torch models have it. (None of these is a member of this protocol, so
    ``isinstance(model, Model)`` holds without them.)

    Models travel to Spark tasks inside closures, so they must pickle, and should hold no
    large state; they may be called from several threads at once.
    """

    task: str

    def init(self, rng: np.random.Generator) -> np.ndarray:
        """The initial parameters: one flat float32 vector, all tensors flattened into it.

        Deterministic for a given generator state (``np.random.default_rng(seed)``).
        """
        ...

    def loss_and_grad(
        self, weights: np.ndarray, X: np.ndarray, y: np.ndarray
    ) -> tuple[float, np.ndarray, int]:
        """``(loss_sum, grad_sum, count)`` over the rows of ``X``.

        ``loss_sum`` is the loss summed over the rows (not the mean), ``grad_sum`` the
        gradient of that sum as a float32 vector of ``len(weights)``, ``count == len(X)``.
        ``X`` is float32 of shape (rows, features); ``y`` holds class ids (classification)
        or float32 targets (regression). Zero rows give ``(0.0, zeros, 0)``.
        """
        ...

    def predict(self, weights: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class ids (int64) for classification, float32 values for regression."""
        ...


def optional_call(model, name: str, instead_of: tuple[str, ...]):
    """The model's optional ``name`` call (``loss_and_predictions``, ``loss_and_grad_into``),
    or None when it has none, or when a call it stands in for (``instead_of``) is defined
    further down the class tree than it: a subclass that overrides ``loss_and_grad`` but
    inherits ``loss_and_grad_into`` must not have its override skipped."""
    method = getattr(model, name, None)
    if not callable(method):
        return None

    def definer(attribute: str):
        """Where ``attribute`` is defined: the model itself (set on the instance) or a class."""
        if attribute in getattr(model, "__dict__", {}):
            return model
        return next((cls for cls in type(model).__mro__ if attribute in vars(cls)), None)

    own = definer(name)
    if own is model:  # set on the instance: nothing is more specific
        return method
    for other in instead_of:
        found = definer(other)
        if found is model or (found is not None and not issubclass(own, found)):
            return None  # the other is more specific: its override must run
    return method
