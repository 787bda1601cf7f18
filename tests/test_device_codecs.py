"""Lossy gradient codecs computed with torch on the model's device (``models/device_codecs.py``):
the blocks and the residual are the host codec's bit for bit, the engine's put of pre-encoded
parts sums the same as ``put_gradients``, a fit with ``encode_on_device=True`` gives the same
weights as without, and what cannot take it is refused by name. The torch code runs on the
CPU here (``encode_on_device=True``); the tests marked ``cuda`` run it on a GPU."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="the torch adapter needs PyTorch: pip install -e '.[torch]'"
)

from conftest import blobs, run_partitions, train_on_threads  # noqa: E402
from test_torch_devices import cuda  # noqa: E402

from allreduce_param import (  # noqa: E402
    ConfigurationError,
    FitSettings,
    InputError,
    UsageError,
    models,
    optim,
)
from allreduce_param.engine import (  # noqa: E402
    AllReduceParameter,
    CodecOverflowError,
    EncodedGradient,
    NonFiniteGradientError,
    SliceLayout,
    Strategy,
)
from allreduce_param.engine.blocks.codec import get_codec  # noqa: E402
from allreduce_param.engine.encoded import GradientPutPlan  # noqa: E402
from allreduce_param.engine.movement.peers import PART_LENGTH  # noqa: E402
from allreduce_param.models.device_codecs import DEVICE_CODECS, DeviceEncoder  # noqa: E402
from allreduce_param.train.task.device_encoding import (  # noqa: E402
    check_device_encoding,
    device_encoding_refusal,
)
from allreduce_param.train.task.job import TrainingJob  # noqa: E402

F32 = np.float32


def awkward(n: int, rng: np.random.Generator, finite_fp16: bool = False) -> np.ndarray:
    """Normal values laced with what rounding gets wrong: zeros of both signs, ties (equal
    magnitudes, bf16 halfway values), subnormals, the largest floats."""
    v = rng.standard_normal(n).astype(F32)
    v[::7] = 0
    v[1::11] = -0.0
    v[2::13], v[3::13] = 1.0, -1.0  # ties for topk
    v[4::17] = F32(1e-40)  # subnormal
    v[6::23] = F32(-1e-45)
    v[8::29] = F32(1.00390625)  # halfway between two bfloat16s: to even
    v[9::29] = F32(1.01171875)  # halfway, rounding up to even
    v[10::31] = F32(60000.0) if finite_fp16 else F32(3.0e38)
    v[12::37] = F32(3e-8)  # fp16 subnormal
    return v


def ties(n: int, rng: np.random.Generator) -> np.ndarray:
    """Few distinct magnitudes: the k-th largest is shared by many."""
    return rng.integers(-2, 3, n).astype(F32)


def sparse(n: int, rng: np.random.Generator) -> np.ndarray:
    """Mostly zeros: fewer non-zeros than topk keeps, so zeros fill its places."""
    v = np.zeros(n, F32)
    v[rng.choice(n, max(1, n // 400), replace=False)] = rng.standard_normal(max(1, n // 400))
    return v


def tiny(n: int, rng: np.random.Generator) -> np.ndarray:
    """Magnitudes whose int8 scale is a float32 subnormal."""
    return (rng.standard_normal(n) * 1e-38).astype(F32)


def host_put(codec, plan: GradientPutPlan, gradient: np.ndarray, residual: np.ndarray, step):
    """The blocks ``Movements.publish`` makes of each part, updating ``residual`` as it does."""
    blocks = []
    with np.errstate(over="ignore", invalid="ignore"):  # Inf and NaN are what is tested
        return _host_parts(codec, plan, gradient, residual, step, blocks)


def _host_parts(codec, plan, gradient, residual, step, blocks):
    for part in plan.parts:
        bounds = slice(part.start, part.start + part.length)
        chunk = np.add(residual[bounds], gradient[bounds], out=residual[bounds])
        block = bytes(codec.encode(chunk, ids=(1, 0, part.owner, part.part, step)))
        _, sent = codec.decode(block, part.length)
        chunk -= sent
        blocks.append(block)
    return blocks


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, but any NaN equals any NaN (their payloads are the hardware's)."""
    nan = np.isnan(a)
    return bool(
        np.array_equal(nan, np.isnan(b))
        and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))
    )


def check_steps(name: str, layout: SliceLayout, inputs, device: str = "cpu") -> None:
    """Put each of ``inputs`` in turn through the device encoder and the host codec: every
    block and the residual after every step must be the same."""
    codec = get_codec(name)
    plan = GradientPutPlan.of(layout, codec)
    encoder = DeviceEncoder(torch, torch.device(device), plan)
    residual = np.zeros(layout.size, F32)
    for step, gradient in enumerate(inputs):
        payload = encoder.encode(torch.from_numpy(gradient.copy()).to(device)).copy()
        expected = host_put(codec, plan, gradient, residual, step)
        for part, block in zip(plan.parts, expected):
            stream = payload[part.offset : part.offset + part.nbytes]
            ids = (1, 0, part.owner, part.part, step)
            got = bytes(codec.encode_stream(stream, part.length, ids=ids))
            assert got == block, f"{name}: step {step}, part {part}"
        assert same_bits(encoder.residual.cpu().numpy(), residual), f"{name}: step {step}"


MAKERS = [awkward, ties, sparse, tiny]


@pytest.mark.parametrize("name", DEVICE_CODECS)
def test_device_blocks_and_residual_are_the_host_codecs_over_awkward_values(name):
    rng = np.random.default_rng(7)
    layout = SliceLayout(2003, 3)  # uneven slices, an odd length each
    steps = [make(layout.size, rng) for make in MAKERS for _ in range(2)]
    if name == "fp16":
        steps[:2] = [awkward(layout.size, rng, finite_fp16=True) for _ in range(2)]
    check_steps(name, layout, steps)


@pytest.mark.parametrize("name", ["bf16", "int8", "topk"])
def test_a_slice_of_several_parts_is_cut_as_the_engine_cuts_it(name):
    rng = np.random.default_rng(3)
    layout = SliceLayout(PART_LENGTH + 301, 1)  # two parts, the second short
    plan = GradientPutPlan.of(layout, get_codec(name))
    assert [(p.start, p.length) for p in plan.parts] == [(0, PART_LENGTH), (PART_LENGTH, 301)]
    check_steps(name, layout, [awkward(layout.size, rng), ties(layout.size, rng)])


@pytest.mark.parametrize("name", DEVICE_CODECS)
def test_nan_and_inf_encode_as_on_the_host(name):
    rng = np.random.default_rng(5)
    layout = SliceLayout(900, 2)
    with_nan = rng.standard_normal(layout.size).astype(F32)
    with_nan[[3, 500]] = [np.nan, -np.nan]
    with_inf = rng.standard_normal(layout.size).astype(F32)
    with_inf[[10, 460]] = [np.inf, -np.inf]
    steps = [with_nan] if name == "fp16" else [with_nan, with_inf]
    check_steps(name, layout, steps)


def test_fp16_refuses_a_value_it_cannot_hold_as_the_host_codec_does():
    layout = SliceLayout(300, 2)
    encoder = DeviceEncoder(
        torch, torch.device("cpu"), GradientPutPlan.of(layout, get_codec("fp16"))
    )
    gradient = np.ones(layout.size, F32)
    gradient[200] = 70000.0
    with pytest.raises(CodecOverflowError, match="fp16 cannot hold.*partition 1.*bf16"):
        encoder.encode(torch.from_numpy(gradient))


@cuda
@pytest.mark.parametrize("name", DEVICE_CODECS)
def test_on_a_gpu_the_blocks_and_residual_are_the_host_codecs(name):
    rng = np.random.default_rng(11)
    layout = SliceLayout(PART_LENGTH + 2003, 3)
    steps = [make(layout.size, rng) for make in MAKERS]
    if name == "fp16":
        steps[0] = awkward(layout.size, rng, finite_fp16=True)
    check_steps(name, layout, steps, device="cuda")


# ---- the engine's put of pre-encoded parts -----------------------------------------------


@pytest.mark.parametrize("hosts", [None, [[0, 1], [2]]], ids=["flat", "hierarchical"])
def test_a_put_of_encoded_parts_sums_as_put_gradients_with_its_residual(hosts):
    size, steps, partitions = 1001, 3, 2 if hosts is None else 3
    gradients = [
        np.random.default_rng(seed).standard_normal((partitions, size)).astype(F32)
        for seed in range(steps)
    ]

    def body(encoded: bool):
        def run(p):
            assert p.info.hierarchical == (hosts is not None)
            plan, residual = p.info.gradient_put_plan, np.zeros(size, F32)
            encoder = DeviceEncoder(torch, torch.device("cpu"), plan)
            p.init(np.zeros(size, F32))
            sums = []
            for step in range(steps):
                p.get_weights()
                gradient = gradients[step][p.info.partition_id]
                if encoded:
                    p.put_gradients(
                        EncodedGradient(encoder.encode(torch.from_numpy(gradient))), count=2
                    )
                else:
                    p.put_gradients(gradient, count=2, residual=residual)
                sums.append(p.aggregate_gradient_partition().copy())
                p.send_weight_partition()
            return sums

        return run

    results = {}
    for encoded in (False, True):
        param = AllReduceParameter(partitions, size, codec="raw", gradient_codec="int8", timeout=30)
        results[encoded] = run_partitions(param, body(encoded), hosts=hosts)
        assert not any(isinstance(r, BaseException) for r in results[encoded]), results[encoded]
    for host, device in zip(results[False], results[True]):
        for a, b in zip(host, device):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_a_nan_gradient_put_encoded_still_names_its_partition():
    size = 400

    def run(p):
        encoder = DeviceEncoder(torch, torch.device("cpu"), p.info.gradient_put_plan)
        p.init(np.zeros(size, F32))
        p.get_weights()
        gradient = np.ones(size, F32)
        if p.info.partition_id == 1:
            gradient[7] = np.nan
        p.put_gradients(EncodedGradient(encoder.encode(torch.from_numpy(gradient))), count=1)
        p.aggregate_gradient_partition()

    param = AllReduceParameter(2, size, codec="raw", gradient_codec="bf16", timeout=30)
    results = run_partitions(param, run)
    assert isinstance(results[0], NonFiniteGradientError), results
    assert "partition 1" in str(results[0])


def test_encoded_gradient_put_refuses_what_it_cannot_take():
    size = 64

    def run(p):
        plan = p.info.gradient_put_plan
        p.init(np.zeros(size, F32))
        p.get_weights()
        if p.info.partition_id == 0:
            return plan, None
        errors = []
        for payload in (
            np.zeros(plan.payload_bytes + 1, np.uint8),
            np.zeros(plan.payload_bytes, np.int8),
        ):
            with pytest.raises(InputError, match=f"{plan.payload_bytes} bytes") as caught:
                p.put_gradients(EncodedGradient(payload))
            errors.append(caught.value)
        return plan, errors

    plan, _ = run_partitions(AllReduceParameter(2, size, gradient_codec="int8", timeout=5), run)[0]
    assert plan.takes_payloads and plan.codec == "int8"
    assert plan.payload_bytes == sum(4 + p.length for p in plan.parts)

    def lossless(p):
        with pytest.raises(InputError, match="'raw' is lossless.*put_gradients"):
            p.put_gradients(EncodedGradient(np.zeros(0, np.uint8)))
        return p.info.gradient_put_plan.refusal

    refusals = run_partitions(AllReduceParameter(2, size, codec="raw", timeout=5), lossless)
    assert all(isinstance(r, str) and "lossless" in r for r in refusals), refusals
    with pytest.raises(UsageError, match="lossless"):
        get_codec("lz4").encode_stream(b"", 0)
    with pytest.raises(UsageError, match="10 values is 20 bytes"):
        get_codec("bf16").encode_stream(bytes(19), 10)


# ---- TorchModel and the trainer ----------------------------------------------------------


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


class DeviceOnly(models.TorchModel):
    """A TorchModel whose host gradient call fails: a fit that trains proves the device path
    (a one-thread fit's host path computes into the parameter's buffer)."""

    def loss_and_grad_into(self, *args, **kwargs):
        raise AssertionError("the gradient came to the host as float32")


def fit(model, gradient_codec: str):
    X, y = blobs(90, 6, 3, seed=1)
    parts = [(X[:40], y[:40]), (X[40:], y[40:])]
    param = AllReduceParameter(
        2, model.size, codec="raw", gradient_codec=gradient_codec, timeout=60
    )
    settings = FitSettings(batch_size=16, epochs=2, seed=7)
    return train_on_threads(
        TrainingJob(model, optim.Adam(lr=0.01), param, settings, 6, False), parts
    )


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_a_fit_encoding_on_the_device_gives_the_same_weights_bit_for_bit(codec):
    host = fit(models.TorchModel(net, encode_on_device=False), codec)
    device = fit(DeviceOnly(net, encode_on_device=True), codec)
    for outputs in (host, device):
        assert all(isinstance(output, dict) for output in outputs), outputs
    assert host[0]["weights"] == device[0]["weights"]
    # the stand-in does fail where the gradient comes down as float32
    assert isinstance(fit(DeviceOnly(net, encode_on_device=False), codec)[0], Exception)


@cuda
@pytest.mark.parametrize("codec", ["bf16", "int8", "topk"])
def test_on_a_gpu_a_fit_encoding_there_gives_the_same_weights(codec):
    host = fit(models.TorchModel(net, device="cuda:0", encode_on_device=False), codec)
    device = fit(DeviceOnly(net, device="cuda:0"), codec)  # "auto": on a GPU, it encodes there
    for outputs in (host, device):
        assert all(isinstance(output, dict) for output in outputs), outputs
    assert host[0]["weights"] == device[0]["weights"]


def test_a_fit_every_task_refuses_ends_at_once_with_the_refusal(caplog):
    """Each task refuses encode_on_device=True with two threads as it sets up its fit (the
    driver refuses it first in a real fit): every partition fails before it fetched
    anything, and none waits out the engine's linger for a goodbye (logged where it gives
    up waiting)."""
    X, y = blobs(60, 6, 3, seed=3)
    model = models.TorchModel(net, encode_on_device=True)
    param = AllReduceParameter(2, model.size, codec="raw", gradient_codec="bf16")
    settings = FitSettings(batch_size=16, epochs=1, seed=7, threads=2)
    job = TrainingJob(model, optim.SGD(0.01), param, settings, 6, False)
    with caplog.at_level("WARNING", logger="allreduce_param"):
        outputs = train_on_threads(job, [(X[:30], y[:30]), (X[30:], y[30:])])
    for partition, output in enumerate(outputs):
        assert re.match(
            rf"partition {partition}, setting up its fit \(model, optimizer, data\): "
            r"ConfigurationError: .*encode_on_device=True, but this fit .*several threads",
            str(output),
        ), outputs
    assert not [r.message for r in caplog.records if "to say they were done" in r.message]


class Counted(models.TorchModel):
    """A TorchModel that counts its device-encoded steps (in the class: each partition trains
    a copy of the model)."""

    encoded: list = []

    def loss_and_encoded_grad(self, *args):
        type(self).encoded.append(1)
        return super().loss_and_encoded_grad(*args)


def test_a_fit_under_ssp_encodes_on_the_device_too():
    X, y = blobs(60, 6, 3, seed=2)
    model = Counted(net, encode_on_device=True)
    param = AllReduceParameter(
        2, model.size, codec="raw", gradient_codec="topk", strategy=Strategy("ssp", staleness=1)
    )
    settings = FitSettings(batch_size=16, epochs=2, seed=7, strategy="ssp", staleness=1)
    job = TrainingJob(model, optim.SGD(0.01), param, settings, 6, False)
    outputs = train_on_threads(job, [(X[:30], y[:30]), (X[30:], y[30:])])
    assert all(isinstance(output, dict) for output in outputs), outputs
    # every step of both partitions: 2 epochs of 4 steps (60 rows, batches of 16)
    assert len(Counted.encoded) == 2 * 2 * 4


def test_encode_on_device_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigurationError, match="'auto', True or False"):
        models.TorchModel(net, encode_on_device="yes")
    model = models.TorchModel(net, encode_on_device=True)
    raw = GradientPutPlan.of(SliceLayout(model.size, 2), get_codec("raw"), "a reason")
    with pytest.raises(ConfigurationError, match="'raw' has no device encoding"):
        model.device_encoder(raw)
    # what the driver (before the stage) and each task ask of the fit's settings
    settings = FitSettings()
    for changed, codec, inline, clip, reason in (
        (settings, "raw", True, None, "'raw' has no device encoding"),
        (settings.replace(threads=2), "bf16", True, None, "several threads.*threads=1"),
        (settings.replace(sync_every=4), "bf16", True, None, "local SGD"),
        (settings, "int8", False, 1.0, "clip_norm under a strategy with a background owner"),
    ):
        refusal = device_encoding_refusal(changed, codec, inline, clip)
        assert re.search(reason, refusal), refusal
        with pytest.raises(ConfigurationError, match="encode_on_device=True, but this fit"):
            check_device_encoding(model, refusal)
        check_device_encoding(models.TorchModel(net), refusal)  # "auto": the host encodes
    assert device_encoding_refusal(settings, "topk", False, None) is None
    # "auto" on the CPU: the gradient goes down as float32, as before
    assert (
        models.TorchModel(net).device_encoder(
            GradientPutPlan.of(SliceLayout(model.size, 2), get_codec("bf16"))
        )
        is None
    )


def test_the_encoder_and_the_model_refuse_a_put_that_takes_no_encoded_parts_alike():
    """The engine's own refusal (here: a host arena's) and a codec without a device format
    read the same from ``TorchModel.device_encoder`` and ``DeviceEncoder``."""
    model = models.TorchModel(net, encode_on_device=True)
    arena = GradientPutPlan.of(SliceLayout(model.size, 2), get_codec("bf16"), "a host arena's")
    raw = GradientPutPlan.of(SliceLayout(model.size, 2), get_codec("raw"), "lossless")
    for plan, reason in (
        (arena, r"put takes no pre-encoded parts \(a host arena's\)"),
        (raw, "'raw' has no device encoding"),
    ):
        with pytest.raises(ConfigurationError, match=f"encode_on_device=True, but .*{reason}"):
            model.device_encoder(plan)
        with pytest.raises(
            ConfigurationError, match=f"cannot be encoded on the device: .*{reason}"
        ):
            DeviceEncoder(torch, torch.device("cpu"), plan)
