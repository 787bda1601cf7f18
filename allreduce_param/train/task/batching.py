"""How an epoch's rows are cut into global batches that every partition agrees on.

Every partition knows every partition's row count (one allreduce at the start), so each
can compute, without talking, which of its rows go into which step. The global batch of a
step is the union of the partitions' shares, each share proportional to the partition's
rows; a partition with fewer rows (or none) takes part in every step with its true count.
The rows themselves are shuffled within each partition, anew each epoch.
"""

from __future__ import annotations

import math

import numpy as np


def steps_per_epoch(total_rows: int, batch_size: int) -> int:
    """How many steps make one pass over ``total_rows`` with global batches of ``batch_size``."""
    return max(1, math.ceil(total_rows / batch_size))


def share_bounds(rows: int, partition_id: int, partition_num: int, steps: int) -> np.ndarray:
    """Where each step's share of a partition's ``rows`` starts and ends: ``steps + 1`` cuts.

    Step ``s`` takes rows ``cuts[s]:cuts[s+1]`` of the partition's (shuffled) rows, about
    ``rows / steps`` of them. The rounding is dithered by ``partition_id / partition_num``,
    so partitions round up at different steps and the global batches stay even.
    """
    dither = partition_id / partition_num
    return np.floor(np.arange(steps + 1) * (rows / steps) + dither).astype(np.int64) - math.floor(
        dither
    )


def global_batch_sizes(counts: list[int], steps: int) -> np.ndarray:
    """The number of rows in each step's global batch (the sum of the partitions' shares)."""
    sizes = np.zeros(steps, dtype=np.int64)
    for partition_id, rows in enumerate(counts):
        sizes += np.diff(share_bounds(rows, partition_id, len(counts), steps))
    return sizes


def epoch_order(rows: int, seed: int, epoch: int, partition_id: int) -> np.ndarray:
    """The shuffled order of a partition's rows in ``epoch``: reproducible from the seed."""
    return np.random.default_rng([seed, epoch, partition_id]).permutation(rows)


class StepPlan:
    """Every global step of a fit as ``(epoch, step in the epoch)``, and this partition's
    cuts of its rows (``share_bounds``): the same steps on every partition, learnt from
    every partition's row count without talking further.

    ``first_epoch``, ``last_epoch``: the fit's epochs, numbered on from the earlier fits' it
    continues; ``steps_per_epoch``: the steps of one epoch that have rows (a step whose
    global batch is empty is left out of the plan).
    """

    def __init__(
        self,
        counts: list[int],
        partition_id: int,
        batch_size: int,
        first_epoch: int,
        last_epoch: int,
    ) -> None:
        total = sum(counts)
        steps = steps_per_epoch(total, batch_size)
        sizes = global_batch_sizes(counts, steps)
        self.first_epoch, self.last_epoch = first_epoch, last_epoch
        self.cuts = share_bounds(counts[partition_id], partition_id, len(counts), steps)
        self.steps: list[tuple[int, int]] = [
            (epoch, step)
            for epoch in range(first_epoch, last_epoch + 1)
            for step in range(steps)
            if sizes[step]
        ]
        self.steps_per_epoch = int(np.count_nonzero(sizes))

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int) -> tuple[int, int]:
        return self.steps[index]

    def at(self, index: int) -> tuple[int, int]:
        """Global step ``index`` as (epoch, step); past the end, the last step."""
        return self.steps[min(index, len(self.steps) - 1)]

    def ends_epoch(self, index: int) -> bool:
        """Whether global step ``index`` is its epoch's last."""
        return index + 1 == len(self.steps) or self.steps[index + 1][0] != self.steps[index][0]

    def epoch_after(self, steps_done: int) -> int:
        """The epoch a fit is in after ``steps_done`` global steps (the last when all are)."""
        return self.steps[steps_done][0] if steps_done < len(self.steps) else self.last_epoch

    def steps_before_epoch(self, epoch: int) -> int:
        """How many of the plan's steps belong to epochs before ``epoch``."""
        return sum(1 for step_epoch, _ in self.steps if step_epoch < epoch)

    def evaluated_before(self, start: int, local_sgd: bool) -> int:
        """How many epochs a fit had evaluated when it checkpointed after ``start`` steps
        (the same on every partition, whatever records came along): with local SGD an epoch
        is evaluated at its last step, before the checkpoint there; otherwise at the next
        epoch's first step, after it."""
        if start == 0:
            return self.first_epoch
        if start >= len(self.steps):
            return self.last_epoch
        return self.steps[start][0] if local_sgd else self.steps[start - 1][0]
