"""The driver's end of a fit's live progress: it merges what the tasks report and shows it.

The tasks report each step and epoch (``task.reporter``); the driver merges a step (an
epoch) once every partition has reported it and hands it to a listener: a progress bar,
a JSON-lines log, or a user's callback.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import TextIO

import numpy as np


class ProgressMerger:
    """The driver's end: merges each step over the partitions as their reports come.

    ``on_event(kind, fields)`` gets ``("start", {...})`` once per partition, ``("step", merged)``
    when every partition reported a step (``merge`` of their records), and ``("epoch",
    metrics)`` when every partition reported an epoch (``merge_epoch`` of their reports; with
    no ``merge_epoch`` each epoch report passes as it is). A ``start`` that says the fit
    resumed at ``[epoch, step]`` (the stage ran again) drops what the failed attempt left
    half-reported from there on, so no step is merged from two attempts. Reports come from
    several connections' threads at once.
    """

    def __init__(
        self,
        partitions: int,
        merge: Callable[[np.ndarray], dict],
        on_event: Callable[[str, dict], None],
        merge_epoch: Callable[[list[dict]], dict] | None = None,
    ) -> None:
        self._partitions = partitions
        self._merge = merge
        self._merge_epoch = merge_epoch
        self._on_event = on_event
        self._pending: dict[tuple, dict] = {}
        self._lock = threading.Lock()

    def on_message(self, message: dict, reply=None) -> None:
        """Take one task's report (a ``messages.MessageServer`` handler; it answers none)."""
        frame = dict(message)
        kind = frame.pop("kind")
        if kind == "start" and frame.get("resumed"):
            first = ("step", *frame["resumed"])
            with self._lock:  # what this partition's failed attempt reported from there on
                for key, items in self._pending.items():
                    if key[0] == "step" and key >= first:
                        items.pop(frame.get("partition"), None)
        if kind == "step":
            key, item = ("step", int(frame["record"][0]), int(frame["record"][1])), frame["record"]
        elif kind == "epoch" and self._merge_epoch is not None:
            key, item = ("epoch", int(frame["epoch"])), frame
        else:
            self._on_event(kind, frame)
            return
        with self._lock:
            items = self._pending.setdefault(key, {})
            items[frame.get("partition", len(items))] = item  # a partition's own again: the newer
            if len(items) < self._partitions:
                return
            del self._pending[key]
        if kind == "step":
            self._on_event("step", self._merge(np.asarray(list(items.values()), dtype=np.float64)))
        else:
            self._on_event("epoch", self._merge_epoch(list(items.values())))


class ProgressBar:
    """A listener: a progress bar (terminal or notebook) with epoch, loss and samples/s,
    a line per epoch, and every step and epoch as a JSON line in ``log_file`` if given."""

    def __init__(self, show: bool = True, log_file: TextIO | None = None) -> None:
        self._show = show
        self._log = log_file
        self._bar = None
        self._resumed = 0  # the step the fit last resumed at, shown once
        self._lock = threading.Lock()

    def __call__(self, kind: str, fields: dict) -> None:
        with self._lock:
            if self._log is not None and kind in ("step", "epoch"):
                self._log.write(json.dumps({"kind": kind, **fields}) + "\n")
                self._log.flush()
            if not self._show:
                return
            if kind == "start" and self._bar is None:
                from tqdm.auto import tqdm

                self._bar = tqdm(
                    total=fields["steps"] * fields["epochs"], unit="step", dynamic_ncols=True
                )
            if kind == "start" and fields.get("done") and self._resumed != fields["done"]:
                self._resumed = fields["done"]
                self._bar.n = fields["done"]
                self._bar.write(f"resumed from the checkpoint after step {fields['done']}")
                self._bar.refresh()
            elif kind == "step" and self._bar is not None:
                seconds = sum(v for k, v in fields.items() if k.endswith("_s"))
                self._bar.set_postfix(
                    epoch=fields["epoch"],
                    loss=f"{fields['loss']:.4f}",
                    samples_s=f"{fields['samples'] / seconds:,.0f}" if seconds else "-",
                    refresh=False,
                )  # update() redraws, at tqdm's own pace
                self._bar.update(1)
            elif kind == "epoch" and self._bar is not None:
                shown = ", ".join(
                    f"{k} {v:.4f}"
                    for k, v in fields.items()
                    if isinstance(v, float) and k != "epoch"
                )
                if fields.get("best_epoch") is not None:
                    shown += f", best epoch {fields['best_epoch']}"
                self._bar.write(f"epoch {fields['epoch']}: {shown}")
                if fields.get("stopped"):
                    self._bar.write(
                        f"stopped early: no better validation loss since epoch {fields['best_epoch']}, "
                        "whose weights the fit keeps"
                    )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
