"""Who else watches a fit on the driver: TensorBoard's writer, and the trackers (MLflow's).

A watcher hears the fit's live events as a ``listener`` does (``"start"``, ``"step"``,
``"epoch"``, ``"meeting"``), then once how it ended: ``finished(trained, fit)`` with the
result, or ``failed(error)``; either way ``close()``. ``DistriOptimizer.fit`` opens the
watchers of its settings once its checks have passed (``watched_fit``), so a fit refused
before any task starts leaves no run behind.

Trackers live above the trainer (``allreduce_param.integrations``), which the trainer must
not import: a tracker registers itself here (``register_tracker``) by name, and the
trainer looks it up by that name. Where a fit's ``tracking=True`` asks for MLflow and
nothing registered it yet, its module is imported by name (``TRACKER_MODULES``), which
registers it; its absence is a ``ConfigurationError`` saying what to install.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from allreduce_param.errors import ConfigurationError
from allreduce_param.train.settings import FitSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WatchedFit:
    """What a watcher may want to know of the fit it watches: the trainer's ``model``,
    ``optimizer`` and ``settings``, and ``fit``'s arguments (``data`` a DataFrame or an RDD;
    ``validation`` a DataFrame or None; ``initial`` the ``TrainedModel`` it continues).
    ``params``: the Params to log instead of the settings (an Estimator's own by name, as
    MLlib's ``LogisticRegression`` has them), or None."""

    model: Any
    optimizer: Any
    settings: FitSettings
    data: Any
    features_col: str
    label_col: str
    validation: Any = None
    weight_col: str | None = None
    initial: Any = None
    params: dict[str, Any] | None = None


class FitWatcher(Protocol):
    """One watcher of one fit (see the module's docstring)."""

    def __call__(self, kind: str, fields: dict) -> None: ...

    def finished(self, trained: Any, fit: WatchedFit) -> None: ...

    def failed(self, error: BaseException) -> None: ...

    def close(self) -> None: ...


#: A tracker: given a fit, its watcher, or None where it does not watch this fit.
Tracker = Callable[[WatchedFit], "FitWatcher | None"]

#: The trackers a fit's ``tracking=True`` may ask for, by name: the module that registers each.
TRACKER_MODULES = {"mlflow": "allreduce_param.integrations.mlflow"}

_trackers: dict[str, Tracker] = {}
_lock = threading.Lock()


def register_tracker(name: str, tracker: Tracker | None) -> None:
    """Make ``tracker`` watch every fit from now on (None: stop ``name``'s)."""
    with _lock:
        if tracker is None:
            _trackers.pop(name, None)
        else:
            _trackers[name] = tracker


def _tracker(name: str) -> Tracker:
    """The tracker ``name``, its module imported where nothing registered it yet."""
    with _lock:
        found = _trackers.get(name)
    if found is not None:
        return found
    module = TRACKER_MODULES[name]
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise ConfigurationError(
            f"tracking=True logs the fit to {name}, which is not installed here ({error}): "
            f"pip install 'allreduce-param[{name}]', or set tracking=False"
        ) from error
    with _lock:
        return _trackers[name]


class Watchers:
    """The watchers of one fit, heard and ended as one; a watcher that fails is logged and
    left out, so a tracking server's trouble never fails a fit."""

    def __init__(self, fit: WatchedFit, watchers: list[FitWatcher]) -> None:
        self._fit, self._watchers = fit, watchers

    def __bool__(self) -> bool:
        return bool(self._watchers)

    def listen(self, kind: str, fields: dict) -> None:
        """A listener: each watcher hears ``kind`` and ``fields`` (a copy each)."""
        for watcher in list(self._watchers):
            self._call(watcher, "__call__", kind, dict(fields))

    def finish(self, make_result: Callable[[], Any]) -> Any:
        """The fit's result from ``make_result()``, which each watcher then hears; every
        watcher closed either way."""
        try:
            trained = make_result()
        except BaseException as error:
            self.fail(error)
            raise
        for watcher in self._watchers:
            self._call(watcher, "finished", trained, self._fit)
        self._close()
        return trained

    def fail(self, error: BaseException) -> None:
        """The fit failed with ``error``: each watcher hears it, and is closed."""
        for watcher in self._watchers:
            self._call(watcher, "failed", error)
        self._close()

    def _close(self) -> None:
        watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            self._call(watcher, "close")

    def _call(self, watcher: FitWatcher, method: str, *args: Any) -> None:
        try:
            getattr(watcher, method)(*args)
        except Exception:  # a watcher's trouble must not fail the fit
            log.warning(
                "%r failed in %s; the fit goes on without it", watcher, method, exc_info=True
            )
            if method != "close" and watcher in self._watchers:
                self._watchers.remove(watcher)
                self._call(watcher, "close")


def watchers_of(fit: WatchedFit) -> Watchers:
    """The watchers ``fit``'s settings ask for: TensorBoard's where ``tensorboard_dir`` is
    set, and each registered tracker's that watches it (with ``tracking=True``, MLflow's is
    looked up first, so that its absence fails here)."""
    settings = fit.settings
    found: list[FitWatcher] = []
    if settings.tracking:
        _tracker("mlflow")
    made = []
    try:
        if settings.tensorboard_dir is not None:
            from allreduce_param.train.driver.tensorboard import TensorBoardWriter

            found.append(TensorBoardWriter.open(settings.tensorboard_dir, fit))
        with _lock:
            trackers = list(_trackers.values())
        for tracker in trackers:
            watcher = tracker(fit)
            if watcher is not None:
                made.append(watcher)
    except BaseException:
        for watcher in found + made:
            watcher.close()
        raise
    return Watchers(fit, found + made)


@contextlib.contextmanager
def watched_fit(fit: WatchedFit) -> Iterator[Watchers]:
    """``watchers_of(fit)`` for the fit's stage: told of an error that leaves it (and
    closed); the fit ends them with ``Watchers.finish`` once it has its result."""
    watchers = watchers_of(fit)
    try:
        yield watchers
    except BaseException as error:
        watchers.fail(error)
        raise
