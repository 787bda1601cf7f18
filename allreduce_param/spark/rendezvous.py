"""How the tasks of a Spark barrier stage meet: the engine's ``Rendezvous`` inside Spark.

``BarrierRendezvous`` uses one ``BarrierTaskContext.allGather``, which waits for the JVM's
barrier coordinator (it polls on a fixed period, so it costs a noticeable fixed time per
stage). ``DriverRendezvous`` meets at the driver's ``MeetingPoint`` instead, as soon as the
last task arrives, and falls back to ``allGather`` when the driver cannot be reached.
"""

from __future__ import annotations

import json
import logging

from allreduce_param.engine.movement.rendezvous import (
    DEFAULT_PATIENCE,
    Address,
    Rendezvous,
    by_partition,
)
from allreduce_param.engine.wire.messages import MessageClient
from allreduce_param.errors import AllReduceError, PeerLostError, UsageError

log = logging.getLogger(__name__)


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
        """One ``allGather`` of every task's address (once per connect)."""
        message = json.dumps({"partition": self.partition_id, "address": list(address)})
        replies = [json.loads(reply) for reply in self._context.allGather(message)]
        return by_partition(
            {reply["partition"]: reply["address"] for reply in replies}, self.partition_num
        )


class DriverRendezvous(BarrierRendezvous):
    """The tasks of a barrier stage meet at the driver's ``MeetingPoint``, reached through
    ``link``, instead of waiting for ``allGather``'s coordinator; when the driver cannot be
    reached, or the meeting point says so, through ``allGather`` after all.

    Must be made inside a task of ``rdd.barrier().mapPartitions(...)``.
    """

    def __init__(self, link: MessageClient, patience: float = DEFAULT_PATIENCE) -> None:
        super().__init__()
        self._link = link
        self._patience = patience

    def exchange(self, address: Address) -> list[Address]:
        """Every task's address, from the meeting point (or ``allGather``)."""
        try:
            self._link.send(
                {
                    "kind": "meet",
                    "stage": self._context.stageId(),
                    "task": self._context.taskAttemptId(),
                    "partition": self.partition_id,
                    "address": list(address),
                }
            )
        except (OSError, AllReduceError) as error:
            log.warning(
                "partition %d cannot reach the driver at %s:%s (%s); meeting through allGather",
                self.partition_id,
                *self._link.address[:2],
                error,
            )
            return super().exchange(address)
        try:
            # the meeting point decides within its patience of the first task, which was no later than
            # this one; as much again covers a driver slow to answer
            answer = self._link.receive(timeout=2 * self._patience)
        except (OSError, AllReduceError) as error:
            raise UsageError(
                f"partition {self.partition_id} lost the driver at {self._link.address[0]}:{self._link.address[1]} "
                f"while meeting its peers there ({type(error).__name__}: {error})"
            ) from error
        if answer.get("kind") == "met":
            return by_partition(answer["addresses"], self.partition_num)
        if answer.get("kind") == "ended":
            raise PeerLostError(
                f"partition {self.partition_id} stops while meeting its peers: the fit ended on "
                "the driver (another task of the stage failed; its error is the fit's)"
            )
        return super().exchange(address)
