"""What the driver side of a fit asks of its Spark session, under classic Spark and Spark Connect alike.

Under Spark Connect (PySpark's thin client: ``SparkSession.builder.remote(...)``) the
Python process is not Spark's driver: it has no ``SparkContext``, no RDDs, no broadcasts
and no JVM to call into. A fit needs only a few things from the session, and this is
where each is answered both ways: settings (``spark.conf`` answers them from the server's
SparkContext under Connect, with no job), the application's identity, the default
parallelism, values for the executors (a broadcast, or under Connect the task's closure),
and the address this process listens on for the tasks' progress.
"""

from __future__ import annotations

import re
import socket
from typing import Any

from allreduce_param.errors import ConfigurationError
from allreduce_param.spark.arrow import record_batch

#: Under Connect, weights travel inside each task's closure, which the client sends to the
#: server in one gRPC message (``spark.connect.grpc.maxInboundMessageSize``, 128 MiB by
#: default); larger ones are refused with a message before they are sent.
CLOSURE_LIMIT = 64 << 20


#: Under Connect, the default parallelism that a job counted, by application and session.
_PARALLELISM: dict[str, int] = {}


def is_connect(session: Any) -> bool:
    """Whether ``session`` is a Spark Connect client session (``pyspark.sql.connect``)."""
    return type(session).__module__.startswith("pyspark.sql.connect")


class SparkInfo:
    """The answers a fit's driver side needs from ``session``, a classic or Connect
    SparkSession (or, for RDD input, None and the classic ``context``: see ``of``)."""

    def __init__(self, session: Any, context: Any = None) -> None:
        self.session = session
        self.connect = session is not None and is_connect(session)
        #: the classic SparkContext; None under Connect
        self.context = context if context is not None or self.connect else session.sparkContext

    @classmethod
    def of(cls, data: Any) -> SparkInfo | None:
        """For a DataFrame (classic or Connect) or an RDD; None for anything else."""
        if hasattr(data, "sparkSession"):
            return cls(data.sparkSession)
        context = getattr(data, "context", None)
        return None if context is None else cls(None, context)

    def setting(self, key: str, default: str) -> str:
        """A setting of the running application (one py4j call classically, where
        ``getConf()`` would copy every setting over; ``spark.conf`` under Connect)."""
        if self.connect:
            value = self.session.conf.get(key, default)
            return default if value is None else str(value)
        return self.context._conf.get(key, default)

    def session_setting(self, key: str) -> str | None:
        """A setting as the session sees it: set when it started or later with
        ``spark.conf.set`` (None when unset). With RDD input, the SparkContext's."""
        if self.session is None:
            return self.context._conf.get(key, None)
        value = self.session.conf.get(key, None)
        return None if value is None else str(value)

    @property
    def application_id(self) -> str:
        """The Spark application's id, and under Connect the server session's too (cached
        data belongs to one)."""
        if self.connect:
            return f"{self.setting('spark.app.id', '')}/{getattr(self.session, 'session_id', '')}"
        return self.context.applicationId

    def default_parallelism(self) -> int:
        """Spark's default parallelism: the total cores of the executors (or of ``local[N]``)."""
        if not self.connect:
            return self.context.defaultParallelism
        configured = self.setting("spark.default.parallelism", "")
        if configured:
            return int(configured)
        master = self.setting("spark.master", "")
        found = re.fullmatch(r"local\[(\d+)(?:\s*,\s*\d+)?\]", master)
        if found:
            return int(found.group(1))
        if master == "local":
            return 1
        # local[*] or a cluster: the partitions spark.range() gets, which are defaultParallelism's;
        # one small job per server session (a cluster's executors are fixed: no dynamic allocation)
        key = self.application_id
        if key not in _PARALLELISM:
            from pyspark.sql import functions as F

            _PARALLELISM[key] = (
                self.session.range(0, 1 << 16).select(F.spark_partition_id()).distinct().count()
            )
        return _PARALLELISM[key]

    def broadcast(self, value: Any) -> Any:
        """``value`` for the executors, read there as ``.value``: a Spark broadcast
        classically; under Connect, which has none, a holder that travels in the closure."""
        if not self.connect:
            return self.context.broadcast(value)
        size = getattr(value, "nbytes", 0)
        if size > CLOSURE_LIMIT:
            raise ConfigurationError(
                f"under Spark Connect the weights travel in each task's closure, and these are "
                f"{size / 2**20:.0f} MiB (at most {CLOSURE_LIMIT >> 20} MiB): predict on a classic session, "
                "or save the model and load it where one runs"
            )
        return Held(value)

    def listening_host(self) -> str:
        """The address this process listens on for the tasks: classically the driver's
        (``spark.driver.host``). Under Connect this process is the client, not the driver:
        its own address on the route to the server's driver (127.0.0.1 when that is local)."""
        driver = self.setting("spark.driver.host", "127.0.0.1")
        if not self.connect:
            return driver
        if driver in ("127.0.0.1", "localhost", "::1"):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((driver, 9))  # a UDP connect sends nothing: it only picks the route
                return probe.getsockname()[0]
            except (
                OSError
            ):  # no route: the tasks cannot reach this process; they meet through Spark
                return "127.0.0.1"

    def driver_bind_address(self) -> str:
        """Where the driver binds its own servers (``spark.driver.bindAddress``), or ""
        when unset or when this process is a Spark Connect client, not the driver."""
        return "" if self.connect else self.setting("spark.driver.bindAddress", "")

    def unreachable(self, address: tuple[str, int], timeout: float = 3.0) -> str | None:
        """Why a task cannot open a TCP connection to ``address`` (a server of this
        process's), or None when it can: one small Spark job of one task."""
        host, port = address

        def probe(batches):
            for _ in batches:
                pass
            try:
                socket.create_connection((host, port), timeout=timeout).close()
                reason = ""
            except OSError as error:
                reason = f"{type(error).__name__}: {error}"
            yield record_batch(reason=[reason])

        rows = self.session.range(0, 1, 1, 1).mapInArrow(probe, "reason string").collect()
        return rows[0]["reason"] or None if rows else "the probe's task returned nothing"

    def client_maybe_unreachable(self) -> bool:
        """Whether the executors might not reach this process: under Connect, with the
        server's driver on another machine (a local server's executors always can)."""
        return self.connect and self.listening_host() != "127.0.0.1"


class Held:
    """A value that travels in a task's closure, read as a broadcast is (``.value``)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def unpersist(self, blocking: bool = False) -> None:
        """Nothing to release: the closure held it."""
