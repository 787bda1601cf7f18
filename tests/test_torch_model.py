"""The torch adapter: an nn.Module trained by the engine (needs the [torch] extra; CI installs it)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="the torch adapter needs PyTorch: pip install -e '.[torch]'"
)

from conftest import train_on_threads  # noqa: E402
from test_train_loop import blobs, reference_fit, run_workers  # noqa: E402

from allreduce_param import (  # noqa: E402
    ConfigurationError,
    DistriOptimizer,
    FitSettings,
    InputError,
    TrainedModel,
    models,
    optim,
)
from allreduce_param.engine import AllReduceParameter  # noqa: E402
from allreduce_param.models.base import merge_buffers  # noqa: E402
from allreduce_param.train.checkpoint import CheckpointSettings, load_buffers, newest  # noqa: E402
from allreduce_param.train.records import Buffers  # noqa: E402
from allreduce_param.train.start import StartPoint  # noqa: E402
from allreduce_param.train.task.job import TrainingJob  # noqa: E402

SPARK_MASTER = "local[2]"


def net():
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def test_loss_and_gradient_are_torchs_own_summed_over_rows():
    model = models.TorchModel(net)
    weights = model.init(np.random.default_rng(0))
    X, y = blobs(9, 6, 3, seed=0)
    loss, grad, count = model.loss_and_grad(weights, X, y)
    module = net()
    torch.nn.utils.vector_to_parameters(torch.from_numpy(weights.copy()), module.parameters())
    expected = torch.nn.functional.cross_entropy(
        module(torch.from_numpy(X)), torch.from_numpy(y.astype(np.int64)), reduction="sum"
    )
    expected.backward()
    assert count == 9 and np.isclose(loss, expected.item(), rtol=1e-6)
    np.testing.assert_allclose(
        grad,
        torch.cat([p.grad.reshape(-1) for p in module.parameters()]).numpy(),
        rtol=1e-5,
        atol=1e-6,
    )
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
    sizes = [
        p.numel() for p in net().parameters()
    ]  # 72, 12, 36, 3: the last layer's are the last 39
    assert sorted(ranges) == [(0, 72), (72, 84), (84, 120), (120, 123)]
    assert set(ranges[:2]) == {(84, 120), (120, 123)} and sum(sizes) == model.size


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_loss_and_predictions_are_the_loss_and_predict_without_a_backward_pass(loss):
    model = models.TorchModel(net, loss=loss)
    weights = model.init(np.random.default_rng(1))
    X, y = blobs(9, 6, 3, seed=2)
    y = (
        y
        if loss == "cross_entropy"
        else np.random.default_rng(3).standard_normal((9, 3)).astype(np.float32)
    )
    total, predictions, count = model.loss_and_predictions(weights, X, y)
    assert count == 9 and total == pytest.approx(model.loss_and_grad(weights, X, y)[0], rel=1e-6)
    np.testing.assert_array_equal(predictions, model.predict(weights, X))
    empty = model.loss_and_predictions(weights, X[:0], y[:0])
    assert (empty[0], len(empty[1]), empty[2]) == (0.0, 0, 0)


def test_init_is_reproducible_from_the_seed():
    model = models.TorchModel(net)
    assert np.array_equal(
        model.init(np.random.default_rng(3)), model.init(np.random.default_rng(3))
    )
    assert not np.array_equal(
        model.init(np.random.default_rng(3)), model.init(np.random.default_rng(4))
    )


def test_a_torch_module_trains_under_bsp_like_single_process():
    X, y = blobs(90, 6, 3, seed=1)
    parts = [(X[:30], y[:30]), (X[30:], y[30:])]
    model, optimizer = models.TorchModel(net), optim.Adam(lr=0.01)
    param = AllReduceParameter(2, model.size, codec="raw", timeout=60)
    outputs = run_workers(
        TrainingJob(
            model,
            optimizer,
            param,
            FitSettings(batch_size=16, epochs=3, seed=7, threads=2),
            6,
            False,
        ),
        parts,
    )
    assert all(isinstance(output, dict) for output in outputs), outputs
    expected = reference_fit(model, optimizer, parts, batch_size=16, epochs=3, seed=7)
    np.testing.assert_allclose(
        np.frombuffer(outputs[0]["weights"], np.float32), expected, rtol=2e-5, atol=2e-6
    )


def test_bad_settings():
    from allreduce_param import ConfigurationError

    with pytest.raises(ConfigurationError, match="loss must be one of"):
        models.TorchModel(net, loss="hinge")
    with pytest.raises(ConfigurationError, match="needs a torch.nn.Module, got int"):
        models.TorchModel(lambda: 3)


# ---- modes and buffers: BatchNorm and Dropout --------------------------------------------


def normed(dropout: float = 0.5):
    """BatchNorm on the input (a cumulative average: ``momentum=None``), a hidden layer with
    BatchNorm (the default momentum) and Dropout after it: every buffer the fit keeps."""
    return torch.nn.Sequential(
        torch.nn.BatchNorm1d(6, momentum=None),
        torch.nn.Linear(6, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(16, 3),
    )


def loaded(model, weights, buffers=None):
    """A fresh module with ``weights`` and ``buffers`` loaded the plain torch way."""
    module = normed()
    module.load_state_dict(model.state_dict(weights, buffers))
    return module


def test_training_calls_run_in_train_mode_and_predictions_in_eval_mode():
    model = models.TorchModel(normed)
    weights = model.init(np.random.default_rng(0))
    X, y = blobs(32, 6, 3, seed=4)
    before = model.buffers()
    first, second = (model.loss_and_grad(weights, X, y)[0] for _ in range(2))
    assert first != second  # Dropout draws new masks each training call
    trained = model.buffers()
    assert int(trained["0.num_batches_tracked"]) == 2 and int(before["0.num_batches_tracked"]) == 0
    predictions = model.predict(weights, X)
    assert np.array_equal(predictions, model.predict(weights, X))
    loss, both, _ = model.loss_and_predictions(weights, X, y)
    assert (
        np.array_equal(both, predictions) and loss == model.loss_and_predictions(weights, X, y)[0]
    )
    for name, value in model.buffers().items():  # predicting read the buffers and changed none
        assert np.array_equal(value, trained[name]), name
    module = loaded(model, weights, trained).eval()  # torch's own eval mode, the same buffers
    with torch.no_grad():
        np.testing.assert_array_equal(module(torch.from_numpy(X)).argmax(1).numpy(), predictions)


def test_threads_copies_buffers_merge_weighted_by_their_rows():
    import threading

    model = models.TorchModel(lambda: normed(dropout=0.0))
    weights = model.init(np.random.default_rng(1))
    X, y = blobs(32, 6, 3, seed=5)
    start = model.buffers()
    shares = [(X[:8], y[:8]), (X[8:], y[8:])]
    threads = [
        threading.Thread(target=model.loss_and_grad, args=(weights, *share)) for share in shares
    ]
    for thread in threads:
        thread.start()
        thread.join()  # one after the other: each thread's copy sees its own share only
    expected = []
    for share, _ in shares:  # the same step, plain torch, one module per share
        module = loaded(model, weights, start)
        module.train()
        module(torch.from_numpy(share))
        expected.append(
            ({k: v.numpy() for k, v in module.state_dict().items() if "running" in k}, len(share))
        )
    merged = model.buffers()
    for name, value in merge_buffers(expected).items():
        np.testing.assert_allclose(merged[name], value, rtol=1e-6, atol=1e-7)
    assert int(merged["0.num_batches_tracked"]) == 1
    np.testing.assert_allclose(merged["0.running_mean"], X.mean(axis=0), rtol=1e-5, atol=1e-6)


def test_set_buffers_applies_them_and_names_what_is_wrong():
    model = models.TorchModel(normed)
    weights = model.init(np.random.default_rng(2))
    X = blobs(10, 6, 3, seed=6)[0]
    buffers = model.buffers()
    buffers["0.running_mean"] = np.full(6, 2.0, np.float32)
    model.set_buffers(buffers)
    assert np.array_equal(model.buffers()["0.running_mean"], buffers["0.running_mean"])
    module = loaded(model, weights, buffers).eval()
    with torch.no_grad():
        np.testing.assert_array_equal(
            model.predict(weights, X), module(torch.from_numpy(X)).argmax(1).numpy()
        )
    with pytest.raises(InputError, match=r"missing \['0.running_var'\], unexpected \['extra'\]"):
        model.set_buffers(
            {**{k: v for k, v in buffers.items() if k != "0.running_var"}, "extra": np.zeros(1)}
        )
    with pytest.raises(
        InputError, match=r"buffer '2.running_mean' has shape \(3,\), the module's \(16,\)"
    ):
        model.set_buffers({**buffers, "2.running_mean": np.zeros(3, np.float32)})
    assert models.TorchModel(net).buffers() == {}


def test_checkpoints_keep_each_partitions_buffers_and_a_resume_ends_with_the_same(tmp_path):
    X, y = blobs(90, 6, 3, seed=7)
    parts = [(X[i::3], y[i::3]) for i in range(3)]

    def job(directory, resume=None):
        # no Dropout: the fit is deterministic
        model = models.TorchModel(lambda: normed(dropout=0.0))
        param = AllReduceParameter(3, model.size, codec="raw", timeout=60)
        return TrainingJob(
            model,
            optim.Adam(lr=0.01),
            param,
            FitSettings(batch_size=18, epochs=3, seed=3),
            6,
            False,
            checkpoints=CheckpointSettings(str(directory), 4, 10),
            start=StartPoint() if resume is None else StartPoint.of_checkpoint(resume),
        )

    whole = train_on_threads(job(tmp_path / "whole"), parts)
    middle = newest(str(tmp_path / "whole" / "step-0000000008"))
    resumed = train_on_threads(job(tmp_path / "resumed", resume=middle), parts)
    for before, after in zip(whole, resumed):
        assert isinstance(before, dict) and isinstance(after, dict), (before, after)
        (kept, rows), (again, rows_again) = (
            (record.buffers, record.rows)
            for record in (Buffers.decode(o["buffers"]) for o in (before, after))
        )
        assert rows == rows_again == 30 and int(kept["0.num_batches_tracked"]) == 15
        for name in kept:
            np.testing.assert_array_equal(again[name], kept[name])
    assert np.array_equal(whole[0]["weights"], resumed[0]["weights"])
    # on another number of workers each starts from the parts' merge
    own = [load_buffers(middle, i, 3) for i in range(3)]
    assert int(own[0]["0.num_batches_tracked"]) == 8
    for name, value in merge_buffers([(b, 30) for b in own]).items():
        np.testing.assert_array_equal(load_buffers(middle, 0, 2)[name], value)


@pytest.fixture(scope="module")
def normed_fit(spark):
    """A real fit on 2 partitions: the first 40 rows on one, the last 40 on the other, each
    step the whole batch (80 rows: 40 a partition), 3 epochs of one step."""
    X, y = blobs(80, 6, 3, seed=8)
    X[:40] += 2.0  # the halves differ: their merge is not either one's
    rows = [(row.tolist(), float(label)) for row, label in zip(X, y)]
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(rows, 2), "features array<float>, label double"
    ).cache()
    model = models.TorchModel(normed)
    result = DistriOptimizer(
        model,
        optim.Adam(lr=0.01),
        batch_size=80,
        epochs=3,
        num_workers=2,
        progress=False,
        partition_scheme="as_is",
        seed=1,
    ).fit(df)
    return model, result, X, df


@pytest.mark.slow
def test_a_fits_buffers_are_the_partitions_merged_by_rows(normed_fit):
    model, result, X, _ = normed_fit
    buffers = result.buffers
    # the input's BatchNorm sees the data itself: each partition's statistics are those of
    # its 40 rows (the same batch each step, a cumulative average), merged by rows
    halves = [X[:40].astype(np.float64), X[40:].astype(np.float64)]
    np.testing.assert_allclose(
        buffers["0.running_mean"], X.astype(np.float64).mean(axis=0), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        buffers["0.running_var"],
        np.mean([h.var(axis=0, ddof=1) for h in halves], axis=0),
        rtol=1e-5,
        atol=1e-5,
    )
    assert int(buffers["0.num_batches_tracked"]) == 3 and int(buffers["2.num_batches_tracked"]) == 3
    # the hidden BatchNorm's moved from their start (zeros and ones)
    assert np.abs(buffers["2.running_mean"]).min() > 0 and not np.allclose(
        buffers["2.running_var"], 1.0
    )
    # the model given to the fit keeps its own
    assert not model.module[0].running_mean.any() and int(model.module[0].num_batches_tracked) == 0


def test_a_fits_predictions_are_deterministic_and_use_its_buffers(normed_fit):
    _, result, X, df = normed_fit
    predictions = result.predict_numpy(X)
    assert np.array_equal(predictions, result.predict_numpy(X))
    module = normed()
    module.load_state_dict(result.state_dict())
    module.eval()
    with torch.no_grad():
        np.testing.assert_array_equal(module(torch.from_numpy(X)).argmax(1).numpy(), predictions)
    for name, value in result.buffers.items():
        assert np.array_equal(module.state_dict()[name].numpy(), value), name
    column = [row["prediction"] for row in result.predict(df).orderBy("features").collect()]
    order = sorted(range(len(X)), key=lambda i: X[i].tolist())
    assert column == [float(predictions[i]) for i in order]


def test_a_fits_export_and_save_keep_the_buffers(normed_fit, tmp_path):
    _, result, X, _ = normed_fit
    state = result.state_dict()
    assert list(state) == list(normed().state_dict())
    with np.load(result.export_npz(tmp_path / "normed.npz")) as saved:
        assert sorted(saved.files) == sorted(state)
        for name, value in state.items():
            np.testing.assert_array_equal(saved[name], value.numpy())
    result.save(tmp_path / "model")  # no pickle: a Sequential is loaded into the module given
    again = TrainedModel.load(tmp_path / "model", module=normed())
    assert sorted(again.buffers) == sorted(result.buffers)
    for name, value in result.buffers.items():
        np.testing.assert_array_equal(again.buffers[name], value)
    np.testing.assert_array_equal(again.predict_numpy(X), result.predict_numpy(X))


def test_the_regularisation_spares_the_parameters_named_bias():
    model = models.TorchModel(
        torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1)),
        loss="mse",
    )
    # 0.weight (6), 0.bias (2), 2.weight (2), 2.bias (1)
    expected = [True] * 6 + [False] * 2 + [True] * 2 + [False]
    assert model.penalized().tolist() == expected
    for start, stop in [(0, 11), (5, 9), (7, 7), (8, 11)]:  # a task builds its slice alone
        assert model.penalized(slice(start, stop)).tolist() == expected[start:stop]


def test_a_task_without_the_gpu_it_asks_for_ends_the_fit_after_one_run(normed_fit):
    """device="cuda" where Spark assigns no GPU (local[N]) fails in every task, on every run:
    the fit raises the task's ConfigurationError at once, and runs no stage again."""
    _, _, _, df = normed_fit
    fit = DistriOptimizer(
        models.TorchModel(normed, device="cuda"),  # the driver checks it on the CPU
        optim.SGD(0.1),
        batch_size=80,
        epochs=1,
        num_workers=2,
        progress=False,
        partition_scheme="as_is",
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pytest.raises(
            ConfigurationError,
            match=r"^partition \d, setting up its fit [^:]*: TorchModel\(device='cuda'\): Spark "
            r"assigned this task no GPU; set .*spark.task.resource.gpu.amount",
        ) as failure:
            fit.fit(df)
    assert not [w for w in said if "runs again" in str(w.message)]  # each run again says so
    assert "org.apache.spark" in str(failure.value.__cause__)  # Spark's own report stays on it


def test_gpus_per_task_in_local_mode_is_refused_before_any_job(normed_fit):
    """local[N] assigns tasks no GPUs: the fit says so, and what to do on one machine."""
    _, _, _, df = normed_fit
    fit = DistriOptimizer(models.TorchModel(normed), optim.SGD(0.1), gpus_per_task=1)
    with pytest.raises(ConfigurationError, match=r"local mode \(local\[2\]\).*device='cuda:0'"):
        fit.fit(df)


def test_encode_on_device_true_where_the_fit_cannot_is_refused_before_the_stage(normed_fit):
    """The driver asks what each task would: here the batches split over two threads."""
    _, _, _, df = normed_fit
    fit = DistriOptimizer(
        models.TorchModel(normed, encode_on_device=True),
        optim.SGD(0.1),
        gradient_codec="bf16",
        threads=2,
        num_workers=2,
        progress=False,
    )
    with pytest.raises(ConfigurationError, match="encode_on_device=True.*several threads"):
        fit.fit(df)
