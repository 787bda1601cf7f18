"""The engine's step as users write it, timed in a Spark barrier stage on every partition, in
rounds that alternate with gloo's ``all_reduce`` at the same size, so that the machine's
drift hits both alike (``bench_allreduce.py``, ``bench_growth.py``)."""

from __future__ import annotations

import time

import numpy as np

from allreduce_param.engine import CODECS, AllReduceParameter, NetworkSettings
from allreduce_param.engine.blocks.codec import get_codec
from benchkit import baselines

#: The codecs that can carry weights (topk keeps only some values: gradients only).
DENSE_CODECS = tuple(name for name in CODECS if not get_codec(name).sparse)
PHASES = ("get", "put", "aggregate", "update", "send")
#: How same-host partitions reach each other: AllReduceParameter settings per name
#: (``tcp-encrypted``: as peers on other hosts meet where the traffic is encrypted).
TRANSPORTS = {
    "shared": dict(unix_sockets=True, shared_memory=True, network=NetworkSettings(encrypt=False)),
    "unix": dict(unix_sockets=True, shared_memory=False, network=NetworkSettings(encrypt=False)),
    "tcp": dict(unix_sockets=False, shared_memory=False, network=NetworkSettings(encrypt=False)),
    "tcp-encrypted": dict(
        unix_sockets=False, shared_memory=False, network=NetworkSettings(encrypt=True)
    ),
}
#: The step as users write it: ``readme`` is the README's loop word for word (``w =
#: p.get_weights()``, ``p.weight_partition[:] -= 0.1 * g``); ``tuned`` fills a buffer of
#: its own (``get_weights(out=w)``) and updates in place without a temporary.
LOOPS = ("readme", "tuned")


def engine_task(
    params: list[AllReduceParameter], loops: list[str], steps: int, warmup: int, sparse: bool
):
    """The barrier task: time every phase of ``warmup + steps`` steps for each parameter and loop."""

    def task(_rows):
        report = []
        for param in params:
            with param.connect() as p:
                rng = np.random.default_rng(p.info.partition_id)
                # as the README's loop computes it: into the engine's buffer, which a raw put
                # publishes where it lies (float32 straight from the generator: no float64
                # vector twice the size at 200M)
                gradient = p.gradient_buffer()
                gradient[:] = rng.standard_normal(param.size, dtype=np.float32)
                if sparse:  # as after a ReLU or for sparse features: 90% zeros
                    gradient[rng.random(param.size, dtype=np.float32) < 0.9] = 0.0
                weights = rng.standard_normal(param.size, dtype=np.float32)
                weights *= np.float32(1e-3)
                p.init(weights)
                del weights
                # error feedback, as the README asks of a lossy gradient codec (the trainer's way)
                residual = (
                    np.zeros(param.size, np.float32)
                    if get_codec(param.gradient_codec).lossy
                    else None
                )
                for loop in loops:
                    timings = np.zeros((warmup + steps, len(PHASES)))
                    weights = np.empty(param.size, np.float32) if loop == "tuned" else None
                    for step in range(warmup + steps):
                        t0 = time.perf_counter()
                        if loop == "readme":
                            w = p.get_weights()
                        else:
                            w = p.get_weights(out=weights)
                        t1 = time.perf_counter()
                        p.put_gradients(gradient, count=1.0, residual=residual)
                        t2 = time.perf_counter()
                        g = p.aggregate_gradient_partition()
                        t3 = time.perf_counter()
                        if loop == "readme":
                            p.weight_partition[:] -= 0.1 * g
                        else:
                            np.multiply(g, np.float32(-0.1), out=g)
                            p.weight_partition[:] += g
                        t4 = time.perf_counter()
                        p.send_weight_partition()
                        t5 = time.perf_counter()
                        timings[step] = np.diff((t0, t1, t2, t3, t4, t5))
                    del w, weights
                    report.append(
                        (
                            param.size,
                            codec_of(param),
                            transport_of(param),
                            loop,
                            timings[warmup:] * 1000.0,
                        )
                    )
                del gradient
        yield report

    return task


def codec_of(param: AllReduceParameter) -> str:
    """The codec as ``--codecs`` names it: ``int8``, or ``int8+topk`` with a gradient codec of its own."""
    return (
        param.codec
        if param.gradient_codec == param.codec
        else f"{param.codec}+{param.gradient_codec}"
    )


def transport_of(param: AllReduceParameter) -> str:
    """The transport (with ``--fetch-threads``, and its fetch threads) ``param`` was made with."""

    def matches(key, value):
        if key == "network":  # a transport names whether it encrypts; the rest is resolved
            return bool(param.network.encrypt) == bool(value.encrypt)
        return getattr(param, key) == value

    return max(
        (
            name
            for name, settings in TRANSPORTS.items()
            if all(matches(key, value) for key, value in settings.items())
        ),
        key=lambda name: len(TRANSPORTS[name]),
    )


def engine_medians(report: list, config: tuple) -> tuple[float, list[float]]:
    """Median over steps of the slowest partition's step, and of each phase likewise."""
    per_partition = np.stack([timings for *key, timings in report if tuple(key) == config])
    slowest_step = per_partition.sum(axis=2).max(axis=0)
    slowest_phase = per_partition.max(axis=0)
    return float(np.median(slowest_step)), [float(x) for x in np.median(slowest_phase, axis=0)]


def alternate(
    spark,
    partitions: int,
    params: list[AllReduceParameter],
    loops: list[str],
    *,
    rounds: int,
    steps: int,
    warmup: int,
    sparse: bool = False,
    gloo: bool = True,
) -> tuple[dict, dict]:
    """``rounds`` rounds of: one barrier stage of ``partitions`` tasks timing every parameter
    and loop (:func:`engine_task`), then gloo's ``all_reduce`` between ``partitions``
    processes at each parameter's size (when ``gloo``).

    Returns ``engine``: ``(size, codec, transport, loop)`` -> one ``(median ms, [phase
    medians])`` per round, and ``gloo_ms``: size -> one median ms per round (empty lists
    without gloo), for :func:`engine_row` and :func:`gloo_row`.
    """
    configs = [
        (param.size, codec_of(param), transport_of(param), loop)
        for param in params
        for loop in loops
    ]
    rdd = spark.sparkContext.parallelize(range(partitions), partitions)
    task = engine_task(params, loops, steps, warmup, sparse)
    # every other round: the other order
    swapped = engine_task(params[::-1], loops, steps, warmup, sparse)
    engine = {config: [] for config in configs}
    gloo_ms = {param.size: [] for param in params}
    for number in range(rounds):
        stage = task if number % 2 == 0 else swapped
        report = [entry for part in rdd.barrier().mapPartitions(stage).collect() for entry in part]
        for config in configs:
            engine[config].append(engine_medians(report, config))
        for size in gloo_ms if gloo else ():
            gloo_ms[size].append(
                baselines.gloo_allreduce_ms(size, processes=partitions, steps=steps, warmup=warmup)
            )
    return engine, gloo_ms


# ---- rows and tables -----------------------------------------------------------------------
# A row is a dict that json can carry from a run in a namespace to the run that started it:
# link, size, partitions, sync (its name), kind (engine | mllib | gloo), rounds (the
# engine's (median, phases) per round), gloo (gloo's ms per round), tree (treeAggregate's ms).
