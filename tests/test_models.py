"""The built-in numpy models and TensorLayout.

Gradients are checked against central finite differences of independent float64 reference
losses written here (not the models' own code), so both the loss and its gradient are
tested. Training tests run plain full-batch gradient descent, the way the trainer combines
the summed gradients: ``w -= lr * grad_sum / count``.
"""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

from allreduce_param.engine.layout import TensorLayout
from allreduce_param.errors import InputError
from allreduce_param.models import (
    MLP,
    LinearRegression,
    LogisticRegression,
    Model,
    SoftmaxRegression,
)

# -- float64 reference losses (summed over rows), independent of the models' code ---------


def _logsumexp(z: np.ndarray) -> np.ndarray:
    top = z.max(axis=1, keepdims=True)
    return (top + np.log(np.exp(z - top).sum(axis=1, keepdims=True)))[:, 0]


def reference_loss(model, weights: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
    """The summed loss of ``model`` in float64, from the documented formulas."""
    p = model.layout.views(np.asarray(weights, dtype=np.float64))
    a = np.asarray(X, dtype=np.float64)
    n_layers = len(p) // 2
    for i in range(1, n_layers + 1):
        a = a @ p[f"w{i}"] + p[f"b{i}"]
        if i < n_layers:
            a = np.maximum(a, 0.0) if model.activation == "relu" else np.tanh(a)  # MLPs only
    if isinstance(model, LogisticRegression):
        z = a[:, 0]
        return float(np.sum(np.logaddexp(0.0, z) - y * z))
    if model.task == "classification":
        return float(np.sum(_logsumexp(a) - a[np.arange(len(y)), y]))
    target = np.asarray(y, dtype=np.float64).reshape(a.shape)
    return float(0.5 * np.sum((a - target) ** 2))


def numeric_gradient(model, weights: np.ndarray, X: np.ndarray, y: np.ndarray, eps: float = 1e-6):
    w = np.asarray(weights, dtype=np.float64).copy()
    grad = np.empty_like(w)
    for i in range(w.size):
        saved = w[i]
        w[i] = saved + eps
        up = reference_loss(model, w, X, y)
        w[i] = saved - eps
        down = reference_loss(model, w, X, y)
        w[i] = saved
        grad[i] = (up - down) / (2 * eps)
    return grad


MODELS = {
    "linear": lambda: LinearRegression(4),
    "logistic": lambda: LogisticRegression(4),
    "softmax": lambda: SoftmaxRegression(4, 3),
    "mlp-relu": lambda: MLP([4, 6, 3]),
    "mlp-tanh-deep": lambda: MLP([4, 5, 4, 3], activation="tanh"),
    "mlp-regression": lambda: MLP([4, 6, 1], task="regression"),
    "mlp-regression-2-outputs": lambda: MLP([4, 5, 2], activation="tanh", task="regression"),
}


def sample(model, rows: int, seed: int = 1):
    """Random float32 features and matching labels or targets for ``model``."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, model.n_features)).astype(np.float32)
    outputs = model.layout.shape(model.layout.names[-1])[0]
    if isinstance(model, LogisticRegression):
        y = rng.integers(0, 2, rows)
    elif model.task == "classification":
        y = rng.integers(0, outputs, rows)
    else:
        y = rng.standard_normal(rows if outputs == 1 else (rows, outputs)).astype(np.float32)
    return X, y


def perturbed_init(model, seed: int = 0) -> np.ndarray:
    """Initial weights with non-zero biases, so that bias gradients are exercised."""
    w = model.init(np.random.default_rng(seed))
    w += np.random.default_rng(seed + 100).normal(0, 0.1, w.size).astype(np.float32)
    return w


@pytest.fixture(params=sorted(MODELS), ids=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


# -- gradients ------------------------------------------------------------------------------


def test_loss_and_gradient_match_float64_finite_differences(model):
    X, y = sample(model, rows=7)
    w = perturbed_init(model)
    loss, grad, count = model.loss_and_grad(w, X, y)
    assert count == 7
    assert isinstance(loss, float)
    assert grad.dtype == np.float32 and grad.shape == (model.size,)
    assert loss == pytest.approx(reference_loss(model, w, X, y), rel=1e-5)
    expected = numeric_gradient(model, w, X, y)
    np.testing.assert_allclose(grad, expected, rtol=1e-3, atol=1e-4)
    assert np.abs(expected).max() > 0.1  # the check is not vacuous


def test_loss_and_gradient_are_sums_over_rows_not_means(model):
    X, y = sample(model, rows=2, seed=3)
    w = perturbed_init(model)
    both = model.loss_and_grad(w, X, y)
    first = model.loss_and_grad(w, X[:1], y[:1])
    second = model.loss_and_grad(w, X[1:], y[1:])
    assert both[2] == 2 and first[2] == second[2] == 1
    assert both[0] == pytest.approx(first[0] + second[0], rel=1e-6)
    np.testing.assert_allclose(both[1], first[1] + second[1], rtol=1e-5, atol=1e-6)


def test_zero_rows_give_zero_loss_zero_gradient_zero_count(model):
    w = model.init(np.random.default_rng(0))
    X, y = sample(model, rows=0)
    loss, grad, count = model.loss_and_grad(w, X, y)
    assert (loss, count) == (0.0, 0)
    assert grad.dtype == np.float32 and grad.shape == (model.size,) and not grad.any()
    # an empty partition may hand over a bare empty array
    loss, grad, count = model.loss_and_grad(w, np.empty(0, np.float32), np.empty(0))
    assert (loss, count, grad.any()) == (0.0, 0, False)
    assert model.predict(w, X).shape[0] == 0


def test_loss_and_predictions_are_the_loss_and_predict_of_one_forward_pass(model):
    w = perturbed_init(model)
    X, y = sample(model, rows=11)
    loss, predictions, count = model.loss_and_predictions(w, X, y)
    assert count == 11 and loss == pytest.approx(model.loss_and_grad(w, X, y)[0], rel=1e-6)
    expected = model.predict(w, X)
    assert predictions.dtype == expected.dtype
    np.testing.assert_array_equal(predictions, expected)
    empty = model.loss_and_predictions(w, *sample(model, rows=0))
    assert (empty[0], empty[1].shape[0], empty[2]) == (0.0, 0, 0)


def test_the_gradient_into_a_vector_is_the_same_and_comes_layer_by_layer_last_first(model):
    """``loss_and_grad_into`` writes ``loss_and_grad``'s gradient and says each layer's range
    once, as soon as it is final, the last layer first; every element is covered."""
    w = perturbed_init(model)
    X, y = sample(model, rows=9)
    loss, grad, count = model.loss_and_grad(w, X, y)
    out = np.full(model.size, np.nan, np.float32)
    ranges = []

    def ready(start, stop):
        assert np.isfinite(out[start:stop]).all()  # written before it is said to be final
        ranges.append((start, stop))

    assert model.loss_and_grad_into(w, X, y, out, ready) == (loss, count)
    assert np.array_equal(out, grad)
    assert ranges == sorted(ranges, reverse=True) and ranges[0][1] == model.size
    assert [stop for _, stop in ranges[1:]] == [start for start, _ in ranges[:-1]] and ranges[-1][
        0
    ] == 0
    assert len(ranges) == len(model.layout.names) // 2  # one range per layer: its weights and bias
    out[:] = 1.0
    assert model.loss_and_grad_into(w, *sample(model, rows=0), out) == (0.0, 0) and not out.any()
    with pytest.raises(
        InputError, match=r"loss_and_grad_into\(out=\): expected a writeable contiguous float32"
    ):
        model.loss_and_grad_into(w, X, y, np.zeros(model.size))


def test_an_override_of_loss_and_grad_is_not_skipped_by_the_inherited_optional_calls():
    from allreduce_param.models.base import optional_call

    class Regularised(MLP):
        def loss_and_grad(self, weights, X, y):
            return super().loss_and_grad(weights, X, y)

    class Streaming(Regularised):
        def loss_and_grad_into(self, weights, X, y, out, ready=None):
            return super().loss_and_grad_into(weights, X, y, out, ready)

    plain, overridden, both = MLP([2, 2]), Regularised([2, 2]), Streaming([2, 2])
    assert (
        optional_call(plain, "loss_and_grad_into", ("loss_and_grad",)) == plain.loss_and_grad_into
    )
    assert optional_call(overridden, "loss_and_grad_into", ("loss_and_grad",)) is None
    assert optional_call(both, "loss_and_grad_into", ("loss_and_grad",)) == both.loss_and_grad_into
    assert optional_call(overridden, "loss_and_predictions", ("loss_and_grad", "predict")) is None
    assert optional_call(plain, "loss_and_predictions", ("loss_and_grad", "predict")) is not None
    plain.predict = lambda weights, X: None  # on the instance: more specific still
    assert optional_call(plain, "loss_and_predictions", ("loss_and_grad", "predict")) is None
    both.loss_and_grad = lambda weights, X, y: None
    assert optional_call(both, "loss_and_grad_into", ("loss_and_grad",)) is None


def test_evaluation_gives_the_same_with_or_without_loss_and_predictions(model):
    from allreduce_param.train.task.compute import evaluate

    class Plain:  # the model's protocol without the optional call
        task = model.task
        loss_and_grad, predict = model.loss_and_grad, model.predict

    w = perturbed_init(model)
    X, y = sample(model, rows=23)
    assert evaluate(model, w, X, y) == pytest.approx(evaluate(Plain(), w, X, y), rel=1e-6)


def test_inputs_are_left_untouched_and_read_only_inputs_work(model):
    X, y = sample(model, rows=5)
    w = perturbed_init(model)
    copies = (X.copy(), y.copy(), w.copy())
    for array in (X, y, w):
        array.setflags(write=False)
    model.loss_and_grad(w, X, y)
    model.predict(w, X)
    for array, copy in zip((X, y, w), copies):
        np.testing.assert_array_equal(array, copy)


def test_stable_for_huge_logits():
    X = np.array([[1.0], [-1.0], [1.0], [-1.0]], dtype=np.float32)
    y = np.array([1, 0, 0, 1])
    logistic = LogisticRegression(1)
    w = np.array([1000.0, 0.0], dtype=np.float32)  # logits +-1000
    softmax = SoftmaxRegression(1, 2)
    ws = np.array([1000.0, -1000.0, 0.0, 0.0], dtype=np.float32)  # logits +-1000 vs -+1000
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # exp(-2000) -> 0 is fine
        loss, grad, _ = logistic.loss_and_grad(w, X, y)
        loss2, grad2, _ = softmax.loss_and_grad(ws, X, y)
    # two rows right with margin 1000 (loss ~0), two wrong (loss 1000 each)
    assert loss == pytest.approx(2000.0)
    assert loss2 == pytest.approx(4000.0)  # softmax margin is 2000
    assert np.isfinite(grad).all() and np.isfinite(grad2).all()
    # rows 3 and 4: x * (p - y) = 1 * (1 - 0) = +1 and -1 * (0 - 1) = +1; bias: +1 - 1 = 0
    np.testing.assert_allclose(grad, [2.0, 0.0], atol=1e-6)


# -- init -----------------------------------------------------------------------------------


def test_init_is_float32_right_size_deterministic_per_seed(model):
    a = model.init(np.random.default_rng(7))
    b = model.init(np.random.default_rng(7))
    c = model.init(np.random.default_rng(8))
    assert a.dtype == np.float32 and a.shape == (model.size,)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    tensors = model.tensors(a)
    for name, tensor in tensors.items():
        if name.startswith("b"):
            assert not tensor.any(), f"bias {name} must start at zero"
        else:
            assert tensor.std() > 0


def test_init_scales_he_for_relu_and_glorot_otherwise():
    model = MLP([400, 300, 10])
    tensors = model.tensors(model.init(np.random.default_rng(0)))
    assert tensors["w1"].std() == pytest.approx(np.sqrt(2 / 400), rel=0.02)  # He normal
    limit = np.sqrt(6 / (300 + 10))
    assert np.abs(tensors["w2"]).max() <= limit  # Glorot uniform on the output layer
    assert tensors["w2"].std() == pytest.approx(limit / np.sqrt(3), rel=0.05)
    tanh = MLP([400, 300, 10], activation="tanh")
    assert np.abs(tanh.tensors(tanh.init(np.random.default_rng(0)))["w1"]).max() <= np.sqrt(6 / 700)


def test_sizes():
    assert LinearRegression(5).size == 6
    assert LogisticRegression(5).size == 6
    assert SoftmaxRegression(5, 3).size == 18
    assert MLP([64, 128, 10]).size == 64 * 128 + 128 + 128 * 10 + 10


# -- training with plain gradient descent -------------------------------------------------


def descend(model, X, y, lr: float, steps: int, seed: int = 0) -> np.ndarray:
    w = model.init(np.random.default_rng(seed))
    for _ in range(steps):
        _, grad, count = model.loss_and_grad(w, X, y)
        w -= np.float32(lr) * grad / np.float32(count)
    return w


def blobs(n_classes: int, rows: int, features: int, seed: int = 0, spread: float = 0.5):
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 3, (n_classes, features))
    y = rng.integers(0, n_classes, rows)
    X = (centres[y] + rng.normal(0, spread, (rows, features))).astype(np.float32)
    return X, y


def test_linear_regression_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((300, 3)).astype(np.float32)
    coefficients, intercept = np.array([2.0, -1.0, 0.5]), 3.0
    y = (X @ coefficients + intercept + rng.normal(0, 0.01, 300)).astype(np.float32)
    model = LinearRegression(3)
    w = descend(model, X, y, lr=0.1, steps=300)
    tensors = model.tensors(w)
    np.testing.assert_allclose(tensors["w1"][:, 0], coefficients, atol=0.01)
    assert tensors["b1"][0] == pytest.approx(intercept, abs=0.01)
    rmse = np.sqrt(np.mean((model.predict(w, X) - y) ** 2))
    assert rmse < 0.02


def test_logistic_regression_separates_two_blobs():
    X, y = blobs(2, 400, 5, seed=1)
    model = LogisticRegression(5)
    w = descend(model, X, y, lr=0.5, steps=200)
    predictions = model.predict(w, X)
    assert predictions.dtype == np.int64
    assert np.mean(predictions == y) >= 0.98
    # float labels, as Spark ML stores them, are accepted
    assert model.loss_and_grad(w, X, y.astype(np.float64))[0] == pytest.approx(
        model.loss_and_grad(w, X, y)[0]
    )


def test_softmax_regression_separates_four_blobs():
    X, y = blobs(4, 400, 6, seed=2)
    model = SoftmaxRegression(6, 4)
    w = descend(model, X, y, lr=0.5, steps=200)
    assert np.mean(model.predict(w, X) == y) >= 0.98


def test_mlp_learns_xor_where_a_linear_model_cannot():
    rng = np.random.default_rng(3)
    X = rng.uniform(-1, 1, (400, 2)).astype(np.float32)
    y = (X[:, 0] * X[:, 1] > 0).astype(np.int64)
    linear = SoftmaxRegression(2, 2)
    assert np.mean(linear.predict(descend(linear, X, y, lr=0.5, steps=300), X) == y) < 0.75
    for activation in ("relu", "tanh"):
        model = MLP([2, 32, 2], activation=activation)
        w = descend(model, X, y, lr=0.5, steps=400)
        assert np.mean(model.predict(w, X) == y) >= 0.95, activation


def test_mlp_regression_fits_a_curve():
    rng = np.random.default_rng(4)
    X = rng.uniform(-2, 2, (300, 1)).astype(np.float32)
    y = np.sin(2 * X[:, 0]).astype(np.float32)
    model = MLP([1, 32, 1], activation="tanh", task="regression")
    start = model.predict(model.init(np.random.default_rng(0)), X)
    w = descend(model, X, y, lr=0.2, steps=600)
    predictions = model.predict(w, X)
    assert predictions.dtype == np.float32 and predictions.shape == (300,)
    assert np.sqrt(np.mean((predictions - y) ** 2)) < 0.5 * np.sqrt(np.mean((start - y) ** 2))
    assert np.sqrt(np.mean((predictions - y) ** 2)) < 0.2


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: MLP([64]), "at least 2 layer widths"),
        (lambda: MLP([]), "at least 2 layer widths"),
        (lambda: MLP([4, 0, 2]), "width #1 must be a whole number >= 1"),
        (lambda: MLP([4, 2.5, 2]), "width #1"),
        (
            lambda: MLP([4, 8, 2], activation="sigmoid"),
            "unknown activation 'sigmoid'.*'relu', 'tanh'",
        ),
        (lambda: MLP([4, 8, 2], task="ranking"), "unknown task 'ranking'"),
        (lambda: MLP([4, 8, 1]), "at least 2 outputs"),
        (lambda: SoftmaxRegression(4, 1), "n_classes must be a whole number >= 2, got 1"),
        (lambda: SoftmaxRegression(4, True), "n_classes"),
        (lambda: LinearRegression(0), "n_features must be a whole number >= 1, got 0"),
        (lambda: LogisticRegression("3"), "n_features"),
    ],
)
def test_bad_constructor_arguments_raise_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_feature_count_mismatch_names_expected_and_got(model):
    w = model.init(np.random.default_rng(0))
    X, y = sample(model, rows=3)
    wide = np.zeros((3, model.n_features + 1), np.float32)
    mismatch = f"X has {model.n_features + 1} features, expected {model.n_features}"
    with pytest.raises(ValueError, match=mismatch):
        model.loss_and_grad(w, wide, y)
    with pytest.raises(ValueError, match=mismatch):
        model.predict(w, wide)
    with pytest.raises(ValueError, match="2-D"):
        model.predict(w, X[0])
    with pytest.raises(
        ValueError, match=f"{model.size} parameters, got shape \\({model.size - 1},\\)"
    ):
        model.loss_and_grad(w[:-1], X, y)
    with pytest.raises(ValueError, match="expected shape"):
        model.loss_and_grad(w, X, y[:2])


@pytest.mark.parametrize(
    "model, labels, message",
    [
        (LogisticRegression(2), [0, 2], "0..1, got values from 0 to 2"),
        (SoftmaxRegression(2, 3), [-1, 0], "0..2, got values from -1 to 0"),
        (SoftmaxRegression(2, 3), [0.5, 1.0], "whole numbers"),
        (SoftmaxRegression(2, 3), ["a", "b"], "integers"),
    ],
)
def test_bad_labels_raise_value_error(model, labels, message):
    w = model.init(np.random.default_rng(0))
    with pytest.raises(ValueError, match=message):
        model.loss_and_grad(w, np.zeros((2, 2), np.float32), np.array(labels))


# -- identity, pickling, threads ------------------------------------------------------------


def test_pickle_round_trip_keeps_the_model(model):
    clone = pickle.loads(pickle.dumps(model))
    assert clone == model and repr(clone) == repr(model) and clone.size == model.size
    assert len(pickle.dumps(model)) < 400  # only the constructor arguments travel
    X, y = sample(model, rows=4)
    w = perturbed_init(model)
    loss, grad, count = model.loss_and_grad(w, X, y)
    loss2, grad2, count2 = clone.loss_and_grad(w, X, y)
    assert (loss, count) == (loss2, count2)
    np.testing.assert_array_equal(grad, grad2)


def test_repr_and_protocol():
    assert repr(LinearRegression(3)) == "LinearRegression(n_features=3)"
    assert repr(SoftmaxRegression(3, 4)) == "SoftmaxRegression(n_features=3, n_classes=4)"
    assert (
        repr(MLP([64, 128, 10]))
        == "MLP(layers=[64, 128, 10], activation='relu', task='classification')"
    )
    assert MLP([2, 3], task="regression") != MLP([2, 3], task="classification")
    for make in MODELS.values():
        model = make()
        assert isinstance(model, Model)
        assert model.task in ("classification", "regression")


def test_predict_dtypes_and_shapes():
    X = np.zeros((3, 2), np.float32)
    for model, dtype, shape in [
        (LinearRegression(2), np.float32, (3,)),
        (LogisticRegression(2), np.int64, (3,)),
        (SoftmaxRegression(2, 3), np.int64, (3,)),
        (MLP([2, 4, 3], task="regression"), np.float32, (3, 3)),
    ]:
        out = model.predict(model.init(np.random.default_rng(0)), X)
        assert out.dtype == dtype and out.shape == shape, model


def test_concurrent_calls_from_threads_agree():
    model = MLP([16, 64, 4])
    X, y = sample(model, rows=512)
    w = model.init(np.random.default_rng(0))
    expected = model.loss_and_grad(w, X, y)
    results: list = [None] * 4

    def work(i: int) -> None:
        for _ in range(20):
            results[i] = model.loss_and_grad(w, X, y)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for loss, grad, count in results:
        assert (loss, count) == (expected[0], expected[2])
        np.testing.assert_array_equal(grad, expected[1])


# -- TensorLayout ---------------------------------------------------------------------------


def test_tensor_layout_offsets_shapes_and_views_without_copies():
    layout = TensorLayout([("w1", (3, 4)), ("b1", (4,)), ("w2", (4, 2)), ("b2", (2,))])
    assert layout.size == 12 + 4 + 8 + 2
    assert layout.names == ("w1", "b1", "w2", "b2")
    assert [layout.offset(n) for n in layout.names] == [0, 12, 16, 24]
    assert layout.shape("w2") == (4, 2)
    flat = np.arange(layout.size, dtype=np.float32)
    views = layout.views(flat)
    assert views["w1"].shape == (3, 4) and views["w1"][1, 0] == 4
    np.testing.assert_array_equal(views["b2"], [24, 25])
    for view in views.values():
        assert np.shares_memory(view, flat)
    views["w2"][:] = -1
    assert (flat[16:24] == -1).all() and flat[15] == 15 and flat[24] == 24
    assert repr(layout).startswith("TensorLayout([('w1', (3, 4))")
    assert pickle.loads(pickle.dumps(layout)) == layout


def test_tensor_layout_errors():
    layout = TensorLayout([("w", (2, 2)), ("b", (2,))])
    with pytest.raises(ValueError, match="contiguous 1-D array of 6 elements"):
        layout.views(np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="contiguous 1-D array of 6 elements"):
        layout.views(np.zeros(12, np.float32)[::2])
    with pytest.raises(KeyError, match="no tensor named 'x'"):
        layout.offset("x")
    with pytest.raises(ValueError, match="appears twice"):
        TensorLayout([("w", (2,)), ("w", (3,))])
    with pytest.raises(ValueError, match="dimensions must be whole numbers"):
        TensorLayout([("w", (2, -1))])


def test_torch_model_without_torch_says_how_to_get_it(monkeypatch):
    import sys

    from allreduce_param import ConfigurationError
    from allreduce_param.models import TorchModel

    monkeypatch.setitem(sys.modules, "torch", None)  # as on a machine without PyTorch
    with pytest.raises(
        ConfigurationError,
        match=r"TorchModel needs PyTorch: pip install 'allreduce-param\[torch\]'",
    ):
        TorchModel(lambda: None)


WEIGHTED_MODELS = [
    lambda: LinearRegression(4),
    lambda: LogisticRegression(4),
    lambda: SoftmaxRegression(4, 3),
    lambda: MLP([4, 6, 3]),
    lambda: MLP([4, 6, 2], task="regression"),
]


@pytest.mark.parametrize("make", WEIGHTED_MODELS)
def test_whole_sample_weights_count_a_row_as_often_as_repeating_it(make):
    model = make()
    rng = np.random.default_rng(7)
    X = rng.standard_normal((9, 4)).astype(np.float32)
    outputs = model.predict_raw(model.init(np.random.default_rng(0)), X).shape[1]
    if model.task == "classification":
        y = rng.integers(0, model.num_classes, 9).astype(np.float64)
    else:
        y = (
            rng.standard_normal((9, outputs)).astype(np.float32)
            if outputs > 1
            else rng.standard_normal(9)
        )
    weights = model.init(np.random.default_rng(1))
    counts = np.array([0, 1, 2, 3, 1, 0, 4, 1, 2])
    loss, grad, count = model.loss_and_grad(weights, X, y, sample_weight=counts)
    repeated = np.repeat(np.arange(9), counts)
    loss_r, grad_r, count_r = model.loss_and_grad(weights, X[repeated], y[repeated])
    assert count == count_r == counts.sum()
    assert loss == pytest.approx(loss_r, rel=1e-6)
    np.testing.assert_allclose(grad, grad_r, rtol=1e-5, atol=1e-6)
    # the same through the evaluation call, and a weight of one changes nothing
    loss_p, _, count_p = model.loss_and_predictions(weights, X, y, sample_weight=counts)
    assert (loss_p, count_p) == (pytest.approx(loss, rel=1e-6), count)
    plain = model.loss_and_grad(weights, X, y)
    ones = model.loss_and_grad(weights, X, y, sample_weight=np.ones(9))
    assert ones[0] == pytest.approx(plain[0], rel=1e-9) and ones[2] == plain[2]
    np.testing.assert_allclose(ones[1], plain[1], rtol=1e-6)


def test_bad_sample_weights_are_refused_naming_what_is_wrong():
    model = SoftmaxRegression(2, 2)
    weights = model.init(np.random.default_rng(0))
    X, y = np.zeros((3, 2), np.float32), np.array([0.0, 1.0, 0.0])
    with pytest.raises(
        InputError,
        match="sample_weight has shape \\(2,\\); it needs one weight per row of X, shape \\(3,\\)",
    ):
        model.loss_and_grad(weights, X, y, sample_weight=[1.0, 2.0])
    for bad in ([1.0, -1.0, 1.0], [1.0, np.nan, 1.0], [np.inf, 1.0, 1.0]):
        with pytest.raises(InputError, match="negative, NaN or infinite weight"):
            model.loss_and_grad(weights, X, y, sample_weight=bad)


@pytest.mark.parametrize(
    "model", [MLP([5, 4, 3]), SoftmaxRegression(7, 3), LinearRegression(6)], ids=repr
)
def test_the_penalty_of_a_slice_is_built_alone_with_the_whole_vectors_bits(model):
    """penalized(part=) and penalty_factors(std, part=) give the whole vector's slice, bit for
    bit, for slices that cut w1's rows anywhere (a task builds its owner's slice alone)."""
    rng = np.random.default_rng(3)
    std = (rng.random(model.n_features) * 3).astype(np.float32)
    std[1] = 0.0
    mask, factors = model.penalized(), model.penalty_factors(std)
    cuts = {0, 1, model.size - 1, model.size} | set(rng.integers(0, model.size, 12).tolist())
    for start in sorted(cuts):
        for stop in sorted(c for c in cuts if c >= start):
            part = slice(start, stop)
            assert np.array_equal(model.penalized(part), mask[part])
            assert model.penalty_factors(std, part).tobytes() == factors[part].tobytes()
    with pytest.raises(InputError, match=r"penalized: part must be a slice\(start, stop\) with"):
        model.penalized(slice(0, model.size + 1))
