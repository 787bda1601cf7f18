"""Shared test set-up: loopback only, the project's Spark settings, and partition groups.

Engine tests run N partitions as N threads of this process (real sockets on 127.0.0.1,
``LocalRendezvous``); Spark tests use one session per module (the ``spark`` fixture:
``local[4]``, or the module's ``SPARK_MASTER`` and ``SPARK_SETTINGS``), stopped at its end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from allreduce_param import AllReduceParameter, LocalRendezvous, Rendezvous
from allreduce_param.spark.session import java_problem, prepare_local_environment

#: the job files (digits.toml, synthetic.toml)
JOB_FILES = Path(__file__).resolve().parents[1] / "conf"
#: the Spark settings for this machine (loopback addresses) that the tests start Spark with
CONF_DIR = JOB_FILES / "local"
prepare_local_environment()


@pytest.fixture(scope="module")
def spark(request):
    """The module's SparkSession: ``local[4]`` unless the module sets ``SPARK_MASTER``, with its
    ``SPARK_SETTINGS``; stopped when the module's tests are done."""
    from allreduce_param.spark.session import local_spark

    master = getattr(request.module, "SPARK_MASTER", "local[4]")
    session = local_spark(
        master,
        f"allreduce-param {request.module.__name__}",
        CONF_DIR,
        **getattr(request.module, "SPARK_SETTINGS", {}),
    )
    yield session
    session.stop()


def pytest_sessionstart(session):
    problem = java_problem()
    if problem:
        pytest.exit(problem, returncode=3)


def run_partitions(
    param: AllReduceParameter,
    body: Callable,
    timeout: float = 120.0,
    hosts: list[list[int]] | None = None,
) -> list:
    """Run ``body(p)`` on every partition of ``param``, one thread each; their results.

    ``p`` is the partition's connected handle, opened and closed here. Each result is the
    body's return value, or the exception it raised (for tests of failures). ``hosts``
    places the partitions on hosts (lists of partition ids): the meeting tells each
    partition the others' scopes as if each list were a machine of its own, so peers of
    one list meet over Unix sockets and shared memory and the others over TCP on
    127.0.0.1, as on several hosts (the real thing, namespaces, is ``test_sim_hosts``).
    """
    group = LocalRendezvous(param.partition_num)
    results: list = [None] * param.partition_num
    scope_of = {
        p: f"test-host-{index}" for index, members in enumerate(hosts or []) for p in members
    }

    def partition(partition_id: int) -> None:
        member = group.member(partition_id)
        try:
            with param.connect(_Placed(member, scope_of) if hosts else member) as p:
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


class _Placed(Rendezvous):
    """A ``LocalRendezvous`` member whose meeting gives every partition the scope of the
    host ``scope_of`` places it on (``run_partitions(hosts=...)``)."""

    def __init__(self, member: Rendezvous, scope_of: dict[int, str]) -> None:
        self._member, self._scope_of = member, scope_of
        self.partition_id, self.partition_num = member.partition_id, member.partition_num

    def bind_address(self):
        return self._member.bind_address()

    def exchange(self, address):
        return [
            (*peer[:4], self._scope_of[index] if peer[3] else None)
            for index, peer in enumerate(self._member.exchange(address))
        ]


def train_on_threads(job, parts: list) -> list:
    """``train_partition(job, X, y, split, weight)`` for each ``(X, y)``, ``(X, y, split)``
    or ``(X, y, split, weight)`` of ``parts``, one thread each (named ``partition-<i>``);
    without ``split`` all rows train, without ``weight`` each counts once. Each partition's
    records by kind, or its error."""
    import numpy as np

    from allreduce_param.train.task.worker import train_partition

    group = LocalRendezvous(len(parts))
    outputs: list = [None] * len(parts)

    def run(i):
        X, y, *rest = parts[i]
        split = rest[0] if rest else np.zeros(len(X), np.int32)
        weight = rest[1] if len(rest) > 1 else None
        try:
            outputs[i] = dict(train_partition(job, X, y, split, weight, rendezvous=group.member(i)))
        except BaseException as error:  # the test inspects it
            outputs[i] = error

    threads = [
        threading.Thread(target=run, args=(i,), name=f"partition-{i}") for i in range(len(parts))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a partition is still training after 120 s"
    return outputs


def blobs(rows: int, features: int, classes: int, seed: int):
    """A classification problem: Gaussian blobs around random centres; (X float32, y float64)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, rows)
    centres = rng.standard_normal((classes, features)).astype(np.float32) * 3
    return (
        centres[labels] + rng.standard_normal((rows, features)).astype(np.float32)
    ), labels.astype(np.float64)


def raise_first(results: list) -> list:
    """``results`` when no partition failed; otherwise re-raise the first failure."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
