"""Where a fit's rows come from and how they reach the workers, on the driver.

``training_source``: a DataFrame checked and prepared once (``data.prepare_once``), or an
RDD of ``(features, label)`` numpy pairs, with one row to try the model on.
``placement``: the rows as they lie where they can train so, and how to shuffle them into
place (``partitioning``) otherwise; ``stage.run_stage`` takes both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from allreduce_param.errors import InputError
from allreduce_param.models.base import model_task
from allreduce_param.train.driver.data import DataSummary, prepare_once
from allreduce_param.train.driver.partitioning import (
    place_pairs,
    place_rows_once,
    refused_in_place,
    rows_in_place,
)


def training_source(
    model: Any, data: Any, features_col: str, label_col: str, validation: Any, weight_col: Any
) -> tuple:
    """``(rows to place, one row to try the model on, features, partitions, summary)``
    of a DataFrame, checked and prepared once (``summary``: what the checks learnt), or of
    an RDD of pairs (no summary)."""
    if hasattr(data, "sparkSession"):
        prepared, summary = prepare_once(
            data,
            features_col,
            label_col,
            validation,
            task=model_task(model),
            num_classes=getattr(model, "num_classes", None),
            weight_col=weight_col,
        )
        return prepared, summary.sample, summary.n_features, summary.partition_num, summary
    if hasattr(data, "mapPartitions"):
        if validation is not None:
            raise InputError(
                "validation goes with DataFrame input; for an RDD, evaluate afterwards"
            )
        first = data.take(1)
        if not first:
            raise InputError("the training RDD has no rows")
        sample = (np.asarray([first[0][0]], np.float32), np.asarray([first[0][1]], np.float64))
        return data, sample, sample[0].shape[1], data.getNumPartitions(), None
    raise InputError(
        f"fit() takes a DataFrame or an RDD of (features, label) pairs, got {type(data).__name__}"
    )


def placement(
    source: Any, workers: int, summary: DataSummary | None, scheme: str, seed: int
) -> tuple[Any, Callable[[], Any]]:
    """``(kept, placed)``: the rows as they lie where they can train so (else None), and
    how to shuffle them into place under ``scheme`` (``partition_scheme``)."""
    if not hasattr(source, "mapInArrow"):
        return None, lambda: place_pairs(source, workers, scheme, seed)
    kept = rows_in_place(source, workers, scheme, summary)

    def placed():  # with nothing kept, or once Spark refused to read the kept rows
        if kept is not None:
            refused_in_place(summary)
        return place_rows_once(source, workers, scheme, seed, summary)

    return kept, placed
