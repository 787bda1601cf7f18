"""The driver's checks of a fit before any task starts: the model against the data, the
workers against Spark's slots, a checkpoint to resume from against the model."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.models.base import (
    dense_for,
    has_buffers,
    is_sparse_matrix,
    model_task,
    takes_sample_weight,
)
from allreduce_param.spark.info import SparkInfo
from allreduce_param.spark.slots import task_slots
from allreduce_param.train.checkpoint import Manifest
from allreduce_param.train.columns import TRAIN
from allreduce_param.train.regularisation import penalized_mask
from allreduce_param.train.start import StartPoint


def check_model(model: Any) -> None:
    """A model follows the protocol: ``init``, ``loss_and_grad``, ``predict``, and where it
    has them a known ``task`` and both of ``buffers``/``set_buffers``."""
    for name in ("init", "loss_and_grad", "predict"):
        if not callable(getattr(model, name, None)):
            raise ConfigurationError(
                f"the model {model!r} has no {name}() method; a model needs init(rng), "
                "loss_and_grad(weights, X, y) and predict(weights, X)"
            )
    model_task(model)  # optional; a task other than classification or regression fails here
    has_buffers(model)  # so does a model with buffers() but no set_buffers(), or the reverse


def check_takes_weights(model: Any, data: Any, weight_col: str) -> None:
    """Sample weights need a DataFrame and a model that takes them."""
    if not isinstance(weight_col, str) or not weight_col:
        raise InputError(
            f"weight_col must be the name of a column of sample weights, got {weight_col!r}"
        )
    if not hasattr(data, "sparkSession"):
        raise InputError(
            f"weight_col={weight_col!r} goes with DataFrame input; for an RDD of (features, "
            "label) pairs, make it a DataFrame with a weight column, e.g. "
            "spark.createDataFrame(rdd.map(lambda r: (Vectors.dense(r[0]), float(r[1]), w)), ...)"
        )
    if not takes_sample_weight(model.loss_and_grad):
        raise ConfigurationError(
            f"weight_col={weight_col!r}: the model {model!r} takes no sample weights (its "
            "loss_and_grad has no sample_weight= argument); use a model that does (the built-in "
            "dense models: MLP, LinearRegression, LogisticRegression, SoftmaxRegression), or "
            "train without weights"
        )


def model_size(model: Any, sample: tuple, n_features: int, seed: int) -> int:
    """Run the model on one real row on the driver, so a shape mismatch fails here; its size.

    The row goes twice (a module with BatchNorm takes no single row in train mode), and a
    model's buffers are put back as they were, so the check leaves no trace in them."""
    weights = model.init(np.random.default_rng(seed))
    if not isinstance(weights, np.ndarray) or weights.dtype != np.float32 or weights.ndim != 1:
        raise InputError(f"{model!r}.init(rng) must return a 1-D float32 vector")
    rows, labels = sample
    if is_sparse_matrix(rows):  # a CSR row: the data trains sparse
        from scipy.sparse import vstack

        X = dense_for(model, vstack([rows, rows], format="csr"))
    else:
        X = np.concatenate([rows, rows])
    y = np.concatenate([labels, labels])
    before = model.buffers() if has_buffers(model) else None
    try:
        _, grad, _ = model.loss_and_grad(weights, X, y)
    except Exception as error:
        raise InputError(
            f"the model {model!r} cannot take the data's feature vectors of {n_features} "
            f"elements: {type(error).__name__}: {error}"
        ) from error
    finally:
        if before is not None:
            model.set_buffers(before)
    if np.shape(grad) != weights.shape:
        raise InputError(
            f"{model!r}.loss_and_grad returned a gradient of shape {np.shape(grad)}, "
            f"the weights have {weights.shape}"
        )
    return int(weights.size)


def worker_count(
    spark: SparkInfo, requested: int | None, partitions: int, profile: Any = None
) -> int:
    """How many barrier tasks: the ``requested`` count, or the data's ``partitions``, within
    the slots.

    Refuses more tasks than Spark can run at once before the stage is submitted, where
    Spark would refuse them only then. ``profile``: the stage's resource profile (GPUs per
    task), whose slots are counted (None: the session's default one).
    """
    slots, counted = task_slots(spark, needed=requested or 1, profile=profile)
    workers = requested or max(1, min(partitions, slots))
    if workers > slots:
        raise ConfigurationError(
            f"num_workers={workers}, but Spark has {slots} task slots ({counted}); a barrier stage "
            "needs all its tasks running at once: lower num_workers, or give Spark more cores "
            "(local[N], spark.executor.instances x spark.executor.cores / spark.task.cpus"
            + (", and GPUs: spark.executor.resource.gpu.amount / gpus_per_task" if profile else "")
            + ")"
        )
    return workers


def check_initial(initial: Any, model: Any, optimizer: Any, settings: Any) -> Any:
    """``fit(initial=...)``'s model, checked against this fit's before any Spark job: a
    ``TrainedModel`` (or an Estimator's Model, whose ``trained`` it is) of the same kind of
    model, holding the optimizer state of this optimizer where ``keep_optimizer_state``
    asks to continue it. The ``TrainedModel``."""
    from allreduce_param.train.result import TrainedModel

    trained = getattr(initial, "trained", initial)
    if not isinstance(trained, TrainedModel):
        raise InputError(
            f"initial must be a TrainedModel (a fit's result, or TrainedModel.load(path)) or an "
            f"Estimator's Model, got {type(initial).__name__}"
        )
    if type(trained.model) is not type(model):
        raise InputError(
            f"initial holds a {type(trained.model).__name__} model, this fit trains a "
            f"{type(model).__name__}: continue with the kind of model initial was trained as"
        )
    _warn_of_dropped_intercepts(trained, model, settings)
    if not settings.keep_optimizer_state:
        return trained
    if trained.optimizer_state is None:
        raise InputError(
            "keep_optimizer_state=True continues the optimizer's state, but initial holds none: "
            "fit the initial model with keep_optimizer_state=True too (or save it from such a "
            "fit), or pass keep_optimizer_state=False to start the optimizer afresh"
        )
    kind = type(optimizer).__name__
    if trained.optimizer_kind != kind or set(trained.optimizer_state) != set(optimizer.state_names):
        raise InputError(
            f"initial holds the state of a {trained.optimizer_kind} optimizer "
            f"({sorted(trained.optimizer_state)}), this fit's is {optimizer!r} "
            f"({sorted(optimizer.state_names)}): continue with the optimizer initial was "
            "trained with, or pass keep_optimizer_state=False to start this one afresh"
        )
    return trained


def _warn_of_dropped_intercepts(trained: Any, model: Any, settings: Any) -> None:
    """A ``UserWarning`` where ``fit_intercept=False`` continues a model whose intercepts are
    not 0: the fit starts them at 0 and holds them there (as a fresh fit does, and as MLlib's
    ``initialModel`` under ``fitIntercept=false``, whose intercept it ignores)."""
    if settings.fit_intercept:
        return
    weights = np.asarray(trained.weights)
    mask = penalized_mask(model, weights.size)
    dropped = 0 if mask is None else int(np.count_nonzero(weights[~mask]))
    if dropped:
        warnings.warn(
            f"fit_intercept=False: initial's {dropped} non-zero intercept(s) start this fit at 0 "
            "and stay there, as MLlib's initialModel under fitIntercept=false; pass "
            "fit_intercept=True to train on from them",
            UserWarning,
            stacklevel=5,  # fit()'s caller
        )


def check_start(start: StartPoint, size: int, optimizer: Any) -> None:
    """Where a fit starts, against the model's ``size`` (a checkpoint: its optimizer state
    too; ``check_initial`` checked a model's)."""
    if start.checkpoint is not None:
        check_resume(start.checkpoint, size, optimizer)
    if start.weights is None:
        return
    if start.weights.shape != (size,):
        raise InputError(
            f"initial holds {start.weights.size} weights, this fit's model has {size}: continue "
            "with a model of the shape initial was trained as (the same layers and features)"
        )
    for name, value in (start.state or {}).items():
        if np.shape(value) != (size,):
            raise InputError(
                f"initial's optimizer state {name!r} has shape {np.shape(value)}, not ({size},): "
                "it does not belong to these weights"
            )


def check_resume(resume: Manifest, size: int, optimizer: Any) -> None:
    """A checkpoint this fit can continue from: the same model size and optimizer state."""
    if resume.size != size:
        raise InputError(
            f"the checkpoint {resume.folder} holds {resume.size} weights, this model has {size}: "
            "resume with the model the checkpoint was made with"
        )
    if set(resume.state_names) != set(optimizer.state_names):
        raise InputError(
            f"the checkpoint {resume.folder} holds optimizer state {list(resume.state_names)}, "
            f"{optimizer!r} needs {list(optimizer.state_names)}: resume with the "
            "optimizer the checkpoint was made with"
        )


def warn_about_data(
    summary, workers: int, batch_size: int, in_place: bool, num_classes: int | None
) -> None:
    """UserWarnings, on the driver, for data that trains but likely not as meant: workers
    that get no training rows, a batch larger than the training data, and a classifier
    whose training labels leave some of its classes without a row. ``in_place``: worker k
    trains on the data's partition k as it lies (else rows are dealt out evenly)."""
    rows = summary.rows(TRAIN)
    holding = {count.partition for count in summary.partition_counts if count.split == TRAIN}
    empty = workers - len(holding) if in_place else max(0, workers - rows)
    if empty > 0:
        warnings.warn(
            f"{empty} of the {workers} workers get no training rows ("
            + (
                f"{workers - len(holding)} of the data's partitions are empty"
                if in_place
                else f"{rows} rows for {workers} workers"
            )
            + "); they take part in every step with nothing to add: repartition the data "
            "(df.repartition(n)) or pass num_workers=<fewer>",
            UserWarning,
            stacklevel=3,
        )
    if batch_size > rows:
        warnings.warn(
            f"batch_size={batch_size} is larger than the {rows} training rows: every step takes "
            "all of them (full-batch gradient descent, one step an epoch); set it below the "
            "rows for mini-batches",
            UserWarning,
            stacklevel=3,
        )
    labels = summary.train_labels
    if num_classes is not None and labels is not None and len(labels) < num_classes:
        missing = sorted(set(range(num_classes)) - {int(label) for label in labels})
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        warnings.warn(
            f"the training labels hold {len(labels)} distinct classes but the model has "
            f"{num_classes} (ids 0..{num_classes - 1}); no training row has class {shown}: "
            "the model will never predict it. Check the labels (a filter that dropped a "
            "class?) or the label metadata from StringIndexer",
            UserWarning,
            stacklevel=3,
        )
