"""``bench_gpu.py``'s run: a ResNet-style model trained by N processes on one machine's GPUs
(the script says how).
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import statistics
import time

import numpy as np

from allreduce_param import models
from allreduce_param.engine import AllReduceParameter, StaticRendezvous
from benchkit import baselines
from benchkit.ranks import free_ports, run_ranks
from benchkit.tables import ms_text, ratio_text, render

TIMEOUT = 300.0
LR = 0.01
WAYS = ("ours", "DDP nccl", "DDP gloo")
CODECS = ("raw", "bf16", "fp16", "bf16-lz4", "int8", "topk")  # raw, and the device codecs
ENCODE_ON_DEVICE = {"auto": "auto", "on": True, "off": False}
ENCODED = "encoded on the device"  # a rank's report: whether ours encoded there


def resnet(width: int, blocks: int, classes: int = 10):
    """A small ResNet for 3-channel images: a stem, ``blocks`` residual blocks at each of
    three widths (width, 2 width, 4 width; the last two halve the resolution), BatchNorm,
    global pooling and a linear head."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, inputs: int, outputs: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(outputs)
            self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(outputs)
            self.skip = (
                nn.Sequential(
                    nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
                )
                if stride != 1 or inputs != outputs
                else nn.Identity()
            )

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))

    layers: list = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    inputs = width
    for stage, outputs in enumerate((width, 2 * width, 4 * width)):
        for index in range(blocks):
            layers.append(Block(inputs, outputs, 2 if stage and index == 0 else 1))
            inputs = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes)]
    return nn.Sequential(*layers)


def batch_of(rank: int, args) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s synthetic batch: images (float32 NCHW) and class ids."""
    rng = np.random.default_rng(rank)
    X = rng.standard_normal((args.batch, 3, args.image, args.image), dtype=np.float32)
    return X, rng.integers(0, 10, args.batch)


def device_of(rank: int, args) -> str:
    import torch

    if args.device == "cpu":
        return "cpu"
    return f"cuda:{rank % torch.cuda.device_count()}"


def sync_device(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def ours_steps(p, model, X, y, steps: int, warmup: int, encoder, residual) -> np.ndarray:
    """The engine's steps: ``(compute ms, sync ms)`` of each timed one. ``encoder``: the
    model's ``device_encoder`` (the gradient encoded on the device and streamed owner by
    owner), else None (streamed down as float32, with ``residual`` for a lossy codec)."""
    times = np.zeros((warmup + steps, 2))
    gradient = p.gradient_buffer()
    for step in range(warmup + steps):
        start = time.perf_counter()
        w = p.get_weights()
        compute_start = time.perf_counter()
        if encoder is not None:
            with p.stream_gradients(count=float(len(X)), encoded=True) as stream:
                model.loss_and_encoded_grad(w, X, y, encoder, stream.ready)
        else:
            with p.stream_gradients(gradient, count=float(len(X)), residual=residual) as stream:
                model.loss_and_grad_into(w, X, y, gradient, stream.ready)
        compute_end = time.perf_counter()
        g = p.aggregate_gradient_partition()
        p.weight_partition[:] -= np.float32(LR) * g
        p.send_weight_partition()
        end = time.perf_counter()
        times[step] = compute_end - compute_start, (end - start) - (compute_end - compute_start)
    return times[warmup:] * 1000.0


def ddp_steps(ddp, optimizer, X, y, steps: int, warmup: int, device: str) -> np.ndarray:
    """DDP's steps, each timed twice: under ``no_sync()`` (compute) and whole; ``(compute
    ms, sync ms)``, sync the whole step's time less the compute's."""
    import contextlib

    import torch

    def step(no_sync: bool) -> float:
        sync_device(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with ddp.no_sync() if no_sync else contextlib.nullcontext():
            loss = torch.nn.functional.cross_entropy(ddp(X), y, reduction="sum")
            loss.backward()
        if not no_sync:
            optimizer.step()
        sync_device(device)
        return time.perf_counter() - start

    times = np.zeros((warmup + steps, 2))
    for index in range(warmup + steps):
        compute = step(no_sync=True)
        whole = step(no_sync=False)
        times[index] = compute, max(0.0, whole - compute)
    return times[warmup:] * 1000.0


def rank_main(rank: int, args, param: AllReduceParameter, ports: list[int], results) -> None:
    """One rank: every way, alternating ``args.rounds`` rounds; puts ``(rank, {way: [per
    round: [(compute, sync) per step]]})`` or ``(rank, error text)``. ``param``: made in
    the parent, so that every rank has its secret."""
    try:
        import datetime

        import torch
        import torch.distributed as dist

        device = device_of(rank, args)
        if device == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.processes))
        else:
            torch.cuda.set_device(device)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", baselines._loopback_interface())
        timeout = datetime.timedelta(seconds=TIMEOUT)
        store = dist.TCPStore(
            "127.0.0.1", ports[-1], args.processes, is_master=rank == 0, timeout=timeout
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=args.processes, timeout=timeout
        )
        ways = [way for way in WAYS if way in args.ways]
        groups = {"DDP gloo": dist.group.WORLD}
        if "DDP nccl" in ways:
            groups["DDP nccl"] = dist.new_group(backend="nccl")

        torch.manual_seed(0)
        module = resnet(args.width, args.blocks)
        model = models.TorchModel(
            module,
            device=device,
            precision=args.precision,
            encode_on_device=ENCODE_ON_DEVICE[args.encode_on_device],
        )
        X, y = batch_of(rank, args)
        X_device = torch.from_numpy(X).to(device)
        y_device = torch.from_numpy(y).to(device)
        ddps = ddp_replicas(module, groups, device, args)
        addresses = [("127.0.0.1", port) for port in ports[: args.processes]]
        autocast = torch.autocast(
            torch.device(device).type, torch.bfloat16, enabled=args.precision == "bf16"
        )
        report: dict = {way: [] for way in ways}
        with param.connect(StaticRendezvous(rank, addresses, timeout=TIMEOUT)) as p:
            p.init(model.init(np.random.default_rng(0)))
            encoder = model.device_encoder(p.info.gradient_put_plan)
            lossy = args.codec != "raw"
            residual = (
                np.zeros(p.info.layout.size, np.float32) if lossy and encoder is None else None
            )
            report[ENCODED] = encoder is not None
            for number in range(args.rounds):
                for way in ways if number % 2 == 0 else ways[::-1]:
                    dist.barrier()
                    if way == "ours":
                        times = ours_steps(
                            p, model, X, y, args.steps, args.warmup, encoder, residual
                        )
                    else:
                        with autocast:
                            times = ddp_steps(
                                *ddps[way], X_device, y_device, args.steps, args.warmup, device
                            )
                    report[way].append(times.tolist())
            dist.barrier()
        dist.destroy_process_group()
        results.put((rank, report))
    except BaseException as error:  # the parent names it and fails
        results.put((rank, f"{type(error).__name__}: {error}"))


def ddp_replicas(module, groups: dict, device: str, args) -> dict:
    """DDP's way for each of ``groups`` (way: its process group): a replica of ``module`` in
    ``DistributedDataParallel`` with its SGD, ``{way: (ddp, optimizer)}``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    # each rank's BatchNorm statistics its own after the start, as ours (torch 2.13 renamed
    # broadcast_buffers=False; both start from the same buffers)
    takes = inspect.signature(DistributedDataParallel).parameters
    own_buffers = {
        "forward_sync_buffers" if "forward_sync_buffers" in takes else "broadcast_buffers": False
    }
    ddps = {}
    for way, group in groups.items():
        if way in args.ways:
            replica = resnet(args.width, args.blocks).to(device)
            replica.load_state_dict(module.state_dict())
            ids = None if device == "cpu" else [torch.device(device).index]
            ddp = DistributedDataParallel(
                replica, device_ids=ids, process_group=group, **own_buffers
            )
            ddps[way] = (ddp, torch.optim.SGD(ddp.parameters(), lr=LR))
    return ddps


def measure(args, size: int) -> tuple[dict, bool]:
    """Every way's rounds: per round the medians over its steps of the slowest rank's
    ``(compute, sync)``, in ms; and whether ours encoded the gradient on the device."""
    import multiprocessing

    ports = free_ports(args.processes + 1)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    param = AllReduceParameter(
        args.processes, size, codec="raw", gradient_codec=args.codec, timeout=TIMEOUT
    )
    processes = [
        context.Process(
            target=rank_main, args=(rank, args, param, ports, results), name=f"bench-gpu-{rank}"
        )
        for rank in range(args.processes)
    ]
    got = run_ranks(processes, results, TIMEOUT * 2)
    encoded = [got[rank].pop(ENCODED) for rank in range(args.processes)]
    rounds = {}
    for way in got[0]:
        times = np.array([got[rank][way] for rank in range(args.processes)])  # rank, round, step, 2
        slowest = times.sum(axis=3).argmax(axis=0)  # round, step: the rank whose step was longest
        picked = np.take_along_axis(times, slowest[None, :, :, None], axis=0)[0]
        rounds[way] = np.median(picked, axis=1).tolist()  # round, (compute, sync)
    return rounds, all(encoded)


def table(rounds: dict, batch: int, processes: int) -> str:
    header = (
        "way",
        "steps/s",
        "images/s",
        "step ms",
        "compute ms",
        "sync ms",
        "x DDP gloo (range)",
    )
    rate = {way: [1000.0 / (c + s) for c, s in each] for way, each in rounds.items()}
    lines = []
    for way, each in rounds.items():
        compute = statistics.median(c for c, _ in each)
        sync = statistics.median(s for _, s in each)
        steps = statistics.median(rate[way])
        baseline = rate.get("DDP gloo", [])
        lines.append(
            (
                way,
                f"{steps:.2f}",
                f"{steps * batch * processes:,.0f}",
                ms_text(statistics.median(c + s for c, s in each)),
                ms_text(compute),
                ms_text(sync),
                ratio_text(rate[way], baseline) if way != "DDP gloo" else "",
            )
        )
    return render(header, lines, left=1)


def machine(args) -> str:
    """The machine line: CPU, memory, OS, Python, torch, and the GPUs."""
    import torch

    try:
        with open("/proc/meminfo") as info:
            memory = f"{int(info.readline().split()[1]) / 2**20:.0f} GiB"
    except OSError:
        memory = "? GiB"
    line = (
        f"{platform.machine()}, {os.cpu_count()} cores, {memory}, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}"
    )
    if args.device != "cpu":
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        line += f", {torch.cuda.device_count()} x {' / '.join(names)}, CUDA {torch.version.cuda}"
    return line


def run(args: argparse.Namespace) -> int:
    """Measure as the command line (``bench_gpu.py``'s, checked there) says; the exit status."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device cuda: this torch ({torch.__version__}) sees no GPU; --device cpu "
            "runs the benchmark on the CPU (a smoke run)"
        )
    if args.device == "cpu" and "DDP nccl" in args.ways:
        args.ways.remove("DDP nccl")  # NCCL is CUDA's alone
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if "DDP nccl" in args.ways and args.processes > gpus:
        args.ways.remove("DDP nccl")
        print(
            f"DDP nccl left out: NCCL refuses two ranks on one GPU ({args.processes} processes, "
            f"{gpus} GPU(s)); it runs with --processes <= {gpus}"
        )
    size = models.TorchModel(resnet(args.width, args.blocks)).size
    print(f"machine: {machine(args)}")
    print(
        f"{args.processes} processes (no Spark) on {args.device}, ResNet-style width "
        f"{args.width}, {args.blocks} blocks per stage, {size:,} parameters "
        f"({size * 4 / 2**20:.1f} MiB float32), {args.image}x{args.image} images, batch "
        f"{args.batch} per rank, {args.precision}; SGD lr {LR}; {args.rounds} rounds "
        f"alternating {', '.join(args.ways)}; each the median of {args.steps} steps after "
        f"{args.warmup} warm-up, the slowest rank's step",
        flush=True,
    )
    rounds, encoded = measure(args, size)
    where = (
        f"on the model's device ({args.device}), only its bytes copied down"
        if encoded
        else "on the host"
    )
    print(
        f"ours: gradient codec {args.codec}" + (f", encoded {where}" if args.codec != "raw" else "")
    )
    print(table(rounds, args.batch, args.processes), flush=True)
    return 0
