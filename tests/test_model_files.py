"""A ``TrainedModel``'s folder holds nothing that runs when it is loaded (``train/model_files.py``,
``models/saving.py``, ``models/torch_saving.py``): a pickle put in a model's files runs
nothing and is a clear error; every built-in model and a ``TorchModel`` round-trip as data;
a pickle loads only where the caller passes ``allow_pickle=True``."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from allreduce_param import InputError, TrainedModel, models
from allreduce_param.models.torch_saving import load_state, state_arrays


class Touch:
    """A pickle whose loading creates the file ``marker``: what an attacker's would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


class Net(torch.nn.Module):
    """A module whose class can be imported and made without arguments, with buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(3, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.hidden(x))))


class Custom:
    """A model of one's own: it saves only as a pickle."""

    n_features = 2

    def init(self, rng):
        return np.zeros(3, np.float32)

    def loss_and_grad(self, weights, X, y):
        raise NotImplementedError

    def predict(self, weights, X):
        return X @ weights[:-1] + weights[-1]


BUILT_IN = [
    models.LinearRegression(3),
    models.LogisticRegression(3),
    models.SoftmaxRegression(3, 4),
    models.MLP([3, 6, 4], activation="tanh"),
    models.MLP([3, 5, 2], task="regression"),
]
X = np.random.default_rng(1).standard_normal((7, 3)).astype(np.float32)


def trained(model) -> TrainedModel:
    return TrainedModel(model, model.init(np.random.default_rng(0)), n_features=3)


def test_a_pickle_in_place_of_a_model_file_runs_nothing_and_says_so(tmp_path):
    marker = tmp_path / "ran"
    folder = tmp_path / "model"
    trained(models.LinearRegression(3)).save(folder)
    (folder / "weights.npy").write_bytes(pickle.dumps(Touch(marker)))
    with pytest.raises(InputError, match=r"weights.npy is not a numpy file of plain arrays"):
        TrainedModel.load(folder)
    assert not marker.exists()
    # a folder of the earlier format (its model.pkl), or one claiming a pickled model
    meta = json.loads((folder / "meta.json").read_text())
    for claims in ({"format": "allreduce-param-model/3"}, {"kind": "pickle"}):
        (folder / "meta.json").write_text(json.dumps({**meta, **claims}))
        (folder / "model.pkl").write_bytes(pickle.dumps(Touch(marker)))
        with pytest.raises(
            InputError, match=r"model.pkl holds the model as a pickle.*allow_pickle=True"
        ):
            TrainedModel.load(folder)
        assert not marker.exists()
    # a TorchModel's module state
    torch_folder = tmp_path / "torch"
    trained(models.TorchModel(Net(), device="cpu")).save(torch_folder)
    (torch_folder / "module_state.npz").write_bytes(pickle.dumps(Touch(marker)))
    with pytest.raises(InputError, match=r"module_state.npz is not a numpy file"):
        TrainedModel.load(torch_folder)
    assert not marker.exists()


def test_allow_pickle_loads_a_folder_of_the_earlier_format(tmp_path):
    """What format /3 wrote: the model pickled in model.pkl, the rest as now."""
    saved = trained(models.SoftmaxRegression(3, 4))
    saved.save(tmp_path / "new")
    meta = json.loads((tmp_path / "new" / "meta.json").read_text())
    for key in ("kind", "config"):
        del meta[key]
    old = tmp_path / "old"
    old.mkdir()
    (old / "meta.json").write_text(json.dumps({**meta, "format": "allreduce-param-model/3"}))
    (old / "weights.npy").write_bytes((tmp_path / "new" / "weights.npy").read_bytes())
    (old / "model.pkl").write_bytes(pickle.dumps(saved.model))
    with pytest.raises(InputError, match="allow_pickle=True"):
        TrainedModel.load(old)
    loaded = TrainedModel.load(old, allow_pickle=True)
    assert loaded.model == saved.model
    np.testing.assert_array_equal(loaded.predict_numpy(X), saved.predict_numpy(X))
    # and the flag does unpickle: what the refusals above kept from running
    (old / "model.pkl").write_bytes(pickle.dumps(Touch(tmp_path / "ran")))
    TrainedModel.load(old, allow_pickle=True)
    assert (tmp_path / "ran").exists()


@pytest.mark.parametrize("model", BUILT_IN, ids=repr)
def test_every_built_in_model_round_trips_as_data(model, tmp_path):
    saved = trained(model)
    saved.save(tmp_path / "m")
    assert sorted(os.listdir(tmp_path / "m")) == ["meta.json", "weights.npy"]
    meta = json.loads((tmp_path / "m" / "meta.json").read_text())
    assert meta["format"] == "allreduce-param-model/4" and meta["kind"] == type(model).__name__
    loaded = TrainedModel.load(tmp_path / "m")
    assert loaded.model == model and type(loaded.model) is type(model)
    np.testing.assert_array_equal(loaded.weights, saved.weights)
    np.testing.assert_array_equal(loaded.predict_numpy(X), saved.predict_numpy(X))
    with pytest.raises(InputError, match="module= is for a TorchModel"):
        TrainedModel.load(tmp_path / "m", module=Net())


def test_a_torch_model_round_trips_with_its_settings_buffers_and_module_state(tmp_path):
    module = Net()
    with torch.no_grad():
        module.norm.running_mean.uniform_()  # a module state unlike a fresh Net's
    model = models.TorchModel(module, device="cpu", precision="bf16", encode_on_device=False)
    saved = trained(model)
    saved.buffers = {**model.buffers(), "norm.running_var": np.full(8, 2.0, np.float32)}
    saved.save(tmp_path / "m")
    assert sorted(os.listdir(tmp_path / "m")) == [
        "buffers.npz",
        "meta.json",
        "module_state.npz",
        "weights.npy",
    ]
    for given in (None, Net(), Net):  # made from the saved class, or the caller's
        loaded = TrainedModel.load(tmp_path / "m", module=given)
        again = loaded.model
        assert isinstance(again, models.TorchModel) and isinstance(again.module, Net)
        assert (again.loss, again.device, again.precision, again.encode_on_device) == (
            "cross_entropy",
            "cpu",
            "bf16",
            False,
        )
        for key, value in module.state_dict().items():
            assert torch.equal(again.module.state_dict()[key], value), key
        np.testing.assert_array_equal(loaded.buffers["norm.running_var"], np.full(8, 2.0))
        np.testing.assert_array_equal(loaded.predict_numpy(X), saved.predict_numpy(X))


def test_a_torch_module_that_cannot_be_made_here_asks_for_module(tmp_path):
    linear = trained(models.TorchModel(torch.nn.Linear(3, 4), device="cpu"))
    linear.save(tmp_path / "linear")
    with pytest.raises(
        InputError, match=r"constructor needs in_features, out_features: pass module="
    ):
        TrainedModel.load(tmp_path / "linear")
    loaded = TrainedModel.load(tmp_path / "linear", module=torch.nn.Linear(3, 4))
    np.testing.assert_array_equal(loaded.predict_numpy(X), linear.predict_numpy(X))
    # a Sequential is made without arguments, but empty: its state does not fit
    stack = trained(models.TorchModel(torch.nn.Sequential(torch.nn.Linear(3, 4)), device="cpu"))
    stack.save(tmp_path / "stack")
    with pytest.raises(InputError, match=r"does not fit Sequential.*pass module="):
        TrainedModel.load(tmp_path / "stack")
    with pytest.raises(InputError, match=r"does not fit Linear"):
        TrainedModel.load(tmp_path / "stack", module=torch.nn.Linear(3, 4))


def test_a_state_numpy_has_no_dtype_for_travels_as_its_bits():
    source = torch.nn.Linear(3, 2).to(torch.bfloat16)
    arrays, dtypes = state_arrays(source)
    assert dtypes == {"weight": "bfloat16", "bias": "bfloat16"}
    assert arrays["weight"].dtype == np.uint16
    target = torch.nn.Linear(3, 2).to(torch.bfloat16)
    load_state(target, arrays, dtypes, "here")
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value)


def test_a_model_of_ones_own_saves_only_as_a_pickle_and_only_on_request(tmp_path):
    saved = TrainedModel(Custom(), np.array([1, 2, 3], np.float32))
    with pytest.raises(InputError, match=r"saves only as a pickle.*pass allow_pickle=True"):
        saved.save(tmp_path / "m")
    assert not (tmp_path / "m").exists()
    saved.save(tmp_path / "m", allow_pickle=True)
    assert json.loads((tmp_path / "m" / "meta.json").read_text())["kind"] == "pickle"
    with pytest.raises(InputError, match="model.pkl holds the model as a pickle"):
        TrainedModel.load(tmp_path / "m")
    loaded = TrainedModel.load(tmp_path / "m", allow_pickle=True)
    np.testing.assert_array_equal(loaded.predict_numpy(X[:, :2]), saved.predict_numpy(X[:, :2]))
    trained(models.LinearRegression(3)).save(tmp_path / "m")  # saved again as data: no pickle left
    assert "model.pkl" not in os.listdir(tmp_path / "m")
    assert isinstance(TrainedModel.load(tmp_path / "m").model, models.LinearRegression)
