"""The model's memory in a worker, checked against what Spark gives a worker, on the driver.

Every barrier task holds the whole model vector more than once: the weights it gathers
each step, the gradient it computes, and that gradient's chunks published for their
owners in its block store; and its own slice of the optimizer's state. A model too large
for that (LogisticRegression over 2^28 sparse features is 1 GiB a copy) would run every
worker out of memory, and Spark would run the stage four times, each ending in a crashed
Python worker. So the fit compares the two before the model is even made on the driver
(``check_worker_memory``), and refuses with one ``ConfigurationError`` naming both.

What a worker may use is known in two cases, and checked only in them:

- ``spark.executor.pyspark.memory`` set: the Python workers' limit (RLIMIT_AS), which
  Spark shares out equally among an executor's ``spark.executor.cores`` workers;
- a local master (``local[N]``) without it: every worker runs on this machine, so together
  they have what the machine has available now.

Elsewhere (a cluster without the Python limit) the workers' memory is the machine's, which
the driver cannot see; the fit goes on unchecked.
"""

from __future__ import annotations

import re
from typing import Any

from allreduce_param.errors import ConfigurationError

#: Whole copies of the model vector a worker holds: the gathered weights, the gradient, and
#: the gradient's chunks published for their owners.
MODEL_COPIES = 3

_UNITS = {"": 1 << 20, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_AMOUNT = re.compile(r"\s*(\d+)\s*([kmgtp]?)b?\s*", re.IGNORECASE)


def spark_bytes(text: str, setting: str) -> int:
    """A Spark memory setting (``512m``, ``4g``, a bare number: MiB) in bytes."""
    found = _AMOUNT.fullmatch(text)
    if found is None:
        raise ConfigurationError(
            f"{setting}={text!r} is not an amount of memory Spark reads (e.g. 512m, 4g)"
        )
    return int(found.group(1)) * _UNITS[found.group(2).lower()]


def worker_bytes(size: int, optimizer: Any, workers: int) -> int:
    """The bytes of one worker's model vectors: ``MODEL_COPIES`` float32 copies of the
    ``size`` parameters, and its slice of each of the optimizer's state vectors."""
    slots = len(getattr(optimizer, "state_names", ()))
    return 4 * size * MODEL_COPIES + 4 * -(-size // max(1, workers)) * slots


def worker_allowance(setting: Any, workers: int) -> tuple[int, str] | None:
    """(bytes one worker may use, where the figure comes from), or None where it is not
    known. ``setting``: a session setting by name (None when unset)."""
    python = setting("spark.executor.pyspark.memory")
    if python:
        cores = int(setting("spark.executor.cores") or 1)
        share = spark_bytes(python, "spark.executor.pyspark.memory") // max(1, cores)
        split = f", shared by spark.executor.cores={cores} workers" if cores > 1 else ""
        return share, f"spark.executor.pyspark.memory={python}{split}"
    master = setting("spark.master") or ""
    if master.startswith("local") and not master.startswith("local-cluster"):
        from allreduce_param.train.task.spill import available_memory

        available = available_memory()
        where = f"this machine's available memory ({_gib(available)}, the local master's"
        return available // max(1, workers), f"{where}, shared by {workers} workers)"
    return None


def check_worker_memory(setting: Any, model: Any, optimizer: Any, workers: int) -> None:
    """Refuse a model whose vectors do not fit the memory Spark gives a worker, naming
    both; a model that does not say its ``size`` before it is made is not checked."""
    size = getattr(model, "size", None)
    if not isinstance(size, int) or size <= 0:
        return
    allowance = worker_allowance(setting, workers)
    if allowance is None:
        return
    allowed, where = allowance
    needed = worker_bytes(size, optimizer, workers)
    if needed <= allowed:
        return
    raise ConfigurationError(
        f"the model {model!r} has {size:,} parameters: each of the {workers} workers holds "
        f"{MODEL_COPIES} float32 copies of them (the weights, the gradient and its chunks for "
        f"their owners) and its share of {type(optimizer).__name__}'s state, "
        f"{_gib(needed)} in all, but a worker has {_gib(allowed)} ({where}). Give the "
        "Python workers more (spark.executor.pyspark.memory, and on a cluster "
        "spark.executor.memoryOverhead), or train a smaller model (fewer features: hash "
        "them into fewer with FeatureHasher's numFeatures)"
    )


def _gib(count: int) -> str:
    return f"{count / (1 << 30):.2f} GiB"
