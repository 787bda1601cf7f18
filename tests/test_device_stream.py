"""A gradient encoded on the model's device and streamed while backward runs
(``stream_gradients(encoded=True)``, ``TorchModel.loss_and_encoded_grad(ready=)``,
``transfers.EncodedCopies``): the same blocks and residual as the unstreamed put, the last
layers' owners first, the same fit bit for bit, and misuse and a broken backward refused
clearly. The torch code runs on the CPU here; the tests marked ``cuda`` run it on a GPU."""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="the torch adapter needs PyTorch: pip install -e '.[torch]'"
)

from conftest import blobs, raise_first, run_partitions, train_on_threads  # noqa: E402
from test_device_codecs import same_bits  # noqa: E402
from test_torch_devices import _NO_GPU, StandInLanding  # noqa: E402

from allreduce_param import (  # noqa: E402
    FitSettings,
    InputError,
    PeerLostError,
    UsageError,
    models,
    optim,
)
from allreduce_param.engine import (  # noqa: E402
    AllReduceParameter,
    CodecOverflowError,
    EncodedGradient,
    SliceLayout,
)
from allreduce_param.engine.blocks.codec import get_codec  # noqa: E402
from allreduce_param.engine.encoded import GradientPutPlan  # noqa: E402
from allreduce_param.models.device_codecs import DeviceEncoder  # noqa: E402
from allreduce_param.models.transfers import EncodedCopies, run_here  # noqa: E402
from allreduce_param.train.task.job import TrainingJob  # noqa: E402

F32 = np.float32
ON_A_GPU = (pytest.mark.cuda, _NO_GPU)  # as test_torch_devices.cuda marks a test


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_A_GPU)])
@pytest.mark.parametrize("codec", ["bf16", "int8", "topk"])
def test_streamed_encoded_owners_are_the_unstreamed_payload_last_layers_first(codec, device):
    model = models.TorchModel(net, device=device, encode_on_device=True)
    plan = GradientPutPlan.of(SliceLayout(model.size, 4), get_codec(codec))
    whole, streamed = (DeviceEncoder(torch, torch.device(device), plan) for _ in range(2))
    X, y = blobs(20, 6, 3, seed=4)
    weights = model.init(np.random.default_rng(0))
    given: list = []
    for step in range(3):  # the residuals carry over: every step must match too
        rows = slice(0, 0) if step == 1 else slice(None)  # an empty batch sends the residual
        _, payload, _ = model.loss_and_encoded_grad(weights, X[rows], y[rows], whole)
        given.clear()
        _, all_of_them, count = model.loss_and_encoded_grad(
            weights, X[rows], y[rows], streamed, lambda owner, b: given.append((owner, b.copy()))
        )
        assert count == len(X[rows])
        assert sorted(owner for owner, _ in given) == list(range(4)), given
        if step != 1:
            assert given[0][0] == 3  # the last layer's owner, finished first in backward
        for owner, got in given:
            offset, nbytes = plan.owner_span(owner)
            assert got.tobytes() == payload[offset : offset + nbytes].tobytes(), (step, owner)
        assert all_of_them.tobytes() == payload.tobytes()
        assert same_bits(streamed.residual.cpu().numpy(), whole.residual.cpu().numpy())
        weights = weights - F32(0.1) * np.sign(weights)  # another step's weights


def test_an_owner_is_handed_over_only_once_its_bytes_landed_in_order():
    plan = GradientPutPlan.of(SliceLayout(6, 3), get_codec("bf16"))  # owners of 2 values
    encoder = DeviceEncoder(torch, torch.device("cpu"), plan)
    landings, given = [], []

    def run_aside(work):
        work()
        landings.append(StandInLanding())
        return landings[-1]

    def ready(owner, payload):
        assert landings[len(given)].landed, "handed over before its copy landed"
        given.append((owner, payload.tobytes()))

    copies = EncodedCopies(encoder, run_aside, ready)
    copies.part_done(3, 6, torch.tensor([4.0, 5.0, 6.0]))  # owner 2 whole, owner 1 half
    assert len(landings) == 1 and given == []  # owner 2 encoded, not landed
    landings[0].landed = True
    copies.part_done(1, 3, torch.tensor([2.0, 3.0]))  # owner 1 whole, owner 0 half
    assert [owner for owner, _ in given] == [2]  # the landed one, passed on without waiting
    copies.part_done(0, 1, torch.tensor([1.0]))
    copies.finish()
    assert [owner for owner, _ in given] == [2, 1, 0]
    whole = DeviceEncoder(torch, torch.device("cpu"), plan).encode(torch.arange(1.0, 7.0))
    assert b"".join(b for _, b in sorted(given)) == whole.tobytes()
    # every element must have come by the end
    encoder = DeviceEncoder(torch, torch.device("cpu"), plan)
    short = EncodedCopies(encoder, run_here, lambda owner, payload: None)
    short.part_done(0, 5, torch.zeros(5))
    with pytest.raises(Exception, match=r"owner\(s\) \[2\] was never given whole"):
        short.finish()


def test_an_empty_owner_is_handed_over_at_once_and_a_part_completes_every_owner_it_spans():
    plan = GradientPutPlan.of(SliceLayout(2, 3), get_codec("bf16"))  # owner 2 holds nothing
    given = []
    copies = EncodedCopies(
        DeviceEncoder(torch, torch.device("cpu"), plan), run_here, lambda o, b: given.append(o)
    )
    copies.part_done(0, 2, torch.tensor([1.0, 2.0]))  # owners 0 and 1 at once
    copies.finish()
    assert given == [2, 0, 1]


def test_fp16_overflow_stops_the_owner_before_it_is_handed_over():
    plan = GradientPutPlan.of(SliceLayout(300, 2), get_codec("fp16"))
    given = []
    copies = EncodedCopies(
        DeviceEncoder(torch, torch.device("cpu"), plan), run_here, lambda o, b: given.append(o)
    )
    gradient = torch.ones(300)
    gradient[20] = 70000.0  # owner 0's
    copies.part_done(150, 300, gradient[150:])
    with pytest.raises(CodecOverflowError, match="fp16 cannot hold.*partition 0.*bf16"):
        copies.part_done(0, 150, gradient[:150])
    assert given == [1]


# ---- the engine's EncodedStream ------------------------------------------------------------


def encoded_steps(size: int, partitions: int, streamed: bool, steps: int = 2):
    """A body: ``steps`` BSP steps putting each partition's int8-encoded gradient whole or
    streamed owner by owner (the last owner first); each step's mean."""

    def body(p):
        plan = p.info.gradient_put_plan
        encoder = DeviceEncoder(torch, torch.device("cpu"), plan)
        p.init(np.zeros(size, F32))
        means = []
        for step in range(steps):
            p.get_weights()
            rng = np.random.default_rng(10 * step + p.info.partition_id)
            payload = encoder.encode(torch.from_numpy(rng.standard_normal(size).astype(F32)))
            if streamed:
                with p.stream_gradients(count=3, encoded=True) as stream:
                    for owner in reversed(range(partitions)):
                        offset, nbytes = plan.owner_span(owner)
                        stream.ready(owner, payload[offset : offset + nbytes])
            else:
                p.put_gradients(EncodedGradient(payload), count=3)
            means.append(p.aggregate_gradient_partition().copy())
            p.send_weight_partition()
        return means

    return body


@pytest.mark.parametrize("hosts", [None, [[0, 1], [2]]], ids=["flat", "hierarchical"])
def test_a_streamed_encoded_put_sums_as_the_whole_one(hosts):
    size, partitions = 5003, 3

    def run(streamed):
        param = AllReduceParameter(partitions, size, codec="raw", gradient_codec="int8", timeout=30)
        steps = encoded_steps(size, partitions, streamed)

        def body(p):
            assert p.info.hierarchical == (hosts is not None)
            return steps(p)

        return raise_first(run_partitions(param, body, hosts=hosts))

    for got, want in zip(run(True), run(False)):
        assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(got, want))


def _payload(p, owner: int, extra: int = 0) -> np.ndarray:
    return np.zeros(p.info.gradient_put_plan.owner_span(owner)[1] + extra, np.uint8)


@pytest.mark.parametrize(
    "misuse, error, fragment",
    [
        (
            lambda p, s: (s.ready(0, _payload(p, 0)), s.ready(0, _payload(p, 0))),
            InputError,
            "ready(0, ...) came twice",
        ),
        (lambda p, s: s.ready(0, _payload(p, 0, 1)), InputError, "uint8 array of 104 bytes"),
        (
            lambda p, s: s.ready(0, _payload(p, 0).view(np.int8)),
            InputError,
            "got dtype int8",
        ),
        (lambda p, s: s.ready(1, _payload(p, 0)), InputError, "names no owner: the owners are 0"),
        (
            lambda p, s: (s.ready(0, _payload(p, 0)), s.close(), s.ready(0, _payload(p, 0))),
            UsageError,
            "ready(0, ...) came after the stream was closed",
        ),
        (
            lambda p, s: p.put_gradients(EncodedGradient(np.zeros(104, np.uint8))),
            UsageError,
            "came while the gradient stream of the step is still open",
        ),
        (
            lambda p, s: None,
            UsageError,
            "closed with no payload for owner(s) [0]: give every owner's",
        ),
    ],
)
def test_misuse_of_an_encoded_stream_is_refused_with_what_to_do(misuse, error, fragment):
    def body(p):
        p.init(np.zeros(100, F32))
        p.get_weights()
        with p.stream_gradients(count=1, encoded=True) as stream:
            misuse(p, stream)

    results = run_partitions(AllReduceParameter(1, 100, gradient_codec="int8", timeout=10), body)
    assert isinstance(results[0], error) and fragment in str(results[0]), results


def test_an_encoded_stream_is_refused_where_puts_take_no_encoded_parts():
    def refused(p, message: str, count: float):
        p.init(np.zeros(100, F32))
        p.get_weights()
        with pytest.raises(InputError, match=message):
            p.stream_gradients(count=count, encoded=True)
        p.put_gradients(np.zeros(100, F32))  # refused before it changed anything

    lossless = "'raw' is lossless.*put_gradients"
    param = AllReduceParameter(1, 100, codec="raw", timeout=10)
    raise_first(run_partitions(param, lambda p: refused(p, lossless, 1)))
    param = AllReduceParameter(1, 100, gradient_codec="bf16", timeout=10)
    raise_first(run_partitions(param, lambda p: refused(p, "count=-1.*number >= 0", -1)))


def test_closed_with_an_owner_missing_fails_the_handle_and_reaches_the_peer():
    weights_read = threading.Barrier(2)

    def body(p):
        p.init(np.zeros(100, F32))
        p.get_weights()
        weights_read.wait(30)
        with p.stream_gradients(count=1, encoded=True) as stream:
            stream.ready(
                p.info.partition_id, _payload(p, p.info.partition_id)
            )  # the own chunk alone
            if p.info.partition_id == 1:
                stream.ready(0, _payload(p, 0))
        return p.aggregate_gradient_partition()

    results = run_partitions(AllReduceParameter(2, 100, gradient_codec="int8", timeout=30), body)
    assert isinstance(results[0], UsageError) and "owner(s) [1]" in str(results[0]), results
    assert isinstance(results[1], PeerLostError) and "owner(s) [1]" in str(results[1]), results


# ---- TorchModel and the trainer ----------------------------------------------------------


class _Breaks(torch.autograd.Function):
    """The identity, whose backward raises: a backward that fails halfway."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward broke")


class Breaker(torch.nn.Module):
    def __init__(self, breaks: bool) -> None:
        super().__init__()
        self.breaks = breaks

    def forward(self, x):
        return _Breaks.apply(x) if self.breaks else x


def test_an_error_in_backward_ends_the_stream_after_the_last_layers_owner_left():
    """The last layer (owner 1's range) is handed over before backward reaches the broken
    layer; the error ends the stream, fails the handle, and reaches the peer when it next
    needs this partition."""
    weights_read = threading.Barrier(2)
    X, y = blobs(8, 6, 3, seed=5)
    given: dict[int, list] = {0: [], 1: []}

    def body(p):
        # the last Linear holds more than half the values: owner 1's range is in it alone
        module = torch.nn.Sequential(
            torch.nn.Linear(6, 4), Breaker(p.info.partition_id == 0), torch.nn.Linear(4, 40)
        )
        model = models.TorchModel(module, encode_on_device=True)
        encoder = model.device_encoder(p.info.gradient_put_plan)
        p.init(model.init(np.random.default_rng(0)))
        weights = p.get_weights()
        weights_read.wait(30)
        try:
            with p.stream_gradients(count=len(X), encoded=True) as stream:

                def ready(owner, payload):
                    given[p.info.partition_id].append(owner)
                    stream.ready(owner, payload)

                model.loss_and_encoded_grad(weights, X, y, encoder, ready)
        except RuntimeError:
            with pytest.raises(UsageError, match="failed in an earlier call .*backward broke"):
                p.aggregate_gradient_partition()
            raise
        # owner 1 has every chunk it sums (partition 0's left before backward broke); the
        # next weights, which need partition 0's slice, never come
        p.aggregate_gradient_partition()
        p.send_weight_partition()
        return p.get_weights()

    size = 6 * 4 + 4 + 4 * 40 + 40
    results = run_partitions(AllReduceParameter(2, size, gradient_codec="bf16", timeout=30), body)
    assert isinstance(results[0], RuntimeError) and "backward broke" in str(results[0])
    assert given[0] == [1]  # the last layer's owner left before backward broke
    assert isinstance(results[1], PeerLostError) and "backward broke" in str(results[1]), results


class Streamed(models.TorchModel):
    """A TorchModel that records whether each device-encoded step was streamed (in the
    class: each partition trains a copy of the model)."""

    streamed: list = []

    def loss_and_encoded_grad(self, weights, X, y, encoder, ready=None):
        type(self).streamed.append(ready is not None)
        return super().loss_and_encoded_grad(weights, X, y, encoder, ready)


def fit(model, gradient_codec: str, overlap: bool):
    X, y = blobs(90, 6, 3, seed=1)
    parts = [(X[:40], y[:40]), (X[40:], y[40:])]
    param = AllReduceParameter(2, model.size, codec="raw", gradient_codec=gradient_codec)
    settings = FitSettings(batch_size=16, epochs=2, seed=7, overlap=overlap)
    return train_on_threads(
        TrainingJob(model, optim.Adam(lr=0.01), param, settings, 6, False), parts
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=ON_A_GPU)])
@pytest.mark.parametrize("codec", ["bf16", "int8", "topk"])
def test_a_fit_streaming_the_device_encoded_gradient_gives_the_same_weights(codec, device):
    outputs = {}
    for overlap in (False, True):
        Streamed.streamed = []
        outputs[overlap] = fit(Streamed(net, device=device, encode_on_device=True), codec, overlap)
        assert all(isinstance(output, dict) for output in outputs[overlap]), outputs[overlap]
        # every step of both partitions: 2 epochs of 6 steps (90 rows, batches of 16)
        assert Streamed.streamed == [overlap] * (2 * 2 * 6)
    assert outputs[True][0]["weights"] == outputs[False][0]["weights"]
