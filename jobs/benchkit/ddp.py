"""``bench_torch_backend.py``'s run: DistributedDataParallel's step time on the engine's
torch.distributed backend against the same on gloo, in plain processes.

N spawned processes (no Spark, no JVM: it runs where there is no Java) join a gloo default
group (torch's TCPStore) and, bound to an engine handle (``StaticRendezvous``), a group of
our backend (``new_group(backend="allreduce_param")``). Each rank makes the same model twice
(the same seed), wraps one in DDP over gloo and one over ours, and the rounds alternate
(ours, gloo, gloo, ours, ...): each round, after ``warmup`` untimed steps, ``steps`` timed
training steps (forward, backward with DDP's bucketed allreduce, SGD) on a fixed batch. The
models: an MLP (``LAYERS`` hidden layers of a width) and a small CNN (two 3x3 convolutions on
28x28 images, max-pooled, two linear layers, as PyTorch's MNIST example).

On one host the ranks talk over 127.0.0.1 (our backend: Unix sockets and shared memory
between processes of one host, as the engine does for Spark tasks). With ``hosts`` > 1 the
ranks are spread over simulated hosts (``harness.sim_hosts``: network namespaces on a
bridge, each link limited to ``rate`` both ways; root only), ``N / hosts`` ranks each, each
rank's interpreter entering its host's namespace before it starts; both groups then cross
the hosts' links.

A step's time is the slowest rank's; a round's figure the median over its steps; the table
gives the medians over the rounds and the median of the per-round ratios with their range,
the machine and its single-core copy bandwidth, and the physical floor of the step's
allreduce: on one host, each rank reading every rank's share of its slice of the gradient
and writing its own (``processes.floor_ms``); across hosts, also the gradient's bytes through
one link at ``rate`` (a two-host allreduce sends at least the whole gradient each way).
``ours CPU ms`` and ``gloo CPU ms``: the CPU time a rank's process took per timed step, all
its threads (the training, our group's thread or gloo's), the mean over the ranks, the
median over the rounds: where the machine is shared and the step times scatter, these
scatter much less. Each process holds both groups, so each figure also holds the other
group's idle threads: gloo's, whose loop wakes about 90 times a second (~3 ms of CPU a
second); ours wait without waking. torch's thread counts are printed, the same for both.
``ours asleep ms`` and ``gloo asleep ms``: the time per timed step the training thread was
neither running nor waiting for a core (its schedstat), the mean over the ranks, the median
over the rounds: the step's waits for the collectives (DDP's last bucket, a peer that is
behind, the GIL); on a loaded machine the rest of a step's wall time is waiting for a core.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time

import numpy as np

from benchkit.baselines import _loopback_interface
from benchkit.machine import copy_bandwidth, machine
from benchkit.processes import floor_ms
from benchkit.ranks import TIMEOUT, free_ports, load_text, spawn_ranks
from benchkit.tables import ms_text, ratio_text, render

#: What the benchmark runs by default: process counts, the MLP's widths, the CNN's channels.
DEFAULT_PROCESSES = "2,4"
DEFAULT_HIDDEN = "256,1024"
DEFAULT_CNN = "32,64"
INPUTS, LAYERS, BATCH = 256, 3, 64
IMAGE, CLASSES = 28, 10
#: Where ranks listen on simulated hosts (each host's namespace has every port free).
HOST_PORT = 29500


def make_model(torch, spec: tuple):
    """The benchmark's model for ``spec``: ``("mlp", width)`` or ``("cnn", (c1, c2))``."""
    torch.manual_seed(0)
    kind, size = spec
    nn = torch.nn
    if kind == "cnn":
        first, second = size
        pooled = (IMAGE - 4) // 2
        return nn.Sequential(
            nn.Conv2d(1, first, 3), nn.ReLU(), nn.Conv2d(first, second, 3), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(second * pooled * pooled, 128), nn.ReLU(),
            nn.Linear(128, CLASSES),
        )  # fmt: skip
    layers, width = [], INPUTS
    for _ in range(LAYERS):
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    return nn.Sequential(*layers, nn.Linear(width, 1))


def batch_of(torch, spec: tuple, rank: int) -> tuple:
    """A fixed batch for ``spec``'s model on ``rank``, and its loss function."""
    generator = torch.Generator().manual_seed(rank)
    if spec[0] == "cnn":
        x = torch.randn(BATCH, 1, IMAGE, IMAGE, generator=generator)
        y = torch.randint(0, CLASSES, (BATCH,), generator=generator)
        return x, y, torch.nn.functional.cross_entropy
    x = torch.randn(BATCH, INPUTS, generator=generator)
    y = torch.randn(BATCH, 1, generator=generator)
    return x, y, torch.nn.functional.mse_loss


def describe(spec: tuple) -> str:
    """The model column's text."""
    kind, size = spec
    if kind == "cnn":
        return f"CNN {size[0]},{size[1]} ch"
    return f"MLP {LAYERS} x {size}"


def timed_steps(
    ddp, optimizer, x, y, loss_of, steps: int, warmup: int
) -> tuple[list[float], float, float]:
    """``warmup`` + ``steps`` training steps of ``ddp``; the timed ones' milliseconds, the
    CPU milliseconds the whole process (every thread) took per timed step, and the
    milliseconds per timed step the training thread was asleep (``thread_asleep_ms``)."""
    times, cpu = [], process_cpu()
    asleep = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            cpu = process_cpu()
        scheduled = thread_scheduled()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_of(ddp(x), y)
        loss.backward()
        optimizer.step()
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1000.0)
            asleep += max(0.0, times[-1] - (thread_scheduled() - scheduled))
    return times, (process_cpu() - cpu) * 1000.0 / max(steps, 1), asleep / max(steps, 1)


def thread_scheduled() -> float:
    """The milliseconds this thread has run or waited runnable for a core
    (``/proc/thread-self/schedstat``'s first two fields; 0 where there is none): a step's
    time less this is the time its thread was asleep, waiting for a collective (or the GIL,
    or a lock) rather than computing or waiting for the machine's cores."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            run, runnable, _ = stat.read().split()
    except OSError:
        return 0.0
    return (int(run) + int(runnable)) / 1e6


def process_cpu() -> float:
    """The CPU seconds this process has taken, all its threads, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rank_main(rank, ranks, param, addresses, store, interface, specs, rounds, steps, warmup,
              results) -> None:  # fmt: skip
    """One rank: for each model, ``rounds`` alternating rounds of DDP on our backend and on
    gloo; puts ``(rank, {"threads": torch's intra-op and inter-op threads, "models": [per
    model: {"ours"/"gloo": step times per round, "ours cpu"/"gloo cpu": CPU ms per step per
    round}]})``, or ``(rank, error text)``, on ``results``."""
    try:
        import torch
        import torch.distributed as dist

        from allreduce_param.engine import StaticRendezvous
        from allreduce_param.torch_backend import BACKEND, bind

        torch.set_num_threads(1)  # as many processes as cores: no oversubscription
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        timeout = datetime.timedelta(seconds=TIMEOUT)
        store = dist.TCPStore(*store, ranks, is_master=rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks, timeout=timeout)
        report = {"threads": (torch.get_num_threads(), torch.get_num_interop_threads())}
        models = report["models"] = []
        try:
            rendezvous = StaticRendezvous(rank, addresses, timeout=TIMEOUT)
            with param.connect(rendezvous) as handle, bind(handle):
                ours_group = dist.new_group(backend=BACKEND)
                for spec in specs:
                    x, y, loss_of = batch_of(torch, spec, rank)
                    runs = {}
                    for name, group in (("ours", ours_group), ("gloo", None)):
                        ddp = torch.nn.parallel.DistributedDataParallel(
                            make_model(torch, spec), process_group=group
                        )
                        runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
                    timings = {f"{name}{what}": [] for name in ("ours", "gloo")
                               for what in ("", " cpu", " asleep")}  # fmt: skip
                    for number in range(rounds):
                        order = ("ours", "gloo") if number % 2 == 0 else ("gloo", "ours")
                        for name in order:
                            dist.barrier()
                            ddp, optimizer = runs[name]
                            times, cpu, asleep = timed_steps(
                                ddp, optimizer, x, y, loss_of, steps, warmup
                            )
                            timings[name].append(times)
                            timings[f"{name} cpu"].append(cpu)
                            timings[f"{name} asleep"].append(asleep)
                    models.append(timings)
                dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, report))
    except BaseException as error:  # the parent names it and fails
        results.put((rank, f"{type(error).__name__}: {error}"))


def measure(ranks: int, specs: list[tuple], rounds: int, steps: int, warmup: int,
            hosts=None) -> list:  # fmt: skip
    """The rows of ``ranks`` processes, one per model: per round the median of the slowest
    rank's step, ours and gloo's. ``hosts``: the simulated hosts to spread the ranks over
    (``harness.sim_hosts``), else all on this one."""
    from allreduce_param.torch_backend import process_group_parameter

    param = process_group_parameter(ranks, timeout=TIMEOUT)
    with contextlib.ExitStack() as stack:
        if hosts is None:
            ports = free_ports(ranks + 1)
            addresses = [("127.0.0.1", port) for port in ports[:ranks]]
            store, interface, executables = ("127.0.0.1", ports[-1]), _loopback_interface(), None
        else:
            per_host = -(-ranks // len(hosts))
            placed = [hosts[rank // per_host] for rank in range(ranks)]
            addresses = [(host.address, HOST_PORT + rank) for rank, host in enumerate(placed)]
            store, interface = (placed[0].address, HOST_PORT - 1), "eth0"
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="ddp-hosts-"))
            executables = [_python_on(host, folder) for host in placed]
        args = (ranks, param, addresses, store, interface, specs, rounds, steps, warmup)
        got = spawn_ranks(rank_main, [args] * ranks, TIMEOUT * (1 + len(specs)), executables)
    rows = []
    for index, spec in enumerate(specs):
        row = dict(processes=ranks, hosts=len(hosts or [None]), spec=spec, params=count(spec))
        row["threads"] = got[0]["threads"]
        for name in ("ours", "gloo"):
            reports = [got[rank]["models"][index] for rank in range(ranks)]
            times = np.stack([np.array(report[name]) for report in reports])
            row[name] = [float(x) for x in np.median(times.max(axis=0), axis=1)]
            for what in ("cpu", "asleep"):
                per = np.array([report[f"{name} {what}"] for report in reports])  # ranks x rounds
                row[f"{name} {what}"] = [float(x) for x in per.mean(axis=0)]
        rows.append(row)
    return rows


def _python_on(host, folder: str) -> str:
    """A wrapper of this interpreter that runs it on simulated ``host`` (its namespace)."""
    path = os.path.join(folder, f"python-on-{host.name}")
    if not os.path.exists(path):
        with open(path, "w") as out:
            out.write(
                f'#!/bin/sh\nexec {shlex.join(host.prefix)} {shlex.quote(sys.executable)} "$@"\n'
            )
        os.chmod(path, 0o700)
    return path


def count(spec: tuple) -> int:
    """The model's parameters."""
    import torch

    return sum(p.numel() for p in make_model(torch, spec).parameters())


def sync_floor_ms(row: dict, bandwidth: float, rate_bits: float | None) -> float:
    """The physical floor of the step's allreduce (see the module): the memory traffic on
    one host; across hosts, at least the gradient's bytes through one link at ``rate_bits``."""
    floor = floor_ms(row["params"], row["processes"], bandwidth)
    if row["hosts"] > 1 and rate_bits:
        floor = max(floor, 4 * row["params"] * 8 / rate_bits * 1e3)
    return floor


def table(rows: list[dict], bandwidth: float, rate_bits: float | None = None) -> str:
    """The rows as a markdown table."""
    header = ("N", "hosts", "model", "parameters", "sync floor ms", "ours ms", "gloo ms",
              "x gloo (range)", "ours CPU ms", "gloo CPU ms", "ours asleep ms",
              "gloo asleep ms")  # fmt: skip
    lines = [
        (
            row["processes"],
            row["hosts"],
            describe(row["spec"]),
            f"{row['params']:,}",
            ms_text(sync_floor_ms(row, bandwidth, rate_bits)),
            ms_text(statistics.median(row["ours"])),
            ms_text(statistics.median(row["gloo"])),
            ratio_text(row["ours"], row["gloo"]),
            ms_text(statistics.median(row["ours cpu"])),
            ms_text(statistics.median(row["gloo cpu"])),
            ms_text(statistics.median(row["ours asleep"])),
            ms_text(statistics.median(row["gloo asleep"])),
        )
        for row in rows
    ]
    return render(header, lines)


def run(counts: list[int], specs: list[tuple], rounds: int, steps: int, warmup: int,
        hosts: int = 1, rate: str | None = None) -> list:  # fmt: skip
    """Measure every process count and model, print the table; the rows. With ``hosts`` >
    1, on that many simulated hosts, their links limited to ``rate`` (as tc writes it)."""
    bandwidth = copy_bandwidth()
    print(f"machine: {machine()}")
    print(
        f"single-core copy bandwidth: {bandwidth / 1e9:.1f} GB/s (np.copyto of 40 MB, median of 5)"
    )
    print(f"load average at the start: {load_text()}")
    where = (
        "on 127.0.0.1"
        if hosts == 1
        else f"on {hosts} simulated hosts (network namespaces, links limited to {rate or 'no rate'} "
        "each way), the ranks spread evenly"
    )
    print(
        f"plain processes (no Spark) {where}, one torch thread each; DDP (batch {BATCH}, SGD) "
        f"on the allreduce_param backend and on gloo; {rounds} rounds alternating the two, "
        f"each the median of {steps} steps after {warmup} warm-up, the slowest rank's step",
        flush=True,
    )
    with _simulated(hosts, rate) as made:
        rows = [
            row for ranks in counts for row in measure(ranks, specs, rounds, steps, warmup, made)
        ]
    intra, inter = rows[0]["threads"]
    print(
        f"torch threads in each rank: {intra} intra-op, {inter} inter-op (one process holds "
        "both groups, so both run with these)"
    )
    print(table(rows, bandwidth, _rate_bits(rate)))
    print(f"load average at the end: {load_text()}", flush=True)
    return rows


@contextlib.contextmanager
def _simulated(hosts: int, rate: str | None):
    """``hosts`` simulated hosts (their list), or None for this one."""
    if hosts == 1:
        yield None
        return
    try:
        import pytest
        from harness.sim_hosts import simulated_hosts
    except ImportError as missing:
        raise SystemExit(
            f"error: --hosts {hosts} makes its hosts with jobs/harness/sim_hosts.py (shared with "
            f"the tests), which needs pytest: {missing}"
        ) from missing
    try:
        with simulated_hosts(hosts, rate) as made:
            yield made.hosts
    except pytest.skip.Exception as why:  # no root, no namespaces: said, not a traceback
        raise SystemExit(f"error: cannot make {hosts} simulated hosts here: {why}") from None


def _rate_bits(rate: str | None) -> float | None:
    """``rate`` as tc writes it (``1gbit``) in bits per second."""
    if not rate:
        return None
    from benchkit.hosts import rate_bits

    return rate_bits(rate)
