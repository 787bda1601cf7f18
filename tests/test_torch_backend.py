"""The torch.distributed backend over the engine, without Spark: AllReduceProcessGroup on
threads (one group per LocalRendezvous handle), with the expectations PyTorch's own c10d
tests hold a backend to; and DistributedDataParallel and FSDP2 (fully_shard, CPU) in two
spawned processes through init_process_group, against DDP on gloo."""

from __future__ import annotations

import math
import multiprocessing
import os
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from allreduce_param.engine import LocalRendezvous, StaticRendezvous  # noqa: E402
from allreduce_param.errors import (  # noqa: E402
    CollectiveMismatchError,
    ConfigurationError,
    InputError,
    UsageError,
)
from allreduce_param.torch_backend import (  # noqa: E402
    BACKEND,
    AllReduceProcessGroup,
    bind,
    process_group_parameter,
    register,
)

DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
]


def run_groups(world: int, body, timeout: float = 60.0) -> list:
    """``body(group, rank)`` on ``world`` threads, each with an AllReduceProcessGroup over its
    own handle; their results (re-raising the first failure)."""
    param = process_group_parameter(world, timeout=timeout)
    rendezvous = LocalRendezvous(world)
    results: list = [None] * world

    def rank(r: int) -> None:
        try:
            with param.connect(rendezvous.member(r)) as handle:
                # one host: the allreduces go through the host arena's shared memory
                assert handle.info.host_arena == (world > 1)
                group = AllReduceProcessGroup(handle)
                try:
                    results[r] = body(group, r)
                finally:
                    group.close()
        except BaseException as error:  # re-raised below
            results[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout * 2)
        assert not thread.is_alive(), "a rank is still running"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def reduce_opts(op):
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


def rooted(options, root: int):
    opts = options()
    opts.rootRank = root
    return opts


def test_allreduce_of_rank_plus_one_with_every_op():
    world = 3
    ops = {
        dist.ReduceOp.SUM: world * (world + 1) / 2,
        dist.ReduceOp.PRODUCT: math.factorial(world),
        dist.ReduceOp.MIN: 1,
        dist.ReduceOp.MAX: world,
        dist.ReduceOp.AVG: (world + 1) / 2,
    }

    def body(group, rank):
        out = []
        for op in ops:
            tensor = torch.tensor([rank + 1.0])
            work = group.allreduce([tensor], reduce_opts(op))
            work.wait()
            out.append((tensor.item(), work.get_future().value()[0] is tensor))
        return out

    for result in run_groups(world, body):
        assert result == [(float(value), True) for value in ops.values()]


def test_each_dtype_sums_as_numpy_does_in_rank_order():
    world = 2

    def tensor_of(dtype, rank):
        rng = np.random.default_rng(rank)
        values = rng.integers(-100, 100, 37) if dtype != torch.uint8 else rng.integers(0, 255, 37)
        return torch.tensor(values).to(dtype)

    def body(group, rank):
        out = {}
        for dtype in DTYPES:
            tensor = tensor_of(dtype, rank)
            group.allreduce([tensor], reduce_opts(dist.ReduceOp.SUM)).wait()
            average = tensor_of(dtype, rank)
            group.allreduce([average], reduce_opts(dist.ReduceOp.AVG)).wait()
            out[dtype] = tensor, average
        return out

    results = run_groups(world, body)
    for dtype in DTYPES:
        expected = tensor_of(dtype, 0) + tensor_of(dtype, 1)  # torch's own sum, in the dtype
        # AVG: that sum over 2 in the dtype; integers truncated toward zero, as NCCL's are
        mean = expected / 2 if dtype.is_floating_point else expected.div(2, rounding_mode="trunc")
        for result in results:
            assert result[dtype][0].dtype == result[dtype][1].dtype == dtype
            assert torch.equal(result[dtype][0], expected), dtype
            assert torch.equal(result[dtype][1], mean), dtype


@pytest.mark.slow
def test_a_thousand_async_collectives_in_order_with_distinct_values():
    world, calls = 2, 1000

    def body(group, rank):
        tensors = [torch.full((3,), float(i * 10 + rank)) for i in range(calls)]
        works = [group.allreduce([t], reduce_opts(dist.ReduceOp.SUM)) for t in tensors]
        for work in works:
            work.wait()
        return tensors

    for tensors in run_groups(world, body):
        for i, tensor in enumerate(tensors):
            assert tensor.tolist() == [float(i * 20 + 1)] * 3


def test_broadcast_from_every_root_allgather_and_reduce_scatter():
    world = 3

    def body(group, rank):
        broadcasts = []
        for root in range(world):
            tensor = torch.arange(5, dtype=torch.float64) * (rank + 1)
            group.broadcast([tensor], rooted(dist.BroadcastOptions, root)).wait()
            broadcasts.append(tensor.tolist())
        gathered = [torch.zeros(2, 2, dtype=torch.int32) for _ in range(world)]
        group.allgather([gathered], [torch.full((2, 2), rank, dtype=torch.int32)]).wait()
        into = torch.zeros(world * 2, dtype=torch.bfloat16)
        group.all_gather_single(into, torch.tensor([rank, -rank], dtype=torch.bfloat16)).wait()
        rs_out = torch.zeros(2)
        inputs = [torch.full((2,), float(rank * 10 + j)) for j in range(world)]
        group.reduce_scatter([rs_out], [inputs], reduce_opts(dist.ReduceOp.SUM)).wait()
        single = torch.zeros(1, dtype=torch.int64)
        group.reduce_scatter_single(
            single, torch.arange(world, dtype=torch.int64) + rank, reduce_opts(dist.ReduceOp.MAX)
        ).wait()
        group.barrier(dist.BarrierOptions()).wait()
        return broadcasts, gathered, into.tolist(), rs_out.tolist(), single.item()

    for rank, (broadcasts, gathered, into, rs_out, single) in enumerate(run_groups(world, body)):
        assert broadcasts == [[float(i * (root + 1)) for i in range(5)] for root in range(world)]
        assert [g.tolist() for g in gathered] == [[[r, r], [r, r]] for r in range(world)]
        assert into == [0.0, 0.0, 1.0, -1.0, 2.0, -2.0]
        assert rs_out == [float(sum(r * 10 + rank for r in range(world)))] * 2
        assert single == rank + world - 1


def test_several_tensors_in_one_call_and_non_contiguous_ones():
    def body(group, rank):
        a = torch.ones(3, 4) * (rank + 1)
        b = torch.ones(4, 3).t() * (rank + 1)  # not contiguous
        group.allreduce([a, b], reduce_opts(dist.ReduceOp.SUM)).wait()
        c = torch.ones(4, 3).t() * 10 * (rank + 1)
        group.allreduce([c], reduce_opts(dist.ReduceOp.SUM)).wait()
        return a, b, c

    for a, b, c in run_groups(2, body):
        assert torch.equal(a, torch.full((3, 4), 3.0))
        assert torch.equal(b, torch.full((3, 4), 3.0))
        assert torch.equal(c, torch.full((3, 4), 30.0))


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"needs a GPU that this PyTorch ({torch.__version__}) can use; "
    f"CUDA built: {torch.backends.cuda.is_built()}",
)
def test_cuda_tensors_go_through_host_copies_and_come_back_on_their_device():
    """CUDA tensors (one GPU shared by both ranks is enough): each collective's result is on
    the tensor's own device and equals the CPU's, for a tensor the caller's stream has just
    written (the host copy is taken on the caller's thread, after that write)."""
    device = torch.device("cuda", 0)

    def body(group, rank):
        grad = torch.arange(1 << 16, dtype=torch.float32, device=device)
        grad.mul_(rank + 1)  # queued on the caller's stream just before the call
        group.allreduce([grad], reduce_opts(dist.ReduceOp.SUM)).wait()
        half = torch.full((7,), rank + 1.0, dtype=torch.bfloat16, device=device)
        group.allreduce([half, half.new_ones(3)], reduce_opts(dist.ReduceOp.AVG)).wait()
        sent = torch.arange(4, dtype=torch.int64, device=device) * (rank + 1)
        group.broadcast([sent], rooted(dist.BroadcastOptions, 1)).wait()
        gathered = [torch.zeros(2, device=device) for _ in range(2)]
        group.allgather([gathered], [torch.full((2,), float(rank), device=device)]).wait()
        torch.cuda.synchronize(device)
        return grad, half, sent, gathered

    for grad, half, sent, gathered in run_groups(2, body):
        assert {grad.device, half.device, sent.device} == {device}
        assert torch.equal(grad.cpu(), torch.arange(1 << 16, dtype=torch.float32) * 3)
        assert half.cpu().tolist() == [1.5] * 7
        assert sent.cpu().tolist() == [0, 2, 4, 6]
        assert [g.cpu().tolist() for g in gathered] == [[0.0, 0.0], [1.0, 1.0]]


def test_what_is_not_supported_is_named():
    def body(group, rank):
        errors = []
        for call in [
            lambda: group.allreduce(
                [torch.zeros(2, dtype=torch.complex64)], reduce_opts(dist.ReduceOp.SUM)
            ),
            lambda: group.allreduce([torch.zeros(2).to_sparse()], reduce_opts(dist.ReduceOp.SUM)),
            lambda: group.allreduce([torch.zeros(2)], reduce_opts(dist.ReduceOp.BAND)),
        ]:
            with pytest.raises(InputError) as caught:
                call()
            errors.append(str(caught.value))
        with pytest.raises(UsageError, match="send is not supported"):
            group.send([torch.zeros(1)], 0, 0)
        with pytest.raises(InputError, match="AVG of bool"):
            group.allreduce(
                [torch.zeros(2, dtype=torch.bool)], reduce_opts(dist.ReduceOp.AVG)
            ).wait()
        return errors

    (errors,) = run_groups(1, body)
    assert "allreduce: tensors of dtype torch.complex64 are not supported" in errors[0]
    assert "pass tensor.to_dense()" in errors[1]
    assert "ReduceOp BAND is not supported" in errors[2]


def test_a_rank_whose_tensor_differs_is_named_on_every_rank():
    """Another dtype on one rank: every rank's Work fails naming both calls, none waits."""

    def body(group, rank):
        tensor = torch.zeros(5, dtype=torch.float32 if rank == 0 else torch.float64)
        with pytest.raises(CollectiveMismatchError) as caught:
            group.allreduce([tensor], reduce_opts(dist.ReduceOp.SUM)).wait()
        return str(caught.value)

    first, second = run_groups(2, body, timeout=20)
    assert "partition 1 called it with 5 elements of float64, op 'sum'" in first
    assert "partition 0 called it with 5 elements of float32, op 'sum'" in second


def test_init_process_group_outside_bind_and_with_the_wrong_rank_is_refused():
    register()
    store = dist.HashStore()
    with pytest.raises(UsageError, match=r"inside allreduce_param\.torch_backend\.bind\(handle\)"):
        dist.init_process_group(backend=BACKEND, rank=0, world_size=1, store=store)
    param = process_group_parameter(1, timeout=10)
    with param.connect(LocalRendezvous(1).member(0)) as handle, bind(handle):
        with pytest.raises(ConfigurationError, match="pass rank=0 and world_size=1"):
            dist.init_process_group(backend=BACKEND, rank=0, world_size=2, store=dist.HashStore())
        with pytest.raises(UsageError, match="already bound"):
            with bind(handle):
                pass
    assert not dist.is_initialized()


# -- DistributedDataParallel in spawned processes, ours against gloo -------------------


def ddp_training(backend: str, rank: int, port: int, fsdp: bool = False) -> tuple[list, list]:
    """A tiny model trained for a few steps with DDP (``fsdp``: FSDP2's ``fully_shard``) on
    ``backend``: its final weights and each step's loss (rank-specific data, the same on
    every backend)."""
    dist.init_process_group(
        backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model[0])
            fully_shard(model[2])
            trained = fully_shard(model)
        else:
            trained = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(5):
            x = torch.randn(16, 8, generator=generator)
            loss = ((trained(x) - x.sum(1, keepdim=True)) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        weights = [_whole(p) if fsdp else p for p in model.parameters()]
        # numpy, not tensors: a tensor through a queue is shared memory its process frees
        return [w.detach().numpy().copy() for w in weights], losses
    finally:
        dist.destroy_process_group()


def _whole(parameter) -> torch.Tensor:
    """An FSDP parameter's shards (rows), gathered through the group's allgather (DTensor's
    own full_tensor() goes through torch's functional collectives, which a process group
    written in Python does not serve)."""
    shards = [None, None]
    dist.all_gather_object(shards, parameter.to_local().detach())
    return torch.cat(shards)


def ddp_rank(param, addresses, rank: int, ports: tuple, results) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # else gloo resolves the host name
        gloo = ddp_training("gloo", rank, ports[0])
        with param.connect(StaticRendezvous(rank, addresses)) as handle, bind(handle):
            ours = ddp_training(BACKEND, rank, ports[1])
            fsdp = ddp_training(BACKEND, rank, ports[2], fsdp=True)
        results.put((rank, gloo, (ours, fsdp)))
    except BaseException as error:  # reported to the test
        results.put((rank, repr(error), None))


@pytest.mark.slow
def test_ddp_and_fsdp_on_our_backend_train_as_ddp_on_gloo():
    from test_processes import free_loopback_ports

    param = process_group_parameter(2, timeout=60)
    ports = free_loopback_ports(5)
    addresses = [("127.0.0.1", port) for port in ports[:2]]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=ddp_rank, args=(param, addresses, r, tuple(ports[2:]), results))
        for r in range(2)
    ]
    for process in processes:
        process.start()
    try:
        got = sorted((results.get(timeout=180) for _ in processes), key=lambda entry: entry[0])
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    for rank, gloo, ours in got:
        assert ours is not None, gloo
        gloo_weights, gloo_losses = gloo
        for our_weights, our_losses in ours:  # DDP, then FSDP
            for theirs, mine in zip(gloo_weights, our_weights):
                np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
            assert np.allclose(our_losses, gloo_losses, rtol=1e-5), (rank, our_losses, gloo_losses)
            assert our_losses[-1] < our_losses[0]  # it trained
    # DDP: every rank ends with the same bits, each slice being summed once, by its owner
    assert all(np.array_equal(a, b) for a, b in zip(got[0][2][0][0], got[1][2][0][0]))


def test_reduce_gather_and_scatter_reach_the_root_only_or_each_rank():
    world, root = 3, 1

    def body(group, rank):
        reduced = torch.tensor([rank + 1, 10 * rank], dtype=torch.int16)
        opts = rooted(dist.ReduceOptions, root)
        opts.reduceOp = dist.ReduceOp.MAX
        group.reduce([reduced], opts).wait()
        gathered = [torch.zeros(1) for _ in range(world)] if rank == root else []
        group.gather(
            [gathered], [torch.tensor([rank * 2.0])], rooted(dist.GatherOptions, root)
        ).wait()
        piece = torch.zeros(2, dtype=torch.float16)
        pieces = [torch.full((2,), r + 0.5, dtype=torch.float16) for r in range(world)]
        group.scatter(
            [piece], [pieces if rank == root else []], rooted(dist.ScatterOptions, root)
        ).wait()
        return reduced.tolist(), [g.item() for g in gathered], piece.tolist()

    for rank, (reduced, gathered, piece) in enumerate(run_groups(world, body)):
        assert reduced == ([3, 20] if rank == root else [rank + 1, 10 * rank])
        assert gathered == ([0.0, 2.0, 4.0] if rank == root else [])
        assert piece == [rank + 0.5] * 2


def test_the_group_thread_runs_calls_in_order_and_outlives_a_failing_one():
    """CallThread, the group's thread: calls run in the order queued, a failing one fails
    its own future (with a note naming the call) and the next still runs, each call's
    ``done`` runs, and the thread ends at close() or when the object is dropped unclosed."""
    import gc

    from allreduce_param.torch_backend.work import CallThread, EngineWork

    calls = CallThread("test-calls", "in the call {}")
    ran, done = [], []

    def fail() -> None:
        raise ValueError("boom")

    works = [EngineWork(torch.futures.Future()) for _ in range(3)]
    for name, run, work in zip(
        ("first", "second", "third"), (lambda: ran.append(1), fail, lambda: ran.append(3)),
        works,
    ):  # fmt: skip
        calls.put(name, run, work, name, lambda: done.append(1))
    assert works[2].get_future().wait() == "third" and works[0].get_future().wait() == "first"
    assert works[2].wait() and works[2].is_success()
    with pytest.raises(ValueError, match="boom") as failed:
        works[1].wait()
    assert "in the call second" in failed.value.__notes__
    assert works[1].is_completed() and not works[1].is_success()
    # the future (DDP's hooks chain on it) fails too, with a copy of the error and its note
    with pytest.raises(ValueError, match="boom") as copied:
        works[1].get_future().wait()
    assert copied.value is not failed.value and "in the call second" in copied.value.__notes__
    assert ran == [1, 3]
    calls.close()
    assert not calls._thread.is_alive() and len(done) == 3
    dropped = CallThread("test-dropped", "{}")
    thread = dropped._thread
    del dropped
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_an_allreduce_its_peers_wait_in_runs_on_the_callers_thread():
    """The group hands an allreduce to its thread unless the thread is idle, the call is small
    (``CALLER_BYTES``) and every peer already waits in it (DDP's last bucket on the rank that
    finished backward last): that one runs in the call itself, done when allreduce() returns,
    with the same sum; the next call, too large for that, goes to the thread after it and
    sums right (the arena's versions run on across the two threads)."""
    import time

    from allreduce_param.torch_backend.process_group import CALLER_BYTES

    queued = threading.Event()
    large = CALLER_BYTES // 4 + 1

    def body(group, rank):
        done_at_return = []
        if rank == 0:  # rank 1 calls only after rank 0's first call: not there yet
            assert not group._collectives.allreduce_peers_arrived()
        for size in (3, large):
            if rank == 1:  # after rank 0's call is in the arena: it waits there for this one
                assert queued.wait(30)
                queued.clear()
                deadline = time.monotonic() + 30
                while not group._collectives.allreduce_peers_arrived():
                    assert time.monotonic() < deadline, "rank 0 never entered its allreduce"
                    time.sleep(0.001)
            tensor = torch.full((size,), rank + 1.0)
            work = group.allreduce([tensor], reduce_opts(dist.ReduceOp.SUM))
            done_at_return.append(work.is_completed())
            if rank == 0:
                queued.set()
            work.wait()
            assert torch.equal(tensor, torch.full((size,), 3.0))
        return done_at_return

    first, second = run_groups(2, body)
    # rank 0's calls wait for rank 1, which calls only after they returned: both queued
    assert first == [False, False]
    # rank 1's small call ran in allreduce() itself
    assert second[0] is True
