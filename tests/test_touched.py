"""The touched-elements sync (``engine/movement/touched.py``): a ``SparseGradient`` put gives
the dense sync's bits, signed zeros and all, over partitions on one host and on several;
the fit that uses it equals the dense one and one process; bad pairs and settings it cannot
serve are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import run_partitions, train_on_threads

from allreduce_param import ConfigurationError, FitSettings, InputError, models, optim
from allreduce_param.engine import AllReduceParameter, SparseGradient, Strategy
from allreduce_param.engine.movement.touched import pack, unpack
from allreduce_param.errors import CorruptBlockError, NonFiniteGradientError
from allreduce_param.train import Regularization
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.touched import check_touched, why_not_touched


def touched_gradients(size: int, partitions: int, seed: int) -> list[np.ndarray]:
    """Dense gradients that are +0.0 outside a few elements each, with -0.0s, exact
    cancellations and elements only one partition touches among the touched."""
    rng = np.random.default_rng(seed)
    grads = []
    for _ in range(partitions):
        grad = np.zeros(size, np.float32)
        where = rng.permutation(np.flatnonzero(rng.random(size) < 0.6))
        grad[where] = rng.standard_normal(where.size).astype(np.float32)
        grad[where[:3]] = -0.0
        grads.append(grad)
    grads[0][7], grads[1][7], grads[-1][7] = 1.5, 0.0, -1.5  # cancels to +0.0
    for grad in grads:  # every partition -0.0 at 11: the dense sum stays -0.0
        grad[11] = -0.0
    grads[0][13] = -0.0  # -0.0 from one partition alone: the dense sum is +0.0 (N > 1)
    return grads


def sync(param: AllReduceParameter, grads: list[np.ndarray], touched: bool, hosts=None) -> list:
    """One step's aggregate on every partition: each its gradient, dense or as its touched
    elements (every element not +0.0)."""

    def body(p):
        p.init(np.zeros(param.size, np.float32))
        p.get_weights()
        grad = grads[p.info.partition_id]
        if touched:
            where = np.flatnonzero((grad != 0) | np.signbit(grad))
            grad = SparseGradient(where, grad[where])
        p.put_gradients(grad, count=p.info.partition_id + 1)
        return p.aggregate_gradient_partition().copy()

    return run_partitions(param, body, hosts=hosts)


@pytest.mark.parametrize(
    "hosts, arena",
    [(None, False), (None, True), ([[0, 1], [2]], True)],
    ids=["one host, blocks", "one host, arena", "two hosts"],
)
@pytest.mark.slow
def test_the_touched_sync_gives_the_dense_sums_bits(hosts, arena):
    """Three partitions, slices of two parts and touched blocks of two parts (0.6 of each
    slice touched: over 2^18 pairs an owner); on two simulated hosts the sums take the
    hosts' order, as the dense ones do. Through a host arena the pairs are written into
    the arena's dense gradient: the same bits again."""
    size, partitions = 3 * (2**19 + 1), 3
    grads = touched_gradients(size, partitions, seed=1)
    results = []
    for touched in (False, True):
        param = AllReduceParameter(
            partitions, size, codec="raw", timeout=60, topology="flat", host_arena=arena
        )
        slices = sync(param, grads, touched, hosts)
        for result in slices:
            assert isinstance(result, np.ndarray), result
        results.append(np.concatenate(slices))
    dense, sparse = results
    np.testing.assert_array_equal(dense.view(np.uint32), sparse.view(np.uint32))
    assert np.signbit(sparse[11]) and not np.signbit(sparse[13]) and sparse[7] == 0


def test_a_nan_among_the_touched_names_its_partition_and_index():
    param = AllReduceParameter(2, 1000, codec="raw", timeout=30)

    def body(p):
        p.init(np.zeros(param.size, np.float32))
        p.get_weights()
        values = np.ones(3, np.float32)
        if p.info.partition_id == 1:
            values[1] = np.nan
        p.put_gradients(SparseGradient(np.array([2, 600, 999]), values))
        return p.aggregate_gradient_partition()

    results = run_partitions(param, body)  # partition 0's fetch may see 1 fail and go
    assert isinstance(results[1], NonFiniteGradientError), results[1]
    assert "partition 1" in str(results[1]) and "index 600" in str(results[1])


@pytest.mark.parametrize(
    "indices, values, fragment",
    [
        ([1, 2000], [1.0, 2.0], "index 2000 (at 1) is out of range"),
        ([-1, 2], [1.0, 2.0], "index -1 (at 0) is out of range"),
        ([5, 5], [1.0, 2.0], "strictly increasing"),
        ([1, 2], [1.0], "of one length"),
        ([1.0, 2.0], [1.0, 2.0], "must be integers"),
        ([1, 2], [1, 2], "floating-point"),
    ],
)
def test_bad_pairs_are_refused_by_name_and_the_handle_goes_on(indices, values, fragment):
    param = AllReduceParameter(1, 1000, codec="raw", timeout=30)

    def body(p):
        p.init(np.zeros(param.size, np.float32))
        p.get_weights()
        with pytest.raises(InputError, match="put_gradients.SparseGradient. on partition 0"):
            p.put_gradients(SparseGradient(np.array(indices), np.array(values)))
        try:
            p.put_gradients(SparseGradient(np.array(indices), np.array(values)))
        except InputError as error:
            message = str(error)
        p.put_gradients(SparseGradient(np.array([3]), np.array([2.0], np.float32)))
        return message, p.aggregate_gradient_partition()[3]

    message, summed = run_partitions(param, body)[0]
    assert fragment in message
    assert summed == 2.0


@pytest.mark.parametrize(
    "settings, fragment",
    [
        (dict(codec="raw", gradient_codec="int8"), "gradient codec 'int8' is lossy"),
        (dict(codec="raw", strategy=Strategy("ssp", staleness=1)), "background owner"),
    ],
)
def test_settings_the_touched_sync_cannot_serve_are_named(settings, fragment):
    param = AllReduceParameter(1, 100, timeout=30, **settings)

    def body(p):
        p.init(np.zeros(param.size, np.float32))
        p.get_weights()
        with pytest.raises(InputError, match=fragment):
            p.put_gradients(SparseGradient(np.array([3]), np.array([2.0], np.float32)))

    assert run_partitions(param, body) == [None]


def test_a_corrupt_touched_block_is_named():
    block = pack((np.array([1, 5], np.uint32), np.array([1.0, 2.0], np.float32)), capacity=3)
    indices, values = unpack(block, 3, 10, "block")
    assert indices.tolist() == [1, 5] and values.tolist() == [1.0, 2.0]
    with pytest.raises(CorruptBlockError, match="past the slice's 5 elements"):
        unpack(block, 3, 5, "block")
    with pytest.raises(CorruptBlockError, match="more than its room for 1"):
        unpack(block, 1, 10, "block")


def sparse_fit(sync: str, parts, model, optimizer, **settings) -> list:
    """A BSP fit on the CSR ``parts``, one thread each, with ``sparse_sync=sync``."""
    param = AllReduceParameter(len(parts), model.size, codec="raw", timeout=60)
    settings = FitSettings(
        **{
            "batch_size": 30,
            "epochs": 2,
            "seed": 7,
            "threads": None,
            "sparse_sync": sync,
            **settings,
        }
    )
    job = TrainingJob(model, optimizer, param, settings, model.n_features, False, sparse=True)
    return train_on_threads(job, parts)


def csr_parts(features: int):
    X = sp.random(150, features, density=0.01, format="csr", dtype=np.float32, random_state=4)
    half = features // 2
    y = np.asarray(X[:, :half].sum(axis=1)).ravel() > np.asarray(X[:, half:].sum(axis=1)).ravel()
    y = y.astype(np.float64)
    return [(X[:40], y[:40]), (X[40:41], y[40:41]), (X[41:], y[41:])]


@pytest.mark.parametrize(
    "model, optimizer, reg",
    [
        (models.SoftmaxRegression(2000, 3), optim.Adam(lr=0.05), 0.0),
        (models.MLP([2000, 4, 2]), optim.SGD(lr=0.1, momentum=0.9), 0.01),
    ],
    ids=["softmax, Adam", "MLP, momentum, L2"],
)
def test_a_fit_with_the_touched_sync_equals_the_dense_one_and_one_process(model, optimizer, reg):
    """Three partitions of CSR rows (one of a single row): the touched sync's weights are the
    dense sync's bits, and one process's on the same global batches (summation order aside),
    whatever the optimizer does to untouched rows (Adam's moments, momentum, L2)."""
    from test_train_loop import reference_fit

    parts = csr_parts(model.n_features)
    regularised = {"regularization": Regularization(reg, standardization=False)} if reg else {}
    fits = {
        sync: sparse_fit(sync, parts, model, optimizer, **regularised)
        for sync in ("dense", "touched")
    }
    for outputs in fits.values():
        for output in outputs:
            assert isinstance(output, dict), output
    touched = np.frombuffer(fits["touched"][0]["weights"], np.float32)
    dense = np.frombuffer(fits["dense"][0]["weights"], np.float32)
    np.testing.assert_array_equal(touched.view(np.uint32), dense.view(np.uint32))
    if not reg:
        expected = reference_fit(model, optimizer, parts, batch_size=30, epochs=2, seed=7)
        np.testing.assert_allclose(touched, expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    "settings, sparse, fragment",
    [
        ({"threads": 2}, True, "its batches are split over threads"),
        ({"gradient_codec": "int8"}, True, "the gradient codec 'int8' is lossy"),
        ({"sync_every": 2}, True, "it needs plain BSP"),
        ({}, False, "the rows are dense"),
    ],
)
def test_sparse_sync_touched_where_it_cannot_serve_says_why(settings, sparse, fragment):
    """The driver refuses it before the stage (``check_touched``), as each task would."""
    model = models.LogisticRegression(200)
    fit = FitSettings(sparse_sync="touched", **settings)
    param = AllReduceParameter(2, model.size, codec="raw", gradient_codec=fit.gradient_codec)
    job = TrainingJob(model, optim.SGD(lr=0.1), param, fit, 200, False, sparse=sparse)
    with pytest.raises(ConfigurationError, match=f"cannot serve this fit: {fragment}"):
        check_touched(job)
    auto = TrainingJob(model, optim.SGD(lr=0.1), param, FitSettings(**settings), 200, False)
    check_touched(auto)  # 'auto' falls back to the dense sync without a word
    assert why_not_touched(auto) is not None
    with pytest.raises(ConfigurationError, match="sparse_sync must be one of 'auto', 'touched'"):
        FitSettings(sparse_sync="sometimes")


def test_auto_takes_the_touched_sync_from_2_to_the_22_features_on_sparse_rows():
    """``sparse_sync='auto'``: touched where the first layer is wide and the rows sparse,
    dense otherwise; 'dense' never."""
    from types import SimpleNamespace

    from allreduce_param.train.task.touched import TOUCHED_FROM_FEATURES, uses_touched_sync

    flat = SimpleNamespace(info=SimpleNamespace(hierarchical=False))
    for features, sparse, sync, expected in [
        (TOUCHED_FROM_FEATURES, True, "auto", True),
        (TOUCHED_FROM_FEATURES - 1, True, "auto", False),
        (TOUCHED_FROM_FEATURES, False, "auto", False),
        (TOUCHED_FROM_FEATURES, True, "dense", False),
        (16, True, "touched", True),
    ]:
        model = models.LogisticRegression(features)
        param = AllReduceParameter(2, model.size, codec="raw")
        settings = FitSettings(sparse_sync=sync)
        job = TrainingJob(model, optim.SGD(lr=0.1), param, settings, features, False, sparse=sparse)
        assert uses_touched_sync(job, flat) is expected, (features, sparse, sync)
    assert TOUCHED_FROM_FEATURES == 2**22


def test_a_hierarchical_sync_refuses_the_touched_put_by_name():
    param = AllReduceParameter(3, 100, codec="raw", timeout=30, topology="hierarchical")

    def body(p):
        p.init(np.zeros(param.size, np.float32))
        p.get_weights()
        with pytest.raises(InputError, match=r"topology hierarchical\): put the gradient as"):
            p.put_gradients(SparseGradient(np.array([3]), np.array([2.0], np.float32)))
        return p.info.hierarchical

    assert run_partitions(param, body, hosts=[[0, 1], [2]]) == [True, True, True]
