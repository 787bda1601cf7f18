"""Benchmark without Spark: a ResNet-style model trained by N processes on one machine's GPUs,
the engine (TorchModel) against torch DDP over NCCL and over gloo.

N spawned processes (no JVM: it runs where Java is not installed) each train the same
model on their own synthetic batch. Rank r runs on ``cuda:(r mod GPUs)``, so N processes
share one GPU or spread over N (DDP over NCCL runs only then: NCCL refuses two ranks on
one GPU); ``--device cpu`` runs everything on the CPU (a smoke run of the script itself:
DDP over gloo only). Three ways of keeping the replicas in sync, alternating in rounds
(the order reversed every other round):

- **ours**: the engine as a fit uses it: ``TorchModel(module, device=...)`` computes the
  summed gradient on the device, which comes down to pinned host memory parameter by
  parameter as backward finishes it and is published chunk by chunk meanwhile
  (``stream_gradients``); the owner of each slice sums it (raw codec, through shared
  memory between processes of one host), runs SGD on its slice and publishes it; the next
  step's weights go up in one copy. The processes meet through ``StaticRendezvous``.
  ``--codec`` puts the gradients with a lossy codec instead (bf16, fp16, bf16-lz4, int8,
  topk; the weights stay raw): by default (``--encode-on-device auto``) on a GPU the codec
  and its error feedback run there and only the encoded bytes come down, owner by owner as
  backward finishes each owner's range, published meanwhile, as a fit streams them
  (``TorchModel(encode_on_device=)``, ``stream_gradients(encoded=True)``);
  ``--encode-on-device off`` streams the float32 gradient down and encodes it on the host,
  as with raw. The header line says which ran.
- **DDP nccl** and **DDP gloo**: ``DistributedDataParallel`` on the same module and batch,
  ``torch.optim.SGD`` (same learning rate, no momentum), over a process group of each
  backend (NCCL only on CUDA), each rank's BatchNorm statistics its own as in ours
  (``broadcast_buffers=False``, ``forward_sync_buffers=False`` from torch 2.13). DDP's
  batch lies on the device; ours goes up each step, as a fit's rows do.

A step's time is the slowest rank's; *compute* is the forward and backward pass alone (for
ours: ``loss_and_grad_into`` or ``loss_and_encoded_grad``, with the copies down and the
chunks published as they come; for DDP: the same step under ``no_sync()``, no allreduce,
timed in each round), *sync* the rest of the step (for ours: waiting for the summed slices,
the update and the weights; for DDP the allreduce that backward did not hide). Each
round's figure is the median over its steps; the table gives the medians over the rounds,
and ``x DDP gloo``: the median of the per-round ratios of steps per second, with their
range.

    python jobs/bench_gpu.py                                  # 2 processes, the GPUs there are
    python jobs/bench_gpu.py --processes 4 --width 64 --batch 128
    python jobs/bench_gpu.py --codec bf16 --ways ours               # bf16 encoded on the GPU
    python jobs/bench_gpu.py --codec bf16 --encode-on-device off     # ... on the host
    python jobs/bench_gpu.py --device cpu --processes 2 --width 4 --blocks 1 --batch 8 \\
        --image 8 --rounds 2 --steps 2 --warmup 1               # a smoke run on a CPU
"""

from __future__ import annotations

import argparse
import sys

from benchkit import gpu


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: a bad option stops here, naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2, help="N ranks on this machine")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--width", type=int, default=32, help="the first stage's channels")
    parser.add_argument("--blocks", type=int, default=2, help="residual blocks per stage")
    parser.add_argument("--image", type=int, default=32, help="image side, pixels")
    parser.add_argument("--batch", type=int, default=64, help="images per rank and step")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument(
        "--codec",
        choices=gpu.CODECS,
        default="raw",
        help="ours: the gradients' codec (weights raw)",
    )
    parser.add_argument(
        "--encode-on-device",
        choices=tuple(gpu.ENCODE_ON_DEVICE),
        default="auto",
        help="ours, a lossy --codec: run it on the model's device (auto: on a GPU)",
    )
    parser.add_argument("--ways", default=",".join(gpu.WAYS), help="of: " + ", ".join(gpu.WAYS))
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first, each round")
    args = parser.parse_args(argv)
    args.ways = [way.strip() for way in args.ways.split(",")]
    unknown = sorted(set(args.ways) - set(gpu.WAYS))
    if unknown or args.processes < 2:
        raise SystemExit(f"--ways: choose from {', '.join(gpu.WAYS)}; --processes: 2 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark as the command line (``argv``, else ``sys.argv``) says; the exit status."""
    return gpu.run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
