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
