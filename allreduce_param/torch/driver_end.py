"""The driver's end of a ``Distributor`` run: where the ranks meet, where their output is
printed as it comes, and where a failing rank's error is heard first.

It is the fit's channel (``engine.wire.messages.MessageServer``: authenticated, encrypted
where the network settings say, and the ``MeetingPoint`` the fit's tasks meet at), with
two more kinds of message: a rank's ``output`` lines, printed on the driver's
``sys.stdout``/``sys.stderr`` with a ``[rank N]`` prefix, and a rank's ``failed`` report.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import TextIO

from allreduce_param.engine.movement.rendezvous import MeetingPoint
from allreduce_param.engine.wire.messages import MessageClient, MessageServer
from allreduce_param.engine.wire.settings import NetworkSettings
from allreduce_param.errors import PeerLostError, TrainingError
from allreduce_param.spark.info import SparkInfo
from allreduce_param.torch.output import OUTPUT
from allreduce_param.torch.rank import FAILED

log = logging.getLogger(__name__)

#: The errors a rank meets because another one failed first: never the root cause.
_SECOND_HAND = (PeerLostError.__name__, "StoreClosedError", "FetchTimeoutError")


@dataclass
class RankReports:
    """The ranks' output and failures as they arrive (from the message server's threads).
    The output goes to ``out`` and ``err``; None: the driver's ``sys.stdout`` and
    ``sys.stderr`` as they are when a line comes (a notebook replaces them per cell)."""

    out: TextIO | None = None
    err: TextIO | None = None
    failures: list[dict] = field(default_factory=list)
    _partial: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def on_message(self, message: dict) -> None:
        kind = message.get("kind")
        if kind == OUTPUT:
            self._print(message)
        elif kind == FAILED:
            with self._lock:
                self.failures.append(message)
        else:
            log.debug("a rank sent a message of unknown kind %r", kind)

    def _print(self, message: dict) -> None:
        """A rank's text, each whole line with its prefix, on the driver's stream of the
        same name; a part line waits for its end (the rank sends it at the latest as the
        function ends)."""
        key = (message.get("rank"), message.get("stream"))
        with self._lock:
            *lines, rest = (self._partial.pop(key, "") + str(message.get("text", ""))).split("\n")
            if rest:
                self._partial[key] = rest
            if lines:
                stream = self._stream(key[1])
                stream.write("".join(f"[rank {key[0]}] {line}\n" for line in lines))
                stream.flush()

    def flush(self) -> None:
        """Print the part lines still held (a rank that ended without a newline)."""
        with self._lock:
            held, self._partial = self._partial, {}
        for (rank, name), text in sorted(held.items(), key=str):
            stream = self._stream(name)
            stream.write(f"[rank {rank}] {text}\n")
            stream.flush()

    def _stream(self, name: str) -> TextIO:
        if name == "stderr":
            return self.err or sys.stderr
        return self.out or sys.stdout

    def root_failure(self) -> TrainingError | None:
        """One error for the run from the ranks' reports: the first rank whose own error it
        was (not a peer's loss it met because of another's failure), with its traceback;
        None when no rank reported."""
        with self._lock:
            reports = list(self.failures)
        if not reports:
            return None
        own = [r for r in reports if not str(r.get("error", "")).startswith(_SECOND_HAND)]
        first = (own or reports)[0]
        return TrainingError(
            f"rank {first.get('rank')} of the Distributor's run failed{first.get('where', '')}: "
            f"{first.get('error')}\n\nIts traceback:\n{first.get('traceback', '')}"
        )


class DriverEnd:
    """The message server and the meeting for one run of ``world`` ranks; close it."""

    def __init__(self, spark: SparkInfo, world: int, network: NetworkSettings) -> None:
        self.reports = RankReports()
        host = spark.listening_host()
        bind, advertise = network.addresses(spark.driver_bind_address() or host, host)
        self._meeting = MeetingPoint(world, network.meeting_patience)
        self._timeout = network.connect_timeout
        self._server = MessageServer(
            bind,
            self._on_message,
            advertise=advertise,
            ports=network.port_range,
            connect_timeout=network.connect_timeout,
            encrypt=network.encrypt,
        )
        self.client: MessageClient | None = self._server.client()
        if spark.client_maybe_unreachable():
            reason = spark.unreachable(self._server.address, network.connect_timeout)
            if reason is not None:
                log.warning(
                    "the executors cannot reach this Spark Connect client (%s): the ranks' "
                    "output stays in the executors' logs, and they meet through Spark",
                    reason,
                )
                self.client = None

    def _on_message(self, message: dict, reply) -> None:
        if not self._meeting.on_message(message, reply):
            self.reports.on_message(message)

    def stage_failed(self) -> None:
        """The stage failed: ranks still meeting are told to stop, and this waits (at most
        ``connect_timeout``) until every rank's connection ended, its reports heard."""
        self._meeting.end()
        self._server.drain(self._timeout)

    def close(self) -> None:
        """Hear the ranks' last lines (at most ``connect_timeout``), then stop listening."""
        try:
            self._server.drain(self._timeout)
        finally:
            self._server.close()
            self.reports.flush()
