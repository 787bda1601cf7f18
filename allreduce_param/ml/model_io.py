"""How the AllReduce Estimators' Models save and load: Spark's metadata file of the Params,
and the weights (and the optimizer state a fit kept) as one Parquet row, through the session
(so anywhere Spark writes, under Spark Connect too); no pickle."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from allreduce_param.errors import InputError
from allreduce_param.ml.allreduce_params import _network
from allreduce_param.spark.arrow import float_lists
from allreduce_param.spark.info import is_connect
from allreduce_param.spark.versions import from_arrow, ml_metadata, to_arrow
from allreduce_param.train.result import History, TrainedModel

#: The Parquet columns of a saved Model that hold its optimizer state, by this prefix.
_STATE_PREFIX = "optimizerState_"


def skip_overwrite_under_connect(session) -> bool:
    """Whether a writer's ``overwrite()`` is left to Spark's overwrite mode: under Spark
    Connect, where pyspark's own deletes the path through the JVM, which a client lacks."""
    return is_connect(session)


def save_metadata(writer: MLWriter, instance, path: str, extra: dict) -> str:
    """Spark's metadata file of ``instance``'s Params (and ``extra``) under ``path`` as
    ``DefaultParamsWriter.saveMetadata`` writes it, but through the session (so under Spark
    Connect too); the write mode the rest of the save uses ("overwrite" or "error")."""
    mode = "overwrite" if writer.shouldOverwrite else "error"
    metadata = DefaultParamsWriter._get_metadata_to_save(instance, writer.sparkSession, extra)
    writer.sparkSession.createDataFrame([(metadata,)], ["value"]).coalesce(1).write.mode(mode).text(
        os.path.join(path, "metadata")
    )
    return mode


class _ModelWriter(MLWriter):
    """Saves a Model: Spark's metadata file of its Params (plus the network's shape), and
    its weights as one row of ``weights array<float>`` in Parquet under ``data``. Both
    are written through the session, so the path may be anywhere Spark writes, and under
    Spark Connect too (where ``overwrite()`` replaces the two folders by Spark's own
    overwrite mode: pyspark's deletes the path through the JVM, which a client lacks)."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def _handleOverwrite(self, path: str) -> None:
        if not skip_overwrite_under_connect(self.sparkSession):
            super()._handleOverwrite(path)

    def saveImpl(self, path: str) -> None:
        import pyarrow as pa

        trained = self.instance.trained
        extra = {
            "numFeatures": int(trained.n_features),
            "numClasses": getattr(trained.model, "num_classes", None),
            "epochs": trained.history.epochs,
            "stepsDone": trained.steps_done,
            "epochsDone": trained.epochs_done,
            "optimizerKind": trained.optimizer_kind,
        }
        mode = save_metadata(self, self.instance, path, extra)
        # one row: the whole vector, and the optimizer's state where the fit kept it
        columns = {"weights": float_lists(np.reshape(trained.weights, (1, -1)))}
        for name, value in (trained.optimizer_state or {}).items():
            columns[f"{_STATE_PREFIX}{name}"] = float_lists(np.reshape(value, (1, -1)))
        from_arrow(self.sparkSession, pa.table(columns)).write.mode(mode).parquet(
            os.path.join(path, "data")
        )


class _ModelReader(MLReader):
    """Reads what ``_ModelWriter`` saved."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        metadata = ml_metadata(self.sparkSession, path)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        table = to_arrow(self.sparkSession.read.parquet(os.path.join(path, "data")))
        weights = np.asarray(table.column("weights").combine_chunks().flatten(), np.float32)
        network = _network(
            instance._task,
            metadata["numFeatures"],
            instance.getHiddenLayers(),
            metadata["numClasses"],
        )
        if weights.size != network.size:
            raise InputError(
                f"{path} holds {weights.size} weights; the network its metadata describes has "
                f"{network.size}: the folder was changed or mixed with another model's"
            )
        history = History(epochs=metadata.get("epochs", []))
        state = {
            name[len(_STATE_PREFIX) :]: np.asarray(
                table.column(name).combine_chunks().flatten(), np.float32
            )
            for name in table.column_names
            if name.startswith(_STATE_PREFIX)
        }
        instance._trained = TrainedModel(
            network,
            weights,
            history,
            metadata["numFeatures"],
            optimizer_state=state or None,
            optimizer_kind=metadata.get("optimizerKind"),
            steps_done=metadata.get("stepsDone"),
            epochs_done=metadata.get("epochsDone"),
        )
        return instance
