"""The worker loop on N threads against single-process mini-batch training on the same batches."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import blobs, train_on_threads

from allreduce_param import FitSettings, TrainingError, models, optim
from allreduce_param.engine import AllReduceParameter
from allreduce_param.train import Regularization
from allreduce_param.train.records import STEP_FIELDS
from allreduce_param.train.task.batching import (
    epoch_order,
    global_batch_sizes,
    share_bounds,
    steps_per_epoch,
)
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.memory_rows import Rows

run_workers = train_on_threads


def reference_fit(
    model,
    optimizer,
    parts,
    batch_size: int,
    epochs: int,
    seed: int,
    penalty: optim.ElasticNet | None = None,
    factors: np.ndarray | None = None,
    held: np.ndarray | None = None,
) -> np.ndarray:
    """Single-process mini-batch training over the very global batches the workers build;
    with ``penalty`` scaled by ``factors`` per coordinate, and the ``held`` ones kept at 0."""
    counts = [X.shape[0] for X, _ in parts]
    steps = steps_per_epoch(sum(counts), batch_size)
    weights = model.init(np.random.default_rng(seed))
    if held is not None:
        weights[held] = 0.0
    state = optimizer.init_state(weights.size)
    sizes = global_batch_sizes(counts, steps)
    global_step = 0
    for epoch in range(epochs):
        orders = [epoch_order(n, seed, epoch, i) for i, n in enumerate(counts)]
        cuts = [share_bounds(n, i, len(parts), steps) for i, n in enumerate(counts)]
        for step in range(steps):
            if sizes[step] == 0:
                continue
            take = [orders[i][cuts[i][step] : cuts[i][step + 1]] for i in range(len(parts))]
            blocks = [parts[i][0][rows] for i, rows in enumerate(take)]
            X = (
                sp.vstack(blocks, format="csr")
                if sp.issparse(blocks[0])
                else np.concatenate(blocks)
            )
            y = np.concatenate([parts[i][1][rows] for i, rows in enumerate(take)])
            _, grad, count = model.loss_and_grad(weights, X, y)
            grad = grad / np.float32(count)
            if held is not None:
                grad[held] = 0.0
            scale = optim.clip_scale(
                float(np.dot(grad.astype(np.float64), grad)), optimizer.clip_norm
            )
            optimizer.step(
                weights,
                grad,
                state,
                global_step,
                grad_scale=scale,
                penalty=penalty,
                penalized=factors,
            )
            global_step += 1
    return weights


CASES = {
    "even": ([40, 40, 40], None, None),
    "skewed with an empty partition": ([0, 7, 90], None, None),
    "sub-batches on threads": ([33, 50], 3, None),
    "uneven sub-batch workloads and clipping": ([60, 61], [1.0, 3.0], 0.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bsp_steps_equal_single_process_minibatch_training(case):
    counts, threads, clip = CASES[case]
    X, y = blobs(sum(counts), 6, 3, seed=1)
    bounds = np.cumsum([0, *counts])
    parts = [(X[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    model = models.MLP([6, 16, 3])
    optimizer = optim.SGD(lr=0.1, momentum=0.9, clip_norm=clip)
    param = AllReduceParameter(len(parts), model.size, codec="raw", timeout=60)
    job = TrainingJob(
        model,
        optimizer,
        param,
        FitSettings(batch_size=32, epochs=3, seed=5, threads=threads),
        n_features=6,
        has_validation=False,
    )
    outputs = run_workers(job, parts)
    for output in outputs:
        assert isinstance(output, dict), output
    expected = reference_fit(model, optimizer, parts, batch_size=32, epochs=3, seed=5)
    weights = np.frombuffer(outputs[0]["weights"], np.float32)
    # the same batches and updates; only the summation order of the gradient differs
    np.testing.assert_allclose(weights, expected, rtol=2e-5, atol=2e-6)
    # every partition took part in every step, with its true count
    steps = [np.frombuffer(o["steps"], np.float64).reshape(-1, len(STEP_FIELDS)) for o in outputs]
    assert len({len(s) for s in steps}) == 1
    assert sum(s[:, 3].sum() for s in steps) == 3 * sum(counts)


def test_rows_in_memory_gathered_into_a_room_are_the_fresh_rows_bit_for_bit():
    """``Rows.take`` into a room: each answer holds exactly its rows (batches longer, shorter,
    longer again), in views of the room's arrays; CSR rows come fresh."""
    rng = np.random.default_rng(0)
    X, y, w = rng.standard_normal((53, 7), np.float32), rng.random(53), rng.random(53)
    rows, order = Rows(X, y, w), epoch_order(53, 3, 0, 0)
    room = rows.room_for(26)
    for start, stop in ((0, 20), (20, 27), (27, 53)):
        got, fresh = rows.take(order[start:stop], room), rows.take(order[start:stop])
        for a, b, kept in zip(got, fresh, room):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
            assert np.shares_memory(a, kept)
    sparse = Rows(sp.csr_matrix(X), y, None)
    taken = sparse.take(order[:5], sparse.room_for(5))
    assert sp.issparse(taken.X) and (taken.X.toarray() == X[order[:5]]).all()


class Gathered(models.SoftmaxRegression):
    """Keeps each step's rows, by partition, to see where they lie (a one-thread fit computes
    into the parameter's buffer; each partition trains this one model). Kept alive, fresh
    arrays could not share an address by reuse of freed memory."""

    rows: dict[str, list] = {}

    def loss_and_grad_into(self, weights, X, y, out, ready=None, sample_weight=None):
        kept = Gathered.rows.setdefault(threading.current_thread().name, [])
        kept.append((X, y, sample_weight))
        return super().loss_and_grad_into(weights, X, y, out, ready, sample_weight=sample_weight)


def test_a_fit_gathers_each_steps_rows_in_memory_into_one_room():
    """Every step of a partition's fit (batches of 11 and 12 rows, weighted) takes its rows
    in one room of its own, not in fresh arrays each step."""
    X, y = blobs(70, 4, 2, seed=4)
    weight = np.random.default_rng(1).random(70)
    split = np.zeros(70, np.int32)
    model = Gathered(4, 2)
    param = AllReduceParameter(3, model.size, codec="raw", timeout=60)
    settings = FitSettings(batch_size=35, epochs=2, seed=0, overlap=False)
    parts = [(X[a:b], y[a:b], split[a:b], weight[a:b]) for a, b in ((0, 23), (23, 46), (46, 70))]
    outputs = train_on_threads(
        TrainingJob(model, optim.SGD(lr=0.1), param, settings, 4, False), parts
    )
    assert all(isinstance(output, dict) for output in outputs), outputs
    assert sorted(Gathered.rows) == ["partition-0", "partition-1", "partition-2"]
    assert {len(y) for steps in Gathered.rows.values() for _, y, _ in steps} == {11, 12}
    for steps in Gathered.rows.values():
        assert len(steps) == 4
        first = steps[0]
        for step in steps[1:]:
            assert all(np.shares_memory(a, b) for a, b in zip(step, first))


@pytest.mark.parametrize(
    "fit_intercept, standardization", [(True, False), (False, False), (True, True)]
)
def test_regularised_bsp_steps_equal_single_process_training(fit_intercept, standardization):
    """Elastic net on each owner's slice (L2 through Adam, L1 as a proximal step), the
    intercepts spared (or held at 0), the penalty standardized by each feature's std over
    every partition's rows (a constant feature's weights held at 0): the sharded fit is one
    process's, to float32 rounding (the std's sums)."""
    X, y = blobs(120, 6, 3, seed=2)
    X[:, 2] = 1.5  # a constant feature
    X[:, 4] *= 0.05  # one of a small spread: penalised less under standardization
    parts = [(X[:50], y[:50]), (X[50:57], y[50:57]), (X[57:], y[57:])]
    model = models.MLP([6, 16, 3])
    optimizer = optim.Adam(lr=0.05, clip_norm=1.0)
    settings = FitSettings(
        batch_size=32,
        epochs=3,
        seed=5,
        regularization=Regularization(0.5, 0.8, standardization=standardization),
        fit_intercept=fit_intercept,
    )
    param = AllReduceParameter(len(parts), model.size, codec="raw", timeout=60)
    job = TrainingJob(model, optimizer, param, settings, n_features=6, has_validation=False)
    outputs = run_workers(job, parts)
    assert all(isinstance(output, dict) for output in outputs), outputs
    weights = np.frombuffer(outputs[0]["weights"], np.float32)
    biases = ~model.penalized()
    factors, held = biases == 0, None if fit_intercept else biases
    if standardization:  # numpy's std (float64, unbiased) over all the rows
        factors = model.penalty_factors(X.astype(np.float64).std(axis=0, ddof=1))
        held = (factors == 0) & ~biases
    expected = reference_fit(
        model,
        optimizer,
        parts,
        32,
        3,
        5,
        settings.regularization.penalty(),
        factors.astype(np.float32),
        held,
    )
    np.testing.assert_allclose(weights, expected, rtol=2e-5, atol=2e-6)
    assert (weights[~biases] == 0).sum() > 10  # the L1 part made exact zeros
    assert (weights[biases] == 0).all() != fit_intercept  # held at 0 only without intercepts
    if standardization:
        first = model.tensors(weights)["w1"]
        assert (first[2] == 0).all()  # the constant feature's weights
        assert (first[4] != 0).sum() > (first[1] != 0).sum()  # the smaller spread, fewer zeros


@pytest.mark.parametrize(
    "changes", [{"strategy": "ssp", "staleness": 1}, {"sync_every": 2}], ids=["ssp", "local-sgd"]
)
def test_the_background_owner_and_local_sgd_regularise_too(changes):
    X, y = blobs(90, 6, 3, seed=3)
    parts = [(X[:40], y[:40]), (X[40:], y[40:])]
    model = models.MLP([6, 8, 3])
    settings = FitSettings(
        batch_size=30,
        epochs=3,
        seed=1,
        regularization=Regularization(0.5, 1.0, standardization=False),
        fit_intercept=False,
        **changes,
    )
    param = AllReduceParameter(
        2, model.size, codec="raw", timeout=60, strategy=settings.synchronisation
    )
    job = TrainingJob(model, optim.SGD(lr=0.1), param, settings, n_features=6, has_validation=False)
    outputs = run_workers(job, parts)
    assert all(isinstance(output, dict) for output in outputs), outputs
    weights = np.frombuffer(outputs[0]["weights"], np.float32)
    assert (weights[~model.penalized()] == 0).all()
    assert (weights[model.penalized()] == 0).sum() > 10


@pytest.mark.parametrize("strategy", ["ssp", "asp"])
@pytest.mark.parametrize("standardization", [False, True])
def test_a_background_owners_clip_leaves_out_the_held_coordinates_as_bsps_does(
    strategy, standardization
):
    """Each partition clips its own gradient under SSP/ASP: by the norm of the trained
    coordinates alone, as BSP clips, not counting the gradient of an intercept held at 0
    by fit_intercept=False (or of a constant feature's weights). One step on one partition
    reads the initial weights under any strategy, so it is then BSP's step, to float32
    rounding (where the clip's scale is applied)."""
    X, y = blobs(40, 5, 3, seed=4)
    X[:, 3] = 2.0  # a constant feature: its weights are held at 0 under standardization
    model = models.MLP([5, 8, 3])

    def one_step(**strategy):
        settings = FitSettings(
            batch_size=40,
            epochs=1,
            seed=1,
            regularization=Regularization(0.01, standardization=standardization),
            fit_intercept=False,
            **strategy,
        )
        param = AllReduceParameter(
            1, model.size, codec="raw", timeout=60, strategy=settings.synchronisation
        )
        optimizer = optim.SGD(lr=0.5, clip_norm=0.05)  # far below the step's gradient norm
        job = TrainingJob(model, optimizer, param, settings, n_features=5, has_validation=False)
        (output,) = run_workers(job, [(X, y)])
        assert isinstance(output, dict), output
        return np.frombuffer(output["weights"], np.float32)

    staleness = {"staleness": 1} if strategy == "ssp" else {}
    bsp, background = one_step(), one_step(strategy=strategy, **staleness)
    np.testing.assert_allclose(background, bsp, rtol=1e-5, atol=1e-7)


class AskedParts(models.MLP):
    """An MLP that records the ``part`` each penalty call asks for (class-wide: threads)."""

    asked: list = []

    def penalized(self, part=None):
        AskedParts.asked.append(part)
        return super().penalized(part)

    def penalty_factors(self, feature_std, part=None):
        AskedParts.asked.append(part)
        return super().penalty_factors(feature_std, part)


class WholeOnly(models.MLP):
    """An MLP whose penalty calls build the whole vector only (no ``part=``), as a model
    written before ``part`` was."""

    def penalized(self):
        return super().penalized()

    def penalty_factors(self, feature_std):
        return super().penalty_factors(feature_std)


def test_each_task_builds_its_own_slice_of_the_penalty_alone_with_the_same_bits():
    """Each owner asks the model for its slice of the mask and the standardized factors
    (not the whole vector's, 64-128 MB at 2**24 features); a model that builds only the
    whole vector is cut instead, to the same bits."""
    X, y = blobs(60, 5, 3, seed=6)
    parts = [(X[:20], y[:20]), (X[20:45], y[20:45]), (X[45:], y[45:])]
    settings = FitSettings(batch_size=15, epochs=2, seed=2, regularization=Regularization(0.3, 0.5))

    def fit(model):
        param = AllReduceParameter(3, model.size, codec="raw", timeout=60)
        job = TrainingJob(model, optim.Adam(lr=0.05), param, settings, 5, has_validation=False)
        outputs = run_workers(job, parts)
        assert all(isinstance(output, dict) for output in outputs), outputs
        return np.frombuffer(outputs[0]["weights"], np.float32), param

    AskedParts.asked = []
    sliced, param = fit(AskedParts([5, 8, 3]))
    owners = {(param.layout.start(i), param.layout.bounds(i).stop) for i in range(3)}
    asked = {None if part is None else (part.start, part.stop) for part in AskedParts.asked}
    assert asked == owners, AskedParts.asked
    assert np.array_equal(sliced, fit(WholeOnly([5, 8, 3]))[0])


class Counted(models.MLP):
    """An MLP that counts its calls of each kind (class-wide: the partitions are threads)."""

    calls: dict = {}

    def loss_and_grad(self, weights, X, y):
        Counted.calls["loss_and_grad"] = Counted.calls.get("loss_and_grad", 0) + 1
        return super().loss_and_grad(weights, X, y)

    def loss_and_grad_into(self, weights, X, y, out, ready=None):
        Counted.calls["into"] = Counted.calls.get("into", 0) + 1
        if ready is not None:  # streamed: each range sent as it is final
            Counted.calls["streamed"] = Counted.calls.get("streamed", 0) + 1
        return super().loss_and_grad_into(weights, X, y, out, ready)


@pytest.mark.parametrize("codec", ["raw", "lz4", "bf16"])
def test_overlapping_the_sync_with_backward_changes_no_bit_of_the_fit(codec):
    """With overlap (the default) a BSP step streams its gradient as backward finishes each
    layer; the weights and every record of the fit are those of putting it whole."""
    X, y = blobs(150, 6, 3, seed=4)
    parts = [(X[:50], y[:50]), (X[50:95], y[50:95]), (X[95:], y[95:])]
    model = Counted([6, 32, 16, 3])
    fits = {}
    for overlap in (True, False):
        Counted.calls = {}
        param = AllReduceParameter(3, model.size, codec=codec, timeout=60)
        job = TrainingJob(
            model,
            optim.Adam(lr=0.01, clip_norm=1.0),
            param,
            FitSettings(batch_size=24, epochs=2, seed=3, threads=None, overlap=overlap),
            n_features=6,
            has_validation=False,
        )
        outputs = run_workers(job, parts)
        assert all(isinstance(output, dict) for output in outputs), outputs
        steps = np.frombuffer(outputs[0]["steps"], np.float64).reshape(-1, len(STEP_FIELDS))
        fits[overlap] = (
            np.frombuffer(outputs[0]["weights"], np.float32),
            steps[:, :4],
            dict(Counted.calls),
        )
    assert np.array_equal(fits[True][0], fits[False][0])
    # epoch, step, loss and count of every step
    assert np.array_equal(fits[True][1], fits[False][1])
    streamed, whole = fits[True][2], fits[False][2]
    # each step streamed; without overlap each step's gradient went into the parameter's
    # buffer whole (loss_and_grad_into, no ranges), none streamed
    assert streamed["streamed"] == 3 * len(fits[True][1])
    assert "streamed" not in whole and whole["into"] >= 3 * len(fits[True][1])


@pytest.mark.parametrize("transport, streamed", [({}, False), ({"unix_sockets": False}, True)])
def test_overlap_auto_streams_where_a_peer_is_reached_over_the_network(transport, streamed):
    """On one host the sync is memory copies and encoding, which would only compete with
    backward for the cores; over TCP (as between hosts) there is wire time to hide."""
    X, y = blobs(60, 6, 3, seed=4)
    model = Counted([6, 8, 3])
    Counted.calls = {}
    param = AllReduceParameter(2, model.size, codec="lz4", timeout=60, **transport)
    # overlap="auto", the default
    job = TrainingJob(
        model,
        optim.SGD(lr=0.1),
        param,
        FitSettings(batch_size=20, epochs=1, seed=0, threads=None),
        n_features=6,
        has_validation=False,
    )
    outputs = run_workers(job, [(X[:30], y[:30]), (X[30:], y[30:])])
    assert all(isinstance(output, dict) for output in outputs), outputs
    steps = len(np.frombuffer(outputs[0]["steps"], np.float64).reshape(-1, len(STEP_FIELDS)))
    assert Counted.calls.get("streamed", 0) == (2 * steps if streamed else 0)


def test_a_failing_step_names_partition_epoch_and_step():
    class Fragile(models.SoftmaxRegression):
        calls = 0

        def loss_and_grad(self, weights, X, y):
            Fragile.calls += 1
            if len(X) and X[0, 0] > 100:  # only partition 1 holds such rows
                raise ValueError("a poisoned row")
            return super().loss_and_grad(weights, X, y)

    X, y = blobs(40, 4, 2, seed=2)
    poisoned = X[20:].copy()
    poisoned[:, 0] = 1000
    model = Fragile(4, 2)
    param = AllReduceParameter(2, model.size, codec="raw", timeout=60)
    job = TrainingJob(
        model, optim.SGD(lr=0.1), param, FitSettings(batch_size=8, epochs=1, seed=0), 4, False
    )
    outputs = run_workers(job, [(X[:20], y[:20]), (poisoned, y[20:])])
    assert isinstance(outputs[1], TrainingError)
    assert str(outputs[1]) == "partition 1, epoch 0, step 0: ValueError: a poisoned row"
    assert isinstance(
        outputs[0], TrainingError
    ) and "partition 0, epoch 0, step 0: PeerLostError" in str(outputs[0])


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"batch_size": 0}, "batch_size must be a positive whole number, got 0"),
        ({"epochs": 1.5}, "epochs must be a positive whole number, got 1.5"),
        ({"num_workers": 0}, "num_workers must be a positive whole number, got 0"),
        ({"codec": "zip"}, "unknown codec 'zip'"),
        ({"threads": 0}, "threads must be a positive count or a list of positive workloads, got 0"),
        ({"threads": [1.0, -2.0]}, r"threads must be .* got \[1.0, -2.0\]"),
        ({"overlap": "sometimes"}, "overlap must be True, False or 'auto', got 'sometimes'"),
    ],
)
def test_settings_are_checked_when_the_optimizer_is_made(settings, message):
    from allreduce_param import ConfigurationError, DistriOptimizer

    with pytest.raises(ConfigurationError, match=message):
        DistriOptimizer(models.MLP([2, 3, 2]), optim.SGD(lr=0.1), **settings)


def test_a_model_without_the_protocol_is_refused():
    from allreduce_param import ConfigurationError, DistriOptimizer

    with pytest.raises(
        ConfigurationError,
        match=r"has no init\(\) method; a model needs init\(rng\), loss_and_grad",
    ):
        DistriOptimizer(object(), optim.SGD(lr=0.1))


# ---- strategies and sync frequencies ---------------------------------------------------------

from allreduce_param.engine import Strategy  # noqa: E402
from allreduce_param.train.result import (  # noqa: E402
    UPDATE_FIELDS,
    History,  # noqa: E402
)


def reference_local_sgd(
    model, optimizer, parts, batch_size, epochs, seed, every, averaging
) -> np.ndarray:
    """Each partition steps its own model; at every sync (every ``every`` steps and at each
    epoch's end) the models are averaged by rows, or the updates summed, in partition order."""
    counts = [X.shape[0] for X, _ in parts]
    steps = steps_per_epoch(sum(counts), batch_size)
    sizes = global_batch_sizes(counts, steps)
    plan = [(epoch, step) for epoch in range(epochs) for step in range(steps) if sizes[step]]
    synced = model.init(np.random.default_rng(seed))
    local = [synced.copy() for _ in parts]
    states = [optimizer.init_state(synced.size) for _ in parts]
    rows, since = [0] * len(parts), 0
    for index, (epoch, step) in enumerate(plan):
        for i, (X, y) in enumerate(parts):
            order = epoch_order(len(X), seed, epoch, i)
            cuts = share_bounds(len(X), i, len(parts), steps)
            take = order[cuts[step] : cuts[step + 1]]
            _, grad, count = model.loss_and_grad(local[i], X[take], y[take])
            if count:
                optimizer.step(local[i], grad, states[i], index, grad_scale=1.0 / count)
            rows[i] += count
        since += 1
        if since == every or index + 1 == len(plan) or plan[index + 1][0] != epoch:
            total = np.zeros_like(synced)
            for i in range(len(parts)):
                total += local[i] * np.float32(rows[i]) if averaging else local[i] - synced
            synced = total / np.float32(sum(rows)) if averaging else synced + total
            local = [synced.copy() for _ in parts]
            rows, since = [0] * len(parts), 0
    return synced


@pytest.mark.parametrize("every, averaging", [(4, True), ("epoch", True), (3, False)])
def test_local_sgd_equals_its_single_process_reference(every, averaging):
    counts = [30, 0, 47]
    X, y = blobs(sum(counts), 5, 3, seed=3)
    bounds = np.cumsum([0, *counts])
    parts = [(X[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    model, optimizer = models.MLP([5, 8, 3]), optim.Adam(lr=0.01)
    param = AllReduceParameter(len(parts), model.size, codec="raw", timeout=60)
    job = TrainingJob(
        model,
        optimizer,
        param,
        FitSettings(
            batch_size=16,
            epochs=2,
            seed=4,
            threads=None,
            sync_every=every,
            model_averaging=averaging,
        ),
        n_features=5,
        has_validation=False,
    )
    outputs = run_workers(job, parts)
    for output in outputs:
        assert isinstance(output, dict), output
    expected = reference_local_sgd(model, optimizer, parts, 16, 2, 4, every, averaging)
    np.testing.assert_allclose(
        np.frombuffer(outputs[0]["weights"], np.float32), expected, rtol=1e-5, atol=1e-6
    )


class StepListener:
    """A way to the driver for ``TrainingJob``: keeps which steps each partition has reported."""

    def __init__(self):
        self.changed = threading.Condition()
        self.steps: dict[int, int] = {}

    def send(self, message):
        if message["kind"] == "step":
            with self.changed:
                self.steps[message["record"][-1]] = self.steps.get(message["record"][-1], 0) + 1
                self.changed.notify_all()

    def close(self):
        pass


class Straggler(models.SoftmaxRegression):
    """The last partition (its thread's name says so) stops at its first step until the
    listener has seen ``ahead`` steps of the others: a slow executor, made by the test, not
    by timing."""

    listener: StepListener | None = None
    ahead = 0
    slow = "partition-2"

    def loss_and_grad(self, weights, X, y):
        listener = Straggler.listener
        if threading.current_thread().name == Straggler.slow and listener is not None:
            with listener.changed:
                assert listener.changed.wait_for(
                    lambda: sum(listener.steps.values()) >= Straggler.ahead, 60
                )
            Straggler.listener = None
        return super().loss_and_grad(weights, X, y)


def train_with_straggler(
    parts, strategy: Strategy, ahead: int, lr: float, batch_size: int
) -> History:
    """Three epochs of SGD on ``parts``, one partition each, the last of them held back at
    its first step until the others have reported ``ahead`` steps; the merged history."""
    Straggler.listener, Straggler.ahead, Straggler.slow = (
        StepListener(),
        ahead,
        f"partition-{len(parts) - 1}",
    )
    model = Straggler(4, 3)
    param = AllReduceParameter(len(parts), model.size, codec="raw", timeout=60, strategy=strategy)
    job = TrainingJob(
        model,
        optim.SGD(lr=lr),
        param,
        FitSettings(batch_size=batch_size, epochs=3, seed=0, threads=None, progress=True),
        n_features=4,
        has_validation=False,
        driver=Straggler.listener,
    )
    outputs = run_workers(job, parts)
    for output in outputs:
        assert isinstance(output, dict), output
    return merged_history(outputs, len(parts))


def merged_history(outputs, partitions: int) -> History:
    steps = [np.frombuffer(o["steps"], np.float64).reshape(-1, len(STEP_FIELDS)) for o in outputs]
    shares = [share for o in outputs for share in json.loads(o["epochs"])]
    updates = [
        np.frombuffer(o["updates"], np.float64).reshape(-1, len(UPDATE_FIELDS) + partitions)
        for o in outputs
        if "updates" in o
    ]
    return History.from_records(steps, shares, 1.0, updates)


def test_backup_workers_leave_out_a_straggler_and_count_it():
    X, y = blobs(180, 4, 3, seed=5)
    parts = [(X[i::3], y[i::3]) for i in range(3)]
    history = train_with_straggler(
        parts, Strategy("bsp", backup_workers=1), ahead=8, lr=0.2, batch_size=30
    )
    assert len(history.steps) == 18  # every step recorded by every partition, computed or skipped
    # one partition left out of every step, the same for every slice; the straggler most
    assert all(step["dropped"] == 1 for step in history.steps) and history.dropped.get(2, 0) >= 4
    assert history.steps[1]["samples"] < 30  # partition 2 skipped the steps it missed
    assert history.epochs[-1]["train_accuracy"] >= 0.9


@pytest.mark.parametrize("strategy", [Strategy("ssp", staleness=2), Strategy("asp")])
def test_asynchronous_strategies_train_and_record_their_staleness(strategy):
    X, y = blobs(240, 4, 3, seed=6)
    parts = [(X[:100], y[:100]), (X[100:], y[100:])]
    model = models.MLP([4, 8, 3])
    param = AllReduceParameter(2, model.size, codec="raw", timeout=60, strategy=strategy)
    job = TrainingJob(
        model,
        optim.Adam(lr=0.02),
        param,
        FitSettings(batch_size=24, epochs=4, seed=0, threads=2),
        n_features=4,
        has_validation=False,
    )
    outputs = run_workers(job, parts)
    for output in outputs:
        assert isinstance(output, dict), output
    history = merged_history(outputs, 2)
    assert len(history.steps) == 40 and sum(s["samples"] for s in history.steps) == 4 * 240
    if strategy.name == "ssp":
        assert max(step["staleness"] for step in history.steps) <= 2
    assert history.epochs[-1]["train_accuracy"] >= 0.9


def test_asp_keeps_the_others_stepping_while_one_partition_is_stuck_and_still_converges():
    X, y = blobs(200, 4, 3, seed=8)
    parts = [(X[:100], y[:100]), (X[100:], y[100:])]
    steps = 3 * steps_per_epoch(200, 20)
    # partition 1 computes nothing until partition 0 has reported every one of its steps
    history = train_with_straggler(parts, Strategy("asp"), ahead=steps, lr=0.1, batch_size=20)
    # partition 0 stepped on to its last step with weights that held none of partition 1's steps
    assert max(step["staleness"] for step in history.steps) == steps - 1
    assert history.epochs[-1]["train_accuracy"] >= 0.9


def test_the_moments_for_standardization_are_the_same_from_dense_and_sparse_rows():
    import scipy.sparse

    from allreduce_param.train.regularisation import local_moments

    rng = np.random.default_rng(0)
    X = (rng.standard_normal((50, 7)) * (rng.random((50, 7)) < 0.3)).astype(np.float32)
    weight = rng.random(50)
    x = X.astype(np.float64)
    for rows in (X, scipy.sparse.csr_matrix(X)):
        first, second, total, squares = local_moments(rows, weight)
        np.testing.assert_allclose(first, weight @ x, rtol=1e-12)
        np.testing.assert_allclose(second, weight @ (x * x), rtol=1e-12)
        assert (total, squares) == pytest.approx((weight.sum(), (weight**2).sum()))


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_a_lossy_codec_standardizes_with_the_moments_a_raw_one_has(codec):
    """The features' moments are summed raw whatever the fit's codec (a bf16 or int8 sum of
    them moved every std by up to 7%): the very bits of a raw fit's std."""
    from conftest import run_partitions

    from allreduce_param.train.regularisation import feature_std

    rng = np.random.default_rng(5)
    X = (rng.standard_normal((90, 4)) * [1.0, 10.0, 0.1, 0.0] + [0, 100, 0, 3]).astype(np.float32)
    cuts = [(0, 40), (40, 40), (40, 90)]

    def std(p):
        return feature_std(p, X[slice(*cuts[p.info.partition_id])])

    raw = run_partitions(AllReduceParameter(3, 8, codec="raw", timeout=60), std)
    lossy = run_partitions(AllReduceParameter(3, 8, codec=codec, timeout=60), std)
    for result in lossy:
        assert np.array_equal(result, raw[0]), (result, raw[0])


def test_the_feature_std_over_partitions_is_mllibs_weighted_unbiased_one():
    """Each partition's rows (one partition with none) and sample weights: every partition
    gets the same std, numpy's weighted unbiased one to float32 rounding."""
    from conftest import run_partitions

    from allreduce_param.train.regularisation import feature_std

    rng = np.random.default_rng(5)
    X = (rng.standard_normal((90, 4)) * [1.0, 10.0, 0.1, 0.0] + [0, 100, 0, 3]).astype(np.float32)
    weight = rng.random(90) * 2
    cuts = [(0, 40), (40, 40), (40, 90)]
    param = AllReduceParameter(3, 8, codec="raw", timeout=60)
    results = run_partitions(
        param,
        lambda p: feature_std(
            p, X[slice(*cuts[p.info.partition_id])], weight[slice(*cuts[p.info.partition_id])]
        ),
    )
    x, total = X.astype(np.float64), weight.sum()
    mean = weight @ x / total
    expected = np.sqrt(weight @ (x - mean) ** 2 / (total - (weight**2).sum() / total))
    for result in results:
        assert np.array_equal(result, results[0]), results
    np.testing.assert_allclose(results[0], expected, rtol=1e-5, atol=1e-12)
    assert results[0][3] == 0  # a constant feature
