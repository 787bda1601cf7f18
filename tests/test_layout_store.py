"""Slice arithmetic and the versioned block store."""

from __future__ import annotations

import threading

import pytest

from allreduce_param import ConfigurationError, FetchTimeoutError, UsageError
from allreduce_param.engine import SliceLayout
from allreduce_param.engine.blocks.store import BlockKey, BlockKind, BlockStore
from allreduce_param.errors import StaleVersionError, StoreClosedError


@pytest.mark.parametrize("partitions", range(1, 9))
def test_slices_tile_the_vector_and_differ_by_at_most_one(partitions):
    for size in range(1, 60):
        layout = SliceLayout(size, partitions)
        starts = [layout.start(i) for i in range(partitions)]
        lengths = [layout.length(i) for i in range(partitions)]
        assert starts[0] == 0 and sum(lengths) == size
        assert all(starts[i] + lengths[i] == starts[i + 1] for i in range(partitions - 1))
        assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
        assert layout.max_length == max(lengths)
        assert [layout.bounds(i) for i in range(partitions)] == [
            slice(s, s + n) for s, n in zip(starts, lengths)
        ]


@pytest.mark.parametrize("partitions", range(1, 9))
def test_the_owners_of_a_range_are_the_slices_it_touches(partitions):
    for size in range(1, 40):
        layout = SliceLayout(size, partitions)
        for start in range(size + 1):
            for stop in range(start, size + 1):
                touched = [
                    p
                    for p in range(partitions)
                    if max(start, layout.start(p)) < min(stop, layout.start(p) + layout.length(p))
                ]
                assert list(layout.owners(start, stop)) == touched, (size, start, stop)
    with pytest.raises(ConfigurationError, match="elements 3:11 are outside the vector of 10"):
        SliceLayout(10, 4).owners(3, 11)


def test_the_formula_of_the_design():
    layout = SliceLayout(10, 4)  # q, r = 2, 2
    assert [(layout.start(i), layout.length(i)) for i in range(4)] == [
        (0, 3),
        (3, 3),
        (6, 2),
        (8, 2),
    ]
    small = SliceLayout(2, 5)
    assert [small.length(i) for i in range(5)] == [1, 1, 0, 0, 0]
    assert small.start(4) == 2


def test_layout_refuses_nonsense():
    with pytest.raises(ConfigurationError, match="partition 4 is outside 0..3"):
        SliceLayout(10, 4).start(4)
    with pytest.raises(ConfigurationError, match="size must be a positive"):
        SliceLayout(-1, 4)


KEY = BlockKey(BlockKind.WEIGHT, 1, 0)


def test_store_keeps_the_newest_versions_only():
    store = BlockStore(keep=2)
    for version in range(5):
        store.put(KEY, version, bytes([version]) * 10)
    assert store.nbytes == 20 and store.newest(KEY) == 4
    assert bytes(store.get(KEY, 3, timeout=0)[1]) == b"\x03" * 10
    with pytest.raises(StaleVersionError, match=r"version 2 is no longer kept \(kept: \[3, 4\]\)"):
        store.get(KEY, 2, timeout=0)
    with pytest.raises(UsageError, match="versions must increase"):
        store.put(KEY, 4, b"again")


def test_store_get_waits_for_a_version_and_times_out_clearly():
    store = BlockStore()
    got = []
    waiter = threading.Thread(target=lambda: got.append(bytes(store.get(KEY, 1, timeout=30)[1])))
    waiter.start()
    store.put(KEY, 0, b"old")
    store.put(KEY, 1, b"new")
    waiter.join()
    assert got == [b"new"]
    with pytest.raises(
        FetchTimeoutError,
        match="weight block from partition 1 to partition 0, version 2 was not published within 0.05 s",
    ):
        store.get(KEY, 2, timeout=0.05)


def test_closing_the_store_ends_waiting_gets():
    store = BlockStore()
    errors = []

    def wait():
        try:
            store.get(KEY, 0, timeout=60)
        except StoreClosedError as error:
            errors.append(error)

    waiter = threading.Thread(target=wait)
    waiter.start()
    store.close()
    waiter.join()
    assert len(errors) == 1 and "while the store closed" in str(errors[0])


def test_store_memory_is_bounded():
    store = BlockStore(keep=1, max_bytes=100)
    store.put(KEY, 0, bytes(60))
    store.put(KEY, 1, bytes(90))  # replaces version 0: 90 bytes held
    with pytest.raises(Exception, match="over its limit of 100"):
        store.put(BlockKey(BlockKind.GRADIENT, 1, 0), 0, bytes(20))


def test_a_get_that_does_not_wait_is_called_back_once_its_version_comes():
    store = BlockStore()
    called = []
    store.put(KEY, 0, b"old")
    # there: at once
    assert bytes(store.get_or_notify(KEY, 0, lambda: called.append("never"))[1]) == b"old"
    waiter = store.get_or_notify(KEY, 2, lambda: called.append("ready"), reader="r")
    assert not isinstance(waiter, tuple) and store.waiting == 1
    store.put(KEY, 1, b"not yet")
    assert called == [] and store.waiting == 1
    store.put(KEY, 2, b"new")
    assert called == ["ready"] and store.waiting == 0 and waiter.fired
    assert waiter.expire(5) is None  # the version came first: nothing to time out
    assert (
        bytes(store.get_or_notify(KEY, 2, lambda: called.append("again"), reader="r")[1]) == b"new"
    )
    assert called == ["ready"]


def test_a_get_that_does_not_wait_expires_with_the_blocking_gets_text_and_is_never_called():
    store = BlockStore()
    called = []
    waiter = store.get_or_notify(KEY, 3, lambda: called.append("late"))
    error = waiter.expire(0.25)
    assert isinstance(error, FetchTimeoutError) and store.waiting == 0
    assert str(error) == (
        "weight block from partition 1 to partition 0, version 3 was not published within "
        "0.25 s (newest there: none)"
    )
    store.put(KEY, 3, b"late")
    assert called == [] and waiter.expire(0.25) is None


def test_closing_the_store_calls_every_waiter_back_and_asking_again_says_why():
    store = BlockStore()
    called = []
    for version in range(3):
        store.get_or_notify(KEY, version, lambda version=version: called.append(version))
    store.close("partition 1 failed: ValueError: bad data")
    assert sorted(called) == [0, 1, 2] and store.waiting == 0
    with pytest.raises(StoreClosedError, match="partition 1 failed: ValueError: bad data"):
        store.get_or_notify(KEY, 0, lambda: called.append("after"))
    assert len(called) == 3


def test_a_replaced_version_is_stale_for_a_get_that_does_not_wait():
    store = BlockStore(keep=1)
    store.put(KEY, 0, b"a")
    store.put(KEY, 1, b"b")
    with pytest.raises(StaleVersionError, match=r"version 0 is no longer kept \(kept: \[1\]\)"):
        store.get_or_notify(KEY, 0, lambda: None)
    assert store.get_or_notify(KEY, 0, lambda: None, newest=True)[0] == 1
