"""Facts about the machine a table was measured on: its hardware and software, the memory
bandwidth one core copies at, the task slots of a local master, and its Spark settings."""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from pathlib import Path

import numpy as np

#: the Spark settings for this machine (loopback addresses) that the benchmarks start Spark with
CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "local"


def machine() -> str:
    """The machine in one line: architecture, cores, memory, OS, Python and PySpark."""
    try:
        with open("/proc/meminfo") as info:
            memory = f"{int(info.readline().split()[1]) / 2**20:.0f} GiB"
    except OSError:
        memory = "? GiB"
    import pyspark

    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {memory}, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, PySpark {pyspark.__version__}"
    )


def copy_bandwidth(megabytes: int = 40, repeats: int = 5) -> float:
    """Bytes per second that ``np.copyto`` moves between two arrays of ``megabytes`` MB:
    the median of ``repeats`` copies, after one that takes the pages."""
    source = np.ones(megabytes * 1_000_000 // 4, np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)  # page faults out of the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return source.nbytes / statistics.median(times)


def local_slots(master: str) -> int:
    """How many tasks run at once on a local master: local[4] -> 4, local[*] -> the cores."""
    found = re.fullmatch(
        r"local\[(\d+|\*)(?:,\d+)?\]|local-cluster\[(\d+),(\d+),\d+\]|local", master
    )
    if not found:
        raise SystemExit(f"cannot tell the task slots of master {master!r}: pass --partitions")
    if found.group(2):
        return int(found.group(2)) * int(found.group(3))
    if found.group(1) and found.group(1) != "*":
        return int(found.group(1))
    return 1 if master == "local" else os.cpu_count() or 1
