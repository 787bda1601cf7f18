"""What the trainer needs from a model: the ``Model`` protocol, in one place.

The trainer (``DistriOptimizer``) never looks inside a model. It asks for one flat float32
parameter vector (``init``), and on every step for the loss and gradient *summed* over the
rows of a local batch (``loss_and_grad``). Sums, not means: each partition sends its sums
with its row count, the engine adds the sums over all partitions and divides by the total
count, which gives the exact mean over the global batch however unevenly the rows fall.
Everything else a model may say (``task``, ``num_classes``, buffers, named tensors, ...) is
optional; ``Model``'s docstring lists each, and what the trainer does without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError

CLASSIFICATION = "classification"
REGRESSION = "regression"
TASKS = (CLASSIFICATION, REGRESSION)


@runtime_checkable
class Model(Protocol):
    """Any object with ``init``, ``loss_and_grad`` and ``predict`` can be trained; the
    built-in models and ``TorchModel`` are examples.

    **Required** (the members of this protocol, so ``isinstance(model, Model)`` checks
    them): ``init(rng)``, ``loss_and_grad(weights, X, y)``, ``predict(weights, X)``, below.

    **Optional** (each looked up with ``getattr``; a model without it trains all the same):

    - ``task``: ``"classification"`` (labels are class ids: whole numbers >= 0, checked on
      the driver before any task starts; the trainer reports accuracy beside the loss) or
      ``"regression"`` (labels are float targets; the trainer reports RMSE). Without it
      (or ``None``) labels are passed as they are (float64, not checked as class ids) and
      the metrics are the loss alone: ``History.epochs`` has ``loss``, ``val_loss`` and
      ``train_loss``, no accuracy or RMSE. Any other value is refused.
    - ``num_classes``: an int, for a classifier whose labels must be class ids
      ``0..num_classes-1`` (the built-in classifiers have it; ``None`` means not known). The
      trainer checks every label against it on the driver, so a label the model has no
      output for fails there, not at some step. Without it a classifier's labels are
      checked to be whole numbers >= 0 only.
    - ``loss_and_predictions(weights, X, y) -> (loss_sum, predictions, count)``: the loss
      and what ``predict`` gives, from one forward pass; evaluation uses it when it is
      there, and ``loss_and_grad`` then ``predict`` otherwise.
    - ``loss_and_grad_into(weights, X, y, out, ready=None) -> (loss_sum, count)``: the same
      loss and gradient, the gradient written into ``out`` (float32, ``len(weights)``), with
      ``ready(start, stop)`` called as each range of ``out`` becomes final during backward
      (each element once; every element final on return). The trainer then sends each
      owner's chunk as soon as it is whole, overlapping the sync with the rest of backward;
      the built-in and torch models have it. (``optional_call`` decides when a subclass's
      override of ``loss_and_grad`` must win over an inherited one.)
    - ``uses_gpu`` (a bool attribute or property): whether the model computes on a GPU in
      this process (``TorchModel`` on one). Backward then leaves the CPU's cores to the
      sync, so ``overlap="auto"`` streams the gradient on one host too; without it, False.
    - ``tensors(weights) -> dict[str, np.ndarray]``: the flat vector as named arrays (the
      built-in models: ``w1``, ``b1``, ...; ``TorchModel``: its state_dict's parameter
      names). ``TrainedModel.export_npz`` writes them; without it, the vector as
      ``"weights"``.
    - ``penalized() -> np.ndarray``: a boolean mask of the flat vector, True where the
      regularisation (``reg_param``, ``elastic_net_param``: MLlib's ``regParam``,
      ``elasticNetParam``) applies, the weights, and False for the intercepts (biases), which
      it never penalises and ``fit_intercept=False`` holds at 0 (not trained). The built-in
      dense models mark every ``b1``, ``b2``, ... False; ``TorchModel`` every parameter whose
      name ends in ``bias``. Each owner cuts its slice out of it; a ``penalized(part=)``
      that takes a slice ``part`` of the flat vector and returns that slice alone (the
      built-ins' do) spares each task the whole vector's mask. Without it every
      coordinate is penalised, and ``fit_intercept=False`` is refused (which are the
      intercepts is not known).
    - ``penalty_factors(feature_std) -> np.ndarray``: float32 of the flat vector's length,
      each coordinate's factor of the penalty when it is standardized (MLlib's
      ``standardization=True``, the default): ``feature_std[j]`` (each input feature's
      standard deviation over the training rows, float32 of ``n_features``) for a weight
      that multiplies feature ``j``, 1 for the other weights, 0 for the intercepts. The
      L1 part then penalises ``std_j * |w|``, the L2 part ``std_j^2 * w^2``: MLlib's penalty
      on the coefficients of standardized features. The built-in dense models have it
      (``w1``'s rows scaled, deeper layers 1), and take ``part=`` as ``penalized`` does.
      Without it a fit with a penalty needs ``standardization=False``.
    - ``sample_weight=`` on ``loss_and_grad``, ``loss_and_grad_into`` and
      ``loss_and_predictions``: one weight >= 0 per row; each row's loss and gradient count
      its weight times, and ``count`` is the weights' sum. The built-in dense models take
      it. A fit with sample weights (``fit(weight_col=...)``, the Estimators' ``weightCol``)
      passes it to every call and needs a model whose ``loss_and_grad`` takes it
      (``takes_sample_weight``); its ``loss_and_grad_into`` serves only if it takes it too.
    - ``takes_sparse``: True for a model whose calls take ``X`` as a
      ``scipy.sparse.csr_matrix`` (float32) as well as a dense matrix; the built-in dense
      models do (sparse-dense products: a row costs its non-zeros). Sparse data (a vector
      column whose non-zeros fill at most a quarter of it: ``HashingTF``, ``OneHotEncoder``)
      reaches such a model as CSR batches. Without it, each batch (and each row evaluated
      or predicted) is made dense for the model first (``dense_for``).
    - ``predict_raw(weights, X) -> np.ndarray``: the outputs before the head, (rows,
      outputs): a classifier's class scores (logits). The built-in dense models have it;
      ``allreduce_param.ml``'s classifier reads its ``rawPrediction`` and ``probability``
      columns from it.
    - **Buffers**, state that is not trained by gradients but changes as the model trains
      (BatchNorm's running statistics): ``buffers() -> dict[str, np.ndarray]`` and
      ``set_buffers(buffers)``, both or neither. ``buffers()`` gives this model object's
      current buffers (copies): what its training calls (``loss_and_grad`` and
      ``loss_and_grad_into``, which may update them) have made of them so far, else what
      ``set_buffers`` set, else the initial ones. ``set_buffers`` replaces them (the same
      names, shapes and dtypes; an error names what differs); later calls, ``predict``
      among them, use them. Evaluation and ``predict`` must not change them. The trainer
      gives each partition its own copy of such a model (``copy.deepcopy``); each
      partition trains its buffers locally (they are not synchronised at every step: they
      do not affect the gradients), and at the end of the fit the driver makes the
      result's one set with ``merge_buffers``: the partitions' floating-point buffers
      averaged, weighted by their training rows; integer and boolean ones (counters such as
      ``num_batches_tracked``) the largest. The epoch-end evaluation inside a fit uses each
      partition's own buffers. ``TrainedModel`` keeps the merged set (its ``buffers``),
      saves, loads and exports it, and predicts with a copy of the model given it;
      checkpoints keep each partition's.  A model without buffers (the built-in numpy
      ones) is used as it is, never copied.

    Models travel to Spark tasks inside closures, so they must pickle, and should hold no
    large state; they may be called from several threads at once.
    """

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
        ``X`` is float32 of shape (rows, features); ``y`` holds class ids (classification),
        float32 targets (regression) or the labels as float64 (no ``task``). Zero rows give
        ``(0.0, zeros, 0)``. A model with buffers may update them here (a training step).
        ``X``, ``y`` (and ``sample_weight``) are lent for the call: the trainer writes the
        next step's rows into the same arrays, so a model copies what it keeps.
        """
        ...

    def predict(self, weights: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class ids (int64) for classification, float32 values for regression; for a model
        without ``task``, whatever it predicts (``TrainedModel.predict`` makes it a double
        column, one value per row). Deterministic: no dropout, buffers only read."""
        ...


def model_task(model: Any) -> str | None:
    """The model's ``task`` (``"classification"``, ``"regression"``), or None when it says
    none; any other value is a ``ConfigurationError`` that names it."""
    task = getattr(model, "task", None)
    if task is not None and task not in TASKS:
        raise ConfigurationError(
            f"the model {model!r} says task = {task!r}; a task is 'classification' or "
            "'regression', or leave it out (None) to train on the loss alone"
        )
    return task


def has_buffers(model: Any) -> bool:
    """Whether the model keeps buffers (has both ``buffers()`` and ``set_buffers()``); one
    without the other is a ``ConfigurationError`` that says which is missing."""
    getter, setter = (
        callable(getattr(model, "buffers", None)),
        callable(getattr(model, "set_buffers", None)),
    )
    if getter != setter:
        missing, present = ("set_buffers", "buffers") if getter else ("buffers", "set_buffers")
        raise ConfigurationError(
            f"the model {model!r} has {present}() but no {missing}(): a model with "
            "buffers needs both (see allreduce_param.models.base.Model)"
        )
    return getter


def merge_buffers(
    pieces: Sequence[tuple[Mapping[str, np.ndarray], float]],
) -> dict[str, np.ndarray]:
    """One set of buffers from several copies' ``(buffers, rows)``: each floating-point
    buffer the mean weighted by ``rows`` (summed in float64, so equal copies give the same
    bits back), each integer or boolean one (a counter) the largest. Copies with no rows
    count only when none has rows (then equally). Every copy must have the same names and
    shapes; an error names the first that differs."""
    if not pieces:
        return {}
    weights = np.asarray([float(rows) for _, rows in pieces], dtype=np.float64)
    if not weights.sum() > 0:
        weights = np.ones(len(pieces))
    first = pieces[0][0]
    for index, (buffers, _) in enumerate(pieces[1:], start=1):
        if set(buffers) != set(first):
            raise InputError(
                f"copy {index}'s buffers {sorted(buffers)} differ from copy 0's {sorted(first)}"
            )
        for name, value in buffers.items():
            if np.shape(value) != np.shape(first[name]):
                raise InputError(
                    f"copy {index}'s buffer {name!r} has shape {np.shape(value)}, copy 0's "
                    f"{np.shape(first[name])}"
                )
    merged: dict[str, np.ndarray] = {}
    for name, value in first.items():
        values = [np.asarray(buffers[name]) for buffers, _ in pieces]
        dtype = np.asarray(value).dtype
        if np.issubdtype(dtype, np.inexact):  # float (or complex): the weighted mean
            wide = np.complex128 if np.issubdtype(dtype, np.complexfloating) else np.float64
            total = sum(w * v.astype(wide) for w, v in zip(weights, values))
            merged[name] = np.asarray(total / weights.sum()).astype(dtype)
        else:  # a counter or a flag: the largest
            merged[name] = np.asarray(np.max(np.stack(values), axis=0)).astype(dtype)
    return merged


def batch_count(rows: int, sample_weight: np.ndarray | None) -> float:
    """The ``count`` a training call returns for ``rows`` rows: the rows, or with
    ``sample_weight`` the weights' sum (float64), which the engine divides the summed
    gradients by."""
    return rows if sample_weight is None else float(np.sum(sample_weight, dtype=np.float64))


def weight_keywords(sample_weight: np.ndarray | None) -> dict:
    """The keyword arguments that pass ``sample_weight`` to a model's call: none without
    weights, so that a model whose calls take no ``sample_weight`` (it is optional in
    ``Model``) still serves every unweighted call."""
    return {} if sample_weight is None else {"sample_weight": sample_weight}


def is_sparse_matrix(X) -> bool:
    """Whether ``X`` is a scipy.sparse matrix (told apart without importing scipy)."""
    return hasattr(X, "tocsr") and hasattr(X, "nnz")


def takes_sparse(model) -> bool:
    """Whether the model takes CSR feature matrices (its ``takes_sparse``)."""
    return getattr(model, "takes_sparse", False) is True


def dense_for(model, X):
    """``X`` as ``model`` takes it: a sparse matrix made dense for a model that does not say
    ``takes_sparse``; anything else as it is."""
    if is_sparse_matrix(X) and not takes_sparse(model):
        return X.toarray()
    return X


def takes_sample_weight(method) -> bool:
    """Whether a model's call takes ``sample_weight=`` (by name, or through ``**kwargs``)."""
    import inspect

    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): do not guess
        return False
    return any(
        p.name == "sample_weight" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters
    )


def takes_part(method) -> bool:
    """Whether a model's ``penalized`` or ``penalty_factors`` takes ``part=`` (builds only
    a slice of the flat vector), by name; without it the caller cuts the whole one."""
    import inspect

    try:
        return "part" in inspect.signature(method).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): do not guess
        return False


def part_bounds(part: slice | None, size: int, who: str) -> tuple[int, int]:
    """``(start, stop)`` of ``part`` (a slice of a flat vector of ``size``; None: all of
    it), for ``penalized(part=)`` and ``penalty_factors(part=)``; anything else is refused
    naming ``who``."""
    if part is None:
        return 0, size
    start, stop = part.start, part.stop
    if (
        not isinstance(part, slice)
        or part.step not in (None, 1)
        or not isinstance(start, int)
        or not isinstance(stop, int)
        or not 0 <= start <= stop <= size
    ):
        raise InputError(
            f"{who}: part must be a slice(start, stop) with 0 <= start <= stop <= {size}, "
            f"got {part!r}"
        )
    return start, stop


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
