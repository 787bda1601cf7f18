"""Where one step of a sparse fit goes, without Spark: ``bench_sparse.py --breakdown``.

For a batch of the click log (``sparse_data.ClickData``) hashed by hand into ``d`` features
(one non-zero per field, as ``FeatureHasher`` makes them) and softmax regression over 2
classes, on one thread, medians of a few repeats after one untimed call (which takes the
pages): the forward product X W; the model's whole ``loss_and_grad_into`` (its backward is
X^T delta, written into the dense gradient of d x 2 floats); X^T delta on the touched
columns alone (indices and rows: what a sync of the touched rows would carry); a copy of the
dense gradient (the memory traffic of a dense sync at the least: each partition reads its
slice of every partition's gradient); Adam over one owner's slice (half the weights, for 2
partitions).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from benchkit.sparse_data import BLOCK_ROWS, ClickData, mix

HEADER = (
    "features",
    "weights",
    "batch rows",
    "non-zeros",
    "touched columns",
    "X W ms",
    "loss_and_grad ms",
    "X^T delta, touched rows only ms",
    "copy of dense grad ms",
    "Adam, owner's half ms",
    "dense grad MB",
    "touched rows MB",
)


def timed(work: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls, after one untimed call."""
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def hashed_batch(values: np.ndarray, features: int):
    """Rows of field values as a float32 CSR matrix of ``features`` columns: field f's value
    v hashed with f to one column (collisions within a row summed)."""
    from scipy.sparse import csr_matrix

    rows, fields = values.shape
    keys = values.astype(np.uint64) * np.uint64(64) + np.arange(fields, dtype=np.uint64)
    columns = (mix(keys) % np.uint64(features)).astype(np.int32)
    columns.sort(axis=1)
    X = csr_matrix(
        (
            np.ones(columns.size, np.float32),
            columns.ravel(),
            np.arange(0, columns.size + 1, fields, dtype=np.int32),
        ),
        shape=(rows, features),
    )
    X.sum_duplicates()
    return X


def touched_product(X, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """X^T delta on the columns X touches alone: (those columns, their rows of the product)."""
    columns, where = np.unique(X.indices, return_inverse=True)
    rows = np.repeat(np.arange(X.shape[0]), np.diff(X.indptr))
    product = np.zeros((len(columns), delta.shape[1]), np.float32)
    np.add.at(product, where, X.data[:, None] * delta[rows])
    return columns, product


def breakdown_row(X, labels: np.ndarray, repeats: int, seed: int) -> tuple:
    """One table row: a step's parts for the batch ``X`` (see the module's docstring)."""
    from allreduce_param import models, optim

    rows, features = X.shape
    model = models.SoftmaxRegression(features, 2)
    weights = model.init(np.random.default_rng(seed))
    grad = np.empty_like(weights)
    copy_target = np.empty_like(grad)
    owner = weights[: len(weights) // 2].copy()
    adam = optim.Adam(lr=1e-3)
    state = adam.init_state(len(owner))
    W = weights[: features * 2].reshape(features, 2)
    delta = np.random.default_rng(seed).standard_normal((rows, 2)).astype(np.float32)
    touched = len(np.unique(X.indices))
    return (
        f"2^{features.bit_length() - 1}",
        f"{model.size:,}",
        f"{rows:,}",
        f"{X.nnz:,}",
        f"{touched:,}",
        f"{timed(lambda: X @ W, repeats):.2f}",
        f"{timed(lambda: model.loss_and_grad_into(weights, X, labels, grad), repeats):.1f}",
        f"{timed(lambda: touched_product(X, delta), repeats):.1f}",
        f"{timed(lambda: np.copyto(copy_target, grad), repeats):.1f}",
        f"{timed(lambda: adam.step(owner, grad[: len(owner)], state, 0), repeats):.1f}",
        f"{grad.nbytes / 2**20:,.0f}",
        f"{touched * (4 + 2 * 4) / 2**20:.2f}",
    )


def breakdown(features_list: list[int], rows: int, repeats: int, seed: int) -> list[tuple]:
    """Table rows, one per feature count, for a batch of ``rows`` click-log rows."""
    values, labels, _, _ = ClickData(max(rows, BLOCK_ROWS), seed=seed).block(0)
    return [
        breakdown_row(hashed_batch(values[:rows], features), labels[:rows], repeats, seed)
        for features in features_list
    ]


SYNC_HEADER = (
    "features",
    "weights",
    "touched elements, global batch",
    "dense: compute ms",
    "dense: put + aggregate ms",
    "touched: compute ms",
    "touched: put + aggregate ms",
    "dense / touched, compute + sync",
)


def sync_row(X_parts: list, label_parts: list, repeats: int, seed: int) -> tuple:
    """One table row: a BSP step's compute, put and aggregate (softmax regression, 2 classes,
    one partition a thread, ``LocalRendezvous``), the dense sync and the touched one
    alternating, step by step, ``repeats`` times after one untimed step each; medians of the
    slowest partition's, and the median (range) of each repeat's dense / touched ratio. The
    get and the send around them (untimed) are the same either way."""
    import threading

    from allreduce_param import models
    from allreduce_param.engine import AllReduceParameter, LocalRendezvous

    partitions, features = len(X_parts), X_parts[0].shape[1]
    model = models.SoftmaxRegression(features, 2)
    weights = model.init(np.random.default_rng(seed))
    param = AllReduceParameter(partitions, model.size, codec="raw", timeout=600)
    group = LocalRendezvous(partitions)
    times = np.zeros((partitions, repeats + 1, 2, 2))  # partition, repeat, sync, (compute, sync)
    failures: list = []

    def partition(i: int) -> None:
        X, y = X_parts[i], label_parts[i]
        try:
            with param.connect(group.member(i)) as p:
                p.init(weights)
                for repeat in range(repeats + 1):
                    for sync in range(2):
                        w = p.get_weights()
                        started = time.perf_counter()
                        if sync:
                            _, grad, count = model.loss_and_touched_grad(w, X, y)
                        else:
                            grad = p.gradient_buffer()
                            _, count = model.loss_and_grad_into(w, X, y, grad)
                        computed = time.perf_counter()
                        p.put_gradients(grad, count=count)
                        p.aggregate_gradient_partition()
                        times[i, repeat, sync] = (
                            computed - started,
                            time.perf_counter() - computed,
                        )
                        p.send_weight_partition()
        except BaseException as error:  # noqa: BLE001 - raised below, on the caller's thread
            failures.append(error)

    threads = [threading.Thread(target=partition, args=(i,)) for i in range(partitions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    slowest = times[:, 1:].max(axis=0)  # repeat, sync, part: the slowest partition's
    ratios = slowest[:, 0].sum(axis=1) / slowest[:, 1].sum(axis=1)
    medians = np.median(slowest, axis=0) * 1e3
    touched = len(np.unique(np.concatenate([X.indices for X in X_parts]))) * 2 + 2
    return (
        f"2^{features.bit_length() - 1}",
        f"{model.size:,}",
        f"{touched:,}",
        f"{medians[0, 0]:.1f}",
        f"{medians[0, 1]:.1f}",
        f"{medians[1, 0]:.1f}",
        f"{medians[1, 1]:.1f}",
        f"{np.median(ratios):.2f} ({ratios.min():.2f}-{ratios.max():.2f})",
    )


def sync_comparison(
    features_list: list[int], rows: int, partitions: int, repeats: int, seed: int
) -> list[tuple]:
    """Table rows, one per feature count: ``sync_row`` for a global batch of ``rows``
    click-log rows cut evenly over ``partitions``."""
    values, labels, _, _ = ClickData(max(rows, BLOCK_ROWS), seed=seed).block(0)
    cuts = np.linspace(0, rows, partitions + 1).astype(int)
    lines = []
    for features in features_list:
        X = hashed_batch(values[:rows], features)
        parts = [X[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        lines.append(
            sync_row(parts, [labels[a:b] for a, b in zip(cuts[:-1], cuts[1:])], repeats, seed)
        )
    return lines
