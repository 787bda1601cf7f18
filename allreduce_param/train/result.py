"""What a fit gives back: the trained weights with their model, and the history of the fit."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.models.base import dense_for, has_buffers, is_sparse_matrix
from allreduce_param.spark.info import SparkInfo
from allreduce_param.train.features import matrix_from_pandas
from allreduce_param.train.model_files import ModelFiles, read_model, write_model
from allreduce_param.train.numpy_files import write_npz
from allreduce_param.train.records import STEP_FIELDS, UPDATE_FIELDS
from allreduce_param.train.rows import features_column, is_vector_type
from allreduce_param.train.storage import Location, locate

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

#: In a folder of a streaming fit's published models (``train.publish``): the file that
#: names the newest complete one, which ``TrainedModel.load`` of the folder reads.
LATEST = "LATEST.json"
#: How many times ``TrainedModel.load`` of such a folder reads the newest model, each time
#: a newer publish removed the one it was reading
_PUBLISHED_READS = 8


def merge_step(rows: np.ndarray) -> dict:
    """One step's records from every partition (partitions x STEP_FIELDS) as one entry:
    the mean loss over the rows computed, the samples (rows; with sample weights, their
    sum), and the slowest partition's phases and the largest staleness."""
    loss_sum, samples = rows[:, 2].sum(), rows[:, 3].sum()
    entry = {
        "epoch": int(rows[0, 0]),
        "step": int(rows[0, 1]),
        "loss": float(loss_sum / samples) if samples else float("nan"),
        "samples": int(samples) if float(samples).is_integer() else float(samples),
    }
    entry.update({name: float(rows[:, i].max()) for i, name in enumerate(STEP_FIELDS) if i >= 4})
    entry["staleness"] = int(entry["staleness"])
    return entry


def merge_epoch(shares: list[dict]) -> dict:
    """One epoch's metrics from every partition's share (sums of loss, metric and rows over
    its validation rows, ``val``, and after the last epoch its training rows, ``train``).
    The metric follows the share's ``task``: accuracy, RMSE, or none (a model without one).
    With early stopping, also ``best_epoch`` (the best so far) and ``stopped`` (whether the
    fit stopped after this epoch, before its last)."""
    merged: dict = {"epoch": shares[0]["epoch"]}
    if "best_epoch" in shares[0]:  # early stopping's, decided alike on every partition
        merged.update(best_epoch=shares[0]["best_epoch"], stopped=shares[0]["stopped"])
    metric = {"classification": "accuracy", "regression": "rmse"}.get(shares[0].get("task"))
    for name in ("val", "train"):
        sums = [share[name] for share in shares if name in share]
        if not sums:
            continue
        loss_sum, metric_sum, count = np.sum(sums, axis=0)
        merged[f"{name}_loss"] = float(loss_sum / count) if count else None
        if metric is None:
            continue
        value = metric_sum / count if count else None
        merged[f"{name}_{metric}"] = (
            None if value is None else float(value if metric == "accuracy" else np.sqrt(value))
        )
    return merged


#: What a fit's time went to, in order: ``checks`` (the driver checks data and settings),
#: ``launch`` (the placement shuffle and the barrier stage's start, until its last task
#: began), ``data`` (the tasks turn their rows into arrays), ``meeting`` (the partitions
#: start their servers and meet), ``training`` (steps and evaluations, until the last
#: partition is done), ``result`` (the records reach the driver and become the result).
PHASES = ("checks", "launch", "data", "meeting", "training", "result")


def fit_phases(
    started: float, submitted: float, finished: float, task_clocks: list[dict]
) -> dict[str, float]:
    """Each of ``PHASES``' seconds, from the driver's ``time.time()`` at ``fit()``'s start,
    at the stage's submission and at the end, and each task's (``started``, ``loaded``,
    ``met``, ``trained``). A phase ends when its last task is through it, so the phases add
    up to the whole fit; executors' clocks are taken to agree with the driver's (on one
    machine they are the same clock; on a cluster they differ by the clock sync's error)."""
    last = {
        mark: max(clock[mark] for clock in task_clocks)
        for mark in ("started", "loaded", "met", "trained")
    }
    marks = [
        started,
        submitted,
        last["started"],
        last["loaded"],
        last["met"],
        last["trained"],
        finished,
    ]
    for index in range(
        1, len(marks)
    ):  # another machine's clock a little off must not make a phase negative
        marks[index] = min(max(marks[index], marks[index - 1]), finished)
    return {name: marks[index + 1] - marks[index] for index, name in enumerate(PHASES)}


@dataclass
class History:
    """Every step (merged over partitions) and every epoch of a fit.

    ``steps``: one dict per step with ``epoch``, ``step``, ``loss`` (mean over the rows
    computed, weighted where the fit has sample weights), ``samples`` (rows, or the sum of
    their weights), the slowest partition's phase times in seconds and the largest
    ``staleness`` (steps; under SSP at most its bound), and with backup workers ``dropped``
    (how many partitions' gradients an owner left out). ``epochs``: one dict per epoch with
    ``loss`` (the mean over its steps, as they trained) and the validation metrics
    (``val_loss``, ``val_accuracy`` or ``val_rmse``); the last also has the training
    metrics of the final weights (``train_loss``, ``train_accuracy`` or ``train_rmse``). A
    model without ``task`` has the losses alone. With early stopping, each epoch also has
    ``best_epoch`` and ``stopped`` (see ``best_epoch`` and ``stopped_early``), and the final
    weights are the best epoch's.
    ``dropped``: with backup workers, for each partition, the steps whose update left out
    its gradient (it came too late, or it skipped the step). ``resumed``: the global steps
    the fit resumed at from a checkpoint (after a retried stage, or ``resume_from``).
    ``checkpoints``: the folder the fit wrote its checkpoints to, if any. ``phases``: where
    the fit's ``seconds`` went, in order (see ``fit_phases``).
    """

    steps: list[dict] = field(default_factory=list)
    epochs: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    dropped: dict[int, int] = field(default_factory=dict)
    resumed: list[int] = field(default_factory=list)
    checkpoints: str | None = None
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def best_epoch(self) -> int | None:
        """With early stopping, the epoch of the lowest validation loss, whose weights the fit
        returned; None without early stopping (or when no epoch's loss was a number)."""
        return self.epochs[-1].get("best_epoch") if self.epochs else None

    @property
    def stopped_early(self) -> bool:
        """Whether early stopping ended the fit before its last epoch (``epochs[-1]`` is the
        epoch it stopped after)."""
        return bool(self.epochs and self.epochs[-1].get("stopped"))

    def phases_line(self) -> str:
        """The phases as one line: ``fit 1.61 s: checks 0.31 s, launch 0.12 s, ...``."""
        parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items())
        return f"fit {self.seconds:.2f} s: {parts}"

    @classmethod
    def from_records(
        cls,
        step_records: list[np.ndarray],
        epoch_shares: list[dict],
        seconds: float,
        update_records: list[np.ndarray] | None = None,
    ) -> History:
        """Merge the partitions' step records (each steps x STEP_FIELDS) step by step, their
        shares of each epoch's metrics epoch by epoch, and the owners' update records."""
        by_epoch: dict[int, list[dict]] = {}
        for share in epoch_shares:
            by_epoch.setdefault(share["epoch"], []).append(share)
        epochs = [merge_epoch(by_epoch[epoch]) for epoch in sorted(by_epoch)]
        if not step_records:
            return cls([], epochs, seconds)
        stacked = np.stack(step_records)  # partitions x steps x fields
        steps = [merge_step(stacked[:, index, :]) for index in range(stacked.shape[1])]
        dropped: dict[int, int] = {}
        if update_records:
            updates = np.concatenate(update_records)
            taken = updates[:, len(UPDATE_FIELDS) :].astype(bool)
            for index, entry in enumerate(steps):  # the updates of global step `index`
                by_all = taken[updates[:, 1] == index].all(axis=0)
                entry["dropped"] = int((~by_all).sum())
                for partition in np.flatnonzero(~by_all):
                    dropped[int(partition)] = dropped.get(int(partition), 0) + 1
        for epoch in epochs:
            in_epoch = [s for s in steps if s["epoch"] == epoch["epoch"]]
            samples = sum(s["samples"] for s in in_epoch)
            epoch["loss"] = (
                sum(s["loss"] * s["samples"] for s in in_epoch if s["samples"]) / samples
                if samples
                else None
            )
        return cls(steps, epochs, seconds, dropped)

    def plot(self, path: str | os.PathLike) -> Path | str:
        """Write the loss curve (each step, each epoch's mean, validation) as a PNG (or the
        format ``path``'s suffix names, e.g. ``.svg``) to ``path``, a local path or a URL as
        ``TrainedModel.save`` takes them (its folder made if missing); its ``Path``, or for a
        URL the URL.

        Needs matplotlib (``pip install 'allreduce-param[plot]'``); uses no pyplot state,
        so a notebook's own plotting is left alone.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise ConfigurationError(
                "History.plot needs matplotlib: pip install 'allreduce-param[plot]'"
            ) from None
        figure = Figure(figsize=(7, 4), layout="tight")
        axes = figure.add_subplot()
        axes.plot(
            [s["loss"] for s in self.steps], linewidth=0.7, alpha=0.5, label="step loss (train)"
        )
        ends = (
            np.cumsum([sum(1 for s in self.steps if s["epoch"] == e["epoch"]) for e in self.epochs])
            - 1
        )
        for key, label in (("loss", "epoch mean (train)"), ("val_loss", "validation")):
            points = [(x, e[key]) for x, e in zip(ends, self.epochs) if e.get(key) is not None]
            if points:
                axes.plot(*zip(*points), marker="o", markersize=3, label=label)
        if all(s["loss"] > 0 for s in self.steps):
            axes.set_yscale("log")
        axes.set_xlabel("step")
        axes.set_ylabel("loss")
        axes.legend()
        target = locate(path, "write the loss curve to")
        target.parent.make_folder()
        # as savefig(path) would take it
        kind = os.path.splitext(target.url)[1].lstrip(".").lower() or "png"
        with target.open_write() as file:
            figure.savefig(file, dpi=100, format=kind)
        return _returned(target)

    @property
    def samples_per_second(self) -> float:
        """Training samples processed per second of the whole fit."""
        return sum(s["samples"] for s in self.steps) / self.seconds if self.seconds else 0.0


class TrainedModel:
    """A model with trained weights: predict, save, load, export.

    ``buffers``: for a model with buffers (``Model.buffers()``, e.g. a ``TorchModel`` with
    BatchNorm), the fit's one set of them, merged from the partitions' (name -> array);
    ``{}`` for a model without. Predictions use a copy of the model given these buffers
    (``set_buffers``), so the model passed in is left as it was; assign ``buffers`` anew to
    change them. ``export_npz`` writes the named tensors; ``state_dict`` gives a
    ``TorchModel``'s as torch's ``load_state_dict`` takes them.

    What a later fit continues from (``DistriOptimizer.fit(initial=...)``): ``steps_done``
    and ``epochs_done``, how far training has come in all (earlier fits' included; by
    default the history's counts), and with the fit's ``keep_optimizer_state``
    ``optimizer_state`` (the optimizer's whole state by name; None: not kept) of the
    optimizer ``optimizer_kind`` (its class name). ``save`` and ``load`` keep them all.
    """

    def __init__(
        self,
        model: Any,
        weights: np.ndarray,
        history: History | None = None,
        n_features: int | None = None,
        buffers: dict[str, np.ndarray] | None = None,
        optimizer_state: dict[str, np.ndarray] | None = None,
        optimizer_kind: str | None = None,
        steps_done: int | None = None,
        epochs_done: int | None = None,
    ) -> None:
        self.model = model
        self.weights = weights
        self.history = history or History()
        self.n_features = n_features
        self.optimizer_state = optimizer_state
        self.optimizer_kind = optimizer_kind
        self.steps_done = len(self.history.steps) if steps_done is None else int(steps_done)
        self.epochs_done = len(self.history.epochs) if epochs_done is None else int(epochs_done)
        # (SparkContext or Connect session, the weights array, its broadcast)
        self._broadcast: tuple | None = None
        self.buffers = buffers

    @property
    def buffers(self) -> dict[str, np.ndarray]:
        """The model's buffers as the fit left them; ``{}`` for a model without."""
        return self._buffers

    @buffers.setter
    def buffers(self, value: dict[str, np.ndarray] | None) -> None:
        value = {name: np.asarray(array) for name, array in (value or {}).items()}
        predictor = self.model
        if value:
            if not has_buffers(self.model):
                raise InputError(
                    f"{self.model!r} keeps no buffers (it has no buffers() and set_buffers()), "
                    f"but buffers {sorted(value)} were given"
                )
            predictor = copy.deepcopy(self.model)
            predictor.set_buffers(value)  # checks the names and shapes
        self._buffers, self._predictor = value, predictor

    def __getstate__(self) -> dict:
        # a broadcast belongs to its driver; the predicting copy is made again from the buffers
        return {**self.__dict__, "_broadcast": None, "_predictor": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.buffers = state["_buffers"]

    def weights_broadcast(self, spark):
        """The weights for the executors, read there as ``.value``, for code of your own that
        predicts in them (``predict`` and the Estimators' Models use it). ``spark``: the
        SparkSession (classic or Spark Connect). Classically a Spark broadcast, one per
        SparkContext, made anew when ``weights`` is set to another array (an array changed in
        place is not seen: assign a new one); under Spark Connect, which has no broadcasts, a
        holder that travels in each task's closure."""
        info = SparkInfo(spark)
        owner = info.session if info.connect else info.context
        held = self._broadcast
        if held is not None and held[0] is owner and held[1] is self.weights:
            return held[2]
        if held is not None and held[0] is owner:
            held[2].unpersist()  # the tasks already running keep their copy
        self._broadcast = (owner, self.weights, info.broadcast(self.weights))
        return self._broadcast[2]

    def __repr__(self) -> str:
        return f"TrainedModel({self.model!r}, {self.weights.size} weights)"

    def predict_numpy(self, X) -> np.ndarray:
        """Predictions for the rows of a float32 matrix, dense or ``scipy.sparse`` (with the
        fit's buffers, if any)."""
        model = self._predictor
        if is_sparse_matrix(X):
            return model.predict(self.weights, dense_for(model, X.astype(np.float32)))
        return model.predict(self.weights, np.asarray(X, dtype=np.float32))

    def predict(
        self, df: DataFrame, features_col: str = "features", prediction_col: str = "prediction"
    ) -> DataFrame:
        """``df`` with a ``prediction_col`` column added (computed in the executors).

        The weights reach the executors as one broadcast, kept for this model's later calls.
        """
        import pandas as pd
        from pyspark.sql import functions as F

        column = features_column(df, features_col)
        model, weights = self._predictor, self.weights_broadcast(df.sparkSession)
        vector, width = is_vector_type(df.schema[features_col].dataType), self.n_features or 1

        def predict(features):
            X = dense_for(model, matrix_from_pandas(features, features_col, width))
            return pd.Series(np.asarray(model.predict(weights.value, X), dtype=np.float64))

        # real types, not strings: this module postpones annotations, pandas_udf reads them;
        # a vector column arrives as a frame of its parts (features.VectorParts)
        kind = pd.DataFrame if vector else pd.Series
        predict.__annotations__ = {"features": kind, "return": pd.Series}
        return df.withColumn(prediction_col, F.pandas_udf(predict, "double")(column))

    def save(self, path: str | os.PathLike, allow_pickle: bool = False) -> None:
        """Write the model, its weights, buffers and history to the folder ``path`` (made if
        missing): a local path (relative to the working directory, not to Spark's default
        file system), or a URL on cluster storage, e.g. ``hdfs://``, ``s3://`` (with s3fs),
        ``file://``; and on the driver of a classic SparkSession any URL its Hadoop reaches
        (``s3a://``, ``abfss://``, ``gs://``, ``dbfs:/``, ...): see ``train/storage.py``.

        The model is saved as data (``train/model_files.py``): a built-in model as its kind
        and constructor arguments, a ``TorchModel`` as its settings, its module's class and
        its module's state as arrays. Any other model saves only as a pickle, which runs code
        when it is loaded: ``allow_pickle=True`` says to (else an ``InputError``)."""
        history = self.history
        meta = {
            "n_features": self.n_features,
            "steps_done": self.steps_done,
            "epochs_done": self.epochs_done,
            "optimizer": self.optimizer_kind,
            "history": {
                "steps": history.steps,
                "epochs": history.epochs,
                "dropped": {str(k): v for k, v in history.dropped.items()},
                "resumed": history.resumed,
                "checkpoints": history.checkpoints,
                "seconds": history.seconds,
                "phases": history.phases,
            },
        }
        files = ModelFiles(self.model, self.weights, self.buffers, self.optimizer_state, meta)
        write_model(locate(path, "save the model to"), files, allow_pickle)

    @classmethod
    def load(
        cls, path: str | os.PathLike, module: Any = None, allow_pickle: bool = False
    ) -> TrainedModel:
        """Read a model written by ``save``, from any path or URL ``save`` takes; or from
        the folder a streaming fit publishes to (``DistriOptimizer.fit_stream``'s
        ``model_path``), its newest complete model.

        ``module``: for a saved ``TorchModel``, the ``torch.nn.Module`` (or a function making
        one) to load its module's state into; without it, one is made from the saved class
        where it can be imported here and takes no arguments, else an ``InputError`` says
        to pass ``module=``. Nothing in the folder runs as it is read: a model saved as a
        pickle (by ``save(allow_pickle=True)``, or by a version before format /4) is an
        ``InputError`` unless ``allow_pickle=True``, for folders you trust."""
        folder = locate(path, "load the model from")
        if not folder.child("meta.json").is_file() and folder.child(LATEST).is_file():
            return cls._load_newest(folder, module, allow_pickle)
        return cls._load_folder(folder, module, allow_pickle)

    @classmethod
    def _load_newest(cls, published: Location, module: Any, allow_pickle: bool) -> TrainedModel:
        """The newest model a streaming fit has published in ``published``: read again from
        the pointer's new target where publishing removed the one being read (it keeps
        only the newest few), a bounded number of times."""
        for _ in range(_PUBLISHED_READS - 1):
            newest = json.loads(published.child(LATEST).read_bytes())["folder"]
            try:
                return cls._load_folder(published.child(newest), module, allow_pickle)
            except (FileNotFoundError, InputError):
                if json.loads(published.child(LATEST).read_bytes())["folder"] == newest:
                    raise  # not removed by a newer publish: missing, damaged or refused
        newest = json.loads(published.child(LATEST).read_bytes())["folder"]
        return cls._load_folder(published.child(newest), module, allow_pickle)

    @classmethod
    def _load_folder(cls, folder: Location, module: Any, allow_pickle: bool) -> TrainedModel:
        """The model ``save`` wrote in ``folder``."""
        meta_file = folder.child("meta.json")
        if not meta_file.is_file():
            held = (
                "holds no saved model (no meta.json)"
                if folder.exists()
                else "does not exist: no saved model there"
            )
            raise InputError(f"{folder} {held}")
        files = read_model(folder, module, allow_pickle)
        meta, saved = files.meta, files.meta["history"]
        history = History(
            saved["steps"],
            saved["epochs"],
            saved["seconds"],
            {int(k): v for k, v in saved.get("dropped", {}).items()},
            saved.get("resumed", []),
            saved.get("checkpoints"),
            saved.get("phases", {}),
        )
        return cls(
            files.model,
            files.weights,
            history,
            meta.get("n_features"),
            buffers=files.buffers,
            optimizer_state=files.optimizer_state,
            optimizer_kind=meta.get("optimizer"),
            steps_done=meta.get("steps_done"),
            epochs_done=meta.get("epochs_done"),
        )

    def named_tensors(self) -> dict[str, np.ndarray]:
        """The weights as named arrays and the buffers by their names: the model's
        ``tensors(weights)`` where it has it (the built-in models: ``w1``, ``b1``, ...;
        ``TorchModel``: its state_dict's names), else the flat vector as ``"weights"``."""
        tensors = getattr(self.model, "tensors", None)
        named = (
            {name: np.asarray(value) for name, value in tensors(self.weights).items()}
            if callable(tensors)
            else {"weights": np.asarray(self.weights)}
        )
        clash = sorted(set(named) & set(self.buffers))
        if clash:
            raise InputError(
                f"{self.model!r} names both a tensor and a buffer {clash}; rename one to export them"
            )
        return {**named, **self.buffers}

    def export_npz(self, path: str | os.PathLike) -> Path | str:
        """Write ``named_tensors()`` to the numpy archive ``path`` (its parent folder made if
        missing), for use without this package: ``np.load(path)[name]``. For a
        ``TorchModel``: exactly its state_dict's entries, buffers included. ``path``: a local
        path or a URL, as ``save`` takes them. The file's ``Path``, or for a URL the URL."""
        target = locate(path, "export the model to")
        if target.is_dir():
            raise InputError(
                f"export_npz({str(path)!r}): that is a folder; give the path of the .npz file to write"
            )
        target.parent.make_folder()
        with target.open_write() as file:
            write_npz(file, self.named_tensors())
        return _returned(target)

    def state_dict(self):
        """The trained module's state_dict (torch tensors: parameters and buffers), which
        ``module.load_state_dict`` takes; for a ``TorchModel`` (any model with
        ``state_dict(weights, buffers)``)."""
        make = getattr(self.model, "state_dict", None)
        if not callable(make):
            raise ConfigurationError(
                f"state_dict() is for a TorchModel's result; {self.model!r} has no "
                "state_dict(weights, buffers): use export_npz(path) for its named tensors"
            )
        return make(self.weights, self.buffers or None)


def _returned(location: Location) -> Path | str:
    """What a method that wrote a file gives back: a local path as a ``Path``, a URL as given."""
    return Path(location.url) if location.local else location.url
