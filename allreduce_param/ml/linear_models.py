"""What ``LogisticRegressionModel`` and ``LinearRegressionModel`` share: the coefficients as MLlib
shows them, the training summary, the margins computed in the executors, and persistence.

A Model holds its coefficients as a (rows, numFeatures) float64 matrix and one intercept
per row (rows: 1 for a linear or a binomial model, K for a multinomial one), in the original
feature space, as MLlib's do. It saves as Spark's metadata file of its Params plus one
Parquet row (``coefficients``, ``intercepts``, flattened) through the session: anywhere Spark
writes, in a ``Pipeline``, under Spark Connect; no pickle. A loaded Model has no summary, as
MLlib's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pyspark.ml.util import DefaultParamsReader, MLReader, MLWriter

from allreduce_param.errors import InputError
from allreduce_param.ml.model_io import save_metadata, skip_overwrite_under_connect
from allreduce_param.spark.arrow import float_lists
from allreduce_param.spark.info import SparkInfo
from allreduce_param.spark.versions import from_arrow, ml_metadata, to_arrow
from allreduce_param.train.features import matrix_from_pandas
from allreduce_param.train.rows import features_column, is_vector_type

#: The version of a saved linear Model's data, in its metadata.
FORMAT = "allreduce-param-linear/1"


@dataclass(frozen=True)
class TrainingSummary:
    """A fit's figures, as MLlib's training summary names them: ``objectiveHistory`` (the
    objective at the start, then after each iteration) and ``totalIterations``. ``note``:
    what MLlib would have logged as a warning (a label with one value, say), or None.
    ``objectiveTimes`` (ours only): when each ``objectiveHistory`` value was reached, as
    ``time.time()`` on partition 0's executor (compare with the driver's clock only where
    both share one: local mode); empty for the normal equations."""

    objectiveHistory: list[float] = field(default_factory=list)
    totalIterations: int = 0
    note: str | None = None
    objectiveTimes: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class LinearFit:
    """A linear Model's contents: ``coefficients`` (rows, num_features) float64 and
    ``intercepts`` (rows,), in the original feature space; ``summary`` from a fit (None
    after ``load``)."""

    coefficients: np.ndarray
    intercepts: np.ndarray
    summary: TrainingSummary | None = None

    @property
    def num_features(self) -> int:
        """The width of a row the Model takes."""
        return int(self.coefficients.shape[1])

    def margins(self, X: Any) -> np.ndarray:
        """``X @ coefficients.T + intercepts``: each row's margin per coefficient row."""
        return np.asarray(X @ self.coefficients.T, np.float64) + self.intercepts

    @classmethod
    def of_solution(cls, solution: Any) -> LinearFit:
        """The Model's contents from the solver's ``GlmSolution``."""
        return cls(
            np.asarray(solution.coefficients, np.float64),
            np.asarray(solution.intercepts, np.float64),
            TrainingSummary(
                list(map(float, solution.objective_history)),
                int(solution.iterations),
                getattr(solution, "note", None),
                list(map(float, getattr(solution, "objective_times", []))),
            ),
        )


class LinearModelParts:
    """A Model's ``LinearFit`` and what comes of it, for the Model classes to hold (one each)."""

    def __init__(self, fit: LinearFit | None) -> None:
        self._fit = fit

    @property
    def fit(self) -> LinearFit:
        """The Model's contents; an ``InputError`` for a Model made neither by fit nor load."""
        if self._fit is None:
            raise InputError("this Model holds no coefficients: make it with fit() or load()")
        return self._fit

    def summary(self, owner: str) -> TrainingSummary:
        """The fit's summary, or MLlib's error where there is none (a loaded Model)."""
        if self.fit.summary is None:
            raise RuntimeError(f"No training summary available for this {owner}")
        return self.fit.summary

    def one_row(self, value: Any) -> np.ndarray:
        """One feature vector (a pyspark.ml Vector or numbers) as a (1, numFeatures) row."""
        array = value.toArray() if hasattr(value, "toArray") else np.asarray(value)
        row = np.asarray(array, np.float64).reshape(1, -1)
        if row.shape[1] != self.fit.num_features:
            raise InputError(
                f"the vector has {row.shape[1]} features; the Model takes {self.fit.num_features}"
            )
        return row


def add_scores(
    dataset, features_col: str, fit: LinearFit, outputs: dict[str, str], score: Any
) -> Any:
    """``dataset`` with ``outputs`` (column name -> field of ``score``'s result) added, computed
    in the executors through Arrow a batch at a time: ``score(margins)`` returns a dict of
    per-row values (vectors as 2-D arrays, numbers as 1-D), every field of ``outputs`` among
    them. The coefficients reach the executors by broadcast (under Spark Connect, in the
    closure)."""
    import pandas as pd
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    if not outputs:
        return dataset
    column = features_column(dataset, features_col, role="featuresCol")  # names a missing one
    vector = is_vector_type(dataset.schema[features_col].dataType)
    held = SparkInfo(dataset.sparkSession).broadcast(fit)
    kinds = {"prediction": "double", "raw": "array<double>", "probability": "array<double>"}
    fields = sorted(set(outputs.values()))

    def scores(features) -> pd.DataFrame:
        model = held.value
        X = matrix_from_pandas(features, features_col, model.num_features, np.float64)
        if X.shape[1] != model.num_features:
            from allreduce_param.errors import InputError

            raise InputError(
                f"the column {features_col!r} holds vectors of {X.shape[1]} features; the "
                f"Model takes {model.num_features}"
            )
        found = score(model.margins(X))
        return pd.DataFrame(
            {name: (list(found[name]) if found[name].ndim == 2 else found[name]) for name in fields}
        )

    scores.__annotations__ = {
        "features": pd.DataFrame if vector else pd.Series,
        "return": pd.DataFrame,
    }
    computed = "__allreduce_linear_scores"
    kind = ", ".join(f"{name} {kinds[name]}" for name in fields)
    out = dataset.withColumn(computed, F.pandas_udf(scores, kind)(column))
    for name, source in outputs.items():
        value = F.col(f"{computed}.{source}")
        out = out.withColumn(name, value if kinds[source] == "double" else array_to_vector(value))
    return out.drop(computed)


class LinearModelWriter(MLWriter):
    """Saves a linear Model: Spark's metadata file of its Params (with ``numFeatures``,
    ``numClasses`` and the format), and its coefficients and intercepts as one Parquet row."""

    def __init__(self, instance: Any, num_classes: int) -> None:
        super().__init__()
        self.instance = instance
        self.num_classes = num_classes

    def _handleOverwrite(self, path: str) -> None:
        if skip_overwrite_under_connect(self.sparkSession):
            return
        super()._handleOverwrite(path)

    def saveImpl(self, path: str) -> None:
        import pyarrow as pa

        fit: LinearFit = self.instance._parts.fit
        extra = {
            "format": FORMAT,
            "numFeatures": fit.num_features,
            "numClasses": self.num_classes,
            "rows": int(fit.coefficients.shape[0]),
        }
        mode = save_metadata(self, self.instance, path, extra)
        table = pa.table(
            {
                "coefficients": float_lists(np.reshape(fit.coefficients, (1, -1)), np.float64),
                "intercepts": float_lists(np.reshape(fit.intercepts, (1, -1)), np.float64),
            }
        )
        from_arrow(self.sparkSession, table).write.mode(mode).parquet(os.path.join(path, "data"))


class LinearModelReader(MLReader):
    """Reads what ``LinearModelWriter`` saved, as a Model of ``cls``."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        metadata = ml_metadata(self.sparkSession, path)
        if metadata.get("format") != FORMAT:
            raise InputError(
                f"{path} holds no {self.cls.__name__} saved by allreduce_param (its metadata's "
                f"format is {metadata.get('format')!r}, not {FORMAT!r})"
            )
        table = to_arrow(self.sparkSession.read.parquet(os.path.join(path, "data")))

        def array(name: str) -> np.ndarray:
            return np.asarray(table.column(name).combine_chunks().flatten(), np.float64)

        rows, width = int(metadata["rows"]), int(metadata["numFeatures"])
        coefficients, intercepts = array("coefficients"), array("intercepts")
        if coefficients.size != rows * width or intercepts.size != rows:
            raise InputError(
                f"{path} holds {coefficients.size} coefficients and {intercepts.size} intercepts; "
                f"its metadata says {rows} x {width} and {rows}: the folder was changed or mixed "
                "with another model's"
            )
        instance = self.cls(LinearFit(coefficients.reshape(rows, width), intercepts))
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        return instance
