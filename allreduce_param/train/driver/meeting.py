"""The driver's end of a fit's tasks' connections: where the partitions meet, and where
their live progress goes (the bar, the log, the listener)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from allreduce_param.engine.movement.rendezvous import MeetingPoint, by_partition
from allreduce_param.engine.wire.messages import MessageClient, MessageServer
from allreduce_param.engine.wire.settings import NetworkSettings
from allreduce_param.spark.info import SparkInfo
from allreduce_param.train.driver.progress import ProgressBar, ProgressMerger
from allreduce_param.train.result import merge_epoch, merge_step
from allreduce_param.train.settings import FitSettings

log = logging.getLogger(__name__)


@dataclass
class DriverEnd:
    """What ``driver_end`` gives the fit: ``client``, what its tasks use to reach the
    driver (None: they cannot), and ``stage_failed``."""

    client: MessageClient | None
    _meeting: MeetingPoint
    _server: MessageServer
    _timeout: float

    def stage_failed(self) -> None:
        """A run of the stage failed: its tasks still waiting to meet are told to stop, and
        this waits, up to ``spark.allreduce.connectTimeout``, until each task that reached
        the driver has ended (Spark kills the rest of a failed barrier stage within seconds),
        so the row files they wrote are gone before the fit runs again or raises."""
        self._meeting.end()
        if not self._server.drain(self._timeout):
            log.warning(
                "tasks of the failed stage were still running %g s after it failed "
                "(spark.allreduce.connectTimeout); Spark kills them, and what they wrote in "
                "its local directories goes with the executor",
                self._timeout,
            )


@contextlib.contextmanager
def driver_end(
    settings: FitSettings,
    spark: SparkInfo,
    workers: int,
    network: NetworkSettings,
    watchers: Callable[[str, dict], None] | None = None,
) -> Iterator[DriverEnd]:
    """The driver's end for the length of the fit: where the partitions meet, and where
    their progress goes (the bar, the log, the listener and the fit's ``watchers``, which
    also hear where everyone listens: a ``"meeting"`` event). Listens where ``network``
    says, by default on ``spark.driver.bindAddress`` (or the driver's host); yields what the
    tasks use to reach it (``_client_of``) and what to call when a run of the stage fails."""
    log_file = open(settings.log_path, "a") if settings.log_path else None
    bar = ProgressBar(show=settings.progress, log_file=log_file)
    listeners = [bar] + [each for each in (settings.listener, watchers) if each is not None]
    progress = ProgressMerger(
        workers,
        merge_step,
        lambda kind, fields: [listen(kind, dict(fields)) for listen in listeners],
        merge_epoch=merge_epoch,
    )
    host = spark.listening_host()
    bind, advertise = network.addresses(spark.driver_bind_address() or host, host)

    def on_met(addresses: dict) -> None:
        servers = by_partition(addresses, workers)  # each starts with its host and port
        fields = {
            "driver": f"{advertise}:{server.address[1]}",
            "servers": [f"{address[0]}:{address[1]}" for address in servers],
        }
        for listen in listeners:
            listen("meeting", dict(fields))

    meeting = MeetingPoint(workers, network.meeting_patience, on_met=on_met)

    def on_message(message: dict, reply) -> None:
        if not meeting.on_message(message, reply):
            progress.on_message(message)

    server = MessageServer(
        bind,
        on_message,
        advertise=advertise,
        ports=network.port_range,
        connect_timeout=network.connect_timeout,
        encrypt=network.encrypt,
    )
    try:
        client = _client_of(server, spark, network.connect_timeout)
        yield DriverEnd(client, meeting, server, network.connect_timeout)
        # the tasks have ended: hear what they sent last before the fit returns
        if not server.drain(network.connect_timeout):
            warnings.warn(
                "some tasks' last progress reports did not reach the driver within "
                f"{network.connect_timeout:g} s (spark.allreduce.connectTimeout): the listener "
                "and the log may miss the fit's last steps; its history is complete",
                RuntimeWarning,
                stacklevel=3,
            )
    finally:
        server.close()
        bar.close()
        if log_file is not None:
            log_file.close()


def _client_of(
    server: MessageServer, spark: SparkInfo, connect_timeout: float
) -> MessageClient | None:
    """What the tasks use to reach ``server``; None where they cannot (under Spark Connect,
    the client may be out of the executors' reach): they then meet through Spark, at
    once, and the fit says that it shows no live progress."""
    if not spark.client_maybe_unreachable():
        return server.client()
    reason = spark.unreachable(server.address, connect_timeout)
    if reason is None:
        return server.client()
    host, port = server.address
    warnings.warn(
        f"the executors cannot reach this Spark Connect client at {host}:{port} ({reason}): the fit "
        "goes on without live progress (no bar, log lines or listener events while it runs); its "
        "history arrives when it ends. To see progress, run where the executors can connect to "
        "this process (e.g. on the cluster's network)",
        RuntimeWarning,
        stacklevel=5,
    )
    return None
