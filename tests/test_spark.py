"""AllReduceParameter inside real Spark barrier stages, local[4] (four task slots on 2 cores)."""

from __future__ import annotations

import functools
import re
import socket
import sys
import threading

import numpy as np
import pytest
import xxhash
from pyspark import cloudpickle

from allreduce_param.engine import AllReduceParameter, Strategy

# the tasks below are defined in this module: ship them by value, workers cannot import tests/
cloudpickle.register_pickle_by_value(sys.modules[__name__])

LR = np.float32(0.5)


def digest(array: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(array, np.float32).tobytes())


def partition_data(size: int, seed: int, partition_id: int):
    rng = np.random.default_rng([seed, partition_id])
    return rng.standard_normal(size).astype(np.float32), float(rng.integers(1, 50))


def start_weights(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 999]).standard_normal(size).astype(np.float32)


def step_task(params: list[AllReduceParameter], seed: int):
    """A barrier task: one BSP step per parameter; digests of what each partition saw."""

    def task(_rows):
        report = []
        for param in params:
            with param.connect() as p:
                weights = start_weights(param.size, seed)
                gradient, count = partition_data(param.size, seed, p.info.partition_id)
                p.init(weights)
                before = p.get_weights().copy()
                p.put_gradients(gradient, count=count)
                p.weight_partition[:] -= LR * p.aggregate_gradient_partition()
                p.send_weight_partition()
                after = p.get_weights()
                transports = sorted(
                    {
                        client._sock.family.name
                        for client in p._peers.peers.values()
                        if client._sock is not None
                    }
                )
                if any(client._shared._mappings._maps for client in p._peers.peers.values()):
                    transports.append("shared memory")
                if p.info.host_arena:
                    transports.append("host arena")
                report.append(
                    (
                        param.size,
                        param.codec,
                        p.info.partition_id,
                        digest(before),
                        digest(after),
                        after if param.size < 100_000 else None,
                        transports,
                    )
                )
        yield report

    return task


def expected_after(size: int, seed: int, partitions: int) -> np.ndarray:
    data = [partition_data(size, seed, i) for i in range(partitions)]
    mean = functools.reduce(np.add, [g for g, _ in data]) / np.float32(sum(c for _, c in data))
    return start_weights(size, seed) - LR * mean


def run_stage(spark, partitions: int, task):
    rdd = spark.sparkContext.parallelize(range(partitions), partitions)
    return [entry for report in rdd.barrier().mapPartitions(task).collect() for entry in report]


TRANSPORTS = {
    "host arena": dict(unix_sockets=True, shared_memory=True, host_arena=True),
    "shared memory": dict(unix_sockets=True, shared_memory=True, host_arena=False),
    "unix sockets": dict(unix_sockets=True, shared_memory=False),
    "tcp": dict(unix_sockets=False, shared_memory=False),
}
SEEN = {
    "host arena": ("host arena",),  # no block travels: the step's connections are never made
    "shared memory": ("AF_UNIX", "shared memory"),
    "unix sockets": ("AF_UNIX",),
    "tcp": ("AF_INET",),
}


@pytest.mark.parametrize(
    "partitions, transport",
    [(3, "host arena"), (2, "shared memory"), (3, "tcp"), (4, "unix sockets")],
)
@pytest.mark.slow
def test_raw_sync_is_exact_on_every_partition(spark, partitions, transport):
    sizes = sorted({1, max(1, partitions - 1), 7919, 3_000_017})
    params = [
        AllReduceParameter(partitions, size, codec="raw", timeout=60, **TRANSPORTS[transport])
        for size in sizes
    ]
    seed = 100 + partitions
    report = run_stage(spark, partitions, step_task(params, seed))
    assert len(report) == partitions * len(sizes)
    for size in sizes:
        rows = [row for row in report if row[0] == size]
        assert sorted(row[2] for row in rows) == list(range(partitions))
        assert {row[3] for row in rows} == {digest(start_weights(size, seed))}
        assert {row[4] for row in rows} == {digest(expected_after(size, seed, partitions))}
        # peers on one host read shared memory, or use Unix sockets, unless told not to
        assert {tuple(row[6]) for row in rows} == {SEEN[transport]}


@pytest.mark.slow
def test_every_codec_in_spark_is_bit_identical_across_partitions_and_within_bound(spark):
    size, partitions, seed = 20_011, 2, 7
    params = [
        AllReduceParameter(partitions, size, codec=codec, timeout=60)
        for codec in ("lz4", "bf16", "fp16", "bf16-lz4")
    ]
    report = run_stage(spark, partitions, step_task(params, seed))
    exact = expected_after(size, seed, partitions)
    for codec, relative in (
        ("lz4", 0.0),
        ("bf16", 2.0**-7),
        ("fp16", 2.0**-10),
        ("bf16-lz4", 2.0**-7),
    ):
        rows = [row for row in report if row[1] == codec]
        assert len(rows) == partitions and len({row[4] for row in rows}) == 1, codec
        # start weights and gradients are rounded by the codec: a few ulps of the codec apart
        assert np.allclose(rows[0][5], exact, rtol=relative, atol=relative * 4), codec


@pytest.mark.slow
def test_uneven_partitions_and_an_empty_one_give_the_exact_mean(spark):
    size = 513
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal(size).astype(np.float32) for _ in range(7)]
    param = AllReduceParameter(3, size, codec="raw")

    def task(partition_rows):
        samples = list(partition_rows)
        with param.connect() as p:
            p.init(np.zeros(size, np.float32))
            gradient = (
                np.sum(samples, axis=0, dtype=np.float32) if samples else np.zeros(size, np.float32)
            )
            p.put_gradients(gradient, count=len(samples))
            yield p.info.partition_id, len(samples), p.aggregate_gradient_partition().copy()

    # 7 rows over 3 partitions, the first emptied: uneven counts and an empty partition
    rdd = spark.sparkContext.parallelize(rows, 3).mapPartitionsWithIndex(
        lambda index, it: iter(()) if index == 0 else it
    )
    parts = rdd.glom().collect()
    assert len(parts[0]) == 0 and len(parts[1]) != len(parts[2])
    result = sorted(rdd.barrier().mapPartitions(task).collect(), key=lambda entry: entry[0])
    assert [entry[1] for entry in result] == [len(part) for part in parts]
    mean = np.concatenate([entry[2] for entry in result])
    sums = [np.sum(part, axis=0, dtype=np.float32) for part in parts[1:]]
    assert np.array_equal(mean, (sums[0] + sums[1]) / np.float32(sum(map(len, parts))))
    kept = np.asarray([row for part in parts for row in part], np.float64)
    assert np.allclose(mean, kept.mean(axis=0), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_peer_that_crashes_fails_the_job_with_its_error(spark):
    param = AllReduceParameter(2, 1000, codec="raw", timeout=600)

    def task(_rows):
        with param.connect() as p:
            p.init(np.zeros(1000))
            p.get_weights()
            if p.info.partition_id == 1:
                raise RuntimeError("partition 1 crashed on purpose")
            p.put_gradients(np.ones(1000))
            p.aggregate_gradient_partition()
        yield 0

    with pytest.raises(Exception) as failure:
        spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(task).collect()
    # Spark reports whichever task failure it handles first: the crash itself, or the
    # survivor's PeerLostError, which carries what the crashed partition said
    assert re.search(r"RuntimeError: partition 1 crashed on purpose", str(failure.value))


@pytest.mark.slow
def test_a_hung_peer_fails_the_job_within_the_timeout_naming_it(spark):
    param = AllReduceParameter(2, 1000, codec="raw", timeout=3)

    def task(_rows):
        with param.connect() as p:
            p.init(np.zeros(1000))
            if p.info.partition_id == 1:
                threading.Event().wait(60)  # stuck, publishes nothing more (Spark kills it)
            p.send_weight_partition()
            p.get_weights()
        yield 0

    with pytest.raises(Exception) as failure:
        spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(task).collect()
    text = str(failure.value)
    assert "FetchTimeoutError" in text
    assert "weight block from partition 1 to all, version 1" in text
    assert "raise AllReduceParameter(timeout=...)" in text


def ours() -> list[str]:
    """The engine's threads alive in this process (all are named allreduce-...); PySpark's
    worker runs threads of its own (a pipelined input reader), which are not ours to count."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("allreduce-"))


def update(gradient, weights, step):
    weights -= gradient


@pytest.mark.parametrize(
    "strategy",
    [Strategy(), Strategy("bsp", backup_workers=1), Strategy("asp")],
    ids=["bsp", "backup workers", "asp"],
)
@pytest.mark.slow
def test_a_second_stage_in_the_same_session_starts_clean(spark, strategy):
    def stage(param):
        def task(_rows):
            import os

            before = ours()
            with param.connect() as p:
                p.init(np.ones(5000))
                if not strategy.inline_owner:  # a few steps with the background owner, then its end
                    p.background.serve_updates(update, 3)
                    for _ in range(3):
                        p.get_weights()
                        if strategy.backup_workers and p.info.last_read_version >= 3:
                            break  # a straggler skips to the newest step: here, past the last
                        p.put_gradients(np.ones(5000), count=1)
                    p.background.finish_updates()
                total = p.collectives.allreduce(np.full(10, p.info.partition_id + 1.0))
                during = ours()
            yield os.getpid(), before, during, ours(), total.tolist()

        return task

    rdd = spark.sparkContext.parallelize(range(2), 2)
    for _ in range(2):
        param = AllReduceParameter(2, 5000, codec="lz4", strategy=strategy)
        for pid, before, during, after, total in (
            rdd.barrier().mapPartitions(stage(param)).collect()
        ):
            assert before == [] and after == [], f"worker {pid}: {before} before, {after} after"
            # the count means something
            assert any(name.startswith("allreduce-serve") for name in during)
            assert strategy.inline_owner or any(
                name.startswith("allreduce-owner") for name in during
            )
            assert total == [3.0] * 10


def test_a_parameter_made_inside_the_task_is_refused_clearly(spark):
    def task(_rows):
        param = AllReduceParameter(2, 100)  # wrong: each task makes its own secret
        with param.connect() as p:
            p.init(np.ones(100))
            p.get_weights()
        yield 0

    with pytest.raises(Exception) as failure:
        spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(task).collect()
    assert (
        "the secrets differ. Every partition must use the same AllReduceParameter object, "
        "made on the driver" in str(failure.value)
    )


def meeting_task(links):
    """A barrier task that meets through ``DriverRendezvous`` over its partition's link; the
    addresses it learnt, and the one it gave."""

    def task(_rows):
        from pyspark import BarrierTaskContext

        from allreduce_param.spark.rendezvous import DriverRendezvous

        partition = BarrierTaskContext.get().partitionId()
        own = ("127.0.0.1", 6000 + partition)
        yield partition, DriverRendezvous(links[partition], patience=2.0).exchange(own)

    return task


@pytest.mark.slow
def test_tasks_meet_at_the_driver_and_fall_back_to_allgather_where_it_is_out_of_reach(spark):
    from allreduce_param.engine.movement.rendezvous import MeetingPoint
    from allreduce_param.engine.wire.messages import MessageClient, MessageServer

    expected = [("127.0.0.1", 6000), ("127.0.0.1", 6001)]
    rdd = spark.sparkContext.parallelize(range(2), 2)
    with socket.create_server(("127.0.0.1", 0)) as closed:
        nobody = closed.getsockname()[:2]  # where nothing listens once the with-block closed it
    for reachable in ((0, 1), (0,), ()):  # all at the driver; only partition 0; none
        meeting = MeetingPoint(2, patience=2.0)
        server = MessageServer("127.0.0.1", meeting.on_message)
        try:
            links = [
                server.client() if partition in reachable else MessageClient(nobody, server.secret)
                for partition in range(2)
            ]
            found = dict(rdd.barrier().mapPartitions(meeting_task(links)).collect())
        finally:
            server.close()
        assert found == {0: expected, 1: expected}, reachable
        # where partition 1 never came, the driver told partition 0 to use allGather
        assert len(meeting._meetings) == (1 if reachable else 0)
        if reachable:
            assert next(iter(meeting._meetings.values())).decided == (
                "met" if len(reachable) == 2 else "allgather"
            )


def test_a_task_whose_meeting_the_driver_ended_stops_with_a_peer_lost_error(spark):
    """``MeetingPoint.end()`` (a run of the fit's stage failed) while partition 0 waits for
    a partition 1 that never comes: partition 0 stops at once, saying why, rather than
    waiting out the patience."""
    from allreduce_param.engine.movement.rendezvous import MeetingPoint
    from allreduce_param.engine.wire.messages import MessageServer

    meeting = MeetingPoint(2, patience=600)
    came = threading.Event()

    def on_message(message, reply):
        meeting.on_message(message, reply)
        came.set()

    server = MessageServer("127.0.0.1", on_message)
    link = server.client()

    def task(_rows):
        from pyspark import BarrierTaskContext

        from allreduce_param.errors import PeerLostError
        from allreduce_param.spark.rendezvous import DriverRendezvous

        if BarrierTaskContext.get().partitionId() == 1:
            yield 1, "stayed away"
            return
        try:
            # waits at most 2 x 15 s for an answer: without end()'s, the task fails, not hangs
            DriverRendezvous(link, patience=15).exchange(("127.0.0.1", 6000))
            yield 0, "met"
        except PeerLostError as error:
            yield 0, str(error)

    def end_once_partition_0_came():
        if came.wait(120):
            meeting.end()

    ender = threading.Thread(target=end_once_partition_0_came, daemon=True)
    ender.start()
    try:
        found = dict(
            spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(task).collect()
        )
    finally:
        came.set()
        ender.join(30)
        server.close()
    assert found[1] == "stayed away"
    assert found[0] == (
        "partition 0 stops while meeting its peers: the fit ended on the driver (another task "
        "of the stage failed; its error is the fit's)"
    )
