"""A partition's rows of each global step: its cut of the epoch's shuffled order
(``batching.StepPlan``), taken from the rows as the fit holds them."""

from __future__ import annotations

import numpy as np

from allreduce_param.train.task.batching import StepPlan
from allreduce_param.train.task.disk_rows import DiskRows
from allreduce_param.train.task.memory_rows import Rows


class StepRows:
    """This partition's rows of each global step, shuffled anew each epoch (from the seed).

    Dense rows in memory come in views of one room, filled again by the next step's call, as
    a row file's (``disk_rows.DiskRows``): every caller is done with a step's rows before it
    asks for the next step's (a model keeps no batch beyond its call).
    """

    def __init__(self, rows: Rows | DiskRows, plan: StepPlan, seed: int, partition_id: int) -> None:
        self.rows, self.plan = rows, plan
        self._seed, self._partition_id = seed, partition_id
        self._order_epoch, self._order = -1, np.empty(0, np.int64)
        self._room: Rows | None = None  # sized once, for this partition's largest share

    def of(self, epoch: int, step: int) -> Rows:
        """This partition's rows of ``step`` of ``epoch``."""
        if epoch != self._order_epoch:
            self._order_epoch = epoch
            self._order = self.rows.epoch_order(self._seed, epoch, self._partition_id)
        cuts = self.plan.cuts
        chosen = self._order[cuts[step] : cuts[step + 1]]
        if not isinstance(self.rows, Rows) or self.rows.sparse:
            return self.rows.take(chosen)  # a row file reuses its own; CSR rows: fresh
        if self._room is None:
            self._room = self.rows.room_for(int(np.diff(cuts).max()))
        return self.rows.take(chosen, self._room)
