"""TorchModel on devices: the choice of device (Spark-free), the refusals, mixed precision, the
gradient's copies down from a device, and buffers and checkpoints through the host. The tests
marked ``cuda`` run the GPU path itself and skip where this torch has no usable GPU."""

from __future__ import annotations

import pickle
import re
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="the torch adapter needs PyTorch: pip install -e '.[torch]'"
)

from conftest import blobs  # noqa: E402

from allreduce_param import ConfigurationError, FitSettings, models  # noqa: E402
from allreduce_param.models.devices import CudaInfo, choose_device, task_gpus  # noqa: E402
from allreduce_param.models.transfers import GradientCopies  # noqa: E402
from allreduce_param.spark.gpus import profile_needed  # noqa: E402

_NO_GPU = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"needs a GPU that this PyTorch ({torch.__version__}) can use; "
    f"CUDA built: {torch.backends.cuda.is_built()}",
)


def cuda(test):
    """Marked ``cuda`` (``pytest -m cuda`` runs these alone), skipped without a usable GPU."""
    return pytest.mark.cuda(_NO_GPU(test))


NO_CUDA = CudaInfo(built=False, count=0, torch_version="2.x+cpu")
TWO_GPUS = CudaInfo(built=True, count=2, torch_version="2.x+cu121")


def net():
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.Tanh(), torch.nn.Linear(12, 3)
    )


@pytest.mark.parametrize(
    "request_, assigned, cuda_info, driver, expected",
    [
        ("auto", ["1"], TWO_GPUS, False, "cuda:1"),  # the task's GPU
        ("auto", ["0", "1"], TWO_GPUS, False, "cuda:0"),  # the first of two
        ("auto", [], TWO_GPUS, False, "cpu"),  # a task with none: the CPU, not a GPU it shares
        ("auto", None, TWO_GPUS, False, "cuda:0"),  # outside Spark: the process's first
        ("auto", None, NO_CUDA, False, "cpu"),
        ("cuda", ["1"], TWO_GPUS, False, "cuda:1"),
        ("cuda", None, NO_CUDA, True, "cpu"),  # a driver's checks: the GPUs are the executors'
        ("cuda:1", [], TWO_GPUS, False, "cuda:1"),  # forced, whatever Spark assigned
        ("cpu", ["0"], TWO_GPUS, False, "cpu"),
    ],
)
def test_the_device_follows_the_request_and_the_tasks_gpus(
    request_, assigned, cuda_info, driver, expected
):
    assert choose_device(request_, assigned, cuda_info, driver) == expected


def test_an_address_is_found_in_cuda_visible_devices():
    """Under GPU isolation the executor sees its GPUs renumbered from 0."""
    isolated = CudaInfo(built=True, count=2, torch_version="2.x", visible="3,5")
    assert choose_device("auto", ["5"], isolated) == "cuda:1"
    with pytest.raises(ConfigurationError, match="CUDA index 7.*sees 2 GPU"):
        choose_device("auto", ["7"], isolated)


@pytest.mark.parametrize(
    "request_, assigned, cuda_info, message",
    [
        ("cuda", [], TWO_GPUS, "assigned this task no GPU.*spark.task.resource.gpu.amount"),
        ("cuda", [], TWO_GPUS, "gpus_per_task"),
        ("auto", ["0"], NO_CUDA, r"assigned GPU 0: this PyTorch build \(2.x\+cpu\) has no CUDA"),
        ("cuda", None, NO_CUDA, "has no CUDA"),
        ("cuda:2", None, TWO_GPUS, "sees 2 GPU"),
        ("cuda:0", None, CudaInfo(True, 0, "2.x"), "sees no GPU"),
        ("gpu", None, TWO_GPUS, "'auto', 'cuda', 'cuda:N'"),
    ],
)
def test_a_gpu_that_cannot_be_had_is_refused_saying_why(request_, assigned, cuda_info, message):
    with pytest.raises(ConfigurationError, match=message):
        choose_device(request_, assigned, cuda_info)


def test_the_gpus_come_from_the_tasks_resources():
    assert task_gpus(None) is None
    assert task_gpus({}) == []
    assert task_gpus({"gpu": SimpleNamespace(name="gpu", addresses=["0", "2"])}) == ["0", "2"]


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="this PyTorch has CUDA")
def test_a_forced_gpu_on_a_torch_without_cuda_names_the_build():
    model = models.TorchModel(net, device="cuda:0")  # made anywhere: chosen where it runs
    X, y = blobs(4, 6, 3, seed=0)
    weights = model.init(np.random.default_rng(0))
    with pytest.raises(
        ConfigurationError, match=re.escape(f"build ({torch.__version__}) has no CUDA")
    ):
        model.loss_and_grad(weights, X, y)


def test_bad_device_and_precision_are_refused():
    with pytest.raises(ConfigurationError, match="device='gpu0'"):
        models.TorchModel(net, device="gpu0")
    with pytest.raises(ConfigurationError, match="precision='fp16'.*'fp32', 'bf16'"):
        models.TorchModel(net, precision="fp16")
    for bad in (0, -1, 0.75, 1.5, True, "1"):
        with pytest.raises(ConfigurationError, match="gpus_per_task"):
            FitSettings(gpus_per_task=bad)
    assert FitSettings(gpus_per_task=0.25).gpus_per_task == 0.25


def test_the_device_is_chosen_again_where_the_model_is_unpickled():
    model = models.TorchModel(net, device="cpu")
    X, y = blobs(4, 6, 3, seed=0)
    model.loss_and_grad(model.init(np.random.default_rng(0)), X, y)
    assert model.torch_device == torch.device("cpu") and not model.uses_gpu
    copy = pickle.loads(pickle.dumps(model))
    assert copy._threads.chosen is None and copy.device == "cpu"
    assert "device='cpu'" in repr(copy) and "device" not in repr(models.TorchModel(net))


def test_bf16_autocast_gives_a_float32_gradient_close_to_fp32s():
    X, y = blobs(32, 6, 3, seed=1)
    full, mixed = models.TorchModel(net), models.TorchModel(net, precision="bf16")
    weights = full.init(np.random.default_rng(0))
    loss, grad, _ = full.loss_and_grad(weights, X, y)
    loss16, grad16, _ = mixed.loss_and_grad(weights, X, y)
    assert grad16.dtype == np.float32
    assert not np.array_equal(grad, grad16)  # bf16 did run
    np.testing.assert_allclose(loss16, loss, rtol=2e-2)
    np.testing.assert_allclose(grad16, grad, rtol=0.1, atol=0.05 * np.abs(grad).max())


class StandInLanding:
    """A stand-in for a CUDA event: lands when the test says so."""

    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


def test_gradient_parts_reach_the_vector_before_ready_announces_them_in_order():
    out, zone = np.zeros(6, np.float32), np.zeros(6, np.float32)
    landings, announced = [], []

    def start_copy(start, stop, gradient):
        zone[start:stop] = gradient  # the copy "on its way"
        landings.append(StandInLanding())
        return landings[-1]

    def ready(start, stop):
        assert np.array_equal(out[start:stop], zone[start:stop]), "announced before it was there"
        announced.append((start, stop))

    copies = GradientCopies(out, zone, start_copy, ready)
    copies.part_done(4, 6, np.array([5, 6], np.float32))  # last layer first, as backward
    copies.part_done(2, 4, np.array([3, 4], np.float32))
    assert announced == []  # nothing landed yet
    landings[0].landed = True
    copies.part_done(0, 2, np.array([1, 2], np.float32))
    assert announced == [(4, 6)]  # the landed one, passed on without waiting
    copies.finish()
    assert announced == [(4, 6), (2, 4), (0, 2)]
    assert out.tolist() == [1, 2, 3, 4, 5, 6]


def test_a_stage_profile_is_asked_only_where_spark_can_give_it():
    def session(**settings):
        values = {"spark.master": "spark://host:7077", **settings}
        return lambda key, default: values.get(key, default)

    with_gpus = session(**{"spark.executor.resource.gpu.amount": "2"})
    assert profile_needed(with_gpus, False, None, (4, 0)) is False
    assert profile_needed(with_gpus, False, 1, (4, 0)) is True
    same = session(**{"spark.task.resource.gpu.amount": "0.5"})
    assert profile_needed(same, True, 0.5, (3, 5)) is False  # the session gives them already
    for settings, connect, version, message in (
        (session(**{"spark.master": "local[4]"}), False, (4, 0), "local mode.*device='cuda:0'"),
        (with_gpus, True, (4, 0), "Spark Connect.*spark.task.resource.gpu.amount=1"),
        (session(), False, (4, 0), "no GPUs.*spark.executor.resource.gpu.amount"),
        (with_gpus, False, (3, 5), "PySpark 4.0.*spark.task.resource.gpu.amount=1"),
    ):
        with pytest.raises(ConfigurationError, match=message):
            profile_needed(settings, connect, 1, version)
    with pytest.raises(ConfigurationError, match="2 GPU\\(s\\) each"):
        profile_needed(with_gpus, False, 3, (4, 0))


def test_buffers_and_state_dict_go_through_the_host_with_the_device_set():
    model = models.TorchModel(net, device="cpu")
    X, y = blobs(16, 6, 3, seed=2)
    weights = model.init(np.random.default_rng(0))
    model.loss_and_grad(weights, X, y)
    trained = model.buffers()
    assert all(isinstance(value, np.ndarray) for value in trained.values())
    fresh = models.TorchModel(net, device="cpu")
    fresh.set_buffers(trained)
    state = fresh.state_dict(weights)
    assert all(value.device.type == "cpu" for value in state.values())
    np.testing.assert_array_equal(state["1.running_mean"].numpy(), trained["1.running_mean"])
    np.testing.assert_array_equal(fresh.predict(weights, X), model.predict(weights, X))


# ---- on a GPU ---------------------------------------------------------------------------


@cuda
def test_on_a_gpu_the_gradient_and_predictions_are_the_cpus():
    X, y = blobs(64, 6, 3, seed=3)
    on_cpu, on_gpu = models.TorchModel(net, device="cpu"), models.TorchModel(net, device="cuda:0")
    weights = on_cpu.init(np.random.default_rng(0))
    loss, grad, _ = on_cpu.loss_and_grad(weights, X, y)
    out, announced = np.full(on_gpu.size, np.nan, np.float32), []
    gpu_loss, rows = on_gpu.loss_and_grad_into(
        weights, X, y, out, lambda start, stop: announced.append((start, stop))
    )
    assert on_gpu.uses_gpu and rows == 64
    np.testing.assert_allclose(gpu_loss, loss, rtol=1e-4)
    np.testing.assert_allclose(out, grad, rtol=1e-3, atol=1e-5)
    covered = np.zeros(on_gpu.size, bool)
    for start, stop in announced:
        covered[start:stop] = True
    assert covered.all()
    np.testing.assert_array_equal(on_gpu.predict(weights, X), on_cpu.predict(weights, X))


@cuda
def test_on_a_gpu_buffers_come_back_as_host_arrays_and_go_back():
    X, y = blobs(32, 6, 3, seed=4)
    model = models.TorchModel(net, device="cuda:0", precision="bf16")
    weights = model.init(np.random.default_rng(0))
    model.loss_and_grad(weights, X, y)
    trained = model.buffers()
    assert all(isinstance(value, np.ndarray) for value in trained.values())
    assert trained["1.num_batches_tracked"] == 1
    again = models.TorchModel(net, device="cuda:0")
    again.set_buffers(trained)
    np.testing.assert_array_equal(again.buffers()["1.running_var"], trained["1.running_var"])
