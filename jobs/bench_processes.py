"""Benchmark without Spark: N plain processes on this host, the engine against gloo.

``bench_allreduce.py --processes 2,4`` runs this (``python jobs/bench_processes.py`` too):
for each N and size, N spawned processes (no JVM) meet through ``StaticRendezvous`` on
127.0.0.1, so, as tasks of one executor host, they reach each other over Unix sockets and
shared memory. The same processes also join a gloo process group (torch.distributed), and
rounds alternate in them: the engine's step, the README's loop word for word
(``w = p.get_weights()``, ``put_gradients(p.gradient_buffer())``,
``aggregate_gradient_partition``, ``p.weight_partition[:] -= 0.1 * g``,
``send_weight_partition``), then gloo's (``all_reduce`` of the gradient, the divide by N,
``w -= 0.1 * g`` on the whole vector), then the engine again, the order swapped every other
round. A step's time is the slowest rank's, a round's figure the median over its steps;
the table gives the medians over the rounds and the median of the per-round ratios with
their range.

Also printed: the machine, the single-core copy bandwidth (``benchkit.machine.copy_bandwidth``:
bytes ``np.copyto`` copies a second, each read once and written once), and each row's
*floor*: under BSP each partition must read every partition's chunk of its slice (S bytes
in all for an S-byte vector, whatever N) and write its slice of the weights (S/N); at the
copy's rate of memory traffic (two bytes moved per byte copied) that is
``(S + S/N) / (2 x copy bandwidth)``. Everything above it (the weights copied out for
``get_weights``, requests, thread hand-offs) is overhead. ``x floor`` is the step over it;
``calls x floor`` the engine's calls alone (the step less the loop's own
``-= 0.1 * g``, the slowest rank's), which is what the engine can bring down.

    python jobs/bench_allreduce.py --processes 2,4                  # 1M and 10M float32
    python jobs/bench_allreduce.py --processes 2,4,8,16 --sizes 1M,10M,100M   # many cores
    python jobs/bench_allreduce.py --processes 2 --sizes 10K --rounds 2 --steps 3 --warmup 1
    python jobs/bench_allreduce.py --processes 2,4 --own-gradient     # a vector of one's own
    python jobs/bench_allreduce.py --processes 2 --memory --sizes 200M --steps 3   # memory

``--own-gradient`` compares, instead of gloo, the loop putting ``p.gradient_buffer()`` with
it putting a vector of its own, beside one copy of that vector (``own_gradient_size``);
``--memory`` measures each process's memory instead of time (``benchkit/process_memory.py``).

Memory: through the host arena (the default here: one host, BSP, raw) the host holds the
weight vector once and one gradient vector per partition, and each partition its summed
slice; gloo's rank two vectors more (its weights and its gradient): at 100M float32 and
N = 16 about 20 GB. Through blocks (``host_arena=False``) an engine partition holds about
four vectors.
"""

from __future__ import annotations

import argparse
import sys

from benchkit import processes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: a bad option stops here, naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--processes", default=processes.DEFAULT_PROCESSES, help="N, comma-separated"
    )
    parser.add_argument(
        "--sizes", default=processes.DEFAULT_SIZES, help="float32 elements (10K, 1M accepted)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, each round")
    parser.add_argument("--no-baselines", action="store_true", help="skip gloo")
    parser.add_argument("--own-gradient", action="store_true", help=processes.OWN_HELP)
    parser.add_argument("--memory", nargs="?", const="arena,blocks", help=processes.MEMORY_HELP)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark as the command line (``argv``, else ``sys.argv``) says; the exit status."""
    return processes.run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
