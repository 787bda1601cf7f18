"""Plain processes as ranks, without Spark: started, their reports collected, each one joined
or killed (``bench_processes.py``, ``bench_gpu.py``; ``process_memory``)."""

from __future__ import annotations

import os
import socket

#: How long a rank waits for its peers (meeting, gloo's store, one step), in seconds.
TIMEOUT = 300.0


def run_ranks(processes: list, results, timeout: float) -> dict:
    """Start the rank ``processes`` and collect each one's report from ``results`` (a queue
    of ``(rank, report)``; a string report is that rank's error, which ends the benchmark
    naming it); every process is joined, or killed, before this returns."""
    for process in processes:
        process.start()
    try:
        got = {}
        for _ in processes:
            rank, report = results.get(timeout=timeout)
            if isinstance(report, str):
                raise SystemExit(f"error: rank {rank} of {len(processes)} failed: {report}")
            got[rank] = report
        return got
    finally:
        for process in processes:
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
