"""How much memory a sync holds on one host: N plain processes, each process's share.

``bench_allreduce.py --processes 2,4 --memory --sizes 200M`` runs this (``python
jobs/bench_processes.py --memory`` too): for each N and size, N spawned processes (as
``benchkit.ranks`` starts them: ``StaticRendezvous`` on 127.0.0.1, so one host: Unix
sockets and shared memory) take ``--steps`` steps of the README's loop, once through the host
arena (``host_arena=True``, the default) and once through blocks (``host_arena=False``);
``--memory arena`` takes the first alone (blocks hold about four vectors a partition).
The harness adds no vector of its own: it computes the gradient into
``p.gradient_buffer()`` and calls ``init`` with the partition's own slice (S/N, freed at
once), so what a process holds beyond its start is the engine's (and the README's update
temporary, ``0.1 * g``, S/N while it runs).

After the last step, with every process still connected, each reads its own
``/proc/self/smaps_rollup``: ``Pss`` (each shared page divided among the processes that
map it, so the processes' Pss add up to the host's memory), its shared-memory part
(``Pss_Shmem``: the memfds) and its private arrays' (``Pss_Anon``), ``Rss`` and its shared part,
and ``VmHWM`` (the peak Rss, transient arrays included) from ``/proc/self/status``; and the
bytes allocated to every shared-memory file (memfd) it holds open, counted once per file
across the host. The table gives each in units of one vector (4 x size bytes) against the
target: the weight vector once per host and one gradient vector per partition, 1 + N.

    python jobs/bench_allreduce.py --processes 2 --memory --sizes 200M --steps 3
    python jobs/bench_allreduce.py --processes 4 --memory arena --sizes 200M --steps 3
"""

from __future__ import annotations

import os

import numpy as np

from allreduce_param.engine import AllReduceParameter, StaticRendezvous
from benchkit.machine import copy_bandwidth, machine
from benchkit.ranks import TIMEOUT, free_ports, load_text, run_ranks
from benchkit.tables import label, render

#: The smaps_rollup fields kept, in kB there.
FIELDS = (
    "Rss",
    "Pss",
    "Pss_Anon",
    "Pss_Shmem",
    "Shared_Clean",
    "Shared_Dirty",
    "Private_Clean",
    "Private_Dirty",
)
#: The ways a step can go (``--memory arena,blocks``): the table's name, ``host_arena``.
WAYS = {"arena": ("host arena", True), "blocks": ("blocks", False)}


def parse_ways(text: str) -> list[str]:
    """``'arena,blocks'`` -> ``['arena', 'blocks']``, each known."""
    ways = text.split(",")
    if not ways or set(ways) - set(WAYS):
        raise SystemExit(f"--memory {text!r}: write ways of {', '.join(WAYS)}, e.g. arena,blocks")
    return ways


def rollup() -> dict[str, int]:
    """This process's memory, in bytes: ``FIELDS`` from smaps_rollup and ``VmHWM``."""
    got = {}
    with open("/proc/self/smaps_rollup") as lines:
        for line in lines:
            name, _, value = line.partition(":")
            if name in FIELDS:
                got[name] = int(value.split()[0]) * 1024
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith("VmHWM:"):
                got["VmHWM"] = int(line.split()[1]) * 1024
    return got


def memfds() -> dict[int, int]:
    """The memfds this process holds open: inode -> bytes allocated to it."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:"):
                continue
            status = os.fstat(int(name))
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        found[status.st_ino] = status.st_blocks * 512
    return found


def memory_rank(rank, ranks, param, addresses, steps, results) -> None:
    """One process: ``steps`` steps of the README's loop at ``param``, then its memory,
    read while every process is still connected; puts ``(rank, report)`` or
    ``(rank, error text)`` on ``results``."""
    try:
        start = rollup()
        with param.connect(StaticRendezvous(rank, addresses, timeout=TIMEOUT)) as p:
            rng = np.random.default_rng(rank)
            p.init(rng.standard_normal(p.info.slice_length, dtype=np.float32) * np.float32(1e-3))
            gradient = p.gradient_buffer()
            rng.standard_normal(dtype=np.float32, out=gradient)  # computed into the buffer
            for _ in range(steps):
                w = p.get_weights()
                p.put_gradients(gradient, count=1.0)
                g = p.aggregate_gradient_partition()
                p.weight_partition[:] -= 0.1 * g
                p.send_weight_partition()
            del w, g
            p.collectives.allreduce_exact(np.zeros(1))  # every process has taken its steps
            report = dict(start=start, end=rollup(), memfds=memfds(), arena=p.info.host_arena)
            p.collectives.allreduce_exact(np.zeros(1))  # and read its memory: now close
        results.put((rank, report))
    except BaseException as error:  # the parent names it and fails
        results.put((rank, f"{type(error).__name__}: {error}"))


def measure(ranks: int, size: int, steps: int, arena: bool) -> dict:
    """One row: ``ranks`` processes at ``size`` through the arena or blocks."""
    import multiprocessing

    ports = free_ports(ranks)
    addresses = [("127.0.0.1", port) for port in ports]
    param = AllReduceParameter(ranks, size, codec="raw", timeout=TIMEOUT, host_arena=arena)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(
            target=memory_rank,
            args=(rank, ranks, param, addresses, steps, results),
            name=f"bench-memory-rank-{rank}",
        )
        for rank in range(ranks)
    ]
    got = run_ranks(processes, results, TIMEOUT * 2)
    return dict(partitions=ranks, size=size, reports=[got[rank] for rank in range(ranks)])


def vectors(nbytes: float, size: int) -> str:
    """``nbytes`` in vectors of ``size`` float32, as the table shows them."""
    return f"{nbytes / (4 * size):.2f}"


def table(rows: list[dict]) -> str:
    """A line per process, then the host's: in vectors of 4 x size bytes."""
    header = ("N", "size", "way", "process", "start Pss MB", "Pss", "Pss shmem", "Pss anon",
              "Rss", "shared", "private", "peak Rss", "Pss - start", "memfd",
              "target 1 + N")  # fmt: skip
    lines = []
    for row in rows:
        size, ranks = row["size"], row["partitions"]
        shown, way = label(size), row["way"]
        totals = dict.fromkeys(("start", "Pss", "Pss_Shmem", "Pss_Anon", "Rss", "shared",
                                "private", "VmHWM"), 0)  # fmt: skip
        files: dict[int, int] = {}
        for rank, report in enumerate(row["reports"]):
            end = report["end"]
            shared = end["Shared_Clean"] + end["Shared_Dirty"]
            private = end["Private_Clean"] + end["Private_Dirty"]
            grown = end["Pss"] - report["start"]["Pss"]
            files.update(report["memfds"])
            mine = sum(report["memfds"].values())
            for key, value in (("start", report["start"]["Pss"]), ("Pss", end["Pss"]),
                               ("Pss_Shmem", end["Pss_Shmem"]), ("Pss_Anon", end["Pss_Anon"]),
                               ("Rss", end["Rss"]), ("shared", shared), ("private", private),
                               ("VmHWM", end["VmHWM"])):  # fmt: skip
                totals[key] += value
            lines.append((ranks, shown, way, f"rank {rank}",
                          f"{report['start']['Pss'] / 2**20:.0f}",
                          *(vectors(x, size) for x in (end["Pss"], end["Pss_Shmem"],
                                                         end["Pss_Anon"], end["Rss"], shared,
                                                         private, end["VmHWM"], grown, mine)),
                          ""))  # fmt: skip
        lines.append((ranks, shown, way, "host (sum; memfds once)",
                      f"{totals['start'] / 2**20:.0f}",
                      *(vectors(totals[key], size)
                        for key in ("Pss", "Pss_Shmem", "Pss_Anon", "Rss", "shared",
                                    "private", "VmHWM")),
                      vectors(totals["Pss"] - totals["start"], size),
                      vectors(sum(files.values()), size), str(1 + ranks)))  # fmt: skip
    return render(header, lines, left=4)


def run_sizes(processes: list[int], sizes: list[int], steps: int, ways=tuple(WAYS)) -> list[dict]:
    """Measure every N and size each of ``ways`` and print the table; the rows."""
    bandwidth = copy_bandwidth()
    print(f"machine: {machine()}")
    print(
        f"single-core copy bandwidth: {bandwidth / 1e9:.1f} GB/s (np.copyto of 40 MB, median of 5)"
    )
    print(f"load average at the start: {load_text()}")
    print(
        "plain processes (no Spark) on 127.0.0.1, StaticRendezvous, raw codec, the README's loop "
        f"with the gradient computed into p.gradient_buffer(), {steps} steps; each process's "
        "/proc/self/smaps_rollup after them, every process still connected; in vectors of "
        "4 x size bytes (start Pss in MB: the process before connect); memfd: the bytes "
        "allocated to the shared-memory files it holds open (the host's: each file once)",
        flush=True,
    )
    rows = []
    for ranks in processes:
        for size in sizes:
            for way, arena in (WAYS[name] for name in ways):
                row = measure(ranks, size, steps, arena)
                if row["reports"][0]["arena"] != arena:
                    way += " (no arena here: blocks)"
                rows.append(dict(row, way=way))
    print(table(rows))
    print(f"load average at the end: {load_text()}", flush=True)
    return rows
