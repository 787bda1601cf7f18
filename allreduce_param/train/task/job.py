"""TrainingJob: everything a fit's task needs, made on the driver and shipped in the closure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from allreduce_param.engine.parameter import AllReduceParameter
from allreduce_param.engine.wire.messages import MessageClient
from allreduce_param.train.checkpoint import CheckpointSettings
from allreduce_param.train.settings import FitSettings
from allreduce_param.train.start import StartPoint


@dataclass(frozen=True)
class TrainingJob:
    """What a task trains, with what, and how.

    ``settings``: the fit's ``FitSettings``, the one source of how it trains (batch size,
    epochs, seed, threads, local SGD, overlap, early stopping, ...); how the blocks travel
    (codecs, strategy, topology, network) is ``param``'s, the engine's spec made from the
    same settings on the driver. ``n_features``: the width of a row; ``has_validation``:
    whether validation rows come with the training rows. ``driver``: the task's way to the
    driver, where the partitions meet and, when the settings ask for progress, report their
    steps (None: they meet through ``allGather`` and report nothing). ``checkpoints``: where
    this fit writes its checkpoints (a folder of its own, chosen on the driver; None:
    never). ``start``: where the fit starts (``train.start.StartPoint``), chosen and
    verified on the driver: the model's initial weights, ``fit(resume_from=...)``'s
    checkpoint, ``fit(initial=...)``'s model, or when the stage runs again the newest
    intact checkpoint of this fit's (``driver.resume.restart_point``).
    ``sparse``: the rows train as a CSR matrix (the driver found the data sparse), not a
    dense one.
    """

    model: Any
    optimizer: Any
    param: AllReduceParameter
    settings: FitSettings
    n_features: int
    has_validation: bool
    driver: MessageClient | None = None
    checkpoints: CheckpointSettings | None = None
    start: StartPoint = StartPoint()
    sparse: bool = False

    def __getstate__(self) -> dict[str, Any]:
        """What travels to the tasks: everything but the settings' ``listener``, which is
        the driver's alone (it may hold a lock, a file, a notebook's widget, none of which
        pickles) and hears the steps there; the tasks report them as they would to it."""
        state = dict(self.__dict__)
        if self.settings.listener is not None:
            state["settings"] = self.settings.replace(listener=_heard_on_the_driver)
        return state

    @property
    def local_sgd(self) -> bool:
        """Whether each partition trains a copy of its own between syncs (``sync_every``)."""
        return self.settings.sync_every != 1

    @property
    def report_progress(self) -> bool:
        """Whether the task reports each step and epoch to the driver."""
        return self.driver is not None and self.settings.reports_progress

    def manifest_settings(self) -> dict:
        """What a checkpoint's manifest records of the fit's settings."""
        s, param = self.settings, self.param
        return {
            "strategy": param.strategy.name,
            "staleness": param.strategy.staleness,
            "backup_workers": param.strategy.backup_workers,
            "sync_every": s.sync_every,
            "batch_size": s.batch_size,
            "epochs": s.epochs,
            "seed": s.seed,
            "partition_scheme": s.partition_scheme,
            "codec": param.codec,
            "early_stopping_patience": s.early_stopping and s.early_stopping.patience,
            "gradient_codec": param.gradient_codec,
            "model": repr(self.model),
            "optimizer": repr(self.optimizer),
        }


def _heard_on_the_driver(kind: str, fields: dict) -> None:
    """A task's stand-in for the driver's listener: the driver hears every event."""
