"""Plain processes as ranks, without Spark: spawned, their reports collected, each one joined
or killed (``bench_processes.py``, ``bench_torch_backend.py``, ``bench_gpu.py``;
``process_memory``). A rank may start in another network namespace (a simulated host):
its interpreter is then a wrapper that enters the namespace first."""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable, Sequence

#: How long a rank waits for its peers (meeting, gloo's store, one step), in seconds.
TIMEOUT = 300.0


def spawn_ranks(
    target: Callable[..., None],
    rank_args: Sequence[tuple],
    timeout: float,
    executables: Sequence[str] | None = None,
) -> dict:
    """Spawn one process per entry of ``rank_args``: rank r runs
    ``target(r, *rank_args[r], results)`` and puts ``(r, report)`` on ``results``; the
    reports by rank (see ``run_ranks``). ``executables``: the Python each rank starts with
    (a wrapper that enters a simulated host's namespace), else this one."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()  # made first: its resource tracker runs on this interpreter
    processes = [
        context.Process(target=target, args=(rank, *args, results), name=f"bench-rank-{rank}")
        for rank, args in enumerate(rank_args)
    ]
    return run_ranks(processes, results, timeout, executables)


def run_ranks(processes: list, results, timeout: float, executables=None) -> dict:
    """Start the rank ``processes`` and collect each one's report from ``results`` (a queue
    of ``(rank, report)``; a string report is that rank's error, which ends the benchmark
    naming it); every process is joined, or killed, before this returns. ``executables``:
    the interpreter each process starts with (spawned processes only), else this one."""
    from multiprocessing import spawn

    default = spawn.get_executable()
    try:
        for index, process in enumerate(processes):
            if executables is not None:
                spawn.set_executable(executables[index])  # read as the process starts
            process.start()
        spawn.set_executable(default)
        got = {}
        for _ in processes:
            rank, report = results.get(timeout=timeout)
            if isinstance(report, str):
                raise SystemExit(f"error: rank {rank} of {len(processes)} failed: {report}")
            got[rank] = report
        return got
    finally:
        spawn.set_executable(default)
        for process in processes:
            if process.pid is None:  # never started
                continue
            process.join(60)
            if process.is_alive():
                process.kill()
                process.join()


def free_ports(count: int) -> list[int]:
    """Ports the kernel just handed out on 127.0.0.1; the ranks bind them again at once."""
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    try:
        return [each.getsockname()[1] for each in sockets]
    finally:
        for each in sockets:
            each.close()


def load_text() -> str:
    """The load averages (1, 5, 15 minutes): the machine may be shared."""
    return ", ".join(f"{value:.1f}" for value in os.getloadavg())
