"""The worker loop on N threads against single-process mini-batch training on the same batches."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from allreduce_param import AllReduceParameter, LocalRendezvous, TrainingError, models, optim
from allreduce_param.train.batching import epoch_order, global_batch_sizes, share_bounds, steps_per_epoch
from allreduce_param.train.worker import STEP_FIELDS, TrainingJob, train_partition


def blobs(rows: int, features: int, classes: int, seed: int):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, rows)
    centres = rng.standard_normal((classes, features)).astype(np.float32) * 3
    return (centres[labels] + rng.standard_normal((rows, features)).astype(np.float32)), labels.astype(np.float64)


def run_workers(job: TrainingJob, parts: list[tuple[np.ndarray, np.ndarray]]) -> list[dict]:
    """``train_partition`` on one thread per partition; each partition's records by kind."""
    group = LocalRendezvous(len(parts))
    outputs: list = [None] * len(parts)

    def run(i):
        X, y = parts[i]
        try:
            outputs[i] = dict(train_partition(job, X, y, np.zeros(len(X), np.int32), rendezvous=group.member(i)))
        except BaseException as error:
            outputs[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(parts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return outputs


def reference_fit(model, optimizer, parts, batch_size: int, epochs: int, seed: int) -> np.ndarray:
    """Single-process mini-batch training over the very global batches the workers build."""
    counts = [len(X) for X, _ in parts]
    steps = steps_per_epoch(sum(counts), batch_size)
    weights = model.init(np.random.default_rng(seed))
    state = optimizer.init_state(weights.size)
    sizes = global_batch_sizes(counts, steps)
    global_step = 0
    for epoch in range(epochs):
        orders = [epoch_order(n, seed, epoch, i) for i, n in enumerate(counts)]
        cuts = [share_bounds(n, i, len(parts), steps) for i, n in enumerate(counts)]
        for step in range(steps):
            if sizes[step] == 0:
                continue
            take = [orders[i][cuts[i][step]:cuts[i][step + 1]] for i in range(len(parts))]
            X = np.concatenate([parts[i][0][rows] for i, rows in enumerate(take)])
            y = np.concatenate([parts[i][1][rows] for i, rows in enumerate(take)])
            _, grad, count = model.loss_and_grad(weights, X, y)
            grad = grad / np.float32(count)
            scale = optim.clip_scale(float(np.dot(grad.astype(np.float64), grad)), optimizer.clip_norm)
            optimizer.step(weights, grad, state, global_step, grad_scale=scale)
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
    job = TrainingJob(model, optimizer, param, batch_size=32, epochs=3, seed=5, threads=threads,
                      n_features=6, has_validation=False)
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
    job = TrainingJob(model, optim.SGD(lr=0.1), param, 8, 1, 0, None, 4, False)
    outputs = run_workers(job, [(X[:20], y[:20]), (poisoned, y[20:])])
    assert isinstance(outputs[1], TrainingError)
    assert str(outputs[1]) == "partition 1, epoch 0, step 0: ValueError: a poisoned row"
    assert isinstance(outputs[0], TrainingError) and "partition 0, epoch 0, step 0: PeerLostError" in str(outputs[0])


@pytest.mark.parametrize("settings, message", [
    ({"batch_size": 0}, "batch_size must be a positive whole number, got 0"),
    ({"epochs": 1.5}, "epochs must be a positive whole number, got 1.5"),
    ({"num_workers": 0}, "num_workers must be a positive whole number, got 0"),
    ({"codec": "zip"}, "unknown codec 'zip'"),
    ({"threads": 0}, "threads must be a positive count or a list of positive workloads, got 0"),
    ({"threads": [1.0, -2.0]}, r"threads must be .* got \[1.0, -2.0\]"),
])
def test_settings_are_checked_when_the_optimizer_is_made(settings, message):
    from allreduce_param import ConfigurationError, DistriOptimizer

    with pytest.raises(ConfigurationError, match=message):
        DistriOptimizer(models.MLP([2, 3, 2]), optim.SGD(lr=0.1), **settings)


def test_a_model_without_the_protocol_is_refused():
    from allreduce_param import ConfigurationError, DistriOptimizer

    with pytest.raises(ConfigurationError, match=r"has no init\(\) method; a model needs init\(rng\), loss_and_grad"):
        DistriOptimizer(object(), optim.SGD(lr=0.1))
