"""How the partitions of one stage learn each other's server addresses, once per connect().

Inside Spark, ``BarrierRendezvous`` uses one ``BarrierTaskContext.allGather`` (about a
second, so it runs once per stage, never per step). Outside Spark, ``StaticRendezvous``
takes a fixed list of addresses (N plain processes, each told its id) and
``LocalRendezvous`` lets N threads of one process meet, for tests and benchmarks.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from abc import ABC, abstractmethod
from typing import Sequence

from .errors import ConfigurationError, UsageError

#: Where a partition's block server listens: ``(host, port)``, or ``(host, port, local_name,
#: local_scope)`` when it also serves on an abstract Unix socket, for peers of the same scope.
Address = tuple


class Rendezvous(ABC):
    """One partition's view of the meeting: who it is, where to serve, and the peers' addresses."""

    partition_id: int
    partition_num: int

    @abstractmethod
    def bind_address(self) -> Address:
        """Where this partition's block server listens: its own host, port 0 for any free one."""

    @abstractmethod
    def exchange(self, address: Address) -> list[Address]:
        """Share this partition's server address; every partition's address, by partition id."""


class BarrierRendezvous(Rendezvous):
    """The partitions of a Spark barrier stage meet through ``BarrierTaskContext.allGather``.

    Must be made inside a task of ``rdd.barrier().mapPartitions(...)``.
    """

    def __init__(self) -> None:
        from pyspark import BarrierTaskContext

        try:
            context = BarrierTaskContext.get()
        except Exception as error:  # PySpark raises a bare RuntimeError outside barrier stages
            raise UsageError(
                "AllReduceParameter.connect() must run inside a barrier stage: "
                "rdd.barrier().mapPartitions(task); this task is not in one "
                f"({error})"
            ) from error
        if context is None:
            raise UsageError(
                "AllReduceParameter.connect() must run inside a Spark task of "
                "rdd.barrier().mapPartitions(task); there is no task context here"
            )
        self._context = context
        self.partition_id = context.partitionId()
        self.partition_num = len(context.getTaskInfos())

    def bind_address(self) -> Address:
        """The executor's own host (from Spark's task infos), any free port."""
        own = self._context.getTaskInfos()[self.partition_id].address
        host = own.rsplit(":", 1)[0]
        return host, 0

    def exchange(self, address: Address) -> list[Address]:
        """One ``allGather`` of every task's address (about a second, once per connect)."""
        message = json.dumps({"partition": self.partition_id, "address": list(address)})
        replies = [json.loads(reply) for reply in self._context.allGather(message)]
        replies.sort(key=lambda reply: reply["partition"])
        found = [reply["partition"] for reply in replies]
        if found != list(range(self.partition_num)):
            raise UsageError(f"the barrier stage's tasks reported partitions {found}, expected 0..{self.partition_num - 1}")
        return [tuple(reply["address"]) for reply in replies]


class StaticRendezvous(Rendezvous):
    """A fixed address list: partition ``i`` serves on ``addresses[i]``.

    For N plain processes (or hosts) that are each told their id and the whole list. The
    processes start at different moments, so ``exchange`` waits, up to ``timeout`` seconds,
    until every peer accepts connections.
    """

    def __init__(self, partition_id: int, addresses: Sequence[Address], timeout: float = 60.0) -> None:
        if not 0 <= partition_id < len(addresses):
            raise ConfigurationError(
                f"partition_id {partition_id} is outside the {len(addresses)} addresses given"
            )
        self.partition_id = partition_id
        self.partition_num = len(addresses)
        self._addresses = [(str(host), int(port)) for host, port in addresses]
        self._timeout = timeout

    def bind_address(self) -> Address:
        """This partition's entry of the list."""
        return self._addresses[self.partition_id]

    def exchange(self, address: Address) -> list[Address]:
        """The list, once every peer accepts connections (waiting up to the timeout)."""
        deadline = time.monotonic() + self._timeout
        for peer, peer_address in enumerate(self._addresses):
            if peer != self.partition_id:
                self._wait_until_serving(peer, peer_address, deadline)
        return list(self._addresses)

    def _wait_until_serving(self, peer: int, address: Address, deadline: float) -> None:
        delay = 0.01
        while True:
            try:
                with socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic())):
                    return
            except OSError as error:
                if time.monotonic() + delay > deadline:
                    raise UsageError(
                        f"partition {peer} at {address[0]}:{address[1]} did not start serving within "
                        f"{self._timeout:g} s ({error}): start all {self.partition_num} processes "
                        "with the same address list"
                    ) from error
                time.sleep(delay)  # the peer process is still starting: poll with backoff
                delay = min(2 * delay, 0.5)


class LocalRendezvous:
    """N threads of one process meet here; ``member(i)`` is partition i's ``Rendezvous``.

    Binds to 127.0.0.1. Meant for tests and benchmarks that run the engine without Spark.
    """

    def __init__(self, partition_num: int, timeout: float = 60.0) -> None:
        self.partition_num = partition_num
        self._timeout = timeout
        self._addresses: list[Address | None] = [None] * partition_num
        self._barrier = threading.Barrier(partition_num)

    def member(self, partition_id: int) -> Rendezvous:
        """Partition ``partition_id``'s side of the meeting."""
        if not 0 <= partition_id < self.partition_num:
            raise ConfigurationError(f"partition_id {partition_id} is outside 0..{self.partition_num - 1}")
        return _LocalMember(self, partition_id)

    def _exchange(self, partition_id: int, address: Address) -> list[Address]:
        self._addresses[partition_id] = address
        try:
            self._barrier.wait(self._timeout)
        except threading.BrokenBarrierError as error:
            raise UsageError(
                f"partition {partition_id} waited {self._timeout:g} s at the rendezvous, "
                f"but not all {self.partition_num} partitions came"
            ) from error
        return [address for address in self._addresses if address is not None]


class _LocalMember(Rendezvous):
    def __init__(self, group: LocalRendezvous, partition_id: int) -> None:
        self._group = group
        self.partition_id = partition_id
        self.partition_num = group.partition_num

    def bind_address(self) -> Address:
        return "127.0.0.1", 0

    def exchange(self, address: Address) -> list[Address]:
        return self._group._exchange(self.partition_id, address)
