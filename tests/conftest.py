"""Shared test set-up: loopback only, the project's Spark settings, and partition groups.

Engine tests run N partitions as N threads of this process (real sockets on 127.0.0.1,
``LocalRendezvous``); Spark tests use one session per module, stopped at its end.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import pytest

from allreduce_param import AllReduceParameter, LocalRendezvous
from allreduce_param.session import java_problem, prepare_local_environment

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
prepare_local_environment(CONF_DIR)


def pytest_sessionstart(session):
    problem = java_problem()
    if problem:
        pytest.exit(problem, returncode=3)


def run_partitions(param: AllReduceParameter, body: Callable, timeout: float = 120.0) -> list:
    """Run ``body(p)`` on every partition of ``param``, one thread each; their results.

    ``p`` is the partition's connected handle, opened and closed here. Each result is the
    body's return value, or the exception it raised (for tests of failures).
    """
    group = LocalRendezvous(param.partition_num)
    results: list = [None] * param.partition_num

    def partition(partition_id: int) -> None:
        try:
            with param.connect(group.member(partition_id)) as p:
                results[partition_id] = body(p)
        except BaseException as error:  # the test inspects it
            results[partition_id] = error

    threads = [threading.Thread(target=partition, args=(i,)) for i in range(param.partition_num)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), f"a partition is still running after {timeout} s"
    return results


def raise_first(results: list) -> list:
    """``results`` when no partition failed; otherwise re-raise the first failure."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
