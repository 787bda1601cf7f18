"""``bench_torch_backend.py``'s run: DistributedDataParallel's step time on the engine's
torch.distributed backend against the same on gloo, in plain processes on this host.

N spawned processes (no Spark, no JVM: it runs where there is no Java) join a gloo default
group (torch's TCPStore on 127.0.0.1) and, bound to an engine handle (``StaticRendezvous``),
a group of our backend (``new_group(backend="allreduce_param")``). Each rank makes the same
MLP twice (the same seed), wraps one in DDP over gloo and one over ours, and the rounds
alternate (ours, gloo, gloo, ours, ...): each round, after ``warmup`` untimed steps,
``steps`` timed training steps (forward, backward with DDP's bucketed allreduce, SGD) on a
fixed batch. A step's time is the slowest rank's; a round's figure the median over its
steps; the table gives the medians over the rounds and the median of the per-round ratios
with their range, the machine and its single-core copy bandwidth.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time

import numpy as np

from benchkit.baselines import _loopback_interface
from benchkit.machine import copy_bandwidth, machine
from benchkit.ranks import TIMEOUT, free_ports, load_text, run_ranks
from benchkit.tables import ms_text, ratio_text, render

#: What the benchmark runs by default: process counts and the MLP's hidden widths.
DEFAULT_PROCESSES = "2"
DEFAULT_HIDDEN = "256,1024"
INPUTS, LAYERS, BATCH = 256, 3, 64


def make_mlp(torch, hidden: int):
    """The benchmark's MLP: ``LAYERS`` hidden layers of ``hidden`` units on ``INPUTS`` inputs."""
    torch.manual_seed(0)
    layers, width = [], INPUTS
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def timed_steps(torch, ddp, optimizer, x, y, steps: int, warmup: int) -> list[float]:
    """``warmup`` + ``steps`` training steps of ``ddp``; the timed ones' milliseconds."""
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1000.0)
    return times


def rank_main(rank, ranks, param, addresses, store_port, hidden_sizes, rounds, steps, warmup,
              results) -> None:  # fmt: skip
    """One rank: for each hidden width, ``rounds`` alternating rounds of DDP on our backend
    and on gloo; puts ``(rank, [per width: (ours per round, gloo's per round)])``, or
    ``(rank, error text)``, on ``results``."""
    try:
        import torch
        import torch.distributed as dist

        from allreduce_param.engine import StaticRendezvous
        from allreduce_param.torch_backend import BACKEND, bind

        torch.set_num_threads(1)  # as many processes as cores: no oversubscription
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
        timeout = datetime.timedelta(seconds=TIMEOUT)
        store = dist.TCPStore("127.0.0.1", store_port, ranks, is_master=rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks, timeout=timeout)
        report = []
        try:
            rendezvous = StaticRendezvous(rank, addresses, timeout=TIMEOUT)
            with param.connect(rendezvous) as handle, bind(handle):
                ours_group = dist.new_group(backend=BACKEND)
                generator = torch.Generator().manual_seed(rank)
                x = torch.randn(BATCH, INPUTS, generator=generator)
                y = torch.randn(BATCH, 1, generator=generator)
                for hidden in hidden_sizes:
                    runs = {}
                    for name, group in (("ours", ours_group), ("gloo", None)):
                        ddp = torch.nn.parallel.DistributedDataParallel(
                            make_mlp(torch, hidden), process_group=group
                        )
                        runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
                    timings = {"ours": [], "gloo": []}
                    for number in range(rounds):
                        order = ("ours", "gloo") if number % 2 == 0 else ("gloo", "ours")
                        for name in order:
                            dist.barrier()
                            ddp, optimizer = runs[name]
                            timings[name].append(
                                timed_steps(torch, ddp, optimizer, x, y, steps, warmup)
                            )
                    report.append((timings["ours"], timings["gloo"]))
                dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, report))
    except BaseException as error:  # the parent names it and fails
        results.put((rank, f"{type(error).__name__}: {error}"))


def measure(ranks: int, hidden_sizes: list[int], rounds: int, steps: int, warmup: int) -> list:
    """The rows of ``ranks`` processes, one per hidden width: per round the median of the
    slowest rank's step, ours and gloo's."""
    import multiprocessing

    from allreduce_param.torch_backend import process_group_parameter

    ports = free_ports(ranks + 1)
    addresses = [("127.0.0.1", port) for port in ports[:ranks]]
    param = process_group_parameter(ranks, timeout=TIMEOUT)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(
            target=rank_main,
            args=(
                rank,
                ranks,
                param,
                addresses,
                ports[-1],
                hidden_sizes,
                rounds,
                steps,
                warmup,
                results,
            ),
            name=f"bench-rank-{rank}",
        )  # fmt: skip
        for rank in range(ranks)
    ]
    got = run_ranks(processes, results, TIMEOUT * (1 + len(hidden_sizes)))
    rows = []
    for index, hidden in enumerate(hidden_sizes):
        row = dict(processes=ranks, hidden=hidden, params=parameter_count(hidden))
        for which, name in enumerate(("ours", "gloo")):
            times = np.stack([np.array(got[rank][index][which]) for rank in range(ranks)])
            row[name] = [float(x) for x in np.median(times.max(axis=0), axis=1)]
        rows.append(row)
    return rows


def parameter_count(hidden: int) -> int:
    """The MLP's parameters at ``hidden`` units."""
    return (INPUTS + 1) * hidden + (LAYERS - 1) * (hidden + 1) * hidden + hidden + 1


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    header = ("N", "MLP", "parameters", "ours ms", "gloo ms", "x gloo (range)")
    lines = [
        (
            row["processes"],
            f"{LAYERS} x {row['hidden']}",
            f"{row['params']:,}",
            ms_text(statistics.median(row["ours"])),
            ms_text(statistics.median(row["gloo"])),
            ratio_text(row["ours"], row["gloo"]),
        )
        for row in rows
    ]
    return render(header, lines)


def run(counts: list[int], hidden_sizes: list[int], rounds: int, steps: int, warmup: int) -> list:
    """Measure every process count and width, print the table; the rows."""
    bandwidth = copy_bandwidth()
    print(f"machine: {machine()}")
    print(
        f"single-core copy bandwidth: {bandwidth / 1e9:.1f} GB/s (np.copyto of 40 MB, median of 5)"
    )
    print(f"load average at the start: {load_text()}")
    print(
        f"plain processes (no Spark) on 127.0.0.1, one torch thread each; DDP of an MLP "
        f"({INPUTS} inputs, batch {BATCH}, SGD) on the allreduce_param backend and on gloo; "
        f"{rounds} rounds alternating the two, each the median of {steps} steps after {warmup} "
        "warm-up, the slowest rank's step",
        flush=True,
    )
    rows = [row for ranks in counts for row in measure(ranks, hidden_sizes, rounds, steps, warmup)]
    print(table(rows))
    print(f"load average at the end: {load_text()}", flush=True)
    return rows
