"""The ``allreduce_param`` MLflow model flavor: a ``TrainedModel`` as an MLflow Model.

The model's folder holds ``MLmodel`` (two flavors: ``allreduce_param``, read back by
``load_model`` as a ``TrainedModel``, and ``python_function``, whose loader is this
module's ``_load_pyfunc``), ``requirements.txt``, and ``data/``: the ``TrainedModel``'s
own folder (``TrainedModel.save``: JSON and arrays, never a pickle, so loading it runs no
code of the folder's) and ``pyfunc.json``, the features column the pyfunc reads.

The pyfunc predicts on a pandas DataFrame holding the features column, each cell the
features of one row as an array (a list, a numpy array, or a Spark ML vector), which is
how ``mlflow.pyfunc.spark_udf`` passes an array column; a frame of that one column may
name it otherwise. Its predictions are ``TrainedModel.predict_numpy``'s, as float64.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from allreduce_param.errors import InputError
from allreduce_param.train.result import TrainedModel

#: The flavor's name in the ``MLmodel`` file.
FLAVOR_NAME = "allreduce_param"
_DATA = "data"
_TRAINED = "trained_model"
_PYFUNC = "pyfunc.json"


def save_model(
    trained_model: TrainedModel,
    path: str | os.PathLike,
    features_col: str = "features",
    signature: Any = None,
    input_example: Any = None,
    mlflow_model: Any = None,
    metadata: dict | None = None,
    **_: Any,
) -> None:
    """Write ``trained_model`` as an MLflow Model into the new folder ``path``.

    ``features_col``: the column the pyfunc reads its rows' features from. ``signature``:
    an ``mlflow.models.ModelSignature`` (``infer_signature``), or None. A model that
    saves only as a pickle (neither built in nor a ``TorchModel``) is refused, as
    ``TrainedModel.save`` refuses it without ``allow_pickle``."""
    from mlflow.models import Model
    from mlflow.pyfunc import add_to_model

    path = os.fspath(path)
    if os.path.exists(path):
        raise InputError(f"{path!r} already exists: save an MLflow model into a new folder")
    data = os.path.join(path, _DATA)
    os.makedirs(data)
    trained_model.save(os.path.join(data, _TRAINED))
    with open(os.path.join(data, _PYFUNC), "w") as file:
        json.dump({"features_col": features_col}, file)
    model = mlflow_model if mlflow_model is not None else Model()
    if signature is not None:
        model.signature = signature
    if input_example is not None:
        from mlflow.models.utils import _save_example

        _save_example(model, input_example, path)
    if metadata is not None:
        model.metadata = metadata
    add_to_model(model, loader_module=__name__, data=_DATA)
    model.add_flavor(
        FLAVOR_NAME, data=_DATA, features_col=features_col, allreduce_param_version=_version()
    )
    model.save(os.path.join(path, "MLmodel"))
    with open(os.path.join(path, "requirements.txt"), "w") as file:
        file.write("\n".join(_requirements()) + "\n")


def log_model(
    trained_model: TrainedModel,
    name: str = "model",
    features_col: str = "features",
    signature: Any = None,
    input_example: Any = None,
    registered_model_name: str | None = None,
    run_id: str | None = None,
    **kwargs: Any,
) -> Any:
    """Log ``trained_model`` as an MLflow Model named ``name`` into the run ``run_id``
    (None: the active run, or a new one, as ``mlflow.<flavor>.log_model`` does), and
    with ``registered_model_name`` as a new version of that registered model. The
    ``mlflow.models.model.ModelInfo`` (its ``model_uri`` loads it back). See
    ``save_model`` for ``features_col`` and ``signature``."""
    import sys

    from mlflow.models import Model

    return Model.log(
        artifact_path=None,
        name=name,
        flavor=sys.modules[__name__],
        trained_model=trained_model,
        features_col=features_col,
        signature=signature,
        input_example=input_example,
        registered_model_name=registered_model_name,
        run_id=run_id,
        **kwargs,
    )


def load_model(model_uri: str) -> TrainedModel:
    """The ``TrainedModel`` logged or saved at ``model_uri`` (``runs:/<id>/model``,
    ``models:/<name>/<version>``, a local folder, ...)."""
    import mlflow

    local = mlflow.artifacts.download_artifacts(artifact_uri=model_uri)
    conf = _flavor_conf(local)
    return TrainedModel.load(os.path.join(local, conf.get("data", _DATA), _TRAINED))


def _flavor_conf(local: str) -> dict:
    from mlflow.models import Model

    flavors = Model.load(os.path.join(local, "MLmodel")).flavors
    if FLAVOR_NAME not in flavors:
        raise InputError(
            f"the MLflow model at {local!r} has no {FLAVOR_NAME!r} flavor (it has "
            f"{sorted(flavors)}): it was not logged by allreduce_param.integrations.mlflow"
        )
    return flavors[FLAVOR_NAME]


class PyfuncModel:
    """What ``mlflow.pyfunc.load_model`` gives for this flavor: ``predict(frame)``."""

    def __init__(self, trained: TrainedModel, features_col: str) -> None:
        self.trained, self.features_col = trained, features_col

    def get_raw_model(self) -> TrainedModel:
        return self.trained

    def predict(self, model_input: Any, params: dict | None = None) -> np.ndarray:
        """The predictions for the rows of ``model_input`` (a pandas DataFrame holding the
        features column, or a matrix), as float64."""
        matrix = features_matrix(model_input, self.features_col)
        return np.asarray(self.trained.predict_numpy(matrix), dtype=np.float64)


def features_matrix(model_input: Any, features_col: str) -> np.ndarray:
    """The float32 rows x features matrix of ``model_input``: a pandas DataFrame's
    ``features_col`` (or its one column), whose cells are arrays; or a 2-d array."""
    import pandas as pd

    if not isinstance(model_input, pd.DataFrame):
        matrix = np.asarray(model_input, dtype=np.float32)
        if matrix.ndim != 2:
            raise InputError(
                f"the model predicts on a pandas DataFrame with a {features_col!r} column of "
                f"arrays, or a 2-d matrix; got an array of shape {matrix.shape}"
            )
        return matrix
    if features_col in model_input.columns:
        column = model_input[features_col]
    elif len(model_input.columns) == 1:
        column = model_input.iloc[:, 0]
    else:
        raise InputError(
            f"the model reads each row's features from the column {features_col!r}, which this "
            f"DataFrame lacks (its columns: {list(model_input.columns)}): pass that column, its "
            "cells arrays of the features"
        )
    rows = [_row(cell) for cell in column]
    if not rows:
        return np.zeros((0, 0), dtype=np.float32)
    widths = {row.size for row in rows}
    if len(widths) != 1:
        raise InputError(
            f"the rows of {features_col!r} have {sorted(widths)} features: every row needs the "
            "same number, the model's"
        )
    return np.stack(rows)


def _row(cell: Any) -> np.ndarray:
    to_array = getattr(cell, "toArray", None)  # a Spark ML vector
    return np.asarray(to_array() if callable(to_array) else cell, dtype=np.float32).ravel()


def _load_pyfunc(data_path: str, model_config: Any = None) -> PyfuncModel:
    """The pyfunc of the model whose ``data`` folder is ``data_path`` (MLflow's loader hook)."""
    with open(os.path.join(data_path, _PYFUNC)) as file:
        features_col = json.load(file)["features_col"]
    return PyfuncModel(TrainedModel.load(os.path.join(data_path, _TRAINED)), features_col)


def infer_signature_of(trained: TrainedModel, data: Any, features_col: str, rows: int = 5) -> Any:
    """The model's signature, from a few rows of the training DataFrame ``data`` (one
    small Spark job): a ``features_col`` column of arrays of doubles in, the predictions
    out. None where ``data`` is no DataFrame (an RDD)."""
    import pandas as pd
    from mlflow.models import infer_signature

    if not hasattr(data, "select"):
        return None
    cells = [row[0] for row in data.select(features_col).limit(rows).collect()]
    example = pd.DataFrame({features_col: [_row(cell).astype(np.float64) for cell in cells]})
    predictions = PyfuncModel(trained, features_col).predict(example)
    return infer_signature(example, predictions)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("allreduce-param")
    except PackageNotFoundError:
        return "unknown"


def _requirements() -> list[str]:
    """What the model needs where it is loaded: this package (with the mlflow extra)."""
    version = _version()
    return [
        "allreduce-param[mlflow]" + ("" if version == "unknown" else f"=={version}"),
    ]
