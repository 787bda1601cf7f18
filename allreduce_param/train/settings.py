"""FitSettings: every setting of a fit, its default, its check and what it means, in one place.

``DistriOptimizer`` takes them as keyword arguments (or a ``FitSettings``), a job file as
its ``[train]`` section, and the pyspark.ml Estimators as Params of the same meaning
(camelCase names: ``batch_size`` is ``batchSize``, ``epochs`` is ``maxEpochs``). A new
setting is a new field here: the Estimators grow the Param, its getter and setter, and
the job files the key, from this class.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from allreduce_param.engine.blocks.codec import codec_names
from allreduce_param.engine.strategy import Strategy
from allreduce_param.engine.wire.settings import SPARK_SETTINGS, NetworkSettings
from allreduce_param.errors import ConfigurationError
from allreduce_param.optim import ElasticNet
from allreduce_param.train.checkpoint import CheckpointSettings
from allreduce_param.train.early_stopping import EarlyStopping, check_patience, check_strategy

#: The settings ``NetworkSettings`` has too (and reads from Spark settings when unset).
NETWORK_FIELDS = tuple(SPARK_SETTINGS)

#: The ways to place rows on the workers (``partition_scheme``; see ``driver.partitioning``).
#: ``FitSettings.sparse_sync``'s values
SPARSE_SYNCS = ("auto", "touched", "dense")
SCHEMES = ("as_is", "contiguous", "round_robin", "random", "overlap_reshuffle")


def check_scheme(scheme: str) -> str:
    """The scheme's name, or a ConfigurationError naming ``partition_scheme`` and the choices."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ConfigurationError(
            f"partition_scheme={scheme!r} is not a data-partition scheme; choose one of "
            f"{', '.join(SCHEMES)}"
        )
    return scheme


def check_regularisation(
    reg_param: Any, elastic_net_param: Any, fit_intercept: Any, standardization: Any
) -> None:
    """MLlib's ranges: ``reg_param >= 0``, ``elastic_net_param`` in [0, 1]; the two flags
    booleans."""
    for name, value, allowed in (
        ("reg_param", reg_param, ">= 0"),
        ("elastic_net_param", elastic_net_param, "in [0, 1]"),
    ):
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and value >= 0 and (name == "reg_param" or value <= 1)
        if not ok:
            raise ConfigurationError(f"{name} must be a finite number {allowed}, got {value!r}")
    for name, value in (("fit_intercept", fit_intercept), ("standardization", standardization)):
        if not isinstance(value, bool):
            raise ConfigurationError(f"{name} must be True or False, got {value!r}")


def check_gpus_per_task(value: Any) -> None:
    """None, a whole number >= 1, or a fraction <= 0.5 (Spark's rule for sharing a GPU: at
    least two tasks on one); else a ConfigurationError naming ``gpus_per_task``."""
    if value is None:
        return
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and value > 0
    ok = ok and (float(value).is_integer() or value <= 0.5)
    if not ok:
        raise ConfigurationError(
            f"gpus_per_task must be a whole number of GPUs >= 1 or a fraction <= 0.5 (that "
            f"many tasks share one GPU, as Spark's spark.task.resource.gpu.amount), got {value!r}"
        )


def workload_shares(threads: int | Sequence[float] | None) -> list[float]:
    """Each sub-batch's share of a batch (summing to 1), from a thread count or workloads."""
    try:
        weights = (
            [1.0] * threads if isinstance(threads, int) else [float(w) for w in (threads or [1.0])]
        )
    except (TypeError, ValueError):
        weights = []
    if not weights or any(not w > 0 for w in weights):
        raise ConfigurationError(
            f"threads must be a positive count or a list of positive workloads, got {threads!r}"
        )
    return [w / sum(weights) for w in weights]


def _setting(
    default: Any,
    doc: str,
    *,
    param: str | None = None,
    kind: str = "identity",
    estimator: bool = True,
) -> Any:
    """A field of FitSettings. ``param``: the Estimators' Param name, when it is not the field's
    name in camelCase; ``kind``: the Param's type (pyspark's ``TypeConverters.to...``, or
    ``identity`` where a value may be of two kinds); ``estimator``: whether the Estimators
    have it (not for what only Python code can give, such as a callable)."""
    return field(
        default=default, metadata={"doc": doc, "param": param, "kind": kind, "estimator": estimator}
    )


@dataclass(frozen=True)
class FitSettings:
    """The settings of a fit; every one has a default. Checked when made, so a bad one fails
    before any data moves, with a message that names it."""

    batch_size: int = _setting(
        256,
        "the global batch of a step, split over the workers by their share of the rows",
        kind="Int",
    )
    epochs: int = _setting(10, "passes over the training rows", param="maxEpochs", kind="Int")
    codec: str = _setting(
        "lz4",
        "how blocks travel between the workers: lz4, raw, bf16, fp16, int8, ...",
        kind="String",
    )
    gradient_codec: str | None = _setting(
        None, "another codec for the gradients alone, e.g. topk (None: codec)", kind="String"
    )
    num_workers: int | None = _setting(
        None,
        "partitions that train (None: one per partition of the data, up to Spark's task slots)",
        kind="Int",
    )
    threads: int | Sequence[float] | None = _setting(
        None,
        "split each partition's batch over threads: a count, or relative workloads",
        estimator=False,
    )
    seed: int = _setting(
        0,
        "the seed of the initial weights and the shuffles: the same seed, the same fit",
        kind="Int",
    )
    timeout: float = _setting(
        300.0, "seconds a worker waits for a peer before the fit fails", kind="Float"
    )
    progress: bool = _setting(
        True, "show the fit's live progress bar", param="showProgress", kind="Boolean"
    )
    log_path: str | None = _setting(
        None, "a file to append each step and epoch to, as JSON lines", kind="String"
    )
    listener: Callable[[str, dict], None] | None = _setting(
        None,
        "a callable(kind, fields) given the start, every step and every epoch",
        estimator=False,
    )
    strategy: str = _setting("bsp", "how the workers synchronise: bsp, ssp or asp", kind="String")
    staleness: int | None = _setting(
        None, "ssp: how many steps a worker may run ahead of the slowest", kind="Int"
    )
    backup_workers: int = _setting(
        0, "bsp: a step goes on without the slowest b workers' gradients", kind="Int"
    )
    sync_every: int | str = _setting(
        1, "local SGD: train k steps between syncs, or 'epoch' (1: sync every step)"
    )
    model_averaging: bool | None = _setting(
        None, "local SGD: average the models (True) or sum their updates", kind="Boolean"
    )
    partition_scheme: str = _setting(
        "as_is",
        "which rows each worker trains on: as_is, contiguous, round_robin, "
        "random, overlap_reshuffle",
        kind="String",
    )
    checkpoint_dir: str | None = _setting(
        None, "where the fit writes checkpoints (storage every executor sees)", kind="String"
    )
    checkpoint_every: int | str | None = _setting(
        None, "checkpoint every k steps or 'epoch' (None: each epoch)"
    )
    checkpoint_keep: int = _setting(2, "how many of the newest checkpoints to keep", kind="Int")
    keep_optimizer_state: bool = _setting(
        False,
        "keep the optimizer's state (Adam's moments, ...) with the trained model, saved with it, "
        "and continue from the initial model's in a fit from one (fit(initial=...), "
        "initialModel), which must hold it: training goes on exactly as one longer fit would. "
        "False: the model holds none, and a fit from one starts the optimizer afresh",
        kind="Boolean",
    )
    verbose: bool = _setting(False, "print where the fit's time went when it ends", kind="Boolean")
    overlap: bool | str = _setting(
        "auto",
        "send each chunk of a gradient while backward computes the rest: True, False or 'auto'",
    )
    data_in: str = _setting(
        "auto",
        "where a task keeps its partition's rows while it trains: 'memory', 'disk' (row files "
        "in spark.local.dir, read a block at a time: partitions larger than memory) or 'auto' "
        "(memory while a partition takes at most a quarter of spark.executor.pyspark.memory, "
        "or without it its share of half the machine's available memory)",
        param="dataIn",
        kind="String",
    )
    bind_address: str | None = _setting(
        None,
        "where the workers' block servers and the driver's message server listen (None: the Spark setting "
        "spark.allreduce.bindAddress, else the address Spark gives each process; one address, never every "
        "interface)",
        kind="String",
    )
    advertise_address: str | None = _setting(
        None,
        "the address the others are told to connect to (None: spark.allreduce.advertiseAddress, else the "
        "bind address when set, else Spark's)",
        kind="String",
    )
    port_range: str | None = _setting(
        None,
        "the ports those servers may take, 'FIRST-LAST' (None: spark.allreduce.portRange, else any free "
        "port); allow one per task on each executor, and one for the driver",
        kind="String",
    )
    connect_timeout: float | None = _setting(
        None,
        "seconds a connection and its handshake may take (None: spark.allreduce.connectTimeout, else 10); "
        "the meeting at the driver waits 3 times this for the last task",
        kind="Float",
    )
    encrypt: bool | None = _setting(
        None,
        "encrypt the traffic that goes over TCP: blocks between workers on different hosts, and the "
        "workers' messages to the driver (None: spark.allreduce.encrypt, else on where "
        "spark.network.crypto.enabled or spark.ssl.enabled is true; same-host Unix sockets and shared "
        "memory never are)",
        kind="Boolean",
    )
    topology: str = _setting(
        "auto",
        "how partitions on several hosts sync: 'hierarchical' (each host sums its partitions in shared "
        "memory and one partition per host exchanges with the other hosts', so connections and each "
        "host's traffic grow with the hosts, not the partitions; plain BSP only), 'flat' (every "
        "partition with every other) or 'auto' (hierarchical under plain BSP on several hosts one of "
        "which has several partitions, else flat); a lossless codec gives the same weights either way",
        kind="String",
    )
    fetch_threads: int | None = _setting(
        None,
        "how many peers each worker fetches blocks from at once (None: the engine's default, 16, or every "
        "peer when there are fewer); the others queue",
        kind="Int",
    )
    gpus_per_task: float | None = _setting(
        None,
        "GPUs each task of the fit's stage is assigned (a fraction <= 0.5 shares one GPU "
        "between tasks): the stage asks Spark for them with a stage-level resource profile, "
        "or the session's spark.task.resource.gpu.amount gives them (None: what the session "
        "gives); a TorchModel runs on its task's GPU",
        kind="Float",
    )
    early_stopping_patience: int | None = _setting(
        None,
        "stop once the validation loss has not improved for this many epochs, and keep the best "
        "epoch's weights (needs validation data; None: train every epoch)",
        kind="Int",
    )
    early_stopping_min_delta: float = _setting(
        0.0,
        "how much lower than the best so far a validation loss must be to count as an improvement",
        kind="Float",
    )
    reg_param: float = _setting(
        0.0,
        "the regularisation's strength, as MLlib's regParam: the objective is the mean loss + "
        "regParam * ((1 - elasticNetParam) / 2 * sum(w^2) + elasticNetParam * sum(abs(w))), over "
        "the weights, never the intercepts (0: none)",
        kind="Float",
    )
    elastic_net_param: float = _setting(
        0.0,
        "the L1 share of the regularisation, in [0, 1], as MLlib's elasticNetParam: 0 is L2 (ridge, "
        "through the optimizer), 1 is L1 (lasso, a proximal step after each update: coefficients "
        "it outweighs become exactly 0)",
        kind="Float",
    )
    fit_intercept: bool = _setting(
        True,
        "train the intercepts (the biases); False holds every one at 0, as MLlib's fitIntercept",
        kind="Boolean",
    )
    standardization: bool = _setting(
        True,
        "as MLlib's standardization: penalise each first-layer weight in proportion to its "
        "feature's standard deviation over the training rows (the L1 part by std, the L2 part by "
        "std^2), which is MLlib's penalty on the coefficients of standardized features; a feature "
        "of std 0 keeps its weights at 0. False: the weights as they are",
        kind="Boolean",
    )
    sparse_sync: str = _setting(
        "auto",
        "how a fit on sparse rows syncs its gradients: 'touched' (only the elements a step's rows "
        "touch: the first layer's rows of the columns they hold, and every layer after it; plain BSP, "
        "a lossless codec, one thread, a flat topology), 'dense' (every element) or 'auto' (touched "
        "where it can and the first layer is wide, see docs/performance.md); the same weights, bit for "
        "bit, either way",
        kind="String",
    )

    def __post_init__(self) -> None:
        for name in ("batch_size", "epochs", "num_workers", "fetch_threads"):
            value = getattr(self, name)
            if not (value is None and name in ("num_workers", "fetch_threads")) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigurationError(f"{name} must be a positive whole number, got {value!r}")
        # an unknown or misplaced codec fails, naming the codecs there are
        codec_names(self.codec, self.gradient_codec)
        workload_shares(self.threads)
        strategy = self.synchronisation
        every = self.sync_every
        if every != "epoch" and (
            isinstance(every, bool) or not isinstance(every, int) or every < 1
        ):
            raise ConfigurationError(
                f"sync_every must be a positive whole number of steps or 'epoch', got {every!r}"
            )
        if every != 1 and not strategy.inline_owner:
            raise ConfigurationError(
                f"sync_every={every!r} (local SGD) goes with strategy='bsp' and no backup "
                f"workers, not with {strategy.as_settings}"
            )
        if self.model_averaging is not None and every == 1:
            raise ConfigurationError(
                "model_averaging goes with sync_every=k or 'epoch' (local SGD); with "
                "sync_every=1 every step averages the gradients"
            )
        strategy.check_topology(self.topology)  # a conflict fails before the fit's first Spark job
        check_scheme(self.partition_scheme)
        check_patience(self.early_stopping_patience, self.early_stopping_min_delta)
        check_strategy(self.early_stopping_patience, strategy)
        if self.checkpoint_dir is None and self.checkpoint_every is not None:
            raise ConfigurationError(
                f"checkpoint_every={self.checkpoint_every!r} goes with checkpoint_dir, the "
                "storage to write the checkpoints to"
            )
        if self.checkpoint_dir is not None:
            CheckpointSettings.for_new_fit(
                str(self.checkpoint_dir), self.checkpoint_every, self.checkpoint_keep
            )
        NetworkSettings.of(self.network_values())
        check_regularisation(
            self.reg_param, self.elastic_net_param, self.fit_intercept, self.standardization
        )
        check_gpus_per_task(self.gpus_per_task)
        if self.sparse_sync not in SPARSE_SYNCS:
            raise ConfigurationError(
                f"sparse_sync must be one of {', '.join(map(repr, SPARSE_SYNCS))}, got "
                f"{self.sparse_sync!r}"
            )
        if not isinstance(self.keep_optimizer_state, bool):
            raise ConfigurationError(
                f"keep_optimizer_state must be True or False, got {self.keep_optimizer_state!r}"
            )
        if self.data_in not in ("memory", "disk", "auto"):
            raise ConfigurationError(
                f"data_in must be 'memory', 'disk' or 'auto', got {self.data_in!r}"
            )
        if self.overlap not in (True, False, "auto"):
            raise ConfigurationError(f"overlap must be True, False or 'auto', got {self.overlap!r}")

    @classmethod
    def of(cls, settings: Mapping[str, Any], where: str = "DistriOptimizer") -> FitSettings:
        """FitSettings from a mapping of field names (a job file's section, keyword arguments);
        a name that is no setting fails, naming ``where`` and the settings there are."""
        names = {item.name for item in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ConfigurationError(
                f"{where}: {', '.join(map(repr, unknown))} "
                f"{'is not a setting' if len(unknown) == 1 else 'are not settings'}; "
                f"the settings are {', '.join(sorted(names))}"
            )
        return cls(**settings)

    def replace(self, **changes: Any) -> FitSettings:
        """A copy with ``changes``, checked as a new one is (itself when there are none)."""
        return FitSettings.of({**self.as_dict(), **changes}) if changes else self

    def network_values(self) -> dict[str, Any]:
        """The networking settings by ``NetworkSettings``' names (None where unset)."""
        return {name: getattr(self, name) for name in NETWORK_FIELDS}

    def as_dict(self) -> dict[str, Any]:
        """Every setting by its field name."""
        return {item.name: getattr(self, item.name) for item in dataclasses.fields(self)}

    # ---- what follows from the settings, derived here and nowhere else -------------------

    @property
    def codecs(self) -> tuple[str, str]:
        """``(codec for weights, codec for gradients)``: ``gradient_codec`` or ``codec``."""
        return self.codec, self.gradient_codec or self.codec

    @property
    def synchronisation(self) -> Strategy:
        """The ``Strategy`` of ``strategy``, ``staleness`` and ``backup_workers``."""
        return Strategy(self.strategy, self.staleness, self.backup_workers)

    @property
    def averages_models(self) -> bool:
        """Local SGD: whether a sync averages the models (``model_averaging``, unset: True)."""
        return True if self.model_averaging is None else bool(self.model_averaging)

    @property
    def reports_progress(self) -> bool:
        """Whether anyone on the driver hears each step: a bar, a log or a listener."""
        return bool(self.progress or self.log_path or self.listener)

    def penalty(self) -> ElasticNet | None:
        """The regularisation of ``reg_param`` and ``elastic_net_param`` (None: none)."""
        if self.reg_param == 0.0:
            return None
        return ElasticNet(self.reg_param, self.elastic_net_param)

    @property
    def standardizes(self) -> bool:
        """Whether the penalty is scaled by each feature's standard deviation (MLlib's
        ``standardization``, which only matters with a penalty)."""
        return self.standardization and self.reg_param > 0

    def early_stopping(self) -> EarlyStopping | None:
        """Early stopping's settings with no state yet (None: the fit trains every epoch)."""
        if self.early_stopping_patience is None:
            return None
        return EarlyStopping(self.early_stopping_patience, float(self.early_stopping_min_delta))

    def checkpoints(self) -> CheckpointSettings | None:
        """A new fit's checkpoints: a folder of its own under ``checkpoint_dir`` (None: none)."""
        if self.checkpoint_dir is None:
            return None
        return CheckpointSettings.for_new_fit(
            str(self.checkpoint_dir), self.checkpoint_every, self.checkpoint_keep
        )


@dataclass(frozen=True)
class ParamSpec:
    """A setting as the Estimators' Param: its name, meaning, type, default and field."""

    name: str
    doc: str
    kind: str
    default: Any
    setting: str


def estimator_params() -> Iterator[ParamSpec]:
    """The settings the Estimators have as Params, in FitSettings' order."""
    for item in dataclasses.fields(FitSettings):
        meta = item.metadata
        if meta["estimator"]:
            head, *rest = item.name.split("_")
            name = meta["param"] or head + "".join(word.capitalize() for word in rest)
            yield ParamSpec(name, meta["doc"], meta["kind"], item.default, item.name)
