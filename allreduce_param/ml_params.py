"""The pyspark.ml Params of the fit's settings (``FitSettings``): one class per Param with its
getter, ``FitSettingParams`` all of them, ``FitSettingSetters`` their setters.

Written by ``python -m allreduce_param._params_source`` from ``train.settings``: do not edit
by hand (``tests/test_settings.py`` checks that it is current).
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters


class HasBatchSize(Params):
    """The fit setting batch_size as the Param batchSize."""

    batchSize = Param(
        Params._dummy(),
        "batchSize",
        "the global batch of a step, split over the workers by their share of the rows",
        typeConverter=TypeConverters.toInt,
    )

    def getBatchSize(self) -> int:
        """The value of batchSize: the global batch of a step, split over the workers by their
        share of the rows.
        """
        return self.getOrDefault(self.batchSize)


class HasMaxEpochs(Params):
    """The fit setting epochs as the Param maxEpochs."""

    maxEpochs = Param(
        Params._dummy(),
        "maxEpochs",
        "passes over the training rows",
        typeConverter=TypeConverters.toInt,
    )

    def getMaxEpochs(self) -> int:
        """The value of maxEpochs: passes over the training rows."""
        return self.getOrDefault(self.maxEpochs)


class HasCodec(Params):
    """The fit setting codec as the Param codec."""

    codec = Param(
        Params._dummy(),
        "codec",
        "how blocks travel between the workers: lz4, raw, bf16, fp16, int8, ...",
        typeConverter=TypeConverters.toString,
    )

    def getCodec(self) -> str:
        """The value of codec: how blocks travel between the workers: lz4, raw, bf16, fp16,
        int8, ...
        """
        return self.getOrDefault(self.codec)


class HasGradientCodec(Params):
    """The fit setting gradient_codec as the Param gradientCodec."""

    gradientCodec = Param(
        Params._dummy(),
        "gradientCodec",
        "another codec for the gradients alone, e.g. topk (None: codec)",
        typeConverter=TypeConverters.toString,
    )

    def getGradientCodec(self) -> str | None:
        """The value of gradientCodec: another codec for the gradients alone, e.g. topk (None:
        codec).
        """
        return self.getOrDefault(self.gradientCodec)


class HasNumWorkers(Params):
    """The fit setting num_workers as the Param numWorkers."""

    numWorkers = Param(
        Params._dummy(),
        "numWorkers",
        "partitions that train (None: one per partition of the data, up to Spark's task slots)",
        typeConverter=TypeConverters.toInt,
    )

    def getNumWorkers(self) -> int | None:
        """The value of numWorkers: partitions that train (None: one per partition of the data,
        up to Spark's task slots).
        """
        return self.getOrDefault(self.numWorkers)


class HasSeed(Params):
    """The fit setting seed as the Param seed."""

    seed = Param(
        Params._dummy(),
        "seed",
        "the seed of the initial weights and the shuffles: the same seed, the same fit",
        typeConverter=TypeConverters.toInt,
    )

    def getSeed(self) -> int:
        """The value of seed: the seed of the initial weights and the shuffles: the same seed,
        the same fit.
        """
        return self.getOrDefault(self.seed)


class HasTimeout(Params):
    """The fit setting timeout as the Param timeout."""

    timeout = Param(
        Params._dummy(),
        "timeout",
        "seconds a worker waits for a peer before the fit fails",
        typeConverter=TypeConverters.toFloat,
    )

    def getTimeout(self) -> float:
        """The value of timeout: seconds a worker waits for a peer before the fit fails."""
        return self.getOrDefault(self.timeout)


class HasShowProgress(Params):
    """The fit setting progress as the Param showProgress."""

    showProgress = Param(
        Params._dummy(),
        "showProgress",
        "show the fit's live progress bar",
        typeConverter=TypeConverters.toBoolean,
    )

    def getShowProgress(self) -> bool:
        """The value of showProgress: show the fit's live progress bar."""
        return self.getOrDefault(self.showProgress)


class HasLogPath(Params):
    """The fit setting log_path as the Param logPath."""

    logPath = Param(
        Params._dummy(),
        "logPath",
        "a file to append each step and epoch to, as JSON lines",
        typeConverter=TypeConverters.toString,
    )

    def getLogPath(self) -> str | None:
        """The value of logPath: a file to append each step and epoch to, as JSON lines."""
        return self.getOrDefault(self.logPath)


class HasTensorboardDir(Params):
    """The fit setting tensorboard_dir as the Param tensorboardDir."""

    tensorboardDir = Param(
        Params._dummy(),
        "tensorboardDir",
        "a folder to write the fit's scalars to as TensorBoard event files while it "
        "runs (each step's loss and samples/s, the learning rate, each epoch's "
        "metrics), one run folder per fit; needs tensorboardX: pip install "
        "'allreduce-param[tensorboard]' (None: none)",
        typeConverter=TypeConverters.toString,
    )

    def getTensorboardDir(self) -> str | None:
        """The value of tensorboardDir: a folder to write the fit's scalars to as TensorBoard
        event files while it runs (each step's loss and samples/s, the learning rate, each
        epoch's metrics), one run folder per fit; needs tensorboardX: pip install
        'allreduce-param[tensorboard]' (None: none).
        """
        return self.getOrDefault(self.tensorboardDir)


class HasTracking(Params):
    """The fit setting tracking as the Param tracking."""

    tracking = Param(
        Params._dummy(),
        "tracking",
        "log the fit to MLflow (its settings, metrics, history and model): True logs "
        "it into the active run or a new one, False never, None as "
        "allreduce_param.integrations.mlflow.autolog() says; needs pip install "
        "'allreduce-param[mlflow]'",
        typeConverter=TypeConverters.toBoolean,
    )

    def getTracking(self) -> bool | None:
        """The value of tracking: log the fit to MLflow (its settings, metrics, history and
        model): True logs it into the active run or a new one, False never, None as
        allreduce_param.integrations.mlflow.autolog() says; needs pip install
        'allreduce-param[mlflow]'.
        """
        return self.getOrDefault(self.tracking)


class HasStrategy(Params):
    """The fit setting strategy as the Param strategy."""

    strategy = Param(
        Params._dummy(),
        "strategy",
        "how the workers synchronise: bsp, ssp or asp",
        typeConverter=TypeConverters.toString,
    )

    def getStrategy(self) -> str:
        """The value of strategy: how the workers synchronise: bsp, ssp or asp."""
        return self.getOrDefault(self.strategy)


class HasStaleness(Params):
    """The fit setting staleness as the Param staleness."""

    staleness = Param(
        Params._dummy(),
        "staleness",
        "ssp: how many steps a worker may run ahead of the slowest",
        typeConverter=TypeConverters.toInt,
    )

    def getStaleness(self) -> int | None:
        """The value of staleness: ssp: how many steps a worker may run ahead of the slowest."""
        return self.getOrDefault(self.staleness)


class HasBackupWorkers(Params):
    """The fit setting backup_workers as the Param backupWorkers."""

    backupWorkers = Param(
        Params._dummy(),
        "backupWorkers",
        "bsp: a step goes on without the slowest b workers' gradients",
        typeConverter=TypeConverters.toInt,
    )

    def getBackupWorkers(self) -> int:
        """The value of backupWorkers: bsp: a step goes on without the slowest b workers'
        gradients.
        """
        return self.getOrDefault(self.backupWorkers)


class HasSyncEvery(Params):
    """The fit setting sync_every as the Param syncEvery."""

    syncEvery = Param(
        Params._dummy(),
        "syncEvery",
        "local SGD: train k steps between syncs, or 'epoch' (1: sync every step)",
        typeConverter=TypeConverters.identity,
    )

    def getSyncEvery(self) -> Any:
        """The value of syncEvery: local SGD: train k steps between syncs, or 'epoch' (1: sync
        every step).
        """
        return self.getOrDefault(self.syncEvery)


class HasModelAveraging(Params):
    """The fit setting model_averaging as the Param modelAveraging."""

    modelAveraging = Param(
        Params._dummy(),
        "modelAveraging",
        "local SGD: average the models (True) or sum their updates",
        typeConverter=TypeConverters.toBoolean,
    )

    def getModelAveraging(self) -> bool | None:
        """The value of modelAveraging: local SGD: average the models (True) or sum their
        updates.
        """
        return self.getOrDefault(self.modelAveraging)


class HasPartitionScheme(Params):
    """The fit setting partition_scheme as the Param partitionScheme."""

    partitionScheme = Param(
        Params._dummy(),
        "partitionScheme",
        "which rows each worker trains on: as_is, contiguous, round_robin, random, "
        "overlap_reshuffle",
        typeConverter=TypeConverters.toString,
    )

    def getPartitionScheme(self) -> str:
        """The value of partitionScheme: which rows each worker trains on: as_is, contiguous,
        round_robin, random, overlap_reshuffle.
        """
        return self.getOrDefault(self.partitionScheme)


class HasCheckpointDir(Params):
    """The fit setting checkpoint_dir as the Param checkpointDir."""

    checkpointDir = Param(
        Params._dummy(),
        "checkpointDir",
        "where the fit writes checkpoints (storage every executor sees)",
        typeConverter=TypeConverters.toString,
    )

    def getCheckpointDir(self) -> str | None:
        """The value of checkpointDir: where the fit writes checkpoints (storage every executor
        sees).
        """
        return self.getOrDefault(self.checkpointDir)


class HasCheckpointEvery(Params):
    """The fit setting checkpoint_every as the Param checkpointEvery."""

    checkpointEvery = Param(
        Params._dummy(),
        "checkpointEvery",
        "checkpoint every k steps or 'epoch' (None: each epoch)",
        typeConverter=TypeConverters.identity,
    )

    def getCheckpointEvery(self) -> Any:
        """The value of checkpointEvery: checkpoint every k steps or 'epoch' (None: each
        epoch).
        """
        return self.getOrDefault(self.checkpointEvery)


class HasCheckpointKeep(Params):
    """The fit setting checkpoint_keep as the Param checkpointKeep."""

    checkpointKeep = Param(
        Params._dummy(),
        "checkpointKeep",
        "how many of the newest checkpoints to keep",
        typeConverter=TypeConverters.toInt,
    )

    def getCheckpointKeep(self) -> int:
        """The value of checkpointKeep: how many of the newest checkpoints to keep."""
        return self.getOrDefault(self.checkpointKeep)


class HasKeepOptimizerState(Params):
    """The fit setting keep_optimizer_state as the Param keepOptimizerState."""

    keepOptimizerState = Param(
        Params._dummy(),
        "keepOptimizerState",
        "keep the optimizer's state (Adam's moments, ...) with the trained model, "
        "saved with it, and continue from the initial model's in a fit from one "
        "(fit(initial=...), initialModel), which must hold it: training goes on "
        "exactly as one longer fit would. False: the model holds none, and a fit from"
        " one starts the optimizer afresh",
        typeConverter=TypeConverters.toBoolean,
    )

    def getKeepOptimizerState(self) -> bool:
        """The value of keepOptimizerState: keep the optimizer's state (Adam's moments, ...)
        with the trained model, saved with it, and continue from the initial model's in a
        fit from one (fit(initial=...), initialModel), which must hold it: training goes on
        exactly as one longer fit would. False: the model holds none, and a fit from one
        starts the optimizer afresh.
        """
        return self.getOrDefault(self.keepOptimizerState)


class HasVerbose(Params):
    """The fit setting verbose as the Param verbose."""

    verbose = Param(
        Params._dummy(),
        "verbose",
        "print where the fit's time went when it ends",
        typeConverter=TypeConverters.toBoolean,
    )

    def getVerbose(self) -> bool:
        """The value of verbose: print where the fit's time went when it ends."""
        return self.getOrDefault(self.verbose)


class HasOverlap(Params):
    """The fit setting overlap as the Param overlap."""

    overlap = Param(
        Params._dummy(),
        "overlap",
        "send each chunk of a gradient while backward computes the rest: True, False or 'auto'",
        typeConverter=TypeConverters.identity,
    )

    def getOverlap(self) -> Any:
        """The value of overlap: send each chunk of a gradient while backward computes the
        rest: True, False or 'auto'.
        """
        return self.getOrDefault(self.overlap)


class HasDataIn(Params):
    """The fit setting data_in as the Param dataIn."""

    dataIn = Param(
        Params._dummy(),
        "dataIn",
        "where a task keeps its partition's rows while it trains: 'memory', 'disk' "
        "(row files in spark.local.dir, read a block at a time: partitions larger "
        "than memory) or 'auto' (memory where 1.5x the partition's rows fit what the "
        "worker may use: spark.executor.pyspark.memory, or without it its share of "
        "the machine's available memory)",
        typeConverter=TypeConverters.toString,
    )

    def getDataIn(self) -> str:
        """The value of dataIn: where a task keeps its partition's rows while it trains:
        'memory', 'disk' (row files in spark.local.dir, read a block at a time: partitions
        larger than memory) or 'auto' (memory where 1.5x the partition's rows fit what the
        worker may use: spark.executor.pyspark.memory, or without it its share of the
        machine's available memory).
        """
        return self.getOrDefault(self.dataIn)


class HasBindAddress(Params):
    """The fit setting bind_address as the Param bindAddress."""

    bindAddress = Param(
        Params._dummy(),
        "bindAddress",
        "where the workers' block servers and the driver's message server listen "
        "(None: the Spark setting spark.allreduce.bindAddress, else the address Spark"
        " gives each process; one address, never every interface)",
        typeConverter=TypeConverters.toString,
    )

    def getBindAddress(self) -> str | None:
        """The value of bindAddress: where the workers' block servers and the driver's message
        server listen (None: the Spark setting spark.allreduce.bindAddress, else the address
        Spark gives each process; one address, never every interface).
        """
        return self.getOrDefault(self.bindAddress)


class HasAdvertiseAddress(Params):
    """The fit setting advertise_address as the Param advertiseAddress."""

    advertiseAddress = Param(
        Params._dummy(),
        "advertiseAddress",
        "the address the others are told to connect to (None: "
        "spark.allreduce.advertiseAddress, else the bind address when set, else "
        "Spark's)",
        typeConverter=TypeConverters.toString,
    )

    def getAdvertiseAddress(self) -> str | None:
        """The value of advertiseAddress: the address the others are told to connect to (None:
        spark.allreduce.advertiseAddress, else the bind address when set, else Spark's).
        """
        return self.getOrDefault(self.advertiseAddress)


class HasPortRange(Params):
    """The fit setting port_range as the Param portRange."""

    portRange = Param(
        Params._dummy(),
        "portRange",
        "the ports those servers may take, 'FIRST-LAST' (None: "
        "spark.allreduce.portRange, else any free port); allow one per task on each "
        "executor, and one for the driver",
        typeConverter=TypeConverters.toString,
    )

    def getPortRange(self) -> str | None:
        """The value of portRange: the ports those servers may take, 'FIRST-LAST' (None:
        spark.allreduce.portRange, else any free port); allow one per task on each executor,
        and one for the driver.
        """
        return self.getOrDefault(self.portRange)


class HasConnectTimeout(Params):
    """The fit setting connect_timeout as the Param connectTimeout."""

    connectTimeout = Param(
        Params._dummy(),
        "connectTimeout",
        "seconds a connection and its handshake may take (None: "
        "spark.allreduce.connectTimeout, else 10); the meeting at the driver waits 3 "
        "times this for the last task",
        typeConverter=TypeConverters.toFloat,
    )

    def getConnectTimeout(self) -> float | None:
        """The value of connectTimeout: seconds a connection and its handshake may take (None:
        spark.allreduce.connectTimeout, else 10); the meeting at the driver waits 3 times
        this for the last task.
        """
        return self.getOrDefault(self.connectTimeout)


class HasEncrypt(Params):
    """The fit setting encrypt as the Param encrypt."""

    encrypt = Param(
        Params._dummy(),
        "encrypt",
        "encrypt the traffic that goes over TCP: blocks between workers on different "
        "hosts, and the workers' messages to the driver (None: "
        "spark.allreduce.encrypt, else on where spark.network.crypto.enabled or "
        "spark.ssl.enabled is true; same-host Unix sockets and shared memory never "
        "are)",
        typeConverter=TypeConverters.toBoolean,
    )

    def getEncrypt(self) -> bool | None:
        """The value of encrypt: encrypt the traffic that goes over TCP: blocks between workers
        on different hosts, and the workers' messages to the driver (None:
        spark.allreduce.encrypt, else on where spark.network.crypto.enabled or
        spark.ssl.enabled is true; same-host Unix sockets and shared memory never are).
        """
        return self.getOrDefault(self.encrypt)


class HasTopology(Params):
    """The fit setting topology as the Param topology."""

    topology = Param(
        Params._dummy(),
        "topology",
        "how partitions on several hosts sync: 'hierarchical' (each host sums its "
        "partitions in shared memory and one partition per host exchanges with the "
        "other hosts', so connections and each host's traffic grow with the hosts, "
        "not the partitions; plain BSP only), 'flat' (every partition with every "
        "other) or 'auto' (hierarchical under plain BSP on several hosts one of which"
        " has several partitions, else flat); a lossless codec gives the same weights"
        " either way",
        typeConverter=TypeConverters.toString,
    )

    def getTopology(self) -> str:
        """The value of topology: how partitions on several hosts sync: 'hierarchical' (each
        host sums its partitions in shared memory and one partition per host exchanges with
        the other hosts', so connections and each host's traffic grow with the hosts, not
        the partitions; plain BSP only), 'flat' (every partition with every other) or 'auto'
        (hierarchical under plain BSP on several hosts one of which has several partitions,
        else flat); a lossless codec gives the same weights either way.
        """
        return self.getOrDefault(self.topology)


class HasFetchThreads(Params):
    """The fit setting fetch_threads as the Param fetchThreads."""

    fetchThreads = Param(
        Params._dummy(),
        "fetchThreads",
        "how many peers each worker fetches blocks from at once (None: the engine's "
        "default, 16, or every peer when there are fewer); the others queue",
        typeConverter=TypeConverters.toInt,
    )

    def getFetchThreads(self) -> int | None:
        """The value of fetchThreads: how many peers each worker fetches blocks from at once
        (None: the engine's default, 16, or every peer when there are fewer); the others
        queue.
        """
        return self.getOrDefault(self.fetchThreads)


class HasGpusPerTask(Params):
    """The fit setting gpus_per_task as the Param gpusPerTask."""

    gpusPerTask = Param(
        Params._dummy(),
        "gpusPerTask",
        "GPUs each task of the fit's stage is assigned (a fraction <= 0.5 shares one "
        "GPU between tasks): the stage asks Spark for them with a stage-level "
        "resource profile, or the session's spark.task.resource.gpu.amount gives them"
        " (None: what the session gives); a TorchModel runs on its task's GPU",
        typeConverter=TypeConverters.toFloat,
    )

    def getGpusPerTask(self) -> float | None:
        """The value of gpusPerTask: GPUs each task of the fit's stage is assigned (a fraction
        <= 0.5 shares one GPU between tasks): the stage asks Spark for them with a
        stage-level resource profile, or the session's spark.task.resource.gpu.amount gives
        them (None: what the session gives); a TorchModel runs on its task's GPU.
        """
        return self.getOrDefault(self.gpusPerTask)


class HasEarlyStoppingPatience(Params):
    """The fit setting early_stopping_patience as the Param earlyStoppingPatience."""

    earlyStoppingPatience = Param(
        Params._dummy(),
        "earlyStoppingPatience",
        "stop once the validation loss has not improved for this many epochs, and "
        "keep the best epoch's weights (needs validation data; None: train every "
        "epoch)",
        typeConverter=TypeConverters.toInt,
    )

    def getEarlyStoppingPatience(self) -> int | None:
        """The value of earlyStoppingPatience: stop once the validation loss has not improved
        for this many epochs, and keep the best epoch's weights (needs validation data;
        None: train every epoch).
        """
        return self.getOrDefault(self.earlyStoppingPatience)


class HasEarlyStoppingMinDelta(Params):
    """The fit setting early_stopping_min_delta as the Param earlyStoppingMinDelta."""

    earlyStoppingMinDelta = Param(
        Params._dummy(),
        "earlyStoppingMinDelta",
        "how much lower than the best so far a validation loss must be to count as an improvement",
        typeConverter=TypeConverters.toFloat,
    )

    def getEarlyStoppingMinDelta(self) -> float:
        """The value of earlyStoppingMinDelta: how much lower than the best so far a validation
        loss must be to count as an improvement.
        """
        return self.getOrDefault(self.earlyStoppingMinDelta)


class HasRegParam(Params):
    """The fit setting reg_param as the Param regParam."""

    regParam = Param(
        Params._dummy(),
        "regParam",
        "the regularisation's strength, as MLlib's regParam: the objective is the "
        "mean loss + regParam * ((1 - elasticNetParam) / 2 * sum(w^2) + "
        "elasticNetParam * sum(abs(w))), over the weights, never the intercepts (0: "
        "none)",
        typeConverter=TypeConverters.toFloat,
    )

    def getRegParam(self) -> float:
        """The value of regParam: the regularisation's strength, as MLlib's regParam: the
        objective is the mean loss + regParam * ((1 - elasticNetParam) / 2 * sum(w^2) +
        elasticNetParam * sum(abs(w))), over the weights, never the intercepts (0: none).
        """
        return self.getOrDefault(self.regParam)


class HasElasticNetParam(Params):
    """The fit setting elastic_net_param as the Param elasticNetParam."""

    elasticNetParam = Param(
        Params._dummy(),
        "elasticNetParam",
        "the L1 share of the regularisation, in [0, 1], as MLlib's elasticNetParam: 0"
        " is L2 (ridge, through the optimizer), 1 is L1 (lasso, a proximal step after"
        " each update: coefficients it outweighs become exactly 0)",
        typeConverter=TypeConverters.toFloat,
    )

    def getElasticNetParam(self) -> float:
        """The value of elasticNetParam: the L1 share of the regularisation, in [0, 1], as
        MLlib's elasticNetParam: 0 is L2 (ridge, through the optimizer), 1 is L1 (lasso, a
        proximal step after each update: coefficients it outweighs become exactly 0).
        """
        return self.getOrDefault(self.elasticNetParam)


class HasStandardization(Params):
    """The fit setting standardization as the Param standardization."""

    standardization = Param(
        Params._dummy(),
        "standardization",
        "as MLlib's standardization: penalise each first-layer weight in proportion "
        "to its feature's standard deviation over the training rows (the L1 part by "
        "std, the L2 part by std^2), which is MLlib's penalty on the coefficients of "
        "standardized features; a feature of std 0 keeps its weights at 0. False: the"
        " weights as they are",
        typeConverter=TypeConverters.toBoolean,
    )

    def getStandardization(self) -> bool:
        """The value of standardization: as MLlib's standardization: penalise each first-layer
        weight in proportion to its feature's standard deviation over the training rows (the
        L1 part by std, the L2 part by std^2), which is MLlib's penalty on the coefficients
        of standardized features; a feature of std 0 keeps its weights at 0. False: the
        weights as they are.
        """
        return self.getOrDefault(self.standardization)


class HasFitIntercept(Params):
    """The fit setting fit_intercept as the Param fitIntercept."""

    fitIntercept = Param(
        Params._dummy(),
        "fitIntercept",
        "train the intercepts (the biases); False holds every one at 0, as MLlib's fitIntercept",
        typeConverter=TypeConverters.toBoolean,
    )

    def getFitIntercept(self) -> bool:
        """The value of fitIntercept: train the intercepts (the biases); False holds every one
        at 0, as MLlib's fitIntercept.
        """
        return self.getOrDefault(self.fitIntercept)


class HasSparseSync(Params):
    """The fit setting sparse_sync as the Param sparseSync."""

    sparseSync = Param(
        Params._dummy(),
        "sparseSync",
        "how a fit on sparse rows syncs its gradients: 'touched' (only the elements a"
        " step's rows touch: the first layer's rows of the columns they hold, and "
        "every layer after it; plain BSP, a lossless codec, one thread, a flat "
        "topology), 'dense' (every element) or 'auto' (touched where it can and the "
        "first layer is wide, see docs/performance.md); the same weights, bit for "
        "bit, either way",
        typeConverter=TypeConverters.toString,
    )

    def getSparseSync(self) -> str:
        """The value of sparseSync: how a fit on sparse rows syncs its gradients: 'touched'
        (only the elements a step's rows touch: the first layer's rows of the columns they
        hold, and every layer after it; plain BSP, a lossless codec, one thread, a flat
        topology), 'dense' (every element) or 'auto' (touched where it can and the first
        layer is wide, see docs/performance.md); the same weights, bit for bit, either way.
        """
        return self.getOrDefault(self.sparseSync)


class HasSolver(Params):
    """The fit setting solver as the Param solver."""

    solver = Param(
        Params._dummy(),
        "solver",
        "how the fit minimises: 'minibatch' (the optimizer's steps over batches, "
        "every setting here) or 'lbfgs' (full-batch L-BFGS, OWL-QN with an L1 part, "
        "on a built-in LinearRegression, LogisticRegression or SoftmaxRegression: the"
        " minimiser of its mean loss plus regularization, as MLlib's, to max_iter and"
        " tol; see docs/linear.md)",
        typeConverter=TypeConverters.toString,
    )

    def getSolver(self) -> str:
        """The value of solver: how the fit minimises: 'minibatch' (the optimizer's steps over
        batches, every setting here) or 'lbfgs' (full-batch L-BFGS, OWL-QN with an L1 part,
        on a built-in LinearRegression, LogisticRegression or SoftmaxRegression: the
        minimiser of its mean loss plus regularization, as MLlib's, to max_iter and tol; see
        docs/linear.md).
        """
        return self.getOrDefault(self.solver)


class HasMaxIter(Params):
    """The fit setting max_iter as the Param maxIter."""

    maxIter = Param(
        Params._dummy(),
        "maxIter",
        "solver='lbfgs': the most L-BFGS iterations (MLlib's maxIter)",
        typeConverter=TypeConverters.toInt,
    )

    def getMaxIter(self) -> int:
        """The value of maxIter: solver='lbfgs': the most L-BFGS iterations (MLlib's maxIter)."""
        return self.getOrDefault(self.maxIter)


class HasTol(Params):
    """The fit setting tol as the Param tol."""

    tol = Param(
        Params._dummy(),
        "tol",
        "solver='lbfgs': stop once the objective's relative change is below tol (MLlib's rule)",
        typeConverter=TypeConverters.toFloat,
    )

    def getTol(self) -> float:
        """The value of tol: solver='lbfgs': stop once the objective's relative change is below
        tol (MLlib's rule).
        """
        return self.getOrDefault(self.tol)


class FitSettingParams(
    HasBatchSize,
    HasMaxEpochs,
    HasCodec,
    HasGradientCodec,
    HasNumWorkers,
    HasSeed,
    HasTimeout,
    HasShowProgress,
    HasLogPath,
    HasTensorboardDir,
    HasTracking,
    HasStrategy,
    HasStaleness,
    HasBackupWorkers,
    HasSyncEvery,
    HasModelAveraging,
    HasPartitionScheme,
    HasCheckpointDir,
    HasCheckpointEvery,
    HasCheckpointKeep,
    HasKeepOptimizerState,
    HasVerbose,
    HasOverlap,
    HasDataIn,
    HasBindAddress,
    HasAdvertiseAddress,
    HasPortRange,
    HasConnectTimeout,
    HasEncrypt,
    HasTopology,
    HasFetchThreads,
    HasGpusPerTask,
    HasEarlyStoppingPatience,
    HasEarlyStoppingMinDelta,
    HasRegParam,
    HasElasticNetParam,
    HasStandardization,
    HasFitIntercept,
    HasSparseSync,
    HasSolver,
    HasMaxIter,
    HasTol,
):
    """Every fit setting's Param and its getter: the Estimators and their Models have them."""


class FitSettingSetters(Params):
    """Every fit setting's setter: the Estimators have them."""

    def setBatchSize(self, value: int) -> Any:
        """Set batchSize: the global batch of a step, split over the workers by their share of
        the rows.
        """
        return self._set(batchSize=value)

    def setMaxEpochs(self, value: int) -> Any:
        """Set maxEpochs: passes over the training rows."""
        return self._set(maxEpochs=value)

    def setCodec(self, value: str) -> Any:
        """Set codec: how blocks travel between the workers: lz4, raw, bf16, fp16, int8, ..."""
        return self._set(codec=value)

    def setGradientCodec(self, value: str | None) -> Any:
        """Set gradientCodec: another codec for the gradients alone, e.g. topk (None: codec)."""
        return self._set(gradientCodec=value)

    def setNumWorkers(self, value: int | None) -> Any:
        """Set numWorkers: partitions that train (None: one per partition of the data, up to
        Spark's task slots).
        """
        return self._set(numWorkers=value)

    def setSeed(self, value: int) -> Any:
        """Set seed: the seed of the initial weights and the shuffles: the same seed, the same
        fit.
        """
        return self._set(seed=value)

    def setTimeout(self, value: float) -> Any:
        """Set timeout: seconds a worker waits for a peer before the fit fails."""
        return self._set(timeout=value)

    def setShowProgress(self, value: bool) -> Any:
        """Set showProgress: show the fit's live progress bar."""
        return self._set(showProgress=value)

    def setLogPath(self, value: str | None) -> Any:
        """Set logPath: a file to append each step and epoch to, as JSON lines."""
        return self._set(logPath=value)

    def setTensorboardDir(self, value: str | None) -> Any:
        """Set tensorboardDir: a folder to write the fit's scalars to as TensorBoard event
        files while it runs (each step's loss and samples/s, the learning rate, each epoch's
        metrics), one run folder per fit; needs tensorboardX: pip install
        'allreduce-param[tensorboard]' (None: none).
        """
        return self._set(tensorboardDir=value)

    def setTracking(self, value: bool | None) -> Any:
        """Set tracking: log the fit to MLflow (its settings, metrics, history and model): True
        logs it into the active run or a new one, False never, None as
        allreduce_param.integrations.mlflow.autolog() says; needs pip install
        'allreduce-param[mlflow]'.
        """
        return self._set(tracking=value)

    def setStrategy(self, value: str) -> Any:
        """Set strategy: how the workers synchronise: bsp, ssp or asp."""
        return self._set(strategy=value)

    def setStaleness(self, value: int | None) -> Any:
        """Set staleness: ssp: how many steps a worker may run ahead of the slowest."""
        return self._set(staleness=value)

    def setBackupWorkers(self, value: int) -> Any:
        """Set backupWorkers: bsp: a step goes on without the slowest b workers' gradients."""
        return self._set(backupWorkers=value)

    def setSyncEvery(self, value: Any) -> Any:
        """Set syncEvery: local SGD: train k steps between syncs, or 'epoch' (1: sync every
        step).
        """
        return self._set(syncEvery=value)

    def setModelAveraging(self, value: bool | None) -> Any:
        """Set modelAveraging: local SGD: average the models (True) or sum their updates."""
        return self._set(modelAveraging=value)

    def setPartitionScheme(self, value: str) -> Any:
        """Set partitionScheme: which rows each worker trains on: as_is, contiguous,
        round_robin, random, overlap_reshuffle.
        """
        return self._set(partitionScheme=value)

    def setCheckpointDir(self, value: str | None) -> Any:
        """Set checkpointDir: where the fit writes checkpoints (storage every executor sees)."""
        return self._set(checkpointDir=value)

    def setCheckpointEvery(self, value: Any) -> Any:
        """Set checkpointEvery: checkpoint every k steps or 'epoch' (None: each epoch)."""
        return self._set(checkpointEvery=value)

    def setCheckpointKeep(self, value: int) -> Any:
        """Set checkpointKeep: how many of the newest checkpoints to keep."""
        return self._set(checkpointKeep=value)

    def setKeepOptimizerState(self, value: bool) -> Any:
        """Set keepOptimizerState: keep the optimizer's state (Adam's moments, ...) with the
        trained model, saved with it, and continue from the initial model's in a fit from
        one (fit(initial=...), initialModel), which must hold it: training goes on exactly
        as one longer fit would. False: the model holds none, and a fit from one starts the
        optimizer afresh.
        """
        return self._set(keepOptimizerState=value)

    def setVerbose(self, value: bool) -> Any:
        """Set verbose: print where the fit's time went when it ends."""
        return self._set(verbose=value)

    def setOverlap(self, value: Any) -> Any:
        """Set overlap: send each chunk of a gradient while backward computes the rest: True,
        False or 'auto'.
        """
        return self._set(overlap=value)

    def setDataIn(self, value: str) -> Any:
        """Set dataIn: where a task keeps its partition's rows while it trains: 'memory',
        'disk' (row files in spark.local.dir, read a block at a time: partitions larger than
        memory) or 'auto' (memory where 1.5x the partition's rows fit what the worker may
        use: spark.executor.pyspark.memory, or without it its share of the machine's
        available memory).
        """
        return self._set(dataIn=value)

    def setBindAddress(self, value: str | None) -> Any:
        """Set bindAddress: where the workers' block servers and the driver's message server
        listen (None: the Spark setting spark.allreduce.bindAddress, else the address Spark
        gives each process; one address, never every interface).
        """
        return self._set(bindAddress=value)

    def setAdvertiseAddress(self, value: str | None) -> Any:
        """Set advertiseAddress: the address the others are told to connect to (None:
        spark.allreduce.advertiseAddress, else the bind address when set, else Spark's).
        """
        return self._set(advertiseAddress=value)

    def setPortRange(self, value: str | None) -> Any:
        """Set portRange: the ports those servers may take, 'FIRST-LAST' (None:
        spark.allreduce.portRange, else any free port); allow one per task on each executor,
        and one for the driver.
        """
        return self._set(portRange=value)

    def setConnectTimeout(self, value: float | None) -> Any:
        """Set connectTimeout: seconds a connection and its handshake may take (None:
        spark.allreduce.connectTimeout, else 10); the meeting at the driver waits 3 times
        this for the last task.
        """
        return self._set(connectTimeout=value)

    def setEncrypt(self, value: bool | None) -> Any:
        """Set encrypt: encrypt the traffic that goes over TCP: blocks between workers on
        different hosts, and the workers' messages to the driver (None:
        spark.allreduce.encrypt, else on where spark.network.crypto.enabled or
        spark.ssl.enabled is true; same-host Unix sockets and shared memory never are).
        """
        return self._set(encrypt=value)

    def setTopology(self, value: str) -> Any:
        """Set topology: how partitions on several hosts sync: 'hierarchical' (each host sums
        its partitions in shared memory and one partition per host exchanges with the other
        hosts', so connections and each host's traffic grow with the hosts, not the
        partitions; plain BSP only), 'flat' (every partition with every other) or 'auto'
        (hierarchical under plain BSP on several hosts one of which has several partitions,
        else flat); a lossless codec gives the same weights either way.
        """
        return self._set(topology=value)

    def setFetchThreads(self, value: int | None) -> Any:
        """Set fetchThreads: how many peers each worker fetches blocks from at once (None: the
        engine's default, 16, or every peer when there are fewer); the others queue.
        """
        return self._set(fetchThreads=value)

    def setGpusPerTask(self, value: float | None) -> Any:
        """Set gpusPerTask: GPUs each task of the fit's stage is assigned (a fraction <= 0.5
        shares one GPU between tasks): the stage asks Spark for them with a stage-level
        resource profile, or the session's spark.task.resource.gpu.amount gives them (None:
        what the session gives); a TorchModel runs on its task's GPU.
        """
        return self._set(gpusPerTask=value)

    def setEarlyStoppingPatience(self, value: int | None) -> Any:
        """Set earlyStoppingPatience: stop once the validation loss has not improved for this
        many epochs, and keep the best epoch's weights (needs validation data; None: train
        every epoch).
        """
        return self._set(earlyStoppingPatience=value)

    def setEarlyStoppingMinDelta(self, value: float) -> Any:
        """Set earlyStoppingMinDelta: how much lower than the best so far a validation loss
        must be to count as an improvement.
        """
        return self._set(earlyStoppingMinDelta=value)

    def setRegParam(self, value: float) -> Any:
        """Set regParam: the regularisation's strength, as MLlib's regParam: the objective is
        the mean loss + regParam * ((1 - elasticNetParam) / 2 * sum(w^2) + elasticNetParam *
        sum(abs(w))), over the weights, never the intercepts (0: none).
        """
        return self._set(regParam=value)

    def setElasticNetParam(self, value: float) -> Any:
        """Set elasticNetParam: the L1 share of the regularisation, in [0, 1], as MLlib's
        elasticNetParam: 0 is L2 (ridge, through the optimizer), 1 is L1 (lasso, a proximal
        step after each update: coefficients it outweighs become exactly 0).
        """
        return self._set(elasticNetParam=value)

    def setStandardization(self, value: bool) -> Any:
        """Set standardization: as MLlib's standardization: penalise each first-layer weight in
        proportion to its feature's standard deviation over the training rows (the L1 part
        by std, the L2 part by std^2), which is MLlib's penalty on the coefficients of
        standardized features; a feature of std 0 keeps its weights at 0. False: the weights
        as they are.
        """
        return self._set(standardization=value)

    def setFitIntercept(self, value: bool) -> Any:
        """Set fitIntercept: train the intercepts (the biases); False holds every one at 0, as
        MLlib's fitIntercept.
        """
        return self._set(fitIntercept=value)

    def setSparseSync(self, value: str) -> Any:
        """Set sparseSync: how a fit on sparse rows syncs its gradients: 'touched' (only the
        elements a step's rows touch: the first layer's rows of the columns they hold, and
        every layer after it; plain BSP, a lossless codec, one thread, a flat topology),
        'dense' (every element) or 'auto' (touched where it can and the first layer is wide,
        see docs/performance.md); the same weights, bit for bit, either way.
        """
        return self._set(sparseSync=value)

    def setSolver(self, value: str) -> Any:
        """Set solver: how the fit minimises: 'minibatch' (the optimizer's steps over batches,
        every setting here) or 'lbfgs' (full-batch L-BFGS, OWL-QN with an L1 part, on a
        built-in LinearRegression, LogisticRegression or SoftmaxRegression: the minimiser of
        its mean loss plus regularization, as MLlib's, to max_iter and tol; see
        docs/linear.md).
        """
        return self._set(solver=value)

    def setMaxIter(self, value: int) -> Any:
        """Set maxIter: solver='lbfgs': the most L-BFGS iterations (MLlib's maxIter)."""
        return self._set(maxIter=value)

    def setTol(self, value: float) -> Any:
        """Set tol: solver='lbfgs': stop once the objective's relative change is below tol
        (MLlib's rule).
        """
        return self._set(tol=value)
