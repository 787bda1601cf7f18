"""A fit's Spark jobs: named in the Spark UI by what they do, in one job group, and cancelled
together when the fit is interrupted.

Every job a fit runs (the data checks, placing the rows, the training stage) runs in one
job group of the fit's own, with ``interruptOnCancel``, and carries a description saying
which fit it is (its model, partitions and epochs) and its phase ("checking the data",
"placing rows", "training"): the Spark UI's jobs page, and its REST API
(``/api/v1/applications/<id>/jobs``), show each by name instead of an anonymous
``mapPartitions``. The fit's jobs also carry a tag of its own, so that where the caller
already set a job group (a streaming query runs its micro-batches in the query's group,
which ``StreamingQuery.stop`` cancels), that group stays theirs and still reaches the fit.

When the fit is interrupted, however it arrives (``KeyboardInterrupt`` from SIGINT, which
is what a notebook's stop button sends; any error on the driver while its jobs run), it
cancels its own jobs, waits until their tasks are gone (bounded by ``TASKS_GONE_WITHIN``,
with a warning where they are not), and re-raises: the next fit in the session then has
the executors to itself. PySpark's own SIGINT handler calls ``cancelAllJobs`` from inside
the interrupted call, on the same py4j connection, and fails there ("reentrant call"); with
pinned threads (``PYSPARK_PIN_THREAD``, the default) that connection is this thread's and
still waits for the interrupted call's answer, so it is closed, and the next call makes a
new one, with the caller's local properties (group, description, tags, pool) restored on
it, and the session its active one again (``SparkSession.getActiveSession()`` asks the
JVM, which keeps it per connection's thread). Under Spark Connect the fit's operations
carry a tag (``SparkSession.addTag``) that ``interruptTag`` stops; Connect has no job
descriptions to set.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from allreduce_param.spark.info import SparkInfo

log = logging.getLogger(__name__)

#: how long an interrupted fit waits for its tasks to be gone before it re-raises anyway
TASKS_GONE_WITHIN = 30.0
#: the local property Spark keeps a thread's job group in
_GROUP = "spark.jobGroup.id"


class FitJobs:
    """The Spark jobs of one fit, as ``fit_jobs`` gives them: ``title`` names the fit (its
    model, partitions, epochs) and ``phase`` what its next jobs do."""

    def __init__(self, spark: SparkInfo | None, title: str) -> None:
        self.spark, self.title = spark, title
        self.name = f"allreduce-param-fit-{secrets.token_hex(4)}"
        self.group = self.name  # the caller's own group where one was set (``start``)
        self._saved: Any = None  # the caller's local properties (a java.util.Properties)
        self._before: set[int] = set()  # jobs of the group that ran before the fit
        self._phase = ""
        self._clean_ups: list[Callable[[], object]] = []
        self._dropped = False  # whether this thread's py4j connection was closed (``cancel``)

    @property
    def context(self) -> Any:
        """The classic SparkContext; None under Spark Connect or without a session."""
        return None if self.spark is None or self.spark.connect else self.spark.context

    @property
    def description(self) -> str:
        """What the Spark UI shows for the fit's next jobs."""
        return f"{self.title}: {self._phase}" if self._phase else self.title

    def start(self) -> None:
        """Put this thread's next jobs in the fit's group (or the caller's, kept), tagged."""
        if self.spark is not None and self.spark.connect:
            self.spark.session.addTag(self.name)
            return
        sc = self.context
        if sc is None:
            return
        self._saved = sc._jsc.sc().getLocalProperties().clone()
        callers = sc.getLocalProperty(_GROUP)
        if callers:  # a streaming query's, or the caller's own: theirs to cancel too
            self.group = callers
            self._before = set(sc.statusTracker().getJobIdsForGroup(callers))
            sc.setInterruptOnCancel(True)
        else:
            sc.setJobGroup(self.group, self.description, interruptOnCancel=True)
        sc.addJobTag(self.name)

    def phase(self, what: str, title: str | None = None) -> None:
        """Name the fit's next jobs: ``what`` they do; ``title``, a new name for the fit
        (once its partitions are known)."""
        self.title = title or self.title
        self._phase = what
        if self.context is not None:
            self.context.setJobDescription(self.description)

    def on_failure(self, clean_up: Callable[[], object]) -> None:
        """Call ``clean_up`` when the fit fails or is interrupted, once its tasks are gone
        (what they left half written: an incomplete checkpoint)."""
        self._clean_ups.append(clean_up)

    def cancel(self, interrupted: bool) -> None:
        """Cancel the fit's jobs and wait, up to ``TASKS_GONE_WITHIN``, until their tasks
        are gone. ``interrupted``: by a ``BaseException`` that may have cut a py4j call short."""
        if self.spark is not None and self.spark.connect:
            self.spark.session.interruptTag(self.name)
            return
        sc = self.context
        if sc is None:
            return
        if interrupted:
            self._dropped = _drop_thread_connection()
        sc.cancelJobsWithTag(self.name)
        if not self._tasks_gone(TASKS_GONE_WITHIN):
            warnings.warn(
                f"the interrupted fit's tasks (job group {self.group!r}) were still running "
                f"{TASKS_GONE_WITHIN:g} s after it cancelled them: Spark kills them; a next fit "
                "may wait for their task slots meanwhile. See the Spark UI's Jobs page",
                RuntimeWarning,
                stacklevel=4,
            )

    def _tasks_gone(self, within: float) -> bool:
        """Whether every job of the fit (in its group, begun since it started) has ended
        and its stages have no task running, waiting up to ``within`` seconds."""
        tracker = self.context.statusTracker()
        deadline = time.monotonic() + within
        while True:
            running = False
            for job in set(tracker.getJobIdsForGroup(self.group)) - self._before:
                info = tracker.getJobInfo(job)
                if info is None:
                    continue
                if info.status == "RUNNING":
                    running = True
                    break
                stages = (tracker.getStageInfo(stage) for stage in info.stageIds)
                if any(stage is not None and stage.numActiveTasks for stage in stages):
                    running = True
                    break
            if not running:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def finish(self) -> None:
        """Give this thread back the local properties (group, description, tags) it had."""
        if self.spark is not None and self.spark.connect:
            self.spark.session.removeTag(self.name)
            return
        if self._saved is not None:
            self.context._jsc.sc().setLocalProperties(self._saved)
        if self._dropped:  # the JVM keeps the active session per connection's thread too
            session = self.spark.session
            session._jvm.SparkSession.setActiveSession(session._jsparkSession)


def _drop_thread_connection() -> bool:
    """Close this thread's py4j connection where it has one of its own (pinned threads):
    an interrupt may have cut its call short, and it would read that call's answer as the
    next one's. The next call opens a new connection. Whether one was closed."""
    from pyspark import SparkContext

    client = getattr(SparkContext._gateway, "_gateway_client", None)
    connection = getattr(client, "get_thread_connection", lambda: None)()
    if connection is None:
        return False
    connection.close(reset=True)
    return True


@contextlib.contextmanager
def fit_jobs(spark: SparkInfo | None, title: str) -> Iterator[FitJobs]:
    """The fit's jobs for the ``with`` block (see the module's docstring): on any way out
    by an exception, its jobs are cancelled and their tasks waited for before it goes on;
    on every way out the thread gets back its job group, description and tags."""
    jobs = FitJobs(spark, title)
    jobs.start()
    try:
        yield jobs
    except BaseException as error:
        try:
            jobs.cancel(interrupted=not isinstance(error, Exception))
        except Exception as failure:  # the fit's own error matters more than the clean-up's
            log.warning("cancelling the fit's Spark jobs failed: %s", failure)
        for clean_up in jobs._clean_ups:
            try:
                clean_up()
            except Exception as failure:
                log.warning("cleaning up after the fit failed: %s", failure)
        raise
    finally:
        with contextlib.suppress(Exception):
            jobs.finish()
