"""DistriOptimizer: fit a model on a Spark DataFrame in one barrier stage, driver out of the data path.

What runs on the driver: checking the settings and the data (before any task starts),
choosing the number of workers, one barrier stage, and assembling the result. What runs
in the tasks: ``worker.train_partition``.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from allreduce_param.engine.blocks.codec import codec_names
from allreduce_param.engine.movement.rendezvous import MeetingPoint
from allreduce_param.engine.parameter import AllReduceParameter
from allreduce_param.engine.strategy import Strategy
from allreduce_param.engine.wire.blocks import parse_address
from allreduce_param.engine.wire.messages import MessageServer
from allreduce_param.engine.wire.settings import NetworkSettings
from allreduce_param.errors import ConfigurationError, InputError, TrainingError
from allreduce_param.models.base import has_buffers, merge_buffers, model_task, takes_sample_weight
from allreduce_param.spark.arrow import record_batch
from allreduce_param.spark.info import SparkInfo
from allreduce_param.spark.slots import check_no_dynamic_allocation, task_slots
from allreduce_param.train.checkpoint import CheckpointSettings, Manifest, newest
from allreduce_param.train.driver.data import arrays_from_arrow, arrays_from_pairs, prepare_once
from allreduce_param.train.driver.partitioning import (
    place_pairs,
    place_rows_once,
    refused_in_place,
    rows_in_place,
)
from allreduce_param.train.early_stopping import EarlyStopping
from allreduce_param.train.progress import ProgressBar, ProgressMerger
from allreduce_param.train.result import (
    STEP_FIELDS,
    UPDATE_FIELDS,
    History,
    TrainedModel,
    fit_phases,
    merge_epoch,
    merge_step,
)
from allreduce_param.train.settings import FitSettings
from allreduce_param.train.task.worker import TrainingJob, buffers_from_payload, train_partition

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import DataFrame

_OUTPUT_SCHEMA = "kind string, payload binary"


class DistriOptimizer:
    """Data-parallel training of ``model`` with ``optimizer``, synchronised by allreduce.

    Its settings, by name (``DistriOptimizer(model, optimizer, batch_size=64)``) or as a
    ``FitSettings``, are listed with their defaults and meanings in ``FitSettings``, which the
    job files and the pyspark.ml Estimators share; the main ones are described here.

    ``model``: a built-in one, a ``TorchModel``, or any object that follows the protocol in
    ``allreduce_param.models.base.Model`` (``task`` is optional there: without it the fit
    reports the losses alone).
    ``batch_size`` is the global batch of a step, split over the partitions by their share
    of the rows. ``num_workers`` defaults to the data's partition count, capped by Spark's
    free task slots. ``threads`` splits each partition's batch into sub-batches computed on
    threads: a count, or a list of relative workloads. ``seed`` fixes the initial weights
    and the shuffles, so a fit is reproducible. ``overlap`` lets a BSP step send each
    owner's chunk of the gradient as soon as backward has finished it, while it computes
    the rest, when the model can say so (``loss_and_grad_into``: the built-in and torch
    models can) and the batch is not split over threads; the result is the same bits.
    ``"auto"`` (the default) does so on the partitions that reach a peer over the network,
    where there is wire time to hide; on one host the sync is memory copies and encoding,
    which would only compete with backward for the cores. True or False: always, never.

    How the partitions synchronise: ``strategy`` ``"bsp"`` (every step waits for every
    partition; with ``backup_workers=b`` it goes on with the first N-b), ``"ssp"`` (with
    ``staleness=s``: no partition more than s steps ahead of the slowest) or ``"asp"``
    (nobody waits); see ``allreduce_param.engine.strategy``. ``sync_every=k`` (or ``"epoch"``)
    lets each partition train a copy of its own for k steps between syncs (local SGD, BSP
    only), at which the models are averaged (``model_averaging=True``, the default) or
    their updates summed. ``partition_scheme`` says which rows each partition trains on:
    ``"as_is"``, ``"contiguous"``, ``"round_robin"``, ``"random"`` or ``"overlap_reshuffle"``
    (see ``train.partitioning``): ``"as_is"`` trains on cached data's own partitions where
    it has one per worker and no validation rows come with it, with no shuffle; otherwise
    each input partition's rows are dealt out to the workers in turn. An optimizer's
    ``clip_norm`` clips by the global norm of each step's gradient under plain BSP; under
    the other strategies and with local SGD, where no step sees every partition's gradient
    at once, each partition's gradient is clipped by its own norm.

    ``codec`` says how blocks travel (see ``allreduce_param.engine.blocks.codec``); ``gradient_codec``
    another one for the gradients alone, such as ``"topk"`` with ``codec="int8"``. What a
    lossy codec rounds off a partition's gradient is kept and added to its next one.
    ``topology`` says how partitions on several hosts sync: ``"auto"`` (the default) is
    hierarchical under plain BSP on several hosts one of which has several partitions (each
    host sums its own in shared memory and one partition per host exchanges with the other
    hosts', so connections and each host's traffic grow with the hosts, not the
    partitions), else flat; ``"flat"`` has every partition exchange with every other, and
    ``"hierarchical"`` asks for the host sums, which only plain BSP (no backup workers) can
    take: with another strategy it is refused here. A lossless codec gives the same weights
    either way.
    ``fetch_threads`` bounds how many peers a worker fetches from at once (None: the
    engine's default; see ``AllReduceParameter``).

    ``checkpoint_dir`` (a local path, or a URL such as ``hdfs://`` or ``s3://`` that fsspec
    opens; on a cluster, storage every executor sees) makes the fit write checkpoints into
    a folder of its own there, ``checkpoint_every`` steps (or each ``"epoch"``, the default)
    and after the last step, keeping the newest ``checkpoint_keep``. When a task fails, the
    fit runs its stage again, up to ``spark.stage.maxConsecutiveAttempts`` times in all (4
    by default), and the new attempt resumes from the newest one instead of starting over;
    ``fit(resume_from=...)`` continues a stopped or finished fit from one.

    ``early_stopping_patience=k`` ends the fit once the loss on ``fit(validation=...)`` has
    not improved for k epochs (by more than ``early_stopping_min_delta``) and returns the
    best epoch's weights (``History.best_epoch``, ``History.stopped_early``); see
    ``train.early_stopping``.

    While it runs, every step comes to the driver: ``progress`` shows a bar (terminal or
    notebook), ``log_path`` appends each step and epoch as a JSON line, and ``listener``,
    a callable ``(kind, fields)``, gets ``"start"``, ``"step"`` and ``"epoch"`` events.
    ``verbose=True`` prints where the fit's time went (``History.phases``) when it ends.
    """

    def __init__(
        self, model: Any, optimizer: Any, settings: FitSettings | None = None, **changes: Any
    ) -> None:
        """``settings`` (a ``FitSettings``), with ``changes`` to it by name, e.g.
        ``DistriOptimizer(model, optimizer, batch_size=64, epochs=40)``; every setting, its
        default and what it means is in ``FitSettings``. A bad one fails here."""
        for name in ("init", "loss_and_grad", "predict"):
            if not callable(getattr(model, name, None)):
                raise ConfigurationError(
                    f"the model {model!r} has no {name}() method; a model needs init(rng), "
                    "loss_and_grad(weights, X, y) and predict(weights, X)"
                )
        model_task(model)  # optional; a task other than classification or regression fails here
        has_buffers(model)  # so does a model with buffers() but no set_buffers(), or the reverse
        if settings is not None and not isinstance(settings, FitSettings):
            raise ConfigurationError(
                f"settings must be a FitSettings, got {type(settings).__name__}: pass "
                "single settings by name, e.g. DistriOptimizer(model, optimizer, epochs=5)"
            )
        s = self.settings = (settings or FitSettings()).replace(**changes)
        self.model, self.optimizer = model, optimizer
        self.codec, self.gradient_codec = codec_names(s.codec, s.gradient_codec)
        self.strategy = Strategy(s.strategy, s.staleness, s.backup_workers)
        self.partition_scheme = s.partition_scheme
        self.checkpoint_dir = None if s.checkpoint_dir is None else str(s.checkpoint_dir)
        self.checkpoint_every, self.checkpoint_keep = s.checkpoint_every, s.checkpoint_keep
        self.sync_every = s.sync_every
        self.model_averaging = True if s.model_averaging is None else bool(s.model_averaging)
        self.batch_size, self.epochs, self.num_workers, self.threads = (
            s.batch_size,
            s.epochs,
            s.num_workers,
            s.threads,
        )
        self.seed, self.timeout, self.verbose, self.overlap = (
            s.seed,
            s.timeout,
            s.verbose,
            s.overlap,
        )
        self.progress, self.log_path, self.listener = s.progress, s.log_path, s.listener
        self.topology, self.fetch_threads = s.topology, s.fetch_threads

    def fit(
        self,
        data: DataFrame | RDD,
        features_col: str = "features",
        label_col: str = "label",
        validation: DataFrame | None = None,
        resume_from: str | None = None,
        weight_col: str | None = None,
    ) -> TrainedModel:
        """Train on ``data`` (a DataFrame, or an RDD of ``(features, label)`` numpy pairs).

        ``validation`` (a DataFrame with the same columns) is evaluated after every epoch.
        ``weight_col``: a numeric column of sample weights (finite, >= 0; the validation
        data needs it too): each step's gradient is the weighted mean over its global batch,
        exactly, however the rows fall on the partitions, and the losses and metrics are
        weighted means. It needs a DataFrame, and a model whose ``loss_and_grad`` takes
        ``sample_weight=`` (the built-in dense models do).
        ``resume_from``: a checkpoint (its folder, or a fit's folder: its newest) to continue
        from, optimizer state included, on any number of workers. Bad data or settings raise
        before any task starts; a failing task raises ``TrainingError`` naming its
        partition, epoch and step.
        """
        started, started_at = time.perf_counter(), time.time()
        spark = SparkInfo.of(data)  # a classic or Spark Connect session's answers
        check_no_dynamic_allocation(spark)
        resume = self._resume_point(resume_from) if resume_from is not None else None
        if self.settings.early_stopping_patience is not None and validation is None:
            raise InputError(
                f"early_stopping_patience={self.settings.early_stopping_patience} stops on the "
                "validation loss: pass validation data, fit(df, validation=validation_df) (with an "
                "Estimator: set validationIndicatorCol)"
            )
        if weight_col is not None:
            self._check_takes_weights(data, weight_col)
        if hasattr(data, "sparkSession"):
            prepared, summary = prepare_once(
                data,
                features_col,
                label_col,
                validation,
                task=model_task(self.model),
                num_classes=getattr(self.model, "num_classes", None),
                weight_col=weight_col,
            )
            n_features, sample, partitions = (
                summary.n_features,
                summary.sample,
                summary.partition_num,
            )
            source = prepared
        elif hasattr(data, "mapPartitions"):
            if validation is not None:
                raise InputError(
                    "validation goes with DataFrame input; for an RDD, evaluate afterwards"
                )
            first = data.take(1)
            if not first:
                raise InputError("the training RDD has no rows")
            sample = (np.asarray([first[0][0]], np.float32), np.asarray([first[0][1]], np.float64))
            n_features, source = sample[0].shape[1], data
            partitions = data.getNumPartitions()
        else:
            raise InputError(
                f"fit() takes a DataFrame or an RDD of (features, label) pairs, got {type(data).__name__}"
            )
        size = self._check_model_takes(sample, n_features)
        workers = self._workers(spark, partitions)
        if self.batch_size < workers:
            raise InputError(
                f"batch_size={self.batch_size} is smaller than the {workers} workers: every worker "
                f"needs rows in each step; raise batch_size or pass num_workers<={self.batch_size}"
            )
        self.strategy.check_partitions(workers)
        if resume is not None:
            self._check_resume(resume, size, workers)
        network = NetworkSettings.of(self.settings.network_values(), spark.session_setting)
        param = AllReduceParameter(
            workers,
            size,
            codec=self.codec,
            gradient_codec=self.gradient_codec,
            timeout=self.timeout,
            strategy=self.strategy,
            bind_address=network.bind_address,
            advertise_address=network.advertise_address,
            port_range=network.port_range,
            connect_timeout=network.connect_timeout,
            encrypt=network.encrypt,
            topology=self.topology,
            fetch_threads=self.fetch_threads,
        )
        checkpoints = (
            None
            if self.checkpoint_dir is None
            else CheckpointSettings.for_new_fit(
                self.checkpoint_dir, self.checkpoint_every, self.checkpoint_keep
            )
        )
        with self._driver_end(spark, workers, network) as driver:
            job = TrainingJob(
                self.model,
                self.optimizer,
                param,
                self.batch_size,
                self.epochs,
                self.seed,
                self.threads,
                n_features,
                validation is not None,
                driver,
                self.sync_every,
                self.model_averaging,
                checkpoints,
                resume,
                self._settings(),
                report_progress=bool(self.progress or self.log_path or self.listener),
                overlap=self.overlap,
                early_stopping=self._early_stopping(),
            )
            if hasattr(source, "mapInArrow"):
                kept = rows_in_place(source, workers, self.partition_scheme, summary)

                def placed():  # with nothing kept, or once Spark refused to read the kept rows
                    if kept is not None:
                        refused_in_place(summary)
                    return place_rows_once(
                        source, workers, self.partition_scheme, self.seed, summary
                    )
            else:
                kept, placed = (
                    None,
                    lambda: place_pairs(source, workers, self.partition_scheme, self.seed),
                )
            try:
                records = self._run(job, kept, placed, stage_attempts(spark))
            except TrainingError as error:
                if checkpoints is None:
                    raise
                raise self._with_checkpoint_advice(error, checkpoints, spark) from error.__cause__
        history = History.from_records(
            records["steps"], records["epochs"], time.perf_counter() - started, records["updates"]
        )
        history.resumed = records["resumed"]
        history.checkpoints = None if checkpoints is None else checkpoints.directory
        history.phases = fit_phases(
            started_at, records["submitted"], time.time(), records["clocks"]
        )
        if self.verbose:
            print(history.phases_line(), flush=True)
        return TrainedModel(
            self.model,
            records["weights"],
            history,
            n_features,
            buffers=merge_buffers(records["buffers"]) if records["buffers"] else None,
        )

    def _early_stopping(self) -> EarlyStopping | None:
        """Early stopping's settings for the tasks, when the fit stops early."""
        s = self.settings
        return (
            None
            if s.early_stopping_patience is None
            else EarlyStopping(s.early_stopping_patience, float(s.early_stopping_min_delta))
        )

    def _settings(self) -> dict:
        """What a checkpoint's manifest records of this fit's settings."""
        return {
            "strategy": self.strategy.name,
            "staleness": self.strategy.staleness,
            "backup_workers": self.strategy.backup_workers,
            "sync_every": self.sync_every,
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "seed": self.seed,
            "partition_scheme": self.partition_scheme,
            "codec": self.codec,
            "early_stopping_patience": self.settings.early_stopping_patience,
            "gradient_codec": self.gradient_codec,
            "model": repr(self.model),
            "optimizer": repr(self.optimizer),
        }

    def _resume_point(self, location: str) -> Manifest:
        found = newest(str(location))
        if found is None:
            raise InputError(
                f"resume_from={str(location)!r} holds no complete checkpoint (no manifest.json "
                "there, nor in a step-... folder of it)"
            )
        return found

    def _check_resume(self, resume: Manifest, size: int, workers: int) -> None:
        """A checkpoint this fit can continue from: the same model size and optimizer state."""
        if resume.size != size:
            raise InputError(
                f"the checkpoint {resume.folder} holds {resume.size} weights, this model has {size}: "
                "resume with the model the checkpoint was made with"
            )
        if set(resume.state_names) != set(self.optimizer.state_names):
            raise InputError(
                f"the checkpoint {resume.folder} holds optimizer state {list(resume.state_names)}, "
                f"{self.optimizer!r} needs {list(self.optimizer.state_names)}: resume with the "
                "optimizer the checkpoint was made with"
            )

    @staticmethod
    def _with_checkpoint_advice(
        error: TrainingError, checkpoints: CheckpointSettings, spark: SparkInfo
    ) -> TrainingError:
        """The failure, with what the fit's checkpoints make possible now."""
        found = newest(checkpoints.directory)
        if found is None:
            advice = (
                f"The fit wrote no complete checkpoint to {checkpoints.directory} before it failed"
            )
        else:
            advice = (
                f"Its newest checkpoint, of step {found.step}, is {found.folder}: "
                f"fit(..., resume_from={found.folder!r}) continues from it"
            )
            if stage_attempts(spark) == 1:
                advice += (
                    "; the stage ran once (spark.stage.maxConsecutiveAttempts=1): with 2 or "
                    "more it resumes from the checkpoint on its own"
                )
        return TrainingError(f"{error}. {advice}")

    @contextlib.contextmanager
    def _driver_end(self, spark: SparkInfo, workers: int, network: NetworkSettings):
        """The driver's end of the tasks' connections, for the length of the fit: where the
        partitions meet, and where their progress goes (the bar, the log, the listener,
        which also hears where everyone listens: a ``"meeting"`` event). Listens where
        ``network`` says, by default on ``spark.driver.bindAddress`` (or the driver's
        host); yields what the tasks use to reach it (``_client_of``)."""
        log_file = open(self.log_path, "a") if self.log_path else None
        bar = ProgressBar(show=self.progress, log_file=log_file)
        listeners = [bar] + ([self.listener] if self.listener else [])
        progress = ProgressMerger(
            workers,
            merge_step,
            lambda kind, fields: [listen(kind, dict(fields)) for listen in listeners],
            merge_epoch=merge_epoch,
        )
        host = spark.listening_host()
        bind, advertise = network.addresses(spark.driver_bind_address() or host, host)

        def on_met(addresses: dict) -> None:
            servers = [parse_address(addresses[partition]) for partition in sorted(addresses)]
            fields = {
                "driver": f"{advertise}:{server.address[1]}",
                "servers": [f"{address.host}:{address.port}" for address in servers],
            }
            for listen in listeners:
                listen("meeting", dict(fields))

        meeting = MeetingPoint(workers, network.meeting_patience, on_met=on_met)

        def on_message(message: dict, reply) -> None:
            if not meeting.on_message(message, reply):
                progress.on_message(message)

        server = MessageServer(
            bind,
            on_message,
            advertise=advertise,
            ports=network.port_range,
            connect_timeout=network.connect_timeout,
            encrypt=network.encrypt,
        )
        try:
            yield self._client_of(server, spark, network.connect_timeout)
        finally:
            server.close()
            bar.close()
            if log_file is not None:
                log_file.close()

    def _check_takes_weights(self, data, weight_col: str) -> None:
        """Sample weights need a DataFrame and a model that takes them."""
        if not isinstance(weight_col, str) or not weight_col:
            raise InputError(
                f"weight_col must be the name of a column of sample weights, got {weight_col!r}"
            )
        if not hasattr(data, "sparkSession"):
            raise InputError(
                f"weight_col={weight_col!r} goes with DataFrame input; for an RDD of (features, "
                "label) pairs, make it a DataFrame with a weight column, e.g. "
                "spark.createDataFrame(rdd.map(lambda r: (Vectors.dense(r[0]), float(r[1]), w)), ...)"
            )
        if not takes_sample_weight(self.model.loss_and_grad):
            raise ConfigurationError(
                f"weight_col={weight_col!r}: the model {self.model!r} takes no sample weights (its loss_and_grad "
                "has no sample_weight= argument); use a model that does (the built-in dense models: MLP, "
                "LinearRegression, LogisticRegression, SoftmaxRegression), or train without weights"
            )

    def _check_model_takes(self, sample, n_features: int) -> int:
        """Run the model on one real row on the driver, so a shape mismatch fails here; its size.

        The row goes twice (a module with BatchNorm takes no single row in train mode), and a
        model's buffers are put back as they were, so the check leaves no trace in them."""
        weights = self.model.init(np.random.default_rng(self.seed))
        if not isinstance(weights, np.ndarray) or weights.dtype != np.float32 or weights.ndim != 1:
            raise InputError(f"{self.model!r}.init(rng) must return a 1-D float32 vector")
        X, y = (np.concatenate([part, part]) for part in sample)
        before = self.model.buffers() if has_buffers(self.model) else None
        try:
            _, grad, _ = self.model.loss_and_grad(weights, X, y)
        except Exception as error:
            raise InputError(
                f"the model {self.model!r} cannot take the data's feature vectors of {n_features} "
                f"elements: {type(error).__name__}: {error}"
            ) from error
        finally:
            if before is not None:
                self.model.set_buffers(before)
        if np.shape(grad) != weights.shape:
            raise InputError(
                f"{self.model!r}.loss_and_grad returned a gradient of shape {np.shape(grad)}, "
                f"the weights have {weights.shape}"
            )
        return int(weights.size)

    def _client_of(self, server: MessageServer, spark: SparkInfo, connect_timeout: float):
        """What the tasks use to reach ``server``; None where they cannot (under Spark Connect,
        the client may be out of the executors' reach): they then meet through Spark, at
        once, and the fit says that it shows no live progress."""
        if not spark.client_maybe_unreachable():
            return server.client()
        reason = spark.unreachable(server.address, connect_timeout)
        if reason is None:
            return server.client()
        host, port = server.address
        warnings.warn(
            f"the executors cannot reach this Spark Connect client at {host}:{port} ({reason}): the fit "
            "goes on without live progress (no bar, log lines or listener events while it runs); its "
            "history arrives when it ends. To see progress, run where the executors can connect to "
            "this process (e.g. on the cluster's network)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None

    def _workers(self, spark: SparkInfo, partitions: int) -> int:
        """How many barrier tasks: the requested count, or the data's ``partitions``, within
        the slots.

        Refuses more tasks than Spark can run at once before the stage is submitted, where
        Spark would refuse them only then.
        """
        slots, counted = task_slots(spark, needed=self.num_workers or 1)
        workers = self.num_workers or max(1, min(partitions, slots))
        if workers > slots:
            raise ConfigurationError(
                f"num_workers={workers}, but Spark has {slots} task slots ({counted}); a barrier stage "
                "needs all its tasks running at once: lower num_workers, or give Spark more cores "
                "(local[N], spark.executor.instances x spark.executor.cores / spark.task.cpus)"
            )
        return workers

    def _run(self, job: TrainingJob, kept, placed: Callable[[], Any], attempts: int) -> dict:
        """The fit's one barrier stage, over ``kept`` (the rows as they lie, or None) or
        where Spark refuses a barrier stage over those (a union or a coalesce in their
        lineage, SPARK-24820) over the rows ``placed()`` shuffles into place; each has a
        partition per worker. The records the partitions yielded.

        The stage returns the records itself, and Spark never retries such a barrier stage
        when a task fails, so this runs it again, up to ``attempts`` runs in all; a new
        attempt's tasks resume from the fit's newest checkpoint. (A shuffle after the stage
        would have Spark retry it, for a stage more on every fit.)"""

        def arrow_task(batches):
            started = time.time()
            arrays = arrays_from_arrow(batches, job.n_features)
            clock = {"started": started, "loaded": time.time()}
            for kind, payload in train_partition(job, *arrays, clock=clock):
                yield record_batch(kind=[kind], payload=[payload])

        def pairs_task(pairs):
            started = time.time()
            arrays = arrays_from_pairs(pairs, job.n_features)
            yield from train_partition(
                job, *arrays, clock={"started": started, "loaded": time.time()}
            )

        def stage(rows) -> list:
            if hasattr(rows, "mapInArrow"):
                return [
                    (row["kind"], row["payload"])
                    for row in rows.mapInArrow(arrow_task, _OUTPUT_SCHEMA, barrier=True).collect()
                ]
            return rows.barrier().mapPartitions(pairs_task).collect()

        submitted = time.time()
        rows, failures = (kept if kept is not None else placed()), 0
        while True:
            try:
                output = stage(rows)
                break
            except Exception as error:
                if rows is kept and "BarrierJobUnsupportedRDDChainException" in str(error):
                    rows = placed()  # refused before any task ran
                    continue
                failures += 1
                if failures >= attempts or _TASK_FAILED not in str(error):
                    raise _task_error(
                        error
                    ) from error  # Spark's own report stays on it, as the cause
        records: dict[str, Any] = {
            "steps": [],
            "epochs": [],
            "updates": [],
            "resumed": [],
            "weights": None,
            "clocks": [],
            "submitted": submitted,
            "buffers": [],
        }
        for kind, payload in output:
            if kind == "steps":
                records["steps"].append(
                    np.frombuffer(payload, dtype=np.float64).reshape(-1, len(STEP_FIELDS))
                )
            elif kind == "epochs":
                records["epochs"].extend(json.loads(bytes(payload)))
            elif kind == "updates":
                records["updates"].append(
                    np.frombuffer(payload, dtype=np.float64).reshape(
                        -1, len(UPDATE_FIELDS) + job.param.partition_num
                    )
                )
            elif kind == "clock":
                records["clocks"].append(json.loads(bytes(payload)))
            elif kind == "resumed":
                records["resumed"] = json.loads(bytes(payload))
            elif kind == "weights":
                records["weights"] = np.frombuffer(bytes(payload), dtype=np.float32).copy()
            elif kind == "buffers":  # every partition's own, with its training rows
                records["buffers"].append(buffers_from_payload(payload))
        return records


#: Spark's reason when a barrier stage has more tasks than the cluster has slots
_NOT_ENOUGH_SLOTS = "SPARK-24819"
#: what Spark says when a task of a barrier stage that returns results failed
_TASK_FAILED = "Could not recover from a failed barrier ResultStage"
_TASK_MESSAGE = re.compile(r"TrainingError: (partition [^\n]*)")
#: a Python error outside the training loop (e.g. the task's closure failed to unpickle)
_PYTHON_ERROR = re.compile(
    r"Traceback \(most recent call last\):\n(?:[ \t][^\n]*\n)*([A-Za-z_][\w.]*: [^\n]*)"
)
#: placing the rows found data that changed since prepare() counted it (partitioning.py)
_PLACEMENT_MESSAGE = re.compile(r"row \d+ of partition \d+ of the prepared data is not among[^\n]*")


def stage_attempts(spark: SparkInfo) -> int:
    """How many times in all a fit runs its stage when tasks fail: Spark's own setting for
    retrying a stage, ``spark.stage.maxConsecutiveAttempts``."""
    # Spark's scheduler reads it at start-up: a session that runs has a valid one
    return max(1, int(spark.setting("spark.stage.maxConsecutiveAttempts", "4")))


def _task_error(error: Exception) -> Exception:
    """One clear error from the wall of Java stack a failed barrier stage gives.

    A partition that lost a failed peer quotes what that peer said; the innermost quote
    is the root cause, whichever task's failure Spark reported.
    """
    text = str(error)
    if _NOT_ENOUGH_SLOTS in text:  # where the slots could only be estimated first (Spark Connect)
        return ConfigurationError(
            "Spark refused the fit's barrier stage: it needs more task slots than the cluster has "
            f"({_NOT_ENOUGH_SLOTS}, after spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures tries); "
            "lower num_workers, or give Spark more executors or cores"
        )
    found = _TASK_MESSAGE.search(text)
    if found:
        return TrainingError(found.group(1).split("TrainingError: ")[-1])
    placement = _PLACEMENT_MESSAGE.search(text)
    if placement:
        return TrainingError(placement.group(0))
    python = _PYTHON_ERROR.search(text)
    if python:
        return TrainingError(
            f"a task of the fit failed outside its training loop: {python.group(1)}"
        )
    spark_reason = re.search(r"org\.apache\.spark\.[\w.]*(?:Exception|Failed)[^\n]*", text)
    return TrainingError(
        spark_reason.group(0) if spark_reason else text.splitlines()[0] if text else repr(error)
    )
