"""Update strategies on the engine (partitions as threads over real sockets): which versions
each step reads, what owners take, and that no gradient is lost or applied twice.

A slow partition is made slow by the test itself: it waits on an event that the others set
when they have got as far as the strategy must let them go without it. If the engine made
them wait for it instead, the test would hang until its timeout and fail.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import raise_first, run_partitions

from allreduce_param import ConfigurationError, FetchTimeoutError, UsageError
from allreduce_param.engine import AllReduceParameter, Strategy
from allreduce_param.engine.blocks.store import BlockKey, BlockKind, BlockStore
from allreduce_param.engine.strategy import CLOCK_SHIFT, GRADIENT_BACKLOG

LR = np.float32(0.5)
SIZE = 1_100_001  # three parts per slice with N = 2: parts travel and are taken separately


def gradients(partitions: int, steps: int, size: int = SIZE) -> list[list[np.ndarray]]:
    """A distinct gradient sum for every partition and step (exact in float32)."""
    rng = np.random.default_rng(7)
    return [
        [rng.integers(-8, 8, size).astype(np.float32) for _ in range(steps)]
        for _ in range(partitions)
    ]


def counts(partitions: int) -> list[float]:
    return [float(3 + 2 * i) for i in range(partitions)]


def sgd(gradient: np.ndarray, weights: np.ndarray, step: int) -> None:
    weights -= LR * gradient


def replay(
    param: AllReduceParameter, start: np.ndarray, grads, sums_by_owner: list[list]
) -> np.ndarray:
    """The weights the owners' update logs imply: each update is the exact mean over the rows
    of the gradients it took, summed in partition order; ``sums_by_owner[j]`` gives, for each
    of owner j's updates, which (partition, step) gradients it took."""
    weights = start.copy()
    rows = counts(param.partition_num)
    for owner, updates in enumerate(sums_by_owner):
        part = param.layout.bounds(owner)
        for taken in updates:
            total = np.zeros(param.layout.length(owner), np.float32)
            for partition, step in taken:
                total += grads[partition][step][part]
            count = sum(rows[partition] for partition, _ in taken)
            if count:
                weights[part] -= LR * (total / np.float32(count))
    return weights


# ---- the rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [
        (("ssp", None, 0), "strategy='ssp' needs staleness=s"),
        (
            ("ssp", 0, 0),
            "staleness must be a whole number >= 1, got 0; staleness 0 is strategy='bsp'",
        ),
        (("bsp", 2, 0), "staleness=2 goes with strategy='ssp', not strategy='bsp'"),
        (("asp", 0, 1), "staleness=0 goes with strategy='ssp'"),
        (("asp", None, 1), "backup_workers=1 goes with strategy='bsp'"),
        (("bsp", None, -1), "backup_workers must be a whole number >= 0, got -1"),
        (("hogwild", None, 0), "strategy='hogwild' is not one of bsp, ssp, asp"),
    ],
)
def test_wrong_strategy_settings_name_the_setting(settings, message):
    with pytest.raises(ConfigurationError, match=message):
        Strategy(*settings)


def test_backup_workers_need_more_partitions_than_backups():
    with pytest.raises(
        ConfigurationError, match="backup_workers=2 needs more than 2 workers, this fit has 2"
    ):
        AllReduceParameter(2, 10, strategy=Strategy("bsp", backup_workers=2))


def test_each_strategy_keeps_exactly_what_a_reader_can_ask_for():
    assert Strategy().keep() == {
        BlockKind.WEIGHT: 1,
        BlockKind.GRADIENT: 1,
        BlockKind.REDUCE_INPUT: 1,
        BlockKind.REDUCE_OUTPUT: 1,
        BlockKind.CHOICE: 1,
        BlockKind.SIGNAL: 1,
        BlockKind.GRADIENT_HOST_SUM: 1,
        BlockKind.REDUCE_INPUT_HOST_SUM: 1,
        BlockKind.RAW_REDUCE_INPUT: 1,
        BlockKind.RAW_REDUCE_OUTPUT: 1,
        BlockKind.RAW_REDUCE_INPUT_HOST_SUM: 1,
        BlockKind.METADATA: 2,
        BlockKind.TYPED_CHUNK: 2,
        BlockKind.TYPED_SLICE: 2,
    }
    assert Strategy("bsp", backup_workers=1).keep()[BlockKind.GRADIENT] == 1
    for name, staleness in (("ssp", 3), ("asp", None)):
        strategy = Strategy(name, staleness)
        assert strategy.keep()[BlockKind.GRADIENT] == GRADIENT_BACKLOG
        assert strategy.keep()[BlockKind.WEIGHT] == 1  # readers ask for the newest only
        assert strategy.waits_for_readers() == {BlockKind.GRADIENT}
    ssp = Strategy("ssp", 3)
    assert ssp.weight_read(10, 0).version == 7 << CLOCK_SHIFT and not ssp.weight_read(10, 0).exact
    assert ssp.clock(ssp.weight_version(5, 123)) == 5
    assert Strategy().weight_read(4, 3).exact and Strategy().weight_read(4, 3).version == 4


# ---- the store under the rules -------------------------------------------------------------

KEY = BlockKey(BlockKind.WEIGHT, 0, 0xFFFFFFFF)


def test_a_buffer_a_reader_holds_is_not_rewritten():
    store = BlockStore(keep=1)
    first = store.reserve(KEY, 0, timeout=1)
    first[:] = b"zero"
    store.put(KEY, 0, first)
    assert store.get(KEY, 0, timeout=1, reader="slow") == (0, memoryview(b"zero"))
    for version in (1, 2, 3):  # newer versions come while "slow" still reads version 0
        buffer = store.reserve(KEY, version, timeout=1)
        assert buffer is not first
        buffer[:] = b"v%03d" % version
        store.put(KEY, version, buffer)
    assert bytes(first) == b"zero"
    assert store.buffer_count(KEY) == 3  # version 0 (held), the newest, and one to write into
    store.get(KEY, 0, timeout=1, newest=True, reader="slow")  # asking again lets version 0 go
    assert store.reserve(KEY, 4, timeout=1) is first


def test_a_newest_read_takes_the_newest_at_or_above_what_it_asks():
    store = BlockStore(keep=1)
    for version in (3, 9):
        store.put(KEY, version, b"%d" % version)
    assert store.get(KEY, 5, timeout=1, newest=True)[0] == 9
    got = []
    reader = threading.Thread(
        target=lambda: got.append(store.get(KEY, 10, timeout=30, newest=True)[0])
    )
    reader.start()
    store.put(KEY, 12, b"12")
    reader.join()
    assert got == [12]


def test_a_producer_waits_for_its_owner_instead_of_dropping_a_gradient():
    key = BlockKey(BlockKind.GRADIENT, 0, 1)
    store = BlockStore(keep=2, wait_for_readers={BlockKind.GRADIENT})
    for version in (0, 1):
        store.put(key, version, store.reserve(key, version, timeout=1))
    with pytest.raises(
        FetchTimeoutError,
        match=r"partition 1 did not take gradient block from partition 0 to "
        r"partition 1, version 0 within 0.05 s",
    ):
        store.reserve(key, 2, timeout=0.05)
    store.get(key, 0, timeout=1)
    store.get(key, 1, timeout=1)  # the owner has asked past version 0: it may go
    store.put(key, 2, store.reserve(key, 2, timeout=1))
    assert store.get(key, 1, timeout=0)[0] == 1


# ---- the strategies on partitions ------------------------------------------------------------


def test_ssp_reads_never_lag_more_than_the_staleness():
    staleness, steps = 2, 8
    grads = gradients(2, steps)
    start = np.random.default_rng(1).standard_normal(SIZE).astype(np.float32)
    param = AllReduceParameter(2, SIZE, "raw", timeout=60, strategy=Strategy("ssp", staleness))
    ahead = threading.Event()

    def body(p):
        p.init(start)
        p.background.serve_updates(sgd, steps)
        lags = []
        for step in range(steps):
            p.get_weights()
            lags.append(step - p.info.strategy.clock(p.info.last_read_version))
            if p.info.partition_id == 0 and step == staleness:
                ahead.set()  # partition 0 read at step s while partition 1 has not finished step 0
            if p.info.partition_id == 1 and step == 0:
                assert ahead.wait(60), "partition 0 could not run the staleness ahead"
            p.put_gradients(grads[p.info.partition_id][step], count=counts(2)[p.info.partition_id])
        p.background.finish_updates()
        return lags, p.get_weights(), p.background.updates

    results = raise_first(run_partitions(param, body))
    lags = [lag for result in results for lag in result[0]]
    assert max(lags) == staleness and min(lags) >= 0
    assert results[0][0][staleness] == staleness
    check_every_gradient_applied_once(param, start, grads, steps, results)


def test_asp_lets_the_others_finish_while_one_partition_is_stuck():
    steps = 6
    grads = gradients(2, steps)
    start = np.zeros(SIZE, np.float32)
    param = AllReduceParameter(2, SIZE, "raw", timeout=60, strategy=Strategy("asp"))
    others_done = threading.Event()

    def body(p):
        p.init(start)
        p.background.serve_updates(sgd, steps)
        for step in range(steps):
            p.get_weights()
            if p.info.partition_id == 1 and step == 0:
                assert others_done.wait(60), "partition 0 waited for the stuck partition"
            p.put_gradients(grads[p.info.partition_id][step], count=counts(2)[p.info.partition_id])
        if p.info.partition_id == 0:
            others_done.set()  # every step of partition 0 is put; partition 1 has computed nothing
        p.background.finish_updates()
        return None, p.get_weights(), p.background.updates

    results = raise_first(run_partitions(param, body))
    check_every_gradient_applied_once(param, start, grads, steps, results)


def check_every_gradient_applied_once(param, start, grads, steps, results) -> None:
    """Every owner took each partition's gradients in order, each once; the final weights
    are the same everywhere and what the owners' logs imply."""
    logs = []
    for updates in (result[2] for result in results):
        taken, seen = [], [0] * param.partition_num
        for update in updates:
            taken.append([(source, seen[source]) for source in update.sources])
            for source in update.sources:
                seen[source] += 1
        assert seen == [steps] * param.partition_num
        logs.append(taken)
    finals = [result[1] for result in results]
    assert all(np.array_equal(final, finals[0]) for final in finals)
    np.testing.assert_array_equal(finals[0], replay(param, start, grads, logs))


def test_backup_workers_go_on_without_the_straggler_and_use_exactly_the_rest():
    steps, partitions, late_step = 5, 3, 1
    grads = gradients(partitions, steps, size=300_007)
    start = np.ones(300_007, np.float32)
    param = AllReduceParameter(
        partitions, 300_007, "raw", timeout=60, strategy=Strategy("bsp", backup_workers=1)
    )
    step_done = threading.Event()

    def body(p):
        p.init(start)
        p.background.serve_updates(sgd, steps)
        read = []
        while True:
            p.get_weights()
            version = p.info.last_read_version
            read.append(version)
            if p.info.partition_id == 0 and version == late_step + 1:
                step_done.set()  # every owner finished the step without partition 2
            if version >= steps:
                break
            if p.info.partition_id == 2 and version == late_step:
                assert step_done.wait(60), "the owners waited for the straggler"
            p.put_gradients(
                grads[p.info.partition_id][version], count=counts(partitions)[p.info.partition_id]
            )
        p.background.finish_updates()
        return read, p.get_weights(), p.background.updates

    results = raise_first(run_partitions(param, body))
    # every slice took the same partitions' gradients at every step
    assert len({tuple(update.sources for update in result[2]) for result in results}) == 1
    for read, _, updates in results:
        assert [update.step for update in updates] == list(range(steps))
        assert all(len(update.sources) == partitions - 1 for update in updates)
        assert 2 not in updates[late_step].sources  # its gradient came too late and was dropped
        assert read == sorted(read) and read[-1] == steps
    logs = [
        [[(source, update.step) for source in update.sources] for update in result[2]]
        for result in results
    ]
    finals = [result[1] for result in results]
    assert all(np.array_equal(final, finals[0]) for final in finals)
    np.testing.assert_array_equal(finals[0], replay(param, start, grads, logs))


def test_the_bsp_calls_are_refused_under_a_background_owner():
    param = AllReduceParameter(2, 10, "raw", timeout=30, strategy=Strategy("asp"))

    def body(p):
        p.init(np.zeros(10))
        with pytest.raises(
            UsageError,
            match=r"aggregate_gradient_partition\(\) is BSP's; under 'asp' the "
            r"background owner that serve_updates\(\) starts",
        ):
            p.aggregate_gradient_partition()
        with pytest.raises(UsageError, match=r"finish_updates\(\) came before serve_updates\(\)"):
            p.background.finish_updates()
        p.background.serve_updates(sgd, 1)
        with pytest.raises(UsageError, match=r"serve_updates\(\) was called twice"):
            p.background.serve_updates(sgd, 1)
        p.get_weights()
        p.put_gradients(np.ones(10), count=1)
        p.background.finish_updates()
        return p.get_weights(), len(p.background.updates)

    results = raise_first(run_partitions(param, body))
    # each update subtracts LR times the mean of the gradients it took: 1 everywhere
    expected = np.concatenate([np.full(5, -LR * updates, np.float32) for _, updates in results])
    assert all(np.array_equal(weights, expected) for weights, _ in results)


def test_an_owner_that_fails_fails_its_partition_with_the_reason():
    param = AllReduceParameter(2, 10, "raw", timeout=30, strategy=Strategy("asp"))

    def broken(gradient, weights, step):
        raise ValueError("the optimizer broke")

    def body(p):
        p.init(np.zeros(10))
        p.background.serve_updates(broken if p.info.partition_id == 1 else sgd, 3)
        for _ in range(3):
            p.get_weights()
            p.put_gradients(np.ones(10), count=1)
        p.background.finish_updates()

    results = run_partitions(param, body)
    assert isinstance(results[1], Exception) and "the optimizer broke" in str(results[1])
    # partition 0 hears it from partition 1 (quoted, unless partition 1 was gone first)
    assert isinstance(results[0], Exception) and "partition 1" in str(results[0])
