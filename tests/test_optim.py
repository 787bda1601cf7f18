"""Sharded optimizers, schedules and clipping (``allreduce_param.optim``).

Each optimizer is checked against a plain float64 numpy implementation of its update rule
written here, against ``torch.optim`` where torch is installed, and for sharding: stepping
N uneven slices with their own state must equal stepping the whole vector bit for bit.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from allreduce_param import optim
from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.optim import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    CosineLR,
    LinearWarmup,
    Optimizer,
    RMSprop,
    StepLR,
    clip_scale,
    squared_norm,
)

STEPS = 6

# Configurations that exercise every branch: weight decay, (Nesterov) momentum, amsgrad,
# centred RMSprop, a schedule.
CONFIGS = {
    "sgd": SGD(0.1),
    "sgd-momentum-wd": SGD(0.05, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": SGD(0.05, momentum=0.8, nesterov=True, weight_decay=0.001),
    "adam": Adam(0.01),
    "adam-wd-amsgrad": Adam(0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, amsgrad=True),
    "adamw": AdamW(0.01, weight_decay=0.1),
    "adamw-amsgrad": AdamW(0.02, betas=(0.5, 0.9), weight_decay=0.02, amsgrad=True),
    "adagrad": Adagrad(0.05),
    "adagrad-init-wd": Adagrad(0.1, eps=1e-8, initial_accumulator_value=0.5, weight_decay=0.01),
    "rmsprop": RMSprop(0.01),
    "rmsprop-momentum-wd": RMSprop(0.005, alpha=0.9, momentum=0.9, weight_decay=0.01),
    "rmsprop-centered": RMSprop(0.005, centered=True),
    "rmsprop-centered-momentum": RMSprop(0.005, alpha=0.95, momentum=0.5, centered=True),
    "sgd-scheduled": SGD(0.1, momentum=0.9, schedule=LinearWarmup(2, CosineLR(3, 0.1))),
    "adam-scheduled": Adam(0.01, schedule=StepLR(2, 0.5)),
}


def data(n: int, steps: int = STEPS, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(steps)]
    return w0, grads


def run(opt: Optimizer, w0: np.ndarray, grads: list[np.ndarray]):
    w = w0.copy()
    state = opt.init_state(len(w))
    for step, g in enumerate(grads):
        opt.step(w, g, state, step)
    return w, state


# ----------------------------------------------------------- float64 reference rules


def reference(opt: Optimizer, w0: np.ndarray, grads: list[np.ndarray]):
    """The textbook update rules, in float64, written independently of the module."""
    w = w0.astype(np.float64)
    n = len(w)
    z = lambda: np.zeros(n)  # noqa: E731
    s: dict[str, np.ndarray] = {}
    for step, g32 in enumerate(grads):
        lr = opt.lr_at(step)
        g = g32.astype(np.float64)
        t = step + 1
        if isinstance(opt, SGD):
            d = g + opt.weight_decay * w
            if opt.momentum:
                b = d.copy() if step == 0 else opt.momentum * s["momentum_buffer"] + d
                s["momentum_buffer"] = b
                d = d + opt.momentum * b if opt.nesterov else b
            w = w - lr * d
        elif isinstance(opt, Adam):  # and AdamW
            b1, b2 = opt.betas
            if isinstance(opt, AdamW):
                w = w * (1 - lr * opt.weight_decay)
                d = g
            else:
                d = g + opt.weight_decay * w
            m = s["exp_avg"] = b1 * s.get("exp_avg", z()) + (1 - b1) * d
            v = s["exp_avg_sq"] = b2 * s.get("exp_avg_sq", z()) + (1 - b2) * d**2
            if opt.amsgrad:
                v = s["max_exp_avg_sq"] = np.maximum(s.get("max_exp_avg_sq", z()), v)
            m_hat = m / (1 - b1**t)
            v_hat = v / (1 - b2**t)
            w = w - lr * m_hat / (np.sqrt(v_hat) + opt.eps)
        elif isinstance(opt, Adagrad):
            d = g + opt.weight_decay * w
            a = s["sum"] = s.get("sum", np.full(n, opt.initial_accumulator_value)) + d**2
            w = w - lr * d / (np.sqrt(a) + opt.eps)
        elif isinstance(opt, RMSprop):
            d = g + opt.weight_decay * w
            al = opt.alpha
            v = s["square_avg"] = al * s.get("square_avg", z()) + (1 - al) * d**2
            if opt.centered:
                ga = s["grad_avg"] = al * s.get("grad_avg", z()) + (1 - al) * d
                avg = np.sqrt(v - ga**2) + opt.eps
            else:
                avg = np.sqrt(v) + opt.eps
            if opt.momentum:
                b = s["momentum_buffer"] = opt.momentum * s.get("momentum_buffer", z()) + d / avg
                w = w - lr * b
            else:
                w = w - lr * d / avg
        else:  # pragma: no cover
            raise AssertionError(opt)
    return w, s


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_float64_reference(name):
    opt = CONFIGS[name]
    w0, grads = data(2000)
    w, state = run(opt, w0, grads)
    w_ref, state_ref = reference(opt, w0, grads)
    assert w.dtype == np.float32
    assert np.abs(w - w0).max() > 1e-3  # the steps did move the weights
    np.testing.assert_allclose(w, w_ref, rtol=2e-5, atol=2e-6)
    assert set(state) == set(state_ref) == set(opt.state_names)
    for key in state:
        assert state[key].dtype == np.float32
        np.testing.assert_allclose(state[key], state_ref[key], rtol=2e-5, atol=1e-6, err_msg=key)


# ------------------------------------------------------------------------- torch.optim


def torch_optimizer(opt: Optimizer, params):
    torch = pytest.importorskip("torch")
    o = torch.optim
    if isinstance(opt, SGD):
        return o.SGD(
            params,
            lr=opt.lr,
            momentum=opt.momentum,
            nesterov=opt.nesterov,
            weight_decay=opt.weight_decay,
        )
    if isinstance(opt, AdamW):
        return o.AdamW(
            params,
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            amsgrad=opt.amsgrad,
        )
    if isinstance(opt, Adam):
        return o.Adam(
            params,
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            amsgrad=opt.amsgrad,
        )
    if isinstance(opt, Adagrad):
        return o.Adagrad(
            params,
            lr=opt.lr,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            initial_accumulator_value=opt.initial_accumulator_value,
        )
    if isinstance(opt, RMSprop):
        return o.RMSprop(
            params,
            lr=opt.lr,
            alpha=opt.alpha,
            eps=opt.eps,
            momentum=opt.momentum,
            centered=opt.centered,
            weight_decay=opt.weight_decay,
        )
    raise AssertionError(opt)  # pragma: no cover


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_torch(name):
    torch = pytest.importorskip("torch")
    opt = CONFIGS[name]
    w0, grads = data(2000, seed=1)
    param = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    reference_opt = torch_optimizer(opt, [param])
    scheduler = None
    if opt.schedule is not None:  # torch's LambdaLR with our factor: lr = base * factor(step)
        scheduler = torch.optim.lr_scheduler.LambdaLR(reference_opt, opt.schedule.factor)
    for g in grads:
        param.grad = torch.from_numpy(g.copy())
        reference_opt.step()
        if scheduler is not None:
            scheduler.step()
    w, state = run(opt, w0, grads)
    np.testing.assert_allclose(w, param.detach().numpy(), rtol=1e-5, atol=1e-6)
    torch_state = reference_opt.state[param]
    for key in state:  # the state arrays carry torch's names
        np.testing.assert_allclose(
            state[key], torch_state[key].numpy(), rtol=1e-5, atol=1e-6, err_msg=key
        )


# ---------------------------------------------------------------------------- sharding


def cuts(n: int, parts: int, rng: np.random.Generator) -> list[int]:
    inner = sorted(rng.choice(np.arange(1, n), parts - 1, replace=False).tolist())
    return [0, *inner, n]


def assert_sharding_exact(opt: Optimizer, n: int, parts: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    w0, grads = data(n, seed=seed)
    scales = [1.0, 0.5, 1.0, 0.25, 1.0, 0.75]  # as if clipping kicked in on some steps
    whole = w0.copy()
    whole_state = opt.init_state(n)
    bounds = cuts(n, parts, rng)
    shards = [w0[a:b].copy() for a, b in zip(bounds, bounds[1:])]
    shard_states = [opt.init_state(len(s)) for s in shards]
    for step, (g, scale) in enumerate(zip(grads, scales)):
        opt.step(whole, g, whole_state, step, grad_scale=scale)
        for (a, b), w, st in zip(zip(bounds, bounds[1:]), shards, shard_states):
            opt.step(w, g[a:b], st, step, grad_scale=scale)
    assert np.array_equal(np.concatenate(shards), whole)  # bit for bit (NaN-free data)
    for key in whole_state:
        assert np.array_equal(np.concatenate([st[key] for st in shard_states]), whole_state[key])


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sharded_steps_are_bit_identical(name, parts, monkeypatch):
    # Small pieces, so that the pieces of the whole vector and of the slices fall differently.
    monkeypatch.setattr(optim.kernels, "PIECE", 64)
    assert_sharding_exact(CONFIGS[name], 1009, parts, seed=parts)


@pytest.mark.parametrize("name", ["adam-wd-amsgrad", "rmsprop-centered-momentum", "sgd-nesterov"])
def test_sharded_steps_bit_identical_across_real_pieces(name):
    assert_sharding_exact(CONFIGS[name], 2 * optim.kernels.PIECE + 12345, 3, seed=5)


def test_cuts_are_uneven():
    bounds = cuts(1009, 7, np.random.default_rng(7))
    assert len(set(np.diff(bounds))) > 1


# ------------------------------------------------------------------ step() behaviour


@pytest.mark.parametrize("name", ["sgd-nesterov", "adamw-amsgrad", "rmsprop-centered-momentum"])
def test_grad_scale_equals_prescaled_gradient(name):
    opt = CONFIGS[name]
    w0, grads = data(3000, steps=3)
    scale = 0.3
    a, b = w0.copy(), w0.copy()
    sa, sb = opt.init_state(3000), opt.init_state(3000)
    for step, g in enumerate(grads):
        opt.step(a, g, sa, step, grad_scale=scale)
        opt.step(b, g * np.float32(scale), sb, step)
    assert np.array_equal(a, b)


def test_step_leaves_grad_untouched_and_handles_empty_slices():
    opt = CONFIGS["adam-wd-amsgrad"]
    w0, grads = data(100, steps=1)
    g = grads[0].copy()
    w = w0.copy()
    opt.step(w, g, opt.init_state(100), 0)
    assert np.array_equal(g, grads[0])
    assert not np.array_equal(w, w0)
    empty = np.zeros(0, np.float32)
    opt.step(empty, empty.copy(), opt.init_state(0), 0)  # a partition may own nothing


def test_partitions_as_threads_do_not_share_scratch(monkeypatch):
    # Partitions may run as threads of one process (LocalRendezvous, reused Spark workers);
    # each must get what it would get alone.
    import threading

    monkeypatch.setattr(optim.kernels, "PIECE", 1 << 14)
    opt = CONFIGS["rmsprop-centered-momentum"]
    n, parts = 400_000, 4
    w0, grads = data(n, steps=5, seed=9)
    expected = run(opt, w0, grads)[0]
    bounds = [k * n // parts for k in range(parts + 1)]
    out = [None] * parts
    start = threading.Barrier(parts)

    def partition(i: int) -> None:
        a, b = bounds[i], bounds[i + 1]
        start.wait()
        out[i] = run(opt, w0[a:b], [g[a:b] for g in grads])[0]

    threads = [threading.Thread(target=partition, args=(i,)) for i in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert np.array_equal(np.concatenate(out), expected)


def test_state_layout():
    assert SGD(0.1).init_state(5) == {}
    assert list(SGD(0.1, momentum=0.9).init_state(5)) == ["momentum_buffer"]
    assert list(Adam().init_state(5)) == ["exp_avg", "exp_avg_sq"]
    assert list(AdamW(amsgrad=True).init_state(5)) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    assert list(RMSprop(momentum=0.5, centered=True).init_state(5)) == [
        "square_avg",
        "momentum_buffer",
        "grad_avg",
    ]
    state = Adagrad(initial_accumulator_value=0.25).init_state(4)
    assert state["sum"].dtype == np.float32 and np.all(state["sum"] == 0.25)
    for array in Adam(amsgrad=True).init_state(7).values():
        assert array.dtype == np.float32 and array.shape == (7,) and not array.any()


def test_bad_step_arguments():
    opt = Adam()
    w = np.zeros(10, np.float32)
    state = opt.init_state(10)
    with pytest.raises(InputError, match="weights"):
        opt.step(w.astype(np.float64), w, state, 0)
    with pytest.raises(InputError, match="grad"):
        opt.step(w, np.zeros(9, np.float32), state, 0)
    with pytest.raises(InputError, match="state"):
        opt.step(w, w.copy(), SGD(0.1, momentum=0.9).init_state(10), 0)
    with pytest.raises(InputError, match="exp_avg"):
        opt.step(w, w.copy(), {**state, "exp_avg": np.zeros(3, np.float32)}, 0)
    with pytest.raises(InputError, match="step"):
        opt.step(w, w.copy(), state, -1)
    read_only = w.copy()
    read_only.flags.writeable = False
    with pytest.raises(InputError, match="read-only"):
        opt.step(read_only, w, state, 0)
    assert issubclass(InputError, ValueError)


# --------------------------------------------------------------------------- schedules


def test_step_lr():
    s = StepLR(10, gamma=0.5)
    assert [s.factor(k) for k in (0, 9, 10, 19, 20, 35)] == [1, 1, 0.5, 0.5, 0.25, 0.125]


def test_cosine_lr():
    s = CosineLR(100, min_factor=0.1)
    assert s.factor(0) == 1.0
    assert s.factor(50) == pytest.approx(0.55)
    assert s.factor(25) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert s.factor(100) == pytest.approx(0.1)
    assert s.factor(1000) == pytest.approx(0.1)
    factors = [s.factor(k) for k in range(101)]
    assert all(a > b for a, b in zip(factors, factors[1:]))  # strictly decreasing to the end
    assert CosineLR(10).factor(10) == pytest.approx(0.0, abs=1e-15)


def test_linear_warmup():
    s = LinearWarmup(4)
    assert [s.factor(k) for k in range(7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    then_step = LinearWarmup(4, after=StepLR(2, 0.5))
    assert [then_step.factor(k) for k in range(9)] == [
        0.25,
        0.5,
        0.75,
        1.0,
        1.0,
        1.0,
        0.5,
        0.5,
        0.25,
    ]
    then_cosine = LinearWarmup(2, after=CosineLR(10, 0.0))
    assert then_cosine.factor(2) == 1.0  # the cosine starts at the end of warm-up
    assert then_cosine.factor(7) == pytest.approx(0.5)
    assert then_cosine.factor(12) == pytest.approx(0.0, abs=1e-15)


def test_lr_at_combines_base_lr_and_schedule():
    assert SGD(0.3).lr_at(0) == SGD(0.3).lr_at(10_000) == 0.3
    opt = Adam(0.01, schedule=LinearWarmup(2, StepLR(3, 0.1)))
    assert [opt.lr_at(k) for k in range(6)] == pytest.approx([0.005, 0.01, 0.01, 0.01, 0.01, 0.001])
    assert AdamW(0.2, schedule=CosineLR(4, 0.5)).lr_at(4) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="step"):
        opt.lr_at(-1)


def test_schedule_changes_the_update():
    # Same gradient, halved lr on step 2 onwards: plain SGD moves exactly lr * g.
    opt = SGD(1.0, schedule=StepLR(2, 0.5))
    w = np.zeros(3, np.float32)
    g = np.array([1.0, -2.0, 4.0], np.float32)
    state = opt.init_state(3)
    opt.step(w, g, state, 1)
    np.testing.assert_array_equal(w, -g)
    opt.step(w, g, state, 2)
    np.testing.assert_array_equal(w, -1.5 * g)


# ---------------------------------------------------------------------------- clipping


def test_clip_scale_brings_global_norm_to_the_bound():
    rng = np.random.default_rng(3)
    g = (rng.standard_normal(10_001) * 10).astype(np.float32)
    bounds = cuts(len(g), 4, rng)
    # Each partition's share, summed as the trainer's scalar allreduce would.
    total = sum(squared_norm(g[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert total == pytest.approx(float(np.sum(g.astype(np.float64) ** 2)), rel=1e-6)
    scale = clip_scale(total, 5.0)
    assert scale < 1.0
    clipped = (g * np.float32(scale)).astype(np.float64)
    assert np.linalg.norm(clipped) == pytest.approx(5.0, rel=1e-5)


def test_clip_scale_below_bound_and_disabled():
    assert clip_scale(4.0, 3.0) == 1.0  # norm 2 < 3
    assert clip_scale(0.0, 1.0) == 1.0
    assert clip_scale(1e12, None) == 1.0
    assert clip_scale(100.0, 5.0) == pytest.approx(0.5)
    assert math.isnan(clip_scale(math.nan, 1.0))
    assert clip_scale(math.inf, 1.0) == 0.0
    with pytest.raises(ValueError, match="global_sq_norm"):
        clip_scale(-1.0, 1.0)


def test_squared_norm_over_many_pieces(monkeypatch):
    monkeypatch.setattr(optim.kernels, "PIECE", 100)
    x = np.random.default_rng(4).standard_normal(1234).astype(np.float32)
    assert squared_norm(x) == pytest.approx(float(np.sum(x.astype(np.float64) ** 2)), rel=1e-6)
    assert squared_norm(np.zeros(0, np.float32)) == 0.0
    with pytest.raises(ValueError):
        squared_norm(x.astype(np.float64))


# -------------------------------------------------------------- settings, repr, pickle

BAD_SETTINGS = [
    (lambda: SGD(-0.1), "lr"),
    (lambda: SGD(math.nan), "lr"),
    (lambda: SGD(0.1, momentum=-0.5), "momentum"),
    (lambda: SGD(0.1, nesterov=True), "nesterov"),
    (lambda: SGD(0.1, momentum=0.9, nesterov="yes"), "nesterov"),
    (lambda: SGD(0.1, weight_decay=-1e-4), "weight_decay"),
    (lambda: SGD(0.1, clip_norm=0.0), "clip_norm"),
    (lambda: SGD(0.1, schedule=0.5), "schedule"),
    (lambda: Adam(betas=(1.0, 0.999)), "betas[0]"),
    (lambda: Adam(betas=(0.9, -0.1)), "betas[1]"),
    (lambda: Adam(betas=0.9), "betas"),
    (lambda: Adam(eps=0.0), "eps"),
    (lambda: Adam(lr=-1e-3), "lr"),
    (lambda: AdamW(weight_decay=-0.01), "weight_decay"),
    (lambda: AdamW(betas=(0.9, 1.5)), "betas[1]"),
    (lambda: Adagrad(initial_accumulator_value=-1.0), "initial_accumulator_value"),
    (lambda: Adagrad(eps=-1e-10), "eps"),
    (lambda: RMSprop(alpha=1.0), "alpha"),
    (lambda: RMSprop(momentum=-0.1), "momentum"),
    (lambda: RMSprop(centered=1), "centered"),
    (lambda: StepLR(0), "step_size"),
    (lambda: StepLR(2.5), "step_size"),
    (lambda: StepLR(10, gamma=0.0), "gamma"),
    (lambda: CosineLR(0), "total_steps"),
    (lambda: CosineLR(10, min_factor=1.5), "min_factor"),
    (lambda: LinearWarmup(0), "warmup_steps"),
    (lambda: LinearWarmup(5, after="cosine"), "after"),
]


@pytest.mark.parametrize("make, setting", BAD_SETTINGS, ids=[s for _, s in BAD_SETTINGS])
def test_bad_settings_name_the_setting(make, setting):
    with pytest.raises(ValueError) as info:
        make()
    assert isinstance(info.value, ConfigurationError)
    message = str(info.value)
    assert setting in message
    assert any(word in message for word in ("must be", "needs"))  # says what is allowed


def test_repr_is_readable_and_evaluable():
    opt = SGD(0.1, momentum=0.9, schedule=LinearWarmup(5, StepLR(10, 0.5)))
    assert repr(opt) == (
        "SGD(lr=0.1, momentum=0.9, nesterov=False, weight_decay=0.0, "
        "schedule=LinearWarmup(warmup_steps=5, after=StepLR(step_size=10, gamma=0.5)), "
        "clip_norm=None)"
    )
    namespace = {
        c.__name__: c for c in (SGD, Adam, AdamW, Adagrad, RMSprop, StepLR, CosineLR, LinearWarmup)
    }
    for name, opt in CONFIGS.items():
        assert eval(repr(opt), namespace) == opt, name  # noqa: S307 - our own repr


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pickle_round_trip(name):
    opt = CONFIGS[name]
    clone = pickle.loads(pickle.dumps(opt))
    assert clone == opt and repr(clone) == repr(opt) and hash(clone) == hash(opt)
    w0, grads = data(500, steps=3)
    assert np.array_equal(run(clone, w0, grads)[0], run(opt, w0, grads)[0])


def test_equality_distinguishes_settings():
    assert Adam() == Adam() and Adam() != AdamW(weight_decay=0.0)
    assert SGD(0.1) != SGD(0.1, momentum=0.5)
    assert StepLR(3) != StepLR(3, 0.5)


# ------------------------------------------------------------------ regularisation (ElasticNet)


def elastic_net_reference(w, g, s, reg, alpha, lr, scale=1.0):
    """One plain-SGD step with MLlib's elastic net, in float64: the L2 gradient joins the
    scaled gradient, then the soft threshold of the L1 part (ISTA)."""
    w, g, s = (np.asarray(a, np.float64) for a in (w, g, s))
    d = g * scale + reg * (1 - alpha) * s * s * w
    w = w - lr * d
    return np.sign(w) * np.maximum(np.abs(w) - lr * reg * alpha * s, 0.0)


def test_elastic_net_step_matches_the_float64_reference_and_spares_unpenalised_elements():
    rng = np.random.default_rng(3)
    n = 500
    w0 = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    s = (rng.random(n) < 0.7).astype(np.float32)  # 0: an intercept, never penalised
    penalty = optim.ElasticNet(1.0, 0.5)
    w = w0.copy()
    SGD(0.3).step(w, g, {}, 0, grad_scale=0.5, penalty=penalty, penalized=s)
    expected = elastic_net_reference(w0, g, s, 1.0, 0.5, 0.3, 0.5)
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)
    assert ((w == 0) == (expected == 0)).all() and (w == 0).sum() > 20  # exact zeros
    free = s == 0  # unpenalised: a plain SGD step, bit for bit
    plain = w0.copy()
    SGD(0.3).step(plain, g, {}, 0, grad_scale=0.5)
    assert np.array_equal(w[free], plain[free])
    # None means every element penalised with factor 1
    a, b = w0.copy(), w0.copy()
    SGD(0.3).step(a, g, {}, 0, penalty=penalty)
    SGD(0.3).step(b, g, {}, 0, penalty=penalty, penalized=np.ones(n, np.float32))
    assert np.array_equal(a, b)


def test_l2_alone_goes_through_the_optimizer_as_weight_decay_would():
    """elastic_net_param=0: reg_param * w joins the gradient before Adam's moments, which is
    what Adam's own (all-coordinates) weight_decay does."""
    w0, grads = data(300, steps=4, seed=2)
    a, b = w0.copy(), w0.copy()
    sa, sb = Adam(0.01).init_state(300), Adam(0.01).init_state(300)
    for step, g in enumerate(grads):
        Adam(0.01).step(a, g, sa, step, penalty=optim.ElasticNet(0.05))
        Adam(0.01, weight_decay=0.05).step(b, g, sb, step)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["sgd-momentum-wd", "adam", "rmsprop-centered"])
def test_sharded_elastic_net_steps_are_bit_identical(name, monkeypatch):
    monkeypatch.setattr(optim.kernels, "PIECE", 64)
    opt, n = CONFIGS[name], 1009
    rng = np.random.default_rng(11)
    w0, grads = data(n, seed=4)
    s = (rng.random(n) < 0.8).astype(np.float32)
    penalty = optim.ElasticNet(0.2, 0.6)
    whole, whole_state = w0.copy(), opt.init_state(n)
    bounds = cuts(n, 3, rng)
    shards = [w0[a:b].copy() for a, b in zip(bounds, bounds[1:])]
    states = [opt.init_state(len(shard)) for shard in shards]
    for step, g in enumerate(grads):
        opt.step(whole, g, whole_state, step, grad_scale=0.5, penalty=penalty, penalized=s)
        for (a, b), w, st in zip(zip(bounds, bounds[1:]), shards, states):
            opt.step(w, g[a:b], st, step, grad_scale=0.5, penalty=penalty, penalized=s[a:b])
    assert np.array_equal(np.concatenate(shards), whole)
    assert (whole == 0).any()


@pytest.mark.parametrize(
    "reg, alpha, message",
    [
        (-0.1, 0.0, "reg_param must be a finite number >= 0, got -0.1"),
        (float("nan"), 0.0, "reg_param must be a finite number >= 0"),
        (0.1, 1.5, "elastic_net_param must be a finite number in \\[0, 1\\], got 1.5"),
        (0.1, -0.5, "elastic_net_param must be a finite number in \\[0, 1\\]"),
    ],
)
def test_elastic_net_settings_are_checked(reg, alpha, message):
    with pytest.raises(ConfigurationError, match=message):
        optim.ElasticNet(reg, alpha)


def test_a_bad_penalty_argument_is_refused():
    w, g = np.zeros(4, np.float32), np.zeros(4, np.float32)
    with pytest.raises(InputError, match="penalized must be None or float32 of shape \\(4,\\)"):
        SGD(0.1).step(w, g, {}, 0, penalty=optim.ElasticNet(0.1), penalized=np.ones(3, bool))
    with pytest.raises(InputError, match="penalty must be an ElasticNet or None"):
        SGD(0.1).step(w, g, {}, 0, penalty=0.1)
