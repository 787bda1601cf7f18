"""The memory a linear fit takes, sampled while it runs: the driver JVM's RSS (in local
mode the JVM is the executor too), its heap in use, and the Python workers' RSS, summed."""

from __future__ import annotations

import threading

from benchkit.sparse_runs import _rss_bytes, python_workers


class MemoryWatcher:
    """In a background thread, every ``interval`` s: the peaks of the driver JVM's VmRSS
    (/proc), of its heap in use (``Runtime.totalMemory - freeMemory`` over py4j) and of the
    summed VmRSS of the Python workers under it (re-listed every 0.5 s)."""

    def __init__(self, spark, jvm_pid: int, interval: float = 0.1) -> None:
        self.jvm_pid, self.interval = jvm_pid, interval
        self._runtime = spark.sparkContext._jvm.java.lang.Runtime.getRuntime()
        self.jvm_peak = self.heap_peak = self.workers_peak = 0
        self._workers: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="linear-watcher", daemon=True)

    def __enter__(self) -> MemoryWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(refresh=True)

    def _run(self) -> None:
        ticks = 0
        while not self._stop.is_set():
            self._sample(refresh=ticks % max(int(0.5 / self.interval), 1) == 0)
            ticks += 1
            self._stop.wait(self.interval)

    def _sample(self, refresh: bool) -> None:
        if refresh:
            self._workers = python_workers(self.jvm_pid)
        self.jvm_peak = max(self.jvm_peak, _rss_bytes(self.jvm_pid))
        self.workers_peak = max(self.workers_peak, sum(map(_rss_bytes, self._workers)))
        try:
            used = self._runtime.totalMemory() - self._runtime.freeMemory()
            self.heap_peak = max(self.heap_peak, int(used))
        except Exception:  # the JVM gone (MLlib's out of memory): the peaks so far stand
            pass
