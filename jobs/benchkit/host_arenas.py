"""``bench_host_arenas.py``'s run: hierarchical sync with and without host arenas, on simulated
hosts (the script says how).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import threading
import time

import numpy as np

from allreduce_param.engine import AllReduceParameter, LocalRendezvous


def one_round(
    hosts: int, slots: int, size: int, arena: bool, steps: int, warmup: int
) -> tuple[float, set[str]]:
    """The slowest partition's median step, in ms, for one configuration, and the digests of
    the final weights the partitions read (one, when all agree)."""
    n = hosts * slots
    param = AllReduceParameter(n, size, "raw", timeout=120, host_arena=arena)
    group = LocalRendezvous(
        n, hosts=[list(range(h * slots, (h + 1) * slots)) for h in range(hosts)]
    )
    medians: list = [None] * n
    digests: set[str] = set()

    def partition(partition_id: int) -> None:
        try:
            with param.connect(group.member(partition_id)) as p:
                assert p.info.hierarchical and p.info.host_arena == arena
                p.init(np.zeros(size, np.float32))
                times = []
                for step in range(warmup + steps):
                    started = time.perf_counter()
                    p.get_weights()
                    gradient = p.gradient_buffer()
                    gradient.fill(np.float32(1e-3 * (partition_id + 1)))
                    p.put_gradients(gradient, count=1.0)
                    p.weight_partition[:] -= np.float32(0.1) * p.aggregate_gradient_partition()
                    p.send_weight_partition()
                    if step >= warmup:
                        times.append(time.perf_counter() - started)
                digests.add(hashlib.sha256(p.get_weights().tobytes()).hexdigest())
                medians[partition_id] = statistics.median(times) * 1e3
        except BaseException as error:
            medians[partition_id] = error

    threads = [threading.Thread(target=partition, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in medians:
        if isinstance(result, BaseException):
            raise result
    return max(medians), digests


def parse_size(text: str) -> int:
    text = text.strip().upper()
    factor = {"K": 1_000, "M": 1_000_000}.get(text[-1], 1)
    return int(float(text[:-1] if factor > 1 else text) * factor)


def machine() -> str:
    try:
        with open("/proc/meminfo") as meminfo:
            memory = f"{int(meminfo.readline().split()[1]) / 2**20:.0f} GiB"
    except OSError:
        memory = "memory unknown"
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {memory}, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}"
    )


def run(args: argparse.Namespace) -> int:
    """Measure as the command line (``bench_host_arenas.py``'s, checked there) says; the exit status."""
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f} at the start")
    print(
        f"{args.hosts} simulated hosts x {args.slots} partitions (threads), hierarchical, raw; "
        f"{args.rounds} alternating rounds of {args.steps} steps (+{args.warmup} warm-up); "
        "the slowest partition's median step"
    )
    print()
    print("| size | arena (ms) | blocks (ms) | arena / blocks (range) |")
    print("|---|---|---|---|")
    for size in [parse_size(each) for each in args.sizes.split(",")]:
        with_arena, without = [], []
        for _ in range(args.rounds):
            arena, arena_digests = one_round(
                args.hosts, args.slots, size, True, args.steps, args.warmup
            )
            blocks, blocks_digests = one_round(
                args.hosts, args.slots, size, False, args.steps, args.warmup
            )
            if len(arena_digests | blocks_digests) != 1:
                raise SystemExit(
                    f"the final weights of {size:,} floats differ between the arenas and the "
                    "blocks (or between partitions): the arenas must give the blocks' bits"
                )
            with_arena.append(arena)
            without.append(blocks)
        ratios = [a / b for a, b in zip(with_arena, without, strict=True)]
        print(
            f"| {size:,} | {statistics.median(with_arena):.1f} | {statistics.median(without):.1f} "
            f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |",
            flush=True,
        )
    print()
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0
