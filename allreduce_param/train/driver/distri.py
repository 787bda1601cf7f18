"""DistriOptimizer: fit a model on a Spark DataFrame in one barrier stage, driver out of the data path.

What runs on the driver: checking the settings and the data (before any task starts,
``checks``), choosing the number of workers, placing the rows (``partitioning``), one
barrier stage (``stage``) with its tasks' connections (``meeting``), and assembling the
result from their records. What runs in the tasks: ``task.worker.train_partition``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from allreduce_param.errors import ConfigurationError, InputError, TrainingError
from allreduce_param.models.base import merge_buffers
from allreduce_param.spark.gpus import stage_profile
from allreduce_param.spark.info import SparkInfo
from allreduce_param.spark.jobs import fit_jobs
from allreduce_param.spark.slots import check_no_dynamic_allocation
from allreduce_param.train import regularisation
from allreduce_param.train.checkpoint import remove_incomplete
from allreduce_param.train.driver.checks import (
    check_model,
    check_start,
    check_takes_weights,
    model_size,
    warn_about_data,
    worker_count,
)
from allreduce_param.train.driver.failures import stage_attempts, with_checkpoint_advice
from allreduce_param.train.driver.meeting import driver_end
from allreduce_param.train.driver.memory import check_worker_memory
from allreduce_param.train.driver.resume import start_point
from allreduce_param.train.driver.source import placement, training_source
from allreduce_param.train.driver.stage import engine_parameter, run_stage
from allreduce_param.train.driver.streaming import start_query
from allreduce_param.train.driver.watchers import WatchedFit, watched_fit
from allreduce_param.train.records import StageOutput
from allreduce_param.train.result import History, TrainedModel, fit_phases
from allreduce_param.train.settings import FitSettings
from allreduce_param.train.task.device_encoding import (
    check_device_encoding,
    device_encoding_refusal,
)
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.touched import check_touched

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark import RDD
    from pyspark.sql import DataFrame
    from pyspark.sql.streaming import StreamingQuery

#: What ``DistriOptimizer`` attributes of the settings' names give where it is not the
#: setting as given: what follows from it (a read-through of ``settings`` either way).
_DERIVED = {
    "codec": lambda s: s.codecs[0],
    "gradient_codec": lambda s: s.codecs[1],
    "strategy": lambda s: s.synchronisation,
    "model_averaging": lambda s: s.averages_models,
}
_SETTINGS = frozenset(FitSettings.__dataclass_fields__)


class DistriOptimizer:
    """Data-parallel training of ``model`` with ``optimizer``, synchronised by allreduce.

    Its settings, by name (``DistriOptimizer(model, optimizer, batch_size=64)``) or as a
    ``FitSettings``, are listed with their defaults and meanings in ``FitSettings``, which the
    job files and the pyspark.ml Estimators share; the main ones are described here.

    ``model``: a built-in one, a ``TorchModel``, or any object that follows the protocol in
    ``allreduce_param.models.base.Model`` (``task`` is optional there: without it the fit
    reports the losses alone).
    ``solver="lbfgs"`` (``optimizer`` None) fits a built-in ``LinearRegression``,
    ``LogisticRegression`` or ``SoftmaxRegression`` by full-batch L-BFGS / OWL-QN to its
    minimiser (``max_iter``, ``tol``), as the linear Estimators do (``driver.lbfgs_fit``).
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

    ``checkpoints=Checkpoints(dir, every, keep)`` (``dir`` a local path, or a URL such as
    ``hdfs://`` or ``s3://`` that fsspec opens; on a cluster, storage every executor sees)
    makes the fit write checkpoints into a folder of its own there, every ``every`` steps
    (or each ``"epoch"``, the default) and after the last step, keeping the newest ``keep``
    (see ``train.checkpoint.Checkpoints``). When a task fails, the
    fit runs its stage again, up to ``spark.stage.maxConsecutiveAttempts`` times in all (4
    by default; each run again is announced with a ``RuntimeWarning`` saying why), and the
    new attempt resumes from the newest one instead of starting over (a task's
    ``ConfigurationError``, ``InputError`` or ``UsageError``, which every run would meet
    again, ends the fit after the first: a full ``checkpoint_dir`` or ``spark.local.dir``
    is one);
    ``fit(resume_from=...)`` continues a stopped or finished fit from one, and
    ``fit(initial=trained_model)`` goes on from an earlier fit's result (with
    ``keep_optimizer_state=True``, exactly as one longer fit).

    ``early_stopping=EarlyStopping(patience=k, min_delta=d)`` ends the fit once the loss
    on ``fit(validation=...)`` has not improved for k epochs (by more than d) and returns
    the best epoch's weights (``History.best_epoch``, ``History.stopped_early``); see
    ``train.early_stopping``. ``regularization=Regularization(reg_param, elastic_net_param,
    standardization)`` is MLlib's penalty (``train.regularisation``); ``network=
    NetworkSettings(...)`` where the servers listen, how long connecting may take, and
    encryption (unset ones follow the Spark settings ``spark.allreduce.*``).

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
        default and what it means is in ``FitSettings``. A bad one fails here. The settings
        read as attributes too (``opt.batch_size``); setting one (``opt.epochs = 5``)
        replaces ``settings`` with a checked copy."""
        check_model(model)
        if settings is not None and not isinstance(settings, FitSettings):
            raise ConfigurationError(
                f"settings must be a FitSettings, got {type(settings).__name__}: pass "
                "single settings by name, e.g. DistriOptimizer(model, optimizer, epochs=5)"
            )
        self.settings = (settings or FitSettings()).replace(**changes)
        self.model, self.optimizer = model, optimizer

    def __getattr__(self, name: str) -> Any:
        settings = self.__dict__.get("settings")
        if settings is None or name not in _SETTINGS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        derive = _DERIVED.get(name)
        return derive(settings) if derive is not None else getattr(settings, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SETTINGS:
            self.settings = self.settings.replace(**{name: value})
        else:
            super().__setattr__(name, value)

    def fit(
        self,
        data: DataFrame | RDD,
        features_col: str = "features",
        label_col: str = "label",
        validation: DataFrame | None = None,
        resume_from: str | None = None,
        weight_col: str | None = None,
        initial: TrainedModel | None = None,
    ) -> TrainedModel:
        """Train on ``data`` (a DataFrame, or an RDD of ``(features, label)`` numpy pairs).

        ``validation`` (a DataFrame with the same columns) is evaluated after every epoch.
        ``weight_col``: a numeric column of sample weights (finite, >= 0; the validation
        data needs it too): each step's gradient is the weighted mean over its global batch,
        exactly, however the rows fall on the partitions, and the losses and metrics are
        weighted means. It needs a DataFrame, and a model whose ``loss_and_grad`` takes
        ``sample_weight=`` (the built-in dense models do).
        ``resume_from``: a checkpoint (its folder, or a fit's folder: its newest) to continue
        from, optimizer state included, on any number of workers.
        ``initial``: a ``TrainedModel`` (a fit's result, or ``TrainedModel.load``'s; or an
        Estimator's Model) to continue from: its weights and buffers, and with
        ``keep_optimizer_state=True`` its optimizer state (which it must hold: fit it with
        that setting too); its epochs are numbered on from the model's and the optimizer
        counts its steps on (learning-rate schedules), so under BSP ``fit(df,
        initial=fit(df))`` of k epochs each gives the same bits as one fit of 2k epochs. It
        must be a model of the same kind and size; pass ``resume_from`` or ``initial``, not
        both. Bad data or settings raise before any task starts; a failing task raises
        ``TrainingError`` naming its partition, epoch and step, except that what only a task
        can find wrong with the settings or the input (its ``ConfigurationError``,
        ``InputError`` or ``UsageError``, which every run would meet again) is raised as that
        type, with that partition and where, after the stage's first run.
        """
        if self.settings.solver == "lbfgs":  # the linear Estimators' full-batch solve
            from allreduce_param.train.driver.lbfgs_fit import fit_lbfgs

            columns = (features_col, label_col, weight_col)
            return fit_lbfgs(self, data, *columns, validation, resume_from, initial)
        started, started_at = time.perf_counter(), time.time()
        spark = SparkInfo.of(data)  # a classic or Spark Connect session's answers
        title = f"allreduce-param fit of {type(self.model).__name__}, {self.settings.epochs} epochs"
        # its jobs in one group, named in the Spark UI; cancelled, their tasks gone, if interrupted
        with fit_jobs(spark, title) as jobs:
            s = self.settings
            check_no_dynamic_allocation(spark)
            profile = stage_profile(spark, s.gpus_per_task)  # None: the session gives them
            start = start_point(resume_from, initial, self.model, self.optimizer, s)
            if s.early_stopping is not None and validation is None:
                raise InputError(
                    f"early_stopping_patience={s.early_stopping.patience} stops on the "
                    "validation loss: pass validation data, fit(df, validation=validation_df) (with an "
                    "Estimator: set validationIndicatorCol)"
                )
            if weight_col is not None:
                check_takes_weights(self.model, data, weight_col)
            jobs.phase("checking the data")
            source, sample, n_features, partitions, summary = training_source(
                self.model, data, features_col, label_col, validation, weight_col
            )
            workers = worker_count(spark, s.num_workers, partitions, profile)
            # before the model is made here: one that cannot fit a worker is refused unmade
            check_worker_memory(spark.session_setting, self.model, self.optimizer, workers)
            size = model_size(self.model, sample, n_features, s.seed)
            regularisation.check_model(self.model, s.regularization, s.fit_intercept, size)
            if s.batch_size < workers:
                raise InputError(
                    f"batch_size={s.batch_size} is smaller than the {workers} workers: every worker "
                    f"needs rows in each step; raise batch_size or pass num_workers<={s.batch_size}"
                )
            s.synchronisation.check_partitions(workers)
            check_start(start, size, self.optimizer)
            network = s.network.resolved(spark.session_setting)  # the session's settings, read once
            param = engine_parameter(s, network, workers, size)
            check_device_encoding(
                self.model,
                device_encoding_refusal(
                    s,
                    param.gradient_codec,
                    param.strategy.inline_owner,
                    getattr(self.optimizer, "clip_norm", None),
                ),
            )
            checkpoints = None if s.checkpoints is None else s.checkpoints.for_new_fit()
            if checkpoints is not None:
                checkpoints.probe()  # before any stage: a folder the tasks cannot write fails here
                # a failed or interrupted fit leaves no step folder without its manifest
                jobs.on_failure(lambda: remove_incomplete(checkpoints.directory))
            watched = WatchedFit(
                self.model,
                self.optimizer,
                s,
                data,
                features_col,
                label_col,
                validation,
                weight_col,
                initial,
            )
            with (
                watched_fit(watched) as watchers,
                driver_end(s, spark, workers, network, watchers.listen) as end,
            ):
                job = TrainingJob(
                    self.model,
                    self.optimizer,
                    param,
                    s,
                    n_features,
                    validation is not None,
                    end.client,
                    checkpoints,
                    start,
                    sparse=summary is not None and summary.sparse,
                )
                check_touched(job)
                kept, placed = placement(source, workers, summary, s.partition_scheme, s.seed)
                if summary is not None:
                    num_classes = getattr(self.model, "num_classes", None)
                    warn_about_data(summary, workers, s.batch_size, kept is not None, num_classes)
                jobs.title = (
                    f"allreduce-param fit of {type(self.model).__name__} on {workers} partitions, "
                    f"{s.epochs} epochs"
                )
                try:
                    output = run_stage(
                        job,
                        kept,
                        placed,
                        stage_attempts(spark),
                        profile,
                        end.stage_failed,
                        jobs.phase,
                    )
                except TrainingError as error:
                    if checkpoints is None:
                        raise
                    raise with_checkpoint_advice(error, checkpoints, spark) from error.__cause__
            return watchers.finish(
                lambda: self._result(output, n_features, started, started_at, checkpoints)
            )

    def fit_stream(
        self,
        stream: DataFrame,
        model_path: str,
        checkpoint_location: str,
        features_col: str = "features",
        label_col: str = "label",
        weight_col: str | None = None,
        initial: TrainedModel | None = None,
        on_model: Callable[[int, TrainedModel], None] | None = None,
        trigger: dict[str, Any] | None = None,
        query_name: str | None = None,
        empty_batches: str = "skip",
        allow_pickle: bool = False,
    ) -> StreamingQuery:
        """Train on a streaming DataFrame as it arrives: each micro-batch one fit of these
        settings that continues from the last one's model (``fit(initial=...)``: the epochs
        and the optimizer's steps go on; with ``keep_optimizer_state=True``, its state too),
        published to ``model_path`` and handed to ``on_model(batch_id, trained_model)``.
        The started ``StreamingQuery`` (``awaitTermination``, ``processAllAvailable``,
        ``stop``).

        ``model_path`` (a local path or a URL, as ``TrainedModel.save`` takes them) always
        holds the latest complete model: ``TrainedModel.load(model_path)`` reads it (see
        ``train.publish``). ``checkpoint_location``: the streaming query's checkpoint; a
        query started again with the same one and the same ``model_path`` goes on from the
        published model at the next micro-batch, training none twice and skipping none.
        ``initial``: a model to start a new ``model_path`` from. ``trigger``: the keyword
        arguments of ``DataStreamWriter.trigger`` (``{"availableNow": True}``,
        ``{"processingTime": "1 minute"}``; None: Spark's default, a micro-batch as soon as
        the last is done). A micro-batch with other training columns' types than the
        model's stops the query with an ``InputError`` naming it, and nothing is published
        for it; one with no rows (a rate source's first) is passed over with a
        ``UserWarning`` (``empty_batches="skip"``) or stops the query (``"error"``).
        ``allow_pickle``: publish a model of your own (neither built in nor a ``TorchModel``)
        as a pickle, and read it back so at a restart (``TrainedModel.save``'s flag: only
        for a ``model_path`` no one else can write to).
        """
        if self.settings.solver == "lbfgs":
            raise ConfigurationError(
                "solver='lbfgs' solves a whole DataFrame at once, not a stream: fit_stream "
                "trains with solver='minibatch'"
            )
        return start_query(
            self,
            stream,
            model_path,
            checkpoint_location,
            {"features_col": features_col, "label_col": label_col, "weight_col": weight_col},
            initial,
            on_model,
            trigger,
            query_name,
            empty_batches,
            allow_pickle,
        )

    def _result(self, output: StageOutput, n_features, started, started_at, checkpoints):
        """The fit's ``TrainedModel``, from the stage's records."""
        history = History.from_records(
            output.steps, output.epochs, time.perf_counter() - started, output.updates
        )
        history.resumed = output.resumed
        history.checkpoints = None if checkpoints is None else checkpoints.directory
        history.phases = fit_phases(started_at, output.submitted, time.time(), output.clocks)
        if self.settings.verbose:
            print(history.phases_line(), flush=True)
        buffers = merge_buffers(output.buffers) if output.buffers else None
        state = output.optimizer_state if self.settings.keep_optimizer_state else None
        return TrainedModel(
            self.model,
            output.weights,
            history,
            n_features,
            buffers=buffers,
            optimizer_state=state,
            optimizer_kind=None if state is None else type(self.optimizer).__name__,
            steps_done=output.reached[0],
            epochs_done=output.reached[1],
        )
