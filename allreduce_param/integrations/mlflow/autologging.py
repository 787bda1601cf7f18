"""MLflow autologging of fits: ``autolog()`` and the tracker every fit consults.

A fit is logged where ``autolog()`` is on and its ``tracking`` setting is not False, or
where ``tracking=True``. It is logged into:

- a new child run of the tuning run, inside a ``CrossValidator`` or
  ``TrainValidationSplit`` fitted while ``autolog()`` is on (which wraps their ``fit``:
  the tuning's own run is the active run, or a new one it ends), as MLflow's own pyspark.ml
  autologging nests one child run per fit;
- else the active run (``mlflow.start_run()``), left open;
- else a new run, ended with the fit (``FAILED`` where the fit raised).

What goes in (``MlflowWatcher.finished``): every fit setting by its flat name as a param
(``batch_size``, ``checkpoint_dir``, ...; the Estimators' Params are these settings; the
linear Estimators' fits log their MLlib Params, ``regParam``, ``maxIter``, ...), the
model's and the optimizer's kind and learning rate; each epoch's metrics with the epoch as
the step (``loss``, ``val_loss``, ``val_accuracy``/``val_rmse``, the last epoch's
``train_*``, ``samples_per_s``), ``step_loss`` by global step thinned to at most
``max_step_points`` points, and the whole fit's ``fit_seconds``, ``fit_samples_per_s``
and ``phase_<name>_s``; the artifacts ``history.json`` and, with matplotlib,
``loss_curve.png``; and the model (``flavor.log_model``, its signature from a few training
rows), registered as a new version of ``registered_model_name`` where one is given: a
streaming fit's micro-batches so become one version each. A tracking server's trouble is
logged as a warning and never fails the fit.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from allreduce_param.errors import ConfigurationError
from allreduce_param.train.driver.watchers import WatchedFit, register_tracker
from allreduce_param.train.result import TrainedModel

log = logging.getLogger(__name__)

#: ``MlflowClient.log_batch`` takes at most this many metrics at once.
_BATCH = 1000
#: The epoch's fields that are no metrics.
_NOT_METRICS = ("epoch", "best_epoch", "stopped")


@dataclass
class AutologConfig:
    """What ``autolog()`` was last called with."""

    enabled: bool = False
    log_models: bool = True
    registered_model_name: str | None = None
    max_step_points: int = 1000
    signature_rows: int = 5


_config = AutologConfig()
_tuning_runs: list[str] = []  # the runs of the tuning fits under way (threads share them)
_lock = threading.Lock()
_originals: dict[type, Any] = {}


def autolog(
    disable: bool = False,
    log_models: bool = True,
    registered_model_name: str | None = None,
    max_step_points: int = 1000,
) -> None:
    """Log every later fit (``DistriOptimizer.fit``, the Estimators' ``fit``, each
    micro-batch of ``fit_stream``) to MLflow, unless its ``tracking`` setting is False;
    ``disable=True`` stops it. ``log_models``: log each fit's model too;
    ``registered_model_name``: register each so logged model as a new version of it;
    ``max_step_points``: the most points of ``step_loss`` per fit. See the module's
    docstring for which run a fit goes into and what is logged."""
    if disable:
        _config.enabled = False
        _unwrap_tuning()
        return
    if isinstance(max_step_points, bool) or not isinstance(max_step_points, int):
        raise ConfigurationError(f"max_step_points must be a whole number, got {max_step_points!r}")
    if max_step_points < 1:
        raise ConfigurationError(f"max_step_points must be at least 1, got {max_step_points}")
    _config.enabled, _config.log_models = True, bool(log_models)
    _config.registered_model_name, _config.max_step_points = registered_model_name, max_step_points
    _wrap_tuning()


def _tracker(fit: WatchedFit) -> MlflowWatcher | None:
    """The watcher of ``fit`` where it is to be logged (see ``autolog``), else None."""
    tracking = fit.settings.tracking
    if tracking is False or (tracking is None and not _config.enabled):
        return None
    return MlflowWatcher.open(fit, _config)


register_tracker("mlflow", _tracker)


class MlflowWatcher:
    """One fit's run: opened (or found) when the fit's stage starts, written and ended
    when the fit ends."""

    def __init__(self, run_id: str, owned: bool, config: AutologConfig) -> None:
        self.run_id, self._owned, self._config = run_id, owned, config

    @classmethod
    def open(cls, fit: WatchedFit, config: AutologConfig) -> MlflowWatcher | None:
        import mlflow

        with _lock:
            parent = _tuning_runs[-1] if _tuning_runs else None
        name = f"{type(fit.model).__name__} fit"
        try:
            if parent is not None:
                run = mlflow.start_run(run_name=name, parent_run_id=parent, nested=True)
            elif mlflow.active_run() is not None:
                return cls(mlflow.active_run().info.run_id, False, config)
            else:
                run = mlflow.start_run(run_name=name)
        except Exception:
            log.warning("MLflow: no run to log the fit into; it goes on untracked", exc_info=True)
            return None
        return cls(run.info.run_id, True, config)

    def __call__(self, kind: str, fields: dict) -> None:
        """The live events: the run is written at the end, from the complete history."""

    def finished(self, trained: TrainedModel, fit: WatchedFit) -> None:
        from mlflow import MlflowClient

        client = MlflowClient()
        params = fit_params(fit)
        try:
            client.log_batch(self.run_id, params=params)
        except Exception as error:  # an active run may hold another fit's values
            log.warning("MLflow: the fit's params were not logged (%s)", error)
        metrics = history_metrics(trained, self._config.max_step_points)
        for start in range(0, len(metrics), _BATCH):
            client.log_batch(self.run_id, metrics=metrics[start : start + _BATCH])
        self._log_history(client, trained)
        if self._config.log_models:
            self._log_model(trained, fit)

    def _log_history(self, client: Any, trained: TrainedModel) -> None:
        history = trained.history
        with tempfile.TemporaryDirectory(prefix="allreduce-mlflow-") as folder:
            record = {
                "steps": history.steps,
                "epochs": history.epochs,
                "seconds": history.seconds,
                "phases": history.phases,
                "resumed": history.resumed,
                "checkpoints": history.checkpoints,
            }
            with open(os.path.join(folder, "history.json"), "w") as file:
                json.dump(record, file)
            try:
                history.plot(os.path.join(folder, "loss_curve.png"))
            except ConfigurationError:  # no matplotlib: the history alone
                pass
            client.log_artifacts(self.run_id, folder)

    def _log_model(self, trained: TrainedModel, fit: WatchedFit) -> None:
        from allreduce_param.integrations.mlflow.flavor import infer_signature_of, log_model

        signature = infer_signature_of(trained, fit.data, fit.features_col)
        log_model(
            trained,
            name="model",
            features_col=fit.features_col,
            signature=signature,
            registered_model_name=self._config.registered_model_name,
            run_id=self.run_id,
        )

    def failed(self, error: BaseException) -> None:
        if self._owned:
            self._end("FAILED")

    def close(self) -> None:
        if self._owned:
            self._end("FINISHED")

    def _end(self, status: str) -> None:
        import mlflow

        self._owned = False
        active = mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            mlflow.end_run(status)
        else:  # started in another thread (a tuning's parallel fits): ended by its id
            mlflow.MlflowClient().set_terminated(self.run_id, status)


def fit_params(fit: WatchedFit) -> list[Any]:
    """The fit's settings by their flat names, with the model's and the optimizer's kind
    and learning rate and the columns, as MLflow params (values as text)."""
    from mlflow.entities import Param

    if fit.params is not None:  # an Estimator's own Params (the linear ones': MLlib's)
        values: dict[str, Any] = dict(fit.params)
    else:
        values = dict(fit.settings.as_flat())
    listener = values.get("listener")
    if listener is not None:
        values["listener"] = getattr(listener, "__qualname__", type(listener).__name__)
    lbfgs = fit.settings.solver == "lbfgs"
    values.update(
        model=type(fit.model).__name__,
        optimizer="L-BFGS" if lbfgs else type(fit.optimizer).__name__,
        learning_rate=None if lbfgs else getattr(fit.optimizer, "lr", None),
        features_col=fit.features_col,
        label_col=fit.label_col,
        weight_col=fit.weight_col,
    )
    return [Param(name, str(value)) for name, value in values.items()]


def history_metrics(trained: TrainedModel, max_step_points: int) -> list[Any]:
    """The history as MLflow metrics: each epoch's by epoch, ``step_loss`` thinned, the
    fit's figures at its last step (see the module's docstring)."""
    from mlflow.entities import Metric

    history, now = trained.history, int(time.time() * 1000)
    first = trained.steps_done - len(history.steps)  # the initial model's steps
    metrics = []
    for epoch in history.epochs:
        at = int(epoch["epoch"])
        for name, value in epoch.items():
            if name not in _NOT_METRICS and _is_number(value):
                metrics.append(Metric(name, float(value), now, at))
        steps = [s for s in history.steps if s["epoch"] == epoch["epoch"]]
        seconds = sum(v for s in steps for k, v in s.items() if k.endswith("_s"))
        if seconds > 0:
            samples = sum(s["samples"] for s in steps)
            metrics.append(Metric("samples_per_s", samples / seconds, now, at))
    count = len(history.steps)
    if count:
        kept = np.unique(np.linspace(0, count - 1, min(count, max_step_points)).round().astype(int))
        for index in kept:
            loss = history.steps[index]["loss"]
            if _is_number(loss):
                metrics.append(Metric("step_loss", float(loss), now, first + int(index)))
    last = first + max(count, 1) - 1
    metrics.append(Metric("fit_seconds", float(history.seconds), now, last))
    metrics.append(Metric("fit_samples_per_s", float(history.samples_per_second), now, last))
    for name, seconds in history.phases.items():
        metrics.append(Metric(f"phase_{name}_s", float(seconds), now, last))
    return metrics


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# ---- tuning: one child run per fit ---------------------------------------------------


def _wrap_tuning() -> None:
    """Wrap ``CrossValidator.fit`` and ``TrainValidationSplit.fit`` (once)."""
    from pyspark.ml.tuning import CrossValidator, TrainValidationSplit

    for cls in (CrossValidator, TrainValidationSplit):
        if cls not in _originals:
            _originals[cls] = cls.__dict__.get("fit")  # None: inherited (Estimator.fit)
            cls.fit = _tuning_fit(cls.fit)


def _unwrap_tuning() -> None:
    """The two classes' ``fit`` as they were."""
    for cls, original in list(_originals.items()):
        if original is None:
            del cls.fit
        else:
            cls.fit = original
        del _originals[cls]


def _tuning_fit(original: Any) -> Any:
    def fit(self: Any, dataset: Any, params: Any = None) -> Any:
        """A tuning fit in its run (the active one, or a new one), which each fit inside
        takes as its parent."""
        import mlflow

        if not _config.enabled:
            return original(self, dataset, params)
        owned = mlflow.active_run() is None
        run = mlflow.start_run(run_name=type(self).__name__) if owned else mlflow.active_run()
        with _lock:
            _tuning_runs.append(run.info.run_id)
        status = "FAILED"
        try:
            result = original(self, dataset, params)
            status = "FINISHED"
            return result
        finally:
            with _lock:
                _tuning_runs.remove(run.info.run_id)
            if owned:
                mlflow.end_run(status)

    fit.__wrapped__ = original  # type: ignore[attr-defined]
    return fit
