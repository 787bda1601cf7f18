"""``bench_processes.py``'s run (and ``bench_allreduce.py --processes``'s): N plain
processes on this host, the engine against gloo, no Spark (the script says how).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from allreduce_param.engine import AllReduceParameter, StaticRendezvous
from benchkit import baselines, process_memory
from benchkit.machine import copy_bandwidth, machine
from benchkit.ranks import TIMEOUT, free_ports, load_text, spawn_ranks
from benchkit.rounds import PHASES
from benchkit.tables import label, ms_text, parse_sizes, ratio_text, render

DEFAULT_SIZES = "1M,10M"
DEFAULT_PROCESSES = "2,4"
LR = np.float32(0.1)
OWN_HELP = (
    "instead of gloo: the README's loop putting p.gradient_buffer() against the same loop "
    "putting a vector of its own, alternating, beside one np.copyto of that vector"
)
MEMORY_HELP = (
    "instead of timings: each process's memory (smaps_rollup) after --steps steps, through "
    "the host arena and through blocks (or the ways named: arena, blocks), in vectors "
    "(jobs/benchkit/process_memory.py)"
)


def engine_steps(p, gradient, steps: int, warmup: int) -> np.ndarray:
    """``warmup + steps`` steps of the README's loop; the timed ones' phases, in ms."""
    timings = np.zeros((warmup + steps, len(PHASES)))
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        w = p.get_weights()
        t1 = time.perf_counter()
        p.put_gradients(gradient, count=1.0)
        t2 = time.perf_counter()
        g = p.aggregate_gradient_partition()
        t3 = time.perf_counter()
        p.weight_partition[:] -= 0.1 * g
        t4 = time.perf_counter()
        p.send_weight_partition()
        t5 = time.perf_counter()
        timings[step] = np.diff((t0, t1, t2, t3, t4, t5))
    del w
    return timings[warmup:] * 1000.0


def gloo_steps(dist, weights, gradient, ranks: int, steps: int, warmup: int) -> np.ndarray:
    """The same loop with gloo: ``all_reduce`` of the gradient sum, the divide by the ranks
    (each put count 1), and the update of the whole vector, as every rank has it; in ms."""
    timings = np.zeros(warmup + steps)
    for step in range(warmup + steps):
        start = time.perf_counter()
        dist.all_reduce(gradient, op=dist.ReduceOp.SUM)
        gradient.div_(ranks)  # ranks identical after the first step: the values stay put
        weights -= 0.1 * gradient
        timings[step] = time.perf_counter() - start
    return timings[warmup:] * 1000.0


def rank_main(
    rank: int,
    ranks: int,
    params: list[AllReduceParameter],
    addresses: list[list],
    store_port: int | None,
    rounds: int,
    steps: int,
    warmup: int,
    own: bool,
    results,
) -> None:
    """One rank: for each parameter (a size), the engine's partition and, with
    ``store_port``, gloo's rank, alternating ``rounds`` rounds; puts ``(rank, [per size:
    (engine's timings per round, gloo's per round)])`` or ``(rank, error text)`` on
    ``results``. With ``own`` (and no gloo), ``own_gradient_size`` instead."""
    try:
        dist = None
        if store_port is not None:
            import datetime

            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)  # as many processes as cores: no oversubscription
            os.environ.setdefault("GLOO_SOCKET_IFNAME", baselines._loopback_interface())
            timeout = datetime.timedelta(seconds=TIMEOUT)
            store = dist.TCPStore(
                "127.0.0.1", store_port, ranks, is_master=rank == 0, timeout=timeout
            )
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=ranks, timeout=timeout
            )
        try:
            each_size = own_gradient_size if own else one_size
            report = [
                each_size(rank, ranks, param, size_addresses, dist, rounds, steps, warmup)
                for param, size_addresses in zip(params, addresses)
            ]
        finally:
            if dist is not None:
                dist.destroy_process_group()
        results.put((rank, report))
    except BaseException as error:  # the parent names it and fails
        results.put((rank, f"{type(error).__name__}: {error}"))


def one_size(rank, ranks, param, addresses, dist, rounds, steps, warmup) -> tuple[list, list]:
    """``rounds`` alternating rounds at ``param``'s size: (engine's timings per round,
    gloo's per round; empty without gloo)."""
    engine_rounds, gloo_rounds = [], []
    with param.connect(StaticRendezvous(rank, addresses, timeout=TIMEOUT)) as p:
        rng = np.random.default_rng(rank)
        gradient = p.gradient_buffer()  # as the README computes it: in the engine's buffer
        gradient[:] = rng.standard_normal(param.size, dtype=np.float32)
        start = rng.standard_normal(param.size, dtype=np.float32) * np.float32(1e-3)
        p.init(start)
        if dist is not None:
            import torch

            weights, torch_gradient = torch.from_numpy(start), torch.from_numpy(gradient.copy())

        def barrier():
            if dist is not None:
                dist.barrier()
            else:
                p.collectives.allreduce_exact(np.zeros(1))

        for number in range(rounds):
            order = ("engine", "gloo") if number % 2 == 0 else ("gloo", "engine")
            for which in order:
                barrier()
                if which == "engine":
                    engine_rounds.append(engine_steps(p, gradient, steps, warmup).tolist())
                elif dist is not None:
                    gloo_rounds.append(
                        gloo_steps(dist, weights, torch_gradient, ranks, steps, warmup).tolist()
                    )
        barrier()
    return engine_rounds, gloo_rounds


def own_gradient_size(rank, ranks, param, addresses, dist, rounds, steps, warmup) -> tuple:
    """``rounds`` alternating rounds at ``param``'s size of the README's loop putting
    ``p.gradient_buffer()`` and of the same loop putting a vector of the user's own (an
    array of its own, holding the same values), then, in every round, ``steps`` timed
    ``np.copyto`` of that vector into another array (what a put of it adds), all ranks at
    once: (buffer's timings per round, own's per round, the copies' per round, in ms).
    The gradient is computed once, before the rounds: computing it would cost both loops
    the same."""
    buffer_rounds, own_rounds, copy_rounds = [], [], []
    with param.connect(StaticRendezvous(rank, addresses, timeout=TIMEOUT)) as p:
        rng = np.random.default_rng(rank)
        buffer = p.gradient_buffer()
        rng.standard_normal(dtype=np.float32, out=buffer)
        own = buffer.copy()  # the user's own vector
        # where the copies are timed to (the buffer is read-only between a put and the
        # next get_weights()), written once so its pages are there
        scratch = own.copy()
        p.init(rng.standard_normal(p.info.slice_length, dtype=np.float32) * np.float32(1e-3))

        def barrier():
            p.collectives.allreduce_exact(np.zeros(1))

        for number in range(rounds):
            order = ("buffer", "own") if number % 2 == 0 else ("own", "buffer")
            for which in order:
                barrier()
                timings = engine_steps(p, buffer if which == "buffer" else own, steps, warmup)
                (buffer_rounds if which == "buffer" else own_rounds).append(timings.tolist())
            barrier()
            copies = np.zeros(warmup + steps)
            for step in range(warmup + steps):
                start = time.perf_counter()
                np.copyto(scratch, own)
                copies[step] = time.perf_counter() - start
            copy_rounds.append((copies[warmup:] * 1000.0).tolist())
        barrier()
    return buffer_rounds, own_rounds, copy_rounds


def measure(
    ranks: int, sizes: list[int], rounds: int, steps: int, warmup: int, gloo: bool,
    own: bool = False,
) -> list[dict]:  # fmt: skip
    """The rows of ``ranks`` processes, one per size: per round the engine's median of the
    slowest rank's step and its phases', and gloo's; with ``own`` (no gloo), per round the
    median of the slowest rank's step putting ``gradient_buffer()``, its put's, the same
    putting a vector of its own, and of the slowest rank's copy of that vector."""
    ports = free_ports(ranks * len(sizes) + 1)
    addresses = [
        [("127.0.0.1", port) for port in ports[i * ranks : (i + 1) * ranks]]
        for i in range(len(sizes))
    ]
    params = [AllReduceParameter(ranks, size, codec="raw", timeout=TIMEOUT) for size in sizes]
    store_port = ports[-1] if gloo else None
    args = (ranks, params, addresses, store_port, rounds, steps, warmup, own)
    got = spawn_ranks(rank_main, [args] * ranks, TIMEOUT * (1 + len(sizes)))
    if own:
        return [own_row(ranks, size, [got[rank][index] for rank in range(ranks)])
                for index, size in enumerate(sizes)]  # fmt: skip
    rows = []
    for index, size in enumerate(sizes):
        # rank, round, step, phase
        engine = np.stack([np.array(got[rank][index][0]) for rank in range(ranks)])
        slowest_step = engine.sum(axis=3).max(axis=0)  # round, step
        slowest_phase = engine.max(axis=0)  # round, step, phase
        # the engine's calls alone: the step less the loop's own update of the slice
        calls = engine.sum(axis=3) - engine[..., PHASES.index("update")]
        row = dict(
            partitions=ranks,
            size=size,
            engine=[float(x) for x in np.median(slowest_step, axis=1)],
            calls=[float(x) for x in np.median(calls.max(axis=0), axis=1)],
            phases=np.median(slowest_phase, axis=1).tolist(),  # round, phase
            gloo=[],
        )
        if gloo:
            gloo_times = np.stack([np.array(got[rank][index][1]) for rank in range(ranks)])
            row["gloo"] = [float(x) for x in np.median(gloo_times.max(axis=0), axis=1)]
        rows.append(row)
    return rows


def own_row(ranks: int, size: int, reports: list) -> dict:
    """One ``--own-gradient`` row from every rank's ``own_gradient_size`` report: per round,
    the medians over steps of the slowest rank's step (and put) for each loop and of the
    slowest rank's copy."""

    def per_round(which: int) -> tuple[list[float], list[list[float]]]:
        timings = np.stack(
            [np.array(report[which]) for report in reports]
        )  # rank, round, step, phase
        steps = np.median(timings.sum(axis=3).max(axis=0), axis=1)
        phases = np.median(timings.max(axis=0), axis=1)  # round, phase
        return [float(x) for x in steps], phases.tolist()

    copies = np.stack([np.array(report[2]) for report in reports])  # rank, round, step
    buffer, buffer_phases = per_round(0)
    own, own_phases = per_round(1)
    return dict(
        partitions=ranks,
        size=size,
        buffer=buffer,
        buffer_phases=buffer_phases,
        own=own,
        own_phases=own_phases,
        copy=[float(x) for x in np.median(copies.max(axis=0), axis=1)],
    )


def own_table(rows: list[dict]) -> str:
    """The ``--own-gradient`` table: both loops' medians over rounds, the difference (own
    less buffer), one copy, the median of the per-round differences over that round's
    copy, with their range (at most 1.00: within one copy), and the difference in each
    phase (the slowest rank's, medians over rounds)."""
    header = ("N", "size", "gradient_buffer() ms", "own vector ms", "own - buffer ms",
              "one copy ms", "difference / copy (range)",
              *(f"{phase} +ms" for phase in PHASES))  # fmt: skip
    lines = []
    for row in rows:
        buffer, own = statistics.median(row["buffer"]), statistics.median(row["own"])
        shares = [(o - b) / c for o, b, c in zip(row["own"], row["buffer"], row["copy"])]
        phases = [
            statistics.median(each[i] for each in row["own_phases"])
            - statistics.median(each[i] for each in row["buffer_phases"])
            for i in range(len(PHASES))
        ]
        lines.append(
            (
                row["partitions"],
                label(row["size"]),
                ms_text(buffer),
                ms_text(own),
                f"{own - buffer:+.3g}",
                ms_text(statistics.median(row["copy"])),
                f"{statistics.median(shares):.2f} ({min(shares):.2f} to {max(shares):.2f})",
                *(f"{value:+.3g}" for value in phases),
            )
        )
    return render(header, lines)


def floor_ms(size: int, partitions: int, bandwidth: float) -> float:
    """Reading S bytes and writing S/N, at the copy's traffic rate (2 x copy bandwidth)."""
    nbytes = 4 * size
    return (nbytes + nbytes / partitions) / (2 * bandwidth) * 1e3


def table(rows: list[dict], bandwidth: float) -> str:
    header = ("N", "size", "floor ms", "ours ms", "gloo ms", "x gloo (range)", "x floor",
              "calls x floor", *(f"{phase} ms" for phase in PHASES))  # fmt: skip
    lines = []
    for row in rows:
        ours = statistics.median(row["engine"])
        floor = floor_ms(row["size"], row["partitions"], bandwidth)
        phases = [statistics.median(each[i] for each in row["phases"]) for i in range(len(PHASES))]
        lines.append(
            (
                row["partitions"],
                label(row["size"]),
                ms_text(floor),
                ms_text(ours),
                ms_text(statistics.median(row["gloo"])) if row["gloo"] else "not installed",
                ratio_text(row["engine"], row["gloo"]),
                f"{ours / floor:.1f}",
                f"{statistics.median(row['calls']) / floor:.1f}",
                *(ms_text(value) for value in phases),
            )
        )
    return render(header, lines)


def run_sizes(processes: list[int], sizes: list[int], rounds: int, steps: int, warmup: int,
        gloo: bool = True, own: bool = False) -> list[dict]:  # fmt: skip
    """Measure every N and size and print the table (with ``own``, ``own_table``); the rows."""
    gloo = gloo and not own and baselines.gloo_available()
    bandwidth = copy_bandwidth()
    print(f"machine: {machine()}")
    print(
        f"single-core copy bandwidth: {bandwidth / 1e9:.1f} GB/s (np.copyto of 40 MB, median of 5); "
        "floor = (S + S/N) bytes / (2 x that)"
    )
    print(f"load average at the start: {load_text()}")
    if own:
        print(
            "plain processes (no Spark) on 127.0.0.1, StaticRendezvous, raw codec, the README's "
            f"loop putting p.gradient_buffer() or a vector of its own; {rounds} rounds "
            f"alternating the two, each the median of {steps} steps after {warmup} warm-up, the "
            "slowest rank's step; then in each round the slowest rank's np.copyto of its vector "
            "into another, all ranks at once (median of as many)",
            flush=True,
        )
        rows = [
            row
            for ranks in processes
            for row in measure(ranks, sizes, rounds, steps, warmup, False, own=True)
        ]
        print(own_table(rows))
        print(f"load average at the end: {load_text()}", flush=True)
        return rows
    print(
        f"plain processes (no Spark) on 127.0.0.1, StaticRendezvous, raw codec, the README's loop; "
        f"{rounds} rounds alternating engine and gloo"
        f"{'' if gloo else ' (gloo: torch not installed)'}; each the median of {steps} steps after "
        f"{warmup} warm-up, the slowest rank's step",
        flush=True,
    )
    rows = [
        row for ranks in processes for row in measure(ranks, sizes, rounds, steps, warmup, gloo)
    ]
    print(table(rows, bandwidth))
    print(f"load average at the end: {load_text()}", flush=True)
    return rows


def parse_counts(text: str) -> list[int]:
    """``'2,4,8'`` -> ``[2, 4, 8]``; each at least 2."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 2:
        raise SystemExit(f"--processes {text!r}: write process counts of 2 or more, e.g. 2,4,8,16")
    return counts


def run(args: argparse.Namespace) -> int:
    """Run what the parsed arguments ask (this module's, or ``bench_allreduce.py
    --processes``'s, checked there): the memory table with ``--memory``, else the timings."""
    counts, sizes = parse_counts(args.processes), parse_sizes(args.sizes or DEFAULT_SIZES)
    if args.memory:
        ways = process_memory.parse_ways(args.memory)
        process_memory.run_sizes(counts, sizes, args.steps, ways)
        return 0
    run_sizes(
        counts,
        sizes,
        args.rounds,
        args.steps,
        args.warmup,
        gloo=not args.no_baselines,
        own=args.own_gradient,
    )
    return 0
