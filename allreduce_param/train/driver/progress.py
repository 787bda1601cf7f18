"""The driver's end of a fit's live progress: it merges what the tasks report and shows it.

The tasks report each step and epoch (``task.reporter``); the driver merges a step (an
epoch) once every partition has reported it and hands it to a listener: a progress bar,
a JSON-lines log, or a user's callback.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from typing import TextIO

import numpy as np

from allreduce_param.train.records import EpochDone, Started, StepDone, read_report


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
        frame = {name: value for name, value in message.items() if name != "kind"}
        report = read_report(message)
        if isinstance(report, Started) and report.resumed:
            first = ("step", *report.resumed)
            with self._lock:  # what this partition's failed attempt reported from there on
                for key, items in self._pending.items():
                    if key[0] == "step" and key >= first:
                        items.pop(report.partition, None)
        if isinstance(report, StepDone):
            key, item, partition = report.key, report.record, report.partition
        elif isinstance(report, EpochDone) and self._merge_epoch is not None:
            key, item, partition = report.key, frame, frame.get("partition")
        else:
            self._on_event(message["kind"], frame)
            return
        with self._lock:
            items = self._pending.setdefault(key, {})
            # a partition's own again: the newer
            items[len(items) if partition is None else partition] = item
            if len(items) < self._partitions:
                return
            del self._pending[key]
        if key[0] == "step":
            self._on_event("step", self._merge(np.asarray(list(items.values()), dtype=np.float64)))
        else:
            self._on_event("epoch", self._merge_epoch(list(items.values())))


def redraws(stream: TextIO) -> bool:
    """Whether a bar on ``stream`` can redraw itself: a terminal, or a notebook (whose widget
    tqdm uses); not a file or a pipe, such as a spark-submit job's log."""
    if _in_notebook():
        return True
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False


def _in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (as ``tqdm.auto`` decides it)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class ProgressBar:
    """A listener that shows a fit's progress, and writes every step and epoch as a JSON line
    to ``log_file`` if given.

    Where ``stream`` (default: ``sys.stderr``) is a terminal or the process a notebook, a
    bar with epoch, loss and samples/s, and a line per epoch; elsewhere (a file, a pipe: a
    spark-submit job's log) a line per epoch alone, with the steps done, the epoch's mean
    training loss and samples/s, and no carriage-return redraws."""

    def __init__(
        self, show: bool = True, log_file: TextIO | None = None, stream: TextIO | None = None
    ) -> None:
        self._show = show
        self._log = log_file
        self._stream = stream
        self._bar = None
        self._lines: _EpochLines | None = None
        self._resumed = 0  # the step the fit last resumed at, shown once
        self._lock = threading.Lock()

    def __call__(self, kind: str, fields: dict) -> None:
        with self._lock:
            if self._log is not None and kind in ("step", "epoch"):
                self._log.write(json.dumps({"kind": kind, **fields}) + "\n")
                self._log.flush()
            if not self._show:
                return
            if kind == "start" and self._bar is None and self._lines is None:
                self._begin(fields["steps"] * fields["epochs"])
            if self._lines is not None:
                self._lines(kind, fields)
                return
            if kind == "start" and fields.get("done") and self._resumed != fields["done"]:
                self._resumed = fields["done"]
                self._bar.n = fields["done"]
                self._bar.write(_resumed_line(fields["done"]))
                self._bar.refresh()
            elif kind == "step" and self._bar is not None:
                seconds = _seconds(fields)
                # update() redraws, at tqdm's own pace
                self._bar.set_postfix(
                    epoch=fields["epoch"],
                    loss=f"{fields['loss']:.4f}",
                    samples_s=f"{fields['samples'] / seconds:,.0f}" if seconds else "-",
                    refresh=False,
                )
                self._bar.update(1)
            elif kind == "epoch" and self._bar is not None:
                for line in _epoch_lines(fields):
                    self._bar.write(line)

    def _begin(self, total: int) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        if not redraws(stream):
            self._lines = _EpochLines(stream, total)
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=self._stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _EpochLines:
    """The bar where nothing can redraw: a line per epoch, written as the epoch ends."""

    def __init__(self, stream: TextIO, total: int) -> None:
        self._stream, self._total = stream, total
        self._done = 0
        self._resumed = 0
        self._loss = self._samples = self._seconds = 0.0  # of the epoch's steps so far

    def __call__(self, kind: str, fields: dict) -> None:
        if kind == "start" and fields.get("done") and self._resumed != fields["done"]:
            self._resumed = self._done = fields["done"]
            self._write([_resumed_line(fields["done"])])
        elif kind == "step":
            self._done += 1
            if fields["samples"]:
                self._loss += fields["loss"] * fields["samples"]
                self._samples += fields["samples"]
            self._seconds += _seconds(fields)
        elif kind == "epoch":
            lines = _epoch_lines(fields)
            done = f"step {self._done}/{self._total}"
            if self._samples:
                rate = f"{self._samples / self._seconds:,.0f}" if self._seconds else "-"
                done += f", train loss {self._loss / self._samples:.4f}, {rate} samples/s"
            lines[0] += f" ({done})"
            self._write(lines)
            self._loss = self._samples = self._seconds = 0.0

    def _write(self, lines: list[str]) -> None:
        self._stream.write("".join(line + "\n" for line in lines))
        self._stream.flush()


def _seconds(step: dict) -> float:
    """A merged step's seconds: the sum of its slowest partition's phases."""
    return sum(value for name, value in step.items() if name.endswith("_s"))


def _resumed_line(done: int) -> str:
    return f"resumed from the checkpoint after step {done}"


def _epoch_lines(fields: dict) -> list[str]:
    """What an epoch's end shows: its metrics, and whether early stopping ended the fit."""
    shown = ", ".join(
        f"{k} {v:.4f}" for k, v in fields.items() if isinstance(v, float) and k != "epoch"
    )
    if fields.get("best_epoch") is not None:
        shown += f", best epoch {fields['best_epoch']}"
    lines = [f"epoch {fields['epoch']}: {shown}"]
    if fields.get("stopped"):
        lines.append(
            f"stopped early: no better validation loss since epoch {fields['best_epoch']}, "
            "whose weights the fit keeps"
        )
    return lines
