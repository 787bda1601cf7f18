"""How the partitions of one stage learn each other's server addresses, once per connect().

Inside Spark, the Spark layer's ``BarrierRendezvous`` (``allreduce_param.spark.rendezvous``)
uses one ``BarrierTaskContext.allGather``, and its ``DriverRendezvous`` meets at the
``MeetingPoint`` below, on the driver, as soon as the last task arrives. Outside Spark,
``StaticRendezvous`` takes a fixed list of addresses (N plain processes, each told its id)
and ``LocalRendezvous`` lets N threads of one process meet, for tests and benchmarks.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from allreduce_param.engine.wire.messages import Reply
from allreduce_param.engine.wire.settings import NetworkSettings
from allreduce_param.errors import ConfigurationError, UsageError

#: How long the tasks at a MeetingPoint wait, after the first came, for the last before
#: they all meet through ``allGather`` instead, unless told: ``NetworkSettings.meeting_patience``.
DEFAULT_PATIENCE = NetworkSettings().meeting_patience

#: The longest pause (seconds) between looks at a peer process that does not serve yet:
#: it starts serving at most this long before it is found, for at most 20 refused
#: connections a second (cheap: nothing listens there yet).
SERVING_LOOK = 0.05

log = logging.getLogger(__name__)

#: Where a partition's block server listens: ``(host, port)``, or as the server advertises
#: itself ``(host, port, fingerprint, local_name, local_scope)`` (``wire.blocks.parse_address``):
#: its secret's fingerprint, and its abstract Unix socket for peers of the same scope.
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


def by_partition(addresses: dict, partition_num: int) -> list[Address]:
    """The addresses in partition order, once each partition 0..N-1 gave one."""
    addresses = {int(partition): address for partition, address in addresses.items()}
    found = sorted(addresses)
    if found != list(range(partition_num)):
        raise UsageError(
            f"the barrier stage's tasks reported partitions {found}, expected 0..{partition_num - 1}"
        )
    return [tuple(addresses[partition]) for partition in range(partition_num)]


@dataclass
class _Meeting:
    """One stage's meeting at a ``MeetingPoint``: each partition's address and the task that
    gave it, the replies owed, until ``decided`` says ``"met"``, ``"allgather"`` or
    ``"ended"``."""

    addresses: dict[int, list] = field(default_factory=dict)
    tasks: dict[int, int] = field(default_factory=dict)
    replies: list[Reply] = field(default_factory=list)
    decided: str | None = None
    timer: threading.Timer | None = None


class MeetingPoint:
    """The driver's side of ``DriverRendezvous``: answers every task of a stage attempt with
    all N addresses as soon as the N-th arrives.

    If the N-th has not come ``patience`` seconds after the first (a task that cannot reach
    the driver, or one that started very late), it tells those that came, and any that come
    after, to meet through ``allGather`` instead, where the others already are. Feed it the
    messages of a ``messages.MessageServer``: ``on_message`` takes those of kind ``meet``.
    It never waits on the caller's thread: a task's answer is sent when its meeting is
    decided, by the message that decides it or, at the patience's end, by a timer's thread
    (one per open meeting).
    """

    def __init__(
        self,
        partition_num: int,
        patience: float = DEFAULT_PATIENCE,
        on_met: Callable[[dict[int, list]], None] | None = None,
    ) -> None:
        self.partition_num = partition_num
        self.patience = patience
        self._on_met = on_met
        self._meetings: dict[int, _Meeting] = {}  # by stage id: the newest meeting of each
        self._lock = threading.Lock()
        self._ended: set = set()  # the stages whose runs end() ended

    def on_message(self, message: dict, reply: Reply) -> bool:
        """Take a ``meet`` message, to be answered through ``reply`` once its meeting is
        decided; False for other kinds.

        A stage's meeting is open until decided; a ``meet`` after that is a retried stage's
        (Spark keeps the stage id), which opens the next. A partition that comes twice to an
        open meeting counts with its newer task (the larger task attempt id).
        """
        if message.get("kind") != "meet":
            return False
        stage, partition, task = (
            message.get("stage"),
            int(message["partition"]),
            int(message.get("task", 0)),
        )
        with self._lock:
            if stage in self._ended:
                meeting = None
            else:
                meeting = self._meetings.get(stage)
                if meeting is None or meeting.decided is not None:
                    meeting = self._meetings[stage] = _Meeting()
                    meeting.timer = threading.Timer(self.patience, self._give_up, args=(meeting,))
                    meeting.timer.daemon = True
                    meeting.timer.start()
                if task >= meeting.tasks.get(partition, -1):
                    meeting.addresses[partition], meeting.tasks[partition] = (
                        message["address"],
                        task,
                    )
                meeting.replies.append(reply)
                if len(meeting.addresses) < self.partition_num:
                    return True
                meeting.decided = "met"
                meeting.timer.cancel()
                addresses = dict(meeting.addresses)
        if meeting is None:
            self._answer([reply], {"kind": "ended"})
            return True
        if self._on_met is not None:
            try:
                self._on_met(addresses)
            except Exception:  # a listener's bug must not keep the tasks from meeting
                log.exception("a listener of the meeting failed")
        self._answer(
            meeting.replies, {"kind": "met", "addresses": {str(k): v for k, v in addresses.items()}}
        )
        return True

    def end(self) -> None:
        """The stages met here so far have failed on the driver: their tasks waiting to
        meet, and any of theirs that come after, are answered ``{"kind": "ended"}`` and stop,
        instead of waiting out the patience for peers that will not come. (A run again is a
        stage of its own: it meets as before.)"""
        with self._lock:
            self._ended.update(self._meetings)
            waiting = [m for m in self._meetings.values() if m.decided is None]
            for meeting in waiting:
                meeting.decided = "ended"
                meeting.timer.cancel()
        for meeting in waiting:
            self._answer(meeting.replies, {"kind": "ended"})

    def _give_up(self, meeting: _Meeting) -> None:
        """The patience is over: those that came meet through allGather."""
        with self._lock:
            if meeting.decided is not None:
                return
            meeting.decided = "allgather"
            came = len(meeting.addresses)
        log.warning(
            "only %d of %d tasks reached the driver within %g s to meet; they meet through allGather "
            "instead (a second or so more)",
            came,
            self.partition_num,
            self.patience,
        )
        self._answer(meeting.replies, {"kind": "allgather"})

    @staticmethod
    def _answer(replies: list[Reply], answer: dict) -> None:
        for reply in replies:  # their meeting is decided: no more are added
            try:
                reply(answer)
            except OSError as error:  # that task is gone; the others still hear
                log.debug("a task left before its meeting was decided: %s", error)


class StaticRendezvous(Rendezvous):
    """A fixed address list: partition ``i`` serves on ``addresses[i]``.

    For N plain processes (or hosts) that are each told their id and the whole list. The
    processes start at different moments, so ``exchange`` waits, up to ``timeout`` seconds,
    until every peer accepts connections. The list says only ``(host, port)``: the peer
    group then asks each peer for the rest (its Unix socket and scope, with the secret
    proven), so processes on one machine share memory as Spark tasks of one host do.
    """

    def __init__(
        self, partition_id: int, addresses: Sequence[Address], timeout: float = 60.0
    ) -> None:
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
        """Connect to ``peer`` until it accepts (or the deadline passes), looking again after
        5 ms, then twice as long each time up to ``SERVING_LOOK``."""
        delay = 0.005
        while True:
            try:
                with socket.create_connection(
                    address, timeout=max(0.1, deadline - time.monotonic())
                ):
                    return
            except OSError as error:
                if time.monotonic() + delay > deadline:
                    raise UsageError(
                        f"partition {peer} at {address[0]}:{address[1]} did not start serving within "
                        f"{self._timeout:g} s ({error}): start all {self.partition_num} processes "
                        "with the same address list"
                    ) from error
                time.sleep(delay)  # the peer process is still starting: poll with backoff
                delay = min(2 * delay, SERVING_LOOK)


class LocalRendezvous:
    """N threads of one process meet here; ``member(i)`` is partition i's ``Rendezvous``.

    Binds to 127.0.0.1. Meant for tests and benchmarks that run the engine without Spark.
    ``hosts`` places the partitions on simulated hosts (lists of partition ids): the meeting
    tells each partition the others' scopes as if each list were a machine of its own, so
    peers of one list meet over Unix sockets and shared memory and the others over TCP on
    127.0.0.1, as on several hosts (None: one host, as the threads are).
    """

    def __init__(
        self, partition_num: int, timeout: float = 60.0, hosts: list[list[int]] | None = None
    ) -> None:
        self.partition_num = partition_num
        self._timeout = timeout
        self._addresses: list[Address | None] = [None] * partition_num
        self._barrier = threading.Barrier(partition_num)
        self._scope_of = {
            p: f"simulated-host-{index}"
            for index, members in enumerate(hosts or [])
            for p in members
        }

    def member(self, partition_id: int) -> Rendezvous:
        """Partition ``partition_id``'s side of the meeting."""
        if not 0 <= partition_id < self.partition_num:
            raise ConfigurationError(
                f"partition_id {partition_id} is outside 0..{self.partition_num - 1}"
            )
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
        met = [address for address in self._addresses if address is not None]
        if not self._scope_of:
            return met
        return [  # a peer that offers shared memory is on its simulated host's scope
            (*peer[:4], self._scope_of[index] if peer[3] else None)
            for index, peer in enumerate(met)
        ]


class _LocalMember(Rendezvous):
    def __init__(self, group: LocalRendezvous, partition_id: int) -> None:
        self._group = group
        self.partition_id = partition_id
        self.partition_num = group.partition_num

    def bind_address(self) -> Address:
        return "127.0.0.1", 0

    def exchange(self, address: Address) -> list[Address]:
        return self._group._exchange(self.partition_id, address)
