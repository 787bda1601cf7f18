"""The torch adapter: an nn.Module trained by the engine (needs the [torch] extra; CI installs it)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch adapter needs PyTorch: pip install -e '.[torch]'")

from allreduce_param import AllReduceParameter, models, optim  # noqa: E402
from allreduce_param.train.worker import TrainingJob  # noqa: E402
from test_train_loop import blobs, reference_fit, run_workers  # noqa: E402


def net():
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def test_loss_and_gradient_are_torchs_own_summed_over_rows():
    model = models.TorchModel(net)
    weights = model.init(np.random.default_rng(0))
    X, y = blobs(9, 6, 3, seed=0)
    loss, grad, count = model.loss_and_grad(weights, X, y)
    module = net()
    torch.nn.utils.vector_to_parameters(torch.from_numpy(weights.copy()), module.parameters())
    expected = torch.nn.functional.cross_entropy(module(torch.from_numpy(X)), torch.from_numpy(y.astype(np.int64)),
                                                 reduction="sum")
    expected.backward()
    assert count == 9 and np.isclose(loss, expected.item(), rtol=1e-6)
    np.testing.assert_allclose(grad, torch.cat([p.grad.reshape(-1) for p in module.parameters()]).numpy(),
                               rtol=1e-5, atol=1e-6)
    assert model.loss_and_grad(weights, X[:0], y[:0])[2] == 0


def test_the_gradient_into_a_vector_comes_parameter_by_parameter_as_autograd_finishes_it():
    model = models.TorchModel(net)
    weights = model.init(np.random.default_rng(0))
    X, y = blobs(9, 6, 3, seed=0)
    loss, grad, count = model.loss_and_grad(weights, X, y)
    out = np.full(model.size, np.nan, np.float32)
    ranges = []

    def ready(start, stop):
        assert np.isfinite(out[start:stop]).all()
        ranges.append((start, stop))

    assert model.loss_and_grad_into(weights, X, y, out, ready) == (loss, count)
    assert np.array_equal(out, grad)
    sizes = [p.numel() for p in net().parameters()]  # 72, 12, 36, 3: the last layer's are the last 39
    assert sorted(ranges) == [(0, 72), (72, 84), (84, 120), (120, 123)]
    assert set(ranges[:2]) == {(84, 120), (120, 123)} and sum(sizes) == model.size


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_loss_and_predictions_are_the_loss_and_predict_without_a_backward_pass(loss):
    model = models.TorchModel(net, loss=loss)
    weights = model.init(np.random.default_rng(1))
    X, y = blobs(9, 6, 3, seed=2)
    y = y if loss == "cross_entropy" else np.random.default_rng(3).standard_normal((9, 3)).astype(np.float32)
    total, predictions, count = model.loss_and_predictions(weights, X, y)
    assert count == 9 and total == pytest.approx(model.loss_and_grad(weights, X, y)[0], rel=1e-6)
    np.testing.assert_array_equal(predictions, model.predict(weights, X))
    empty = model.loss_and_predictions(weights, X[:0], y[:0])
    assert (empty[0], len(empty[1]), empty[2]) == (0.0, 0, 0)


def test_init_is_reproducible_from_the_seed():
    model = models.TorchModel(net)
    assert np.array_equal(model.init(np.random.default_rng(3)), model.init(np.random.default_rng(3)))
    assert not np.array_equal(model.init(np.random.default_rng(3)), model.init(np.random.default_rng(4)))


def test_a_torch_module_trains_under_bsp_like_single_process():
    X, y = blobs(90, 6, 3, seed=1)
    parts = [(X[:30], y[:30]), (X[30:], y[30:])]
    model, optimizer = models.TorchModel(net), optim.Adam(lr=0.01)
    param = AllReduceParameter(2, model.size, codec="raw", timeout=60)
    outputs = run_workers(TrainingJob(model, optimizer, param, 16, 3, 7, 2, 6, False), parts)
    assert all(isinstance(output, dict) for output in outputs), outputs
    expected = reference_fit(model, optimizer, parts, batch_size=16, epochs=3, seed=7)
    np.testing.assert_allclose(np.frombuffer(outputs[0]["weights"], np.float32), expected, rtol=2e-5, atol=2e-6)


def test_bad_settings():
    from allreduce_param import ConfigurationError

    with pytest.raises(ConfigurationError, match="loss must be one of"):
        models.TorchModel(net, loss="hinge")
    with pytest.raises(ConfigurationError, match="needs a torch.nn.Module, got int"):
        models.TorchModel(lambda: 3)
