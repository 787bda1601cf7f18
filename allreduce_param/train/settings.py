"""FitSettings: every setting of a fit, its default, its check and what it means, in one place.

``DistriOptimizer`` takes them as keyword arguments (or a ``FitSettings``). Settings that
belong together are one object each: ``network`` (``NetworkSettings``), ``checkpoints``
(``Checkpoints``), ``early_stopping`` (``EarlyStopping``) and ``regularization``
(``Regularization``), e.g. ``DistriOptimizer(model, optimizer,
checkpoints=Checkpoints(dir="ckpt", every=100))``.

A job file's ``[train]`` section and the pyspark.ml Estimators' Params keep every setting
flat, as their conventions want (``checkpoint_dir``, ``checkpointDir``; camelCase for the
Params: ``batch_size`` is ``batchSize``, ``epochs`` is ``maxEpochs``): ``FLAT`` maps those
names into the groups, the one place that does, and ``FitSettings.of_flat`` reads them. A
new setting is a new field here (or in a group, with its line in ``FLAT``); the Estimators'
Params are then written out by ``python -m allreduce_param._params_source``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from allreduce_param.engine.blocks.codec import codec_names
from allreduce_param.engine.strategy import Strategy
from allreduce_param.engine.wire.settings import NetworkSettings
from allreduce_param.errors import ConfigurationError
from allreduce_param.train.checkpoint import Checkpoints
from allreduce_param.train.early_stopping import EarlyStopping, check_patience, check_strategy
from allreduce_param.train.regularisation import Regularization, check_fit_intercept

#: ``FitSettings.sparse_sync``'s values
SPARSE_SYNCS = ("auto", "touched", "dense")
#: ``FitSettings.solver``'s values
SOLVERS = ("minibatch", "lbfgs")
#: The ways to place rows on the workers (``partition_scheme``; see ``driver.partitioning``).
SCHEMES = ("as_is", "contiguous", "round_robin", "random", "overlap_reshuffle")


def check_scheme(scheme: str) -> str:
    """The scheme's name, or a ConfigurationError naming ``partition_scheme`` and the choices."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ConfigurationError(
            f"partition_scheme={scheme!r} is not a data-partition scheme; choose one of "
            f"{', '.join(SCHEMES)}"
        )
    return scheme


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


def _group(default: Any, doc: str) -> Any:
    """A field of FitSettings that holds a group of settings (flat in ``FLAT``)."""
    return field(default=default, metadata={"doc": doc, "group": True, "estimator": False})


#: The groups' classes by their field of FitSettings, and whether the group may be None (left out).
GROUPS: dict[str, tuple[type, bool]] = {
    "network": (NetworkSettings, False),
    "checkpoints": (Checkpoints, True),
    "early_stopping": (EarlyStopping, True),
    "regularization": (Regularization, False),
}


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
    tensorboard_dir: str | None = _setting(
        None,
        "a folder to write the fit's scalars to as TensorBoard event files while it runs (each "
        "step's loss and samples/s, the learning rate, each epoch's metrics), one run folder per "
        "fit; needs tensorboardX: pip install 'allreduce-param[tensorboard]' (None: none)",
        kind="String",
    )
    tracking: bool | None = _setting(
        None,
        "log the fit to MLflow (its settings, metrics, history and model): True logs it into the "
        "active run or a new one, False never, None as allreduce_param.integrations.mlflow."
        "autolog() says; needs pip install 'allreduce-param[mlflow]'",
        kind="Boolean",
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
    checkpoints: Checkpoints | None = _group(
        None, "where and how often the fit writes checkpoints (None: it writes none)"
    )
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
        "(memory where 1.5x the partition's rows fit what the worker may use: "
        "spark.executor.pyspark.memory, or without it its share of the machine's available memory)",
        param="dataIn",
        kind="String",
    )
    network: NetworkSettings = _group(
        NetworkSettings(),
        "where the servers listen, how long connecting may take, encryption (unset: Spark's "
        "settings, spark.allreduce.*)",
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
    early_stopping: EarlyStopping | None = _group(
        None, "stop when the validation loss stops improving (None: train every epoch)"
    )
    regularization: Regularization = _group(
        Regularization(), "MLlib's penalty: regParam, elasticNetParam, standardization"
    )
    fit_intercept: bool = _setting(
        True,
        "train the intercepts (the biases); False holds every one at 0, as MLlib's fitIntercept",
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

    solver: str = _setting(
        "minibatch",
        "how the fit minimises: 'minibatch' (the optimizer's steps over batches, every setting "
        "here) or 'lbfgs' (full-batch L-BFGS, OWL-QN with an L1 part, on a built-in "
        "LinearRegression, LogisticRegression or SoftmaxRegression: the minimiser of its mean "
        "loss plus regularization, as MLlib's, to max_iter and tol; see docs/linear.md)",
        kind="String",
    )
    max_iter: int = _setting(
        100, "solver='lbfgs': the most L-BFGS iterations (MLlib's maxIter)", kind="Int"
    )
    tol: float = _setting(
        1e-6,
        "solver='lbfgs': stop once the objective's relative change is below tol (MLlib's rule)",
        kind="Float",
    )

    def __post_init__(self) -> None:
        for name in ("batch_size", "epochs", "num_workers", "fetch_threads"):
            value = getattr(self, name)
            if not (value is None and name in ("num_workers", "fetch_threads")) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigurationError(f"{name} must be a positive whole number, got {value!r}")
        for name, (kind, optional) in GROUPS.items():  # each group checked its own values
            value = getattr(self, name)
            if not (isinstance(value, kind) or (optional and value is None)):
                raise ConfigurationError(
                    f"{name} must be a {kind.__name__}{' or None' if optional else ''}, got "
                    f"{value!r}: e.g. {name}={kind.__name__}(...)"
                )
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
        check_strategy(self.early_stopping, strategy)
        check_fit_intercept(self.fit_intercept)
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
        if self.solver not in SOLVERS:
            raise ConfigurationError(
                f"solver must be one of {', '.join(map(repr, SOLVERS))}, got {self.solver!r}"
            )
        if (
            isinstance(self.max_iter, bool)
            or not isinstance(self.max_iter, int)
            or self.max_iter < 0
        ):
            raise ConfigurationError(f"max_iter must be a whole number >= 0, got {self.max_iter!r}")
        tol = self.tol
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not tol >= 0:
            raise ConfigurationError(f"tol must be a number >= 0, got {tol!r}")
        if not math.isfinite(tol):
            raise ConfigurationError(f"tol must be a finite number >= 0, got {tol!r}")
        if self.data_in not in ("memory", "disk", "auto"):
            raise ConfigurationError(
                f"data_in must be 'memory', 'disk' or 'auto', got {self.data_in!r}"
            )
        if self.tracking not in (None, True, False):
            raise ConfigurationError(
                f"tracking must be True, False or None (as autolog() says), got {self.tracking!r}"
            )
        if self.tensorboard_dir is not None and (
            not isinstance(self.tensorboard_dir, str | os.PathLike) or not str(self.tensorboard_dir)
        ):
            raise ConfigurationError(
                "tensorboard_dir must be a folder's path (or None: no TensorBoard events), got "
                f"{self.tensorboard_dir!r}"
            )
        if self.overlap not in (True, False, "auto"):
            raise ConfigurationError(f"overlap must be True, False or 'auto', got {self.overlap!r}")

    @classmethod
    def of(cls, settings: Mapping[str, Any], where: str = "DistriOptimizer") -> FitSettings:
        """FitSettings from a mapping of field names (keyword arguments); a name that is no
        setting fails, naming ``where``, the settings there are, and for a flat name (a job
        file's, such as ``checkpoint_dir``) the group that holds it."""
        names = {item.name for item in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            grouped = [
                f"{name} is {FLAT[name].group}={GROUPS[FLAT[name].group][0].__name__}"
                f"({FLAT[name].field}=...)"
                for name in unknown
                if name in FLAT
            ]
            raise ConfigurationError(
                f"{where}: {', '.join(map(repr, unknown))} "
                f"{'is not a setting' if len(unknown) == 1 else 'are not settings'}; "
                f"{'; '.join(grouped) + '; ' if grouped else ''}"
                f"the settings are {', '.join(sorted(names))}"
            )
        return cls(**settings)

    @classmethod
    def of_flat(cls, settings: Mapping[str, Any], where: str = "[train]") -> FitSettings:
        """FitSettings from a mapping of flat names (a job file's ``[train]``, the Estimators'
        Params as settings): the grouped ones (``FLAT``) into their groups. A name that is no
        setting fails, naming ``where`` and the flat names there are."""
        names = set(flat_names())
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ConfigurationError(
                f"{where}: {', '.join(map(repr, unknown))} "
                f"{'is not a setting' if len(unknown) == 1 else 'are not settings'}; "
                f"the settings are {', '.join(sorted(names))}"
            )
        values = {name: value for name, value in settings.items() if name not in FLAT}
        for group in GROUPS:
            members = {
                flat.field: settings[name]
                for name, flat in FLAT.items()
                if flat.group == group and name in settings
            }
            values[group] = _group_of_flat(group, members)
        return cls(**values)

    def replace(self, **changes: Any) -> FitSettings:
        """A copy with ``changes``, checked as a new one is (itself when there are none)."""
        return FitSettings.of({**self.as_dict(), **changes}) if changes else self

    def as_flat(self) -> dict[str, Any]:
        """Every setting by its flat name (``of_flat``'s inverse: a group's members as
        ``FLAT`` names them, an optional group left out as its flat defaults)."""
        values = {}
        for name in flat_names():
            if name not in FLAT:
                values[name] = getattr(self, name)
                continue
            flat = FLAT[name]
            group = getattr(self, flat.group)
            values[name] = flat.default if group is None else getattr(group, flat.field)
        return values

    def as_dict(self) -> dict[str, Any]:
        """Every setting by its field name (a group as its object)."""
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
        return bool(self.progress or self.log_path or self.listener or self.tensorboard_dir)


@dataclass(frozen=True)
class Flat:
    """A grouped setting as the job files and the Estimators name it: its ``group`` (a field
    of FitSettings), its ``field`` there, its flat default (None: unset), the Param's type
    and meaning (see ``_setting``)."""

    group: str
    field: str
    default: Any
    kind: str
    doc: str


#: The grouped settings by their flat names, each group's in its order: the one place that
#: maps the job files' keys and the Estimators' Params into the groups.
FLAT: dict[str, Flat] = {
    "checkpoint_dir": Flat(
        "checkpoints",
        "dir",
        None,
        "String",
        "where the fit writes checkpoints (storage every executor sees)",
    ),
    "checkpoint_every": Flat(
        "checkpoints",
        "every",
        None,
        "identity",
        "checkpoint every k steps or 'epoch' (None: each epoch)",
    ),
    "checkpoint_keep": Flat(
        "checkpoints", "keep", 2, "Int", "how many of the newest checkpoints to keep"
    ),
    "bind_address": Flat(
        "network",
        "bind_address",
        None,
        "String",
        "where the workers' block servers and the driver's message server listen (None: the Spark setting "
        "spark.allreduce.bindAddress, else the address Spark gives each process; one address, never every "
        "interface)",
    ),
    "advertise_address": Flat(
        "network",
        "advertise_address",
        None,
        "String",
        "the address the others are told to connect to (None: spark.allreduce.advertiseAddress, else the "
        "bind address when set, else Spark's)",
    ),
    "port_range": Flat(
        "network",
        "port_range",
        None,
        "String",
        "the ports those servers may take, 'FIRST-LAST' (None: spark.allreduce.portRange, else any free "
        "port); allow one per task on each executor, and one for the driver",
    ),
    "connect_timeout": Flat(
        "network",
        "connect_timeout",
        None,
        "Float",
        "seconds a connection and its handshake may take (None: spark.allreduce.connectTimeout, else 10); "
        "the meeting at the driver waits 3 times this for the last task",
    ),
    "encrypt": Flat(
        "network",
        "encrypt",
        None,
        "Boolean",
        "encrypt the traffic that goes over TCP: blocks between workers on different hosts, and the "
        "workers' messages to the driver (None: spark.allreduce.encrypt, else on where "
        "spark.network.crypto.enabled or spark.ssl.enabled is true; same-host Unix sockets and shared "
        "memory never are)",
    ),
    "early_stopping_patience": Flat(
        "early_stopping",
        "patience",
        None,
        "Int",
        "stop once the validation loss has not improved for this many epochs, and keep the best "
        "epoch's weights (needs validation data; None: train every epoch)",
    ),
    "early_stopping_min_delta": Flat(
        "early_stopping",
        "min_delta",
        0.0,
        "Float",
        "how much lower than the best so far a validation loss must be to count as an improvement",
    ),
    "reg_param": Flat(
        "regularization",
        "reg_param",
        0.0,
        "Float",
        "the regularisation's strength, as MLlib's regParam: the objective is the mean loss + "
        "regParam * ((1 - elasticNetParam) / 2 * sum(w^2) + elasticNetParam * sum(abs(w))), over "
        "the weights, never the intercepts (0: none)",
    ),
    "elastic_net_param": Flat(
        "regularization",
        "elastic_net_param",
        0.0,
        "Float",
        "the L1 share of the regularisation, in [0, 1], as MLlib's elasticNetParam: 0 is L2 (ridge, "
        "through the optimizer), 1 is L1 (lasso, a proximal step after each update: coefficients "
        "it outweighs become exactly 0)",
    ),
    "standardization": Flat(
        "regularization",
        "standardization",
        True,
        "Boolean",
        "as MLlib's standardization: penalise each first-layer weight in proportion to its "
        "feature's standard deviation over the training rows (the L1 part by std, the L2 part by "
        "std^2), which is MLlib's penalty on the coefficients of standardized features; a feature "
        "of std 0 keeps its weights at 0. False: the weights as they are",
    ),
}


def _group_of_flat(group: str, members: dict[str, Any]) -> Any:
    """A group's object from its flat settings by field name (those not given: defaults).
    An optional group is left out where its first setting is unset: no checkpoints without
    ``checkpoint_dir`` (``checkpoint_every`` alone is refused), no early stopping without
    ``early_stopping_patience`` (a bad ``early_stopping_min_delta`` still is)."""
    if group == "checkpoints" and members.get("dir") is None:
        if members.get("every") is not None:
            raise ConfigurationError(
                f"checkpoint_every={members['every']!r} goes with checkpoint_dir, the "
                "storage to write the checkpoints to"
            )
        return None
    if group == "early_stopping" and members.get("patience") is None:
        check_patience(None, members.get("min_delta", 0.0))
        return None
    return GROUPS[group][0](**members)


def flat_names() -> Iterator[str]:
    """Every setting's flat name (a job file's key), in FitSettings' order."""
    for item in dataclasses.fields(FitSettings):
        if item.metadata.get("group"):
            yield from (name for name, flat in FLAT.items() if flat.group == item.name)
        else:
            yield item.name


@dataclass(frozen=True)
class ParamSpec:
    """A setting as the Estimators' Param: its name, meaning, type, default and flat name."""

    name: str
    doc: str
    kind: str
    default: Any
    setting: str


def estimator_params() -> Iterator[ParamSpec]:
    """The settings the Estimators have as Params, in FitSettings' order (a group's by its
    flat names, ``FLAT``)."""
    fields = {item.name: item for item in dataclasses.fields(FitSettings)}
    for name in flat_names():
        if name in FLAT:
            flat = FLAT[name]
            yield ParamSpec(_camel(name), flat.doc, flat.kind, flat.default, name)
            continue
        meta = fields[name].metadata
        if meta["estimator"]:
            yield ParamSpec(
                meta["param"] or _camel(name), meta["doc"], meta["kind"], fields[name].default, name
            )


def _camel(name: str) -> str:
    """``batch_size`` as ``batchSize``."""
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)
