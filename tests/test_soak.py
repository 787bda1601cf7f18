"""A soak: 10,000 small syncs between two partitions. Memory, threads and descriptors stay
flat once warm, so a long fit does not leak its way into an out-of-memory kill. (A block
server's pool may start another of its threads late, when two answers happen to meet:
those are counted against the pool's bound, the others must not change at all.)"""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest
from conftest import raise_first, run_partitions

from allreduce_param.engine import AllReduceParameter
from allreduce_param.engine.wire.blocks import SERVE_THREADS

pytestmark = pytest.mark.slow

SYNCS, WARM = 10_000, 1_000


def resident_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def usage() -> tuple[int, int, int, int]:
    """Resident KiB, threads but the block servers' pools', those, and open descriptors."""
    names = [thread.name for thread in threading.enumerate()]
    serving = sum(name.startswith("allreduce-serve-") for name in names)
    return resident_kib(), len(names) - serving, serving, len(os.listdir("/proc/self/fd"))


def test_ten_thousand_syncs_leave_memory_threads_and_descriptors_flat():
    # earlier tests' garbage (sockets in reference cycles) collected now, not mid-soak, where
    # its descriptors closing would read as this soak's count moving
    gc.collect()
    size = 1_000
    param = AllReduceParameter(2, size, codec="lz4", timeout=60)
    samples = {}

    def body(p):
        gradient = np.full(size, p.info.partition_id + 1.0, np.float32)
        weights = np.empty(size, np.float32)
        p.init(np.zeros(size))
        for sync in range(SYNCS):
            p.get_weights(out=weights)
            p.put_gradients(gradient, count=1.0)
            p.weight_partition[:] -= np.float32(1e-4) * p.aggregate_gradient_partition()
            p.send_weight_partition()
            if p.info.partition_id == 0 and sync in (WARM, SYNCS - 1):
                samples[sync] = usage()
        return p.get_weights()

    results = raise_first(run_partitions(param, body, timeout=600))
    assert np.array_equal(results[0], results[1])
    np.testing.assert_allclose(results[0], np.full(size, -1.5e-4 * SYNCS, np.float32), rtol=1e-3)
    (rss_warm, threads_warm, _, fds_warm), (rss_end, threads_end, serving, fds_end) = (
        samples[WARM],
        samples[SYNCS - 1],
    )
    assert threads_end == threads_warm and fds_end == fds_warm, samples
    assert serving <= 2 * SERVE_THREADS, samples
    assert rss_end - rss_warm < 8 * 1024, samples  # KiB: 9,000 more syncs, under 8 MiB more
