"""The fit's one barrier stage, as the driver launches it: the engine's spec for it, the
tasks' code over the placed rows, the runs again after a task failed, and the records
the tasks return, decoded (``records.StageOutput``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from allreduce_param.engine.parameter import AllReduceParameter
from allreduce_param.engine.wire.settings import NetworkSettings
from allreduce_param.errors import AllReduceError
from allreduce_param.spark.arrow import fit_the_address_space_limit, record_batch
from allreduce_param.train.checkpoint_space import SETTING_NAMES
from allreduce_param.train.columns import ORDER_COLUMNS
from allreduce_param.train.driver.failures import UNSUPPORTED_CHAIN, run_until_done
from allreduce_param.train.driver.memory import worker_bytes
from allreduce_param.train.driver.resume import restart_point
from allreduce_param.train.driver.user_warning import warn_user
from allreduce_param.train.records import STAGE_SCHEMA, StageOutput
from allreduce_param.train.settings import FitSettings
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.row_claims import claimed
from allreduce_param.train.task.spill import Place, memory_budget, pair_rows, partition_rows
from allreduce_param.train.task.worker import train_rows

log = logging.getLogger(__name__)


def engine_parameter(
    settings: FitSettings, network: NetworkSettings, workers: int, size: int
) -> AllReduceParameter:
    """The engine's spec for a fit of ``size`` weights on ``workers`` partitions: the one
    place the trainer makes an ``AllReduceParameter``. ``network``: the settings read from
    the session on the driver, once."""
    codec, gradient_codec = settings.codecs
    return AllReduceParameter(
        workers,
        size,
        codec=codec,
        gradient_codec=gradient_codec,
        timeout=settings.timeout,
        strategy=settings.synchronisation,
        network=network,
        topology=settings.topology,
        fetch_threads=settings.fetch_threads,
    )


def run_stage(
    job: TrainingJob,
    kept,
    placed: Callable[[], Any],
    attempts: int,
    profile: Any = None,
    failed: Callable[[], None] | None = None,
    phase: Callable[[str], None] = lambda what: None,
) -> StageOutput:
    """The fit's one barrier stage, over ``kept`` (the rows as they lie, or None) or, where
    Spark refuses a barrier stage over those (a union or a coalesce in their lineage,
    SPARK-24820), over the rows ``placed()`` shuffles into place; each has a partition per
    worker. The records the partitions returned, with when the stage was submitted.

    The stage returns the records itself, and Spark never retries such a barrier stage
    when a task fails, so this runs it again, up to ``attempts`` runs in all; a new
    attempt's tasks resume from the fit's newest intact checkpoint (``restart_point``).
    A task's error that every run would meet again (``failures.recurs``: a
    ``ConfigurationError``, ``InputError`` or ``UsageError``) ends it after the first run,
    as that error.
    Each run again is announced with a ``RuntimeWarning`` saying why; the error after the
    last run says how many ran. (A shuffle after the stage would have Spark retry it, for a
    stage more on every fit.) ``profile``: the stage-level resource profile its tasks run
    with (``spark.gpus.stage_profile``; None: the session's default). ``failed``: called
    after a run failed, before the next or the error (``DriverEnd.stage_failed``: it waits
    for that run's tasks to end). ``phase``: names the jobs that follow in the Spark UI
    (``spark.jobs.FitJobs.phase``)."""

    def place():
        phase("placing rows")
        return placed()

    submitted = time.time()
    rows = [kept if kept is not None else place()]

    def run(attempt: TrainingJob) -> list[tuple[str, bytes]]:
        phase("training")
        try:
            return _stage(attempt, rows[0], profile)
        except Exception as error:
            if rows[0] is not kept or UNSUPPORTED_CHAIN not in str(error):
                raise
        rows[0] = place()  # refused before any task ran: not a run that failed
        phase("training")
        return _stage(attempt, rows[0], profile)

    def again(error: Exception, failures: int) -> TrainingJob:
        _warn_again(job, error, failures, attempts)
        return restart_point(job)  # the newest intact checkpoint, verified here

    pairs = run_until_done(run, job, attempts, again, failed)
    output = StageOutput.of(pairs, job.param.partition_num)
    output.submitted = submitted
    return output


def _warn_again(job: TrainingJob, error: Exception, failures: int, attempts: int) -> None:
    """Say that the stage failed and runs again, and from where: a run can take long (the
    rows are loaded anew), and a fit that goes quiet meanwhile looks hung. (At the user's call.)"""
    origin = "the start" if job.start.fresh else job.start.describe()
    start = (
        f"from the newest checkpoint of this fit (from {origin} if none was written yet)"
        if job.checkpoints is not None
        else f"from {origin}; a fit with checkpoints ({SETTING_NAMES}) would resume from its "
        "newest checkpoint"
    )
    warn_user(
        f"the fit's stage failed, run {failures} of at most {attempts} "
        f"(spark.stage.maxConsecutiveAttempts): {error}. It runs again, {start}",
        RuntimeWarning,
    )


@contextlib.contextmanager
def driver_link(job: TrainingJob) -> Iterator[None]:
    """A task's connection to the driver (``job.driver``) for the task's whole length:
    opened as it starts, closed last, after its row files are removed. A failed fit's driver
    waits for its tasks' connections to end (``meeting.driver_end``), so what the tasks
    left is gone when the fit's error reaches the caller. A driver out of reach here is
    tried again, and met without, when the task meets its peers (``DriverRendezvous``)."""
    if job.driver is not None:
        try:
            job.driver.connect()
        except (OSError, AllReduceError) as error:
            log.info("this task cannot reach the driver yet (%s)", error)
    try:
        yield
    finally:
        if job.driver is not None:
            job.driver.close()


def _stage(job: TrainingJob, rows, profile: Any) -> list[tuple[str, bytes]]:
    """Run the tasks over ``rows`` (a DataFrame, or an RDD of pairs), with ``profile`` when
    given; their records, encoded."""

    data_in = job.settings.data_in
    # after a shuffle, Spark sorts each partition by its order keys (spilling as it needs):
    # a task puts each row where it belongs as it comes, in memory (held once, not twice) or
    # in its row file (nothing held per row)
    presorted = hasattr(rows, "mapInArrow") and ORDER_COLUMNS[0] in rows.columns
    # the model's vectors in a worker: what the rows "auto" keeps in memory leave room for
    size = getattr(job.model, "size", None)
    reserved = worker_bytes(
        size if isinstance(size, int) else 0, job.optimizer, job.param.partition_num
    )
    if presorted:
        rows = rows.sortWithinPartitions("split", *ORDER_COLUMNS)

    def trained(started: float, rows, validation):
        """The fit over the partition's rows as they are held; both released on every way
        out, a failure and a task cancelled partway included."""
        try:
            clock = {"started": started, "loaded": time.time()}
            yield from train_rows(job, rows, validation, clock=clock)
        finally:
            rows.release()
            validation.release()

    def held(place: Place):  # where this task's rows go, and the budget "auto" keeps to
        fit_the_address_space_limit()  # before the first row is read
        budget = memory_budget(job.param.partition_num, reserved)
        return (place if data_in != "memory" else None), budget

    def arrow_task(batches):
        started, place = time.time(), Place.of_task(job.param.secret)
        with (
            driver_link(job),
            claimed(place, data_in != "memory"),
        ):  # over fits' row files removed first
            loaded = partition_rows(
                batches, job.n_features, job.sparse, data_in, *held(place), presorted
            )
            for kind, payload in trained(started, *loaded):
                yield record_batch(kind=[kind], payload=[payload])

    def pairs_task(pairs):
        started, place = time.time(), Place.of_task(job.param.secret)
        with driver_link(job), claimed(place, data_in != "memory"):
            loaded = pair_rows(pairs, job.n_features, data_in, *held(place))
            yield from trained(started, *loaded)

    if hasattr(rows, "mapInArrow"):
        extra = {} if profile is None else {"profile": profile}  # PySpark 4.0+ takes it
        frame = rows.mapInArrow(arrow_task, STAGE_SCHEMA, barrier=True, **extra)
        return [(row["kind"], row["payload"]) for row in frame.collect()]
    stage = rows.barrier().mapPartitions(pairs_task)
    return (stage if profile is None else stage.withResources(profile)).collect()
