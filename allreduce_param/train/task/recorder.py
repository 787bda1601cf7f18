"""A partition's history of its steps, and its reports of them to the driver.

Each step's record is a row of ``records.STEP_FIELDS`` (epoch, step, loss sum, count, the
phases' seconds, staleness); the fit's history is every record so far, an earlier fit's
included, which the task yields at its end and each checkpoint keeps. With backup workers
the own owner's updates (``ConnectedParameter.updates``) are history too, and a resumed
fit carries the earlier run's along.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from allreduce_param.train.records import (
    STEP_FIELDS,
    UPDATE_FIELDS,
    EpochDone,
    Started,
    StepDone,
)

Report = Callable[[Started | StepDone | EpochDone], None]


class StepRecorder:
    """Keeps this partition's step records and says where the fit is; sends its progress
    reports through ``report`` (``ProgressReporter.report``; None: none are sent).

    ``where``: the epoch and step the fit is at, which a task's error names; ``records``:
    one row of ``STEP_FIELDS`` per global step so far; ``resumed``: the global steps the fit
    resumed at.
    """

    def __init__(self, partition_id: int, report: Report | None = None) -> None:
        self.partition_id = partition_id
        self.where: dict[str, int | None] = {"epoch": None, "step": None}
        self.records: list[np.ndarray] = []
        self.resumed: list[int] = []
        self._earlier_updates: list[list[float]] = []  # backup workers: before a resume
        self._report = report

    def at(self, epoch: int | None, step: int | None) -> None:
        """The fit is now at ``step`` of ``epoch`` (None: between steps, or done)."""
        self.where.update(epoch=epoch, step=step)

    def report(self, report: Started | StepDone | EpochDone) -> None:
        """Send one progress report to the driver, where the fit reports any."""
        if self._report is not None:
            self._report(report)

    def restore(
        self, steps: Sequence[Sequence[float]], updates: list[list[float]], resumed: list[int]
    ) -> None:
        """Continue the history of an earlier run (a checkpoint's records): its step rows,
        its owner's updates (backup workers) and the steps it resumed at."""
        self.records = [np.asarray(row, dtype=np.float64) for row in steps]
        self._earlier_updates = updates
        self.resumed = resumed

    def started(self, steps_per_epoch: int, epochs: int, start: int, at: tuple | None) -> None:
        """Report the fit's start: ``start`` global steps done, ``at`` (epoch, step) where it
        resumes (None: from the beginning)."""
        resumed = list(at) if at is not None else None
        self.report(Started(self.partition_id, steps_per_epoch, epochs, start, resumed))

    def keep(
        self,
        epoch: int,
        step: int,
        loss_sum: float,
        count: float,
        phases: Sequence[float],
        staleness: int = 0,
    ) -> np.ndarray:
        """Keep the record of ``step`` of ``epoch`` (``phases``: read, compute, put,
        aggregate, update, send seconds); the caller fills in what comes later and reports
        it once it is whole (``report_step``)."""
        record = np.array([epoch, step, loss_sum, count, *phases, staleness], dtype=np.float64)
        self.records.append(record)
        return record

    def report_step(self, record: np.ndarray) -> None:
        """Report a kept step's record to the driver."""
        self.report(StepDone(record.tolist(), self.partition_id))

    def steps_until(self, steps_done: int, plan: Sequence[tuple[int, int]]) -> list[list[Any]]:
        """The records of the first ``steps_done`` global steps as lists; a straggler's steps
        the others went on without (backup workers) as rows of zeros."""
        steps = [row.tolist() for row in self.records[:steps_done]]
        for index in range(len(steps), steps_done):
            steps.append([*plan[index], 0.0, 0.0] + [0.0] * (len(STEP_FIELDS) - 4))
        return steps

    def updates_table(
        self, updates: Sequence | None, partition_num: int, before: int | None = None
    ) -> np.ndarray:
        """The own owner's ``updates`` (backup workers; None: none kept), those of steps
        before ``before``, as rows of ``UPDATE_FIELDS`` then one 0/1 column per partition,
        the earlier run's first."""
        width = len(UPDATE_FIELDS) + partition_num
        if updates is None:
            return np.zeros((0, width), dtype=np.float64)
        kept = [update for update in updates if before is None or update.step < before]
        table = np.zeros((len(kept), width), dtype=np.float64)
        for row, update in zip(table, kept):
            row[: len(UPDATE_FIELDS)] = self.partition_id, update.step, update.count
            row[len(UPDATE_FIELDS) + np.asarray(update.sources, dtype=np.int64)] = 1
        earlier = np.asarray(self._earlier_updates, dtype=np.float64).reshape(-1, width)
        return np.concatenate([earlier, table])
