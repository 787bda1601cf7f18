"""The Distributor: a user's DDP training function run on Spark ranks over this project's
torch.distributed backend, against the same function on gloo in plain processes; rank 0's
value back, each rank's output on the driver, one TrainingError naming a failing rank, and
the refusals before the stage."""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import signal
import socket
import sys
import threading
import time
import warnings

import numpy as np
import pytest

from allreduce_param.engine.wire.messages import MessageServer
from allreduce_param.errors import ConfigurationError, TrainingError
from allreduce_param.torch.driver_end import RankReports
from allreduce_param.torch.output import streamed_output
from allreduce_param.torch.rank import guarded_init, rank_environment

torch = pytest.importorskip("torch")

from pyspark import cloudpickle  # noqa: E402

from allreduce_param.torch import Distributor  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 6


def ddp_training(steps: int) -> dict:
    """A user's training function: a small MLP under DDP, each rank on its own rows, SGD
    with momentum; prints its losses; the final weights and the loss curve."""
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's too)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 8, generator=data)
    y = torch.randint(0, 3, (64,), generator=data)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        print(f"step {step} loss {losses[-1]:.6f} on rank {os.environ.get('RANK')}")
    return {
        "weights": [p.detach().numpy().copy() for p in model.parameters()],
        "losses": losses,
        "environment": {
            name: os.environ.get(name)
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
        },
        "backend": dist.get_backend(),
    }


def _gloo_rank(rank: int, world: int, store: str, results) -> None:
    """One plain process on gloo, as torchrun would run the function."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results.put((rank, ddp_training(STEPS)))
    finally:
        dist.destroy_process_group()


def gloo_reference(tmp_path, world: int = 2) -> dict:
    """The same function on gloo in ``world`` spawned processes; rank 0's result."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store = str(tmp_path / "gloo-store")
    processes = [
        context.Process(target=_gloo_rank, args=(rank, world, store, results))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    try:
        got = dict(results.get(timeout=120) for _ in processes)
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
    return got[0]


@pytest.fixture(scope="module")
def ddp_run(spark):
    """One Distributor run of the DDP function on 2 ranks: its result and the driver's
    stdout meanwhile."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = Distributor(num_processes=2).run(ddp_training, STEPS)
    return result, printed.getvalue()


@pytest.mark.slow
def test_ddp_on_the_distributor_gives_glooʼs_weights_and_loss_curve(ddp_run, tmp_path):
    result, _ = ddp_run
    reference = gloo_reference(tmp_path)
    assert result["backend"] != "gloo"
    assert len(result["losses"]) == STEPS and result["losses"][-1] < result["losses"][0]
    np.testing.assert_allclose(result["losses"], reference["losses"], rtol=1e-6)
    for ours, theirs in zip(result["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


def test_rank_0ʼs_value_comes_back_with_torchrunʼs_environment(ddp_run):
    result, _ = ddp_run
    assert result["environment"] == {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
    }


def test_each_rankʼs_output_reaches_the_driver(ddp_run):
    _, printed = ddp_run
    for rank in (0, 1):
        lines = [line for line in printed.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert [line.split()[3] for line in lines] == [str(step) for step in range(STEPS)]
        assert all(line.endswith(f"on rank {rank}") for line in lines)


def _raises_on_rank_1() -> None:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    dist.all_reduce(torch.ones(4))  # waits for rank 1, which never comes


def test_a_raising_rank_is_one_training_error_naming_it(spark):
    with pytest.raises(TrainingError) as caught:
        Distributor(num_processes=2).run(_raises_on_rank_1)
    text = str(caught.value)
    assert "rank 1" in text and "ValueError: rank 1 cannot go on" in text
    assert "_raises_on_rank_1" in text  # its traceback


def _inits_the_group_itself(values: list) -> tuple:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # as a script written for torchrun does
    total = torch.tensor(values[dist.get_rank()], dtype=torch.float32)
    dist.all_reduce(total)
    dist.destroy_process_group()  # and made again, on the same ranks
    dist.init_process_group(backend="nccl")  # whatever it names, the group is ours
    again = torch.tensor(values[dist.get_rank()], dtype=torch.float32)
    dist.all_reduce(again, op=dist.ReduceOp.MAX)
    return dist.get_backend(), total.tolist(), again.tolist()


def test_a_function_that_calls_init_process_group_gets_the_group(spark):
    backend, total, again = Distributor(num_processes=2).run(
        _inits_the_group_itself, [[1.0, 2.0], [3.0, 5.0]]
    )
    assert backend != "gloo"
    assert total == [4.0, 7.0]
    assert again == [3.0, 5.0]


def test_what_the_run_cannot_do_is_refused_before_the_stage(spark):
    with pytest.raises(ConfigurationError, match="task slots"):
        Distributor(num_processes=64).run(_inits_the_group_itself, [])
    with pytest.raises(ConfigurationError, match="no such file"):
        Distributor(num_processes=2).run("no-such-train.py")
    with pytest.raises(ConfigurationError, match="command line only"):
        Distributor(num_processes=2).run(__file__, lr=0.1)
    with pytest.raises(ConfigurationError, match="num_processes"):
        Distributor(num_processes=0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigurationError, match="use_gpu=False"):
            Distributor(num_processes=2, use_gpu=True).run(_inits_the_group_itself, [])


def _waits_for_ctrl_c(port: int) -> None:
    """Rank 0 tells the test it runs, with its job's description, then waits until its task
    is killed; rank 1 waits for it."""
    import torch.distributed as dist
    from pyspark import BarrierTaskContext

    if dist.get_rank() == 0:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as link:
            described = BarrierTaskContext.get().getLocalProperty("spark.job.description")
            link.sendall(f"{described}\n".encode())
            link.settimeout(300)  # a run the test never interrupts fails, it does not hang
            link.recv(1)  # never answered
    dist.barrier()


@pytest.mark.slow
def test_ctrl_c_cancels_the_runʼs_stage_and_the_next_run_trains(spark):
    main = threading.main_thread().ident
    heard: dict = {}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(300)

        def interrupt_once_rank_0_runs() -> None:
            connection, _ = listener.accept()
            with connection:
                heard["description"] = connection.makefile().readline().strip()
                heard["at"] = time.monotonic()
                signal.pthread_kill(main, signal.SIGINT)  # as Ctrl-C in the driver's terminal

        interrupter = threading.Thread(target=interrupt_once_rank_0_runs, daemon=True)
        interrupter.start()
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            with pytest.raises(KeyboardInterrupt):
                Distributor(num_processes=2).run(_waits_for_ctrl_c, listener.getsockname()[1])
        raised = time.monotonic()
        interrupter.join(5)
    assert heard["description"] == "Distributor: _waits_for_ctrl_c"
    assert raised - heard["at"] < 30  # cancelled, its tasks gone, then re-raised
    assert not [w for w in warned if "still running" in str(w.message)]
    assert spark.sparkContext.statusTracker().getActiveStageIds() == []
    result = Distributor(num_processes=2).run(ddp_training, 2)
    assert result["losses"][1] < result["losses"][0]


SCRIPT = """
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # as torchrun's scripts do: the Distributor's group answers
total = torch.tensor([float(os.environ["RANK"]) + 1.0])
dist.all_reduce(total)
print(f"sum {float(total)} rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} "
      f"argv {sys.argv[1:]} backend {dist.get_backend()}")
if sys.argv[1] == "fail" and dist.get_rank() == 1:
    print("rank 1 gives up", file=sys.stderr)
    sys.exit(3)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_script_runs_on_every_rank_as_torchrun_would(spark, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert Distributor(num_processes=2).run(str(script), "ok", 7) is None
    lines = sorted(line for line in printed.getvalue().splitlines() if " sum " in line)
    assert lines == [
        f"[rank {rank}] sum 3.0 rank {rank} of 2 argv ['ok', '7'] backend allreduce_param"
        for rank in (0, 1)
    ]
    with pytest.raises(TrainingError) as caught:
        Distributor(num_processes=2).run(str(script), "fail")
    assert "rank 1" in str(caught.value) and "status 3" in str(caught.value)
    assert "rank 1 gives up" in str(caught.value)  # its stderr's last lines


def test_init_process_group_inside_the_function_refuses_another_rank():
    opened = []

    def original(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None):
        raise AssertionError("the original is never called by the guard")

    guard = guarded_init(original, lambda: opened.append(True), rank=1, world=2)
    with pytest.raises(ConfigurationError, match="world_size=4"):
        guard("gloo", world_size=4)
    with pytest.raises(ConfigurationError, match="rank=0"):
        guard(backend="gloo", rank=0, world_size=2)


def test_torchrunʼs_variables_from_the_hosts():
    hosts = ((0, 2), (1, 3))
    assert rank_environment(3, hosts, ("10.0.0.5", 40001)) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "40001",
        "TORCHELASTIC_RUN_ID": "allreduce-param-10.0.0.5-40001",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def test_output_travels_in_lines_and_the_root_failure_wins():
    printed, executor_log = io.StringIO(), io.StringIO()
    reports, heard = RankReports(out=printed), threading.Event()

    def on_message(message: dict, reply) -> None:
        reports.on_message(message)
        if message.get("rank") == 3 and message["kind"] == "failed":  # the last one sent
            heard.set()

    server = MessageServer("127.0.0.1", on_message)
    link = server.client()
    try:
        with contextlib.redirect_stdout(executor_log):
            with streamed_output(link, 3):
                print("first", end="")
                print(" line\nsecond")
                sys.stdout.write("no newline")
            assert sys.stdout is executor_log
        link.send({"kind": "failed", "rank": 0, "error": "PeerLostError: rank 3 went"})
        link.send({"kind": "failed", "rank": 3, "error": "KeyError: 'x'", "traceback": "tb"})
        assert heard.wait(30)
        reports.flush()
    finally:
        link.close()
        server.close()
    assert executor_log.getvalue() == "first line\nsecond\nno newline"
    assert printed.getvalue() == "[rank 3] first line\n[rank 3] second\n[rank 3] no newline\n"
    root = str(reports.root_failure())
    assert root.startswith("rank 3 of the Distributor's run failed: KeyError: 'x'")
