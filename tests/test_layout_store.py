"""Slice arithmetic and the versioned block store."""

from __future__ import annotations

import threading

import pytest

from allreduce_param import ConfigurationError, FetchTimeoutError, SliceLayout, UsageError
from allreduce_param.errors import StaleVersionError, StoreClosedError
from allreduce_param.store import BlockKey, BlockKind, BlockStore


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
        assert [layout.bounds(i) for i in range(partitions)] == [slice(s, s + n) for s, n in zip(starts, lengths)]


@pytest.mark.parametrize("partitions", range(1, 9))
def test_the_owners_of_a_range_are_the_slices_it_touches(partitions):
    for size in range(1, 40):
        layout = SliceLayout(size, partitions)
        for start in range(size + 1):
            for stop in range(start, size + 1):
                touched = [p for p in range(partitions)
                           if max(start, layout.start(p)) < min(stop, layout.start(p) + layout.length(p))]
                assert list(layout.owners(start, stop)) == touched, (size, start, stop)
    with pytest.raises(ConfigurationError, match="elements 3:11 are outside the vector of 10"):
        SliceLayout(10, 4).owners(3, 11)


def test_the_formula_of_the_design():
    layout = SliceLayout(10, 4)  # q, r = 2, 2
    assert [(layout.start(i), layout.length(i)) for i in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
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
    with pytest.raises(FetchTimeoutError, match="weight block from partition 1 to partition 0, version 2 was not published within 0.05 s"):
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
