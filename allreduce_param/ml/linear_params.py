"""MLlib's Params of ``LogisticRegression`` and ``LinearRegression``, as MLlib declares them
(pyspark's own declarations: the same names, defaults and documentation), what this project
does not support among them (refused by name when set, never ignored), and the problem they
describe for the solver (``models.glm.GlmProblem``).

``aggregationDepth`` is accepted and means nothing here: MLlib sums each iteration's
gradient up a tree of that depth towards the driver; here the partitions sum it among
themselves (the engine's allreduce) and the driver takes no part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pyspark.ml.classification import _LogisticRegressionParams
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.regression import _LinearRegressionParams

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.ml.labels import inferred_class_count
from allreduce_param.ml_params import (
    HasCheckpointDir,
    HasCheckpointEvery,
    HasCheckpointKeep,
    HasDataIn,
)
from allreduce_param.train.settings import FLAT

#: MLlib's bound on the features its normal equations take (WeightedLeastSquares.MAX_NUM_FEATURES).
NORMAL_MAX_FEATURES = 4096

_AGGREGATION_DEPTH_DOC = (
    "accepted for MLlib's sake and ignored: MLlib sums each iteration's gradient up a tree of "
    "this depth to the driver; here the partitions sum it among themselves (allreduce), so no "
    "depth applies (>= 2)"
)
_BLOCK_SIZE_DOC = (
    "MLlib's stacking of rows into blocks of this many MB (0.0: auto); only the default 0.0 "
    "is accepted here: each partition computes over all its rows at once"
)

_TENSORBOARD_DOC = (
    "a folder to write the fit's objective by iteration to as TensorBoard event files, one "
    "run folder per fit; needs tensorboardX: pip install 'allreduce-param[tensorboard]' "
    "(unset: none). Not one of MLlib's Params"
)

#: The Params refused when set, with what to do instead; ``maxBlockSizeInMB`` only at a value
#: other than its default, ``loss`` only as "huber" (see ``refuse_unsupported``).
_REFUSED = {
    "lowerBoundsOnCoefficients": "bound-constrained optimization (L-BFGS-B) is not supported",
    "upperBoundsOnCoefficients": "bound-constrained optimization (L-BFGS-B) is not supported",
    "lowerBoundsOnIntercepts": "bound-constrained optimization (L-BFGS-B) is not supported",
    "upperBoundsOnIntercepts": "bound-constrained optimization (L-BFGS-B) is not supported",
}


class LinearFitSettingParams(HasCheckpointDir, HasCheckpointEvery, HasCheckpointKeep, HasDataIn):
    """The project's own Params the linear models share with its other Estimators, with the
    same meanings and defaults: ``checkpointDir`` (None: no checkpoints), ``checkpointEvery``
    (iterations here; None or "epoch": each iteration, as each passes over every row),
    ``checkpointKeep`` and ``dataIn`` ("memory", "disk", "auto"); and ``resumeFrom``,
    ``DistriOptimizer.fit``'s ``resume_from`` as a Param."""

    resumeFrom = Param(
        Params._dummy(),
        "resumeFrom",
        "a checkpoint of a fit of the same problem (its step-... folder, or a fit-... folder: "
        "its newest intact one) to continue from, e.g. after a fit that failed in every run "
        "(unset: from the start). Not one of MLlib's Params",
        typeConverter=TypeConverters.toString,
    )

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._setDefault(
            checkpointDir=FLAT["checkpoint_dir"].default,
            checkpointEvery=FLAT["checkpoint_every"].default,
            checkpointKeep=FLAT["checkpoint_keep"].default,
            dataIn="auto",
        )


class LogisticRegressionParams(_LogisticRegressionParams, LinearFitSettingParams):
    """``LogisticRegression``'s and its Model's Params: MLlib's, with ``aggregationDepth``'s
    and ``maxBlockSizeInMB``'s documentation saying what they mean here, and this project's
    ``tensorboardDir``."""

    aggregationDepth = Param(
        Params._dummy(), "aggregationDepth", _AGGREGATION_DEPTH_DOC, TypeConverters.toInt
    )
    maxBlockSizeInMB = Param(
        Params._dummy(), "maxBlockSizeInMB", _BLOCK_SIZE_DOC, TypeConverters.toFloat
    )
    tensorboardDir = Param(
        Params._dummy(), "tensorboardDir", _TENSORBOARD_DOC, TypeConverters.toString
    )


class LinearRegressionParams(_LinearRegressionParams, LinearFitSettingParams):
    """``LinearRegression``'s and its Model's Params: MLlib's, with ``aggregationDepth``'s
    and ``maxBlockSizeInMB``'s documentation saying what they mean here, and this project's
    ``tensorboardDir``."""

    aggregationDepth = Param(
        Params._dummy(), "aggregationDepth", _AGGREGATION_DEPTH_DOC, TypeConverters.toInt
    )
    maxBlockSizeInMB = Param(
        Params._dummy(), "maxBlockSizeInMB", _BLOCK_SIZE_DOC, TypeConverters.toFloat
    )
    tensorboardDir = Param(
        Params._dummy(), "tensorboardDir", _TENSORBOARD_DOC, TypeConverters.toString
    )


def refuse_unsupported(stage: Params) -> None:
    """A ``ConfigurationError`` naming the first Param ``stage`` sets that this project does
    not support (MLlib's bounds on coefficients and intercepts, ``maxBlockSizeInMB`` other
    than 0.0, ``loss="huber"``), and what to do; checked before any Spark job."""
    where = type(stage).__name__
    for name, why in _REFUSED.items():
        if stage.hasParam(name) and stage.isSet(stage.getParam(name)):
            raise ConfigurationError(
                f"{where}: {name} is set, and {why} here; clear it "
                f"({where.lower()}.clear({where.lower()}.{name})) or fit with "
                f"pyspark.ml's {where}"
            )
    if stage.getOrDefault(stage.getParam("maxBlockSizeInMB")) != 0.0:
        raise ConfigurationError(
            f"{where}: maxBlockSizeInMB={stage.getOrDefault(stage.getParam('maxBlockSizeInMB'))} "
            "is not supported (each partition computes over all its rows at once); leave it at "
            "0.0"
        )
    if stage.hasParam("loss") and stage.getOrDefault(stage.getParam("loss")) != "squaredError":
        raise ConfigurationError(
            f"{where}: loss={stage.getOrDefault(stage.getParam('loss'))!r} is not supported "
            "(only 'squaredError': the huber loss is not built); set loss='squaredError' or fit "
            "with pyspark.ml's LinearRegression"
        )
    depth = stage.getOrDefault(stage.getParam("aggregationDepth"))
    if depth < 2:
        raise ConfigurationError(f"{where}: aggregationDepth={depth} must be >= 2, as in MLlib")


def common_problem(stage: Params) -> dict[str, Any]:
    """The ``GlmProblem`` fields every linear model's Params give (MLlib's meanings)."""
    return {
        "fit_intercept": stage.getOrDefault(stage.getParam("fitIntercept")),
        "reg_param": stage.getOrDefault(stage.getParam("regParam")),
        "elastic_net_param": stage.getOrDefault(stage.getParam("elasticNetParam")),
        "standardization": stage.getOrDefault(stage.getParam("standardization")),
        "max_iter": stage.getOrDefault(stage.getParam("maxIter")),
        "tol": stage.getOrDefault(stage.getParam("tol")),
    }


def linear_solver(solver: str, num_features: int) -> str:
    """``LinearRegression``'s ``solver`` as MLlib resolves it: ``"auto"`` takes the normal
    equations for at most ``NORMAL_MAX_FEATURES`` features (MLlib's WeightedLeastSquares,
    which handles an L1 part itself), else L-BFGS (OWL-QN with an L1 part); ``"normal"`` over
    more features is refused, as MLlib refuses it."""
    if solver == "auto":
        return "normal" if num_features <= NORMAL_MAX_FEATURES else "l-bfgs"
    if solver == "normal" and num_features > NORMAL_MAX_FEATURES:
        raise InputError(
            f"LinearRegression: solver='normal' takes at most {NORMAL_MAX_FEATURES} features "
            f"(the normal equations' matrix is features x features); the data has "
            f"{num_features}: set solver='l-bfgs' or 'auto'"
        )
    if solver not in ("normal", "l-bfgs"):
        raise ConfigurationError(
            f"LinearRegression: solver={solver!r} is not one of 'auto', 'normal', 'l-bfgs'"
        )
    return solver


def class_count(
    label_metadata: dict, labels: tuple | None, largest: float | None, label_col: str
) -> int:
    """The number of classes MLlib would use for a logistic regression: the label column's
    metadata (``StringIndexer``'s ``num_vals`` or ``vals``) where it says, else the largest
    label + 1 (``labels``: the distinct labels the data checks found, or ``largest``)."""
    told = told_classes(label_metadata)
    if told is not None:
        return told
    top = max(labels) if labels else largest
    if top is None:
        raise InputError("LogisticRegression: the training data has no labels")
    return inferred_class_count(top, label_col)


def told_classes(label_metadata: dict) -> int | None:
    """The number of classes a label column's ML metadata says (``StringIndexer``'s
    ``num_vals`` or ``vals``), or None where it says none."""
    told = label_metadata.get("num_vals") or (
        len(label_metadata["vals"]) if "vals" in label_metadata else None
    )
    return None if told is None else int(told)


def logistic_family(family: str, num_classes: int) -> str:
    """``family`` as MLlib resolves it: ``"auto"`` is binomial for 1 or 2 classes, else
    multinomial; ``"binomial"`` over more than 2 classes is refused, as MLlib refuses it."""
    family = family.lower()
    if family not in ("auto", "binomial", "multinomial"):
        raise ConfigurationError(
            f"LogisticRegression: family={family!r} is not one of 'auto', 'binomial', 'multinomial'"
        )
    if family == "binomial" and num_classes > 2:
        raise InputError(
            f"LogisticRegression: family='binomial' takes 1 or 2 outcome classes, but the label "
            f"has {num_classes}; set family='multinomial' (or 'auto')"
        )
    if family == "auto":
        return "binomial" if num_classes <= 2 else "multinomial"
    return family


class LinearSetters(Params):
    """The setters ``LogisticRegression`` and ``LinearRegression`` share, as MLlib's: each sets
    its Param and returns the stage; ``setParams`` sets any by name."""

    def setParams(self, **params: Any):
        """Set Params by name (any of ``explainParams()``'s), e.g. ``setParams(regParam=0.1)``."""
        return set_by_name(self, params)

    def setMaxIter(self, value: int):
        """Set ``maxIter``: the most iterations of the solver."""
        return self._set(maxIter=value)

    def setRegParam(self, value: float):
        """Set ``regParam``: the regularization's strength (>= 0)."""
        return self._set(regParam=value)

    def setElasticNetParam(self, value: float):
        """Set ``elasticNetParam``: the L1 share of the penalty, in [0, 1]."""
        return self._set(elasticNetParam=value)

    def setTol(self, value: float):
        """Set ``tol``: the convergence tolerance of the iterations."""
        return self._set(tol=value)

    def setFitIntercept(self, value: bool):
        """Set ``fitIntercept``: whether to fit an intercept."""
        return self._set(fitIntercept=value)

    def setStandardization(self, value: bool):
        """Set ``standardization``: whether to train on standardized features."""
        return self._set(standardization=value)

    def setWeightCol(self, value: str):
        """Set ``weightCol``: the column of instance weights ("" or unset: all 1.0)."""
        return self._set(weightCol=value)

    def setAggregationDepth(self, value: int):
        """Set ``aggregationDepth`` (accepted and ignored here: see its documentation)."""
        return self._set(aggregationDepth=value)

    def setMaxBlockSizeInMB(self, value: float):
        """Set ``maxBlockSizeInMB`` (only 0.0 is accepted at fit)."""
        return self._set(maxBlockSizeInMB=value)

    def setCheckpointDir(self, value: str | None):
        """Set ``checkpointDir``: where the fit writes checkpoints (storage every executor sees;
        each fit in a new folder under it), which a stage run again after a lost task resumes
        from; None: no checkpoints."""
        return self._set(checkpointDir=value)

    def setCheckpointEvery(self, value: Any):
        """Set ``checkpointEvery``: a checkpoint every that many iterations (None or "epoch":
        each iteration)."""
        return self._set(checkpointEvery=value)

    def setCheckpointKeep(self, value: int):
        """Set ``checkpointKeep``: how many of the newest checkpoints stay."""
        return self._set(checkpointKeep=value)

    def setResumeFrom(self, value: str | None):
        """Set ``resumeFrom``: a checkpoint of this problem's fit to continue from (its
        folder, or its fit's folder: the newest intact one); None: from the start."""
        return self._set(resumeFrom=value)

    def getResumeFrom(self) -> str | None:
        """The checkpoint the fit continues from (None: from the start)."""
        resume = self.getParam("resumeFrom")
        return self.getOrDefault(resume) if self.isDefined(resume) else None

    def setDataIn(self, value: str):
        """Set ``dataIn``: where a task keeps its partition's rows while it solves: "memory",
        "disk" (row files in spark.local.dir, read in blocks each iteration) or "auto"."""
        return self._set(dataIn=value)

    def fit_options(self) -> dict[str, Any]:
        """``fit_glm``'s ``checkpoints`` (a ``Checkpoints``, None without ``checkpointDir``),
        ``data_in`` and ``resume_from``, from these Params, checked; their errors name the
        Params."""
        data_in = self.getOrDefault(self.getParam("dataIn"))
        if data_in not in ("memory", "disk", "auto"):
            raise ConfigurationError(
                f"{type(self).__name__}: dataIn must be 'memory', 'disk' or 'auto', got {data_in!r}"
            )
        options = {"data_in": data_in, "resume_from": self.getResumeFrom() or None}
        directory = self.getOrDefault(self.getParam("checkpointDir"))
        if not directory:
            return {"checkpoints": None, **options}
        from allreduce_param.train.checkpoint import Checkpoints

        try:
            return {
                **options,
                "checkpoints": Checkpoints(
                    directory,
                    self.getOrDefault(self.getParam("checkpointEvery")),
                    self.getOrDefault(self.getParam("checkpointKeep")),
                ),
            }
        except ConfigurationError as error:
            named = str(error)
            for flat, param in (
                ("checkpoint_dir", "checkpointDir"),
                ("checkpoint_every", "checkpointEvery"),
                ("checkpoint_keep", "checkpointKeep"),
            ):
                named = named.replace(flat, param)
            raise ConfigurationError(f"{type(self).__name__}: {named}") from error

    def setTensorboardDir(self, value: str):
        """Set ``tensorboardDir``: where the fit writes its objective as TensorBoard events."""
        return self._set(tensorboardDir=value)

    def tensorboard_directory(self) -> str | None:
        """The ``tensorboardDir`` to write to, or None where it is unset or empty."""
        folder = self.getParam("tensorboardDir")
        return (
            self.getOrDefault(folder)
            if self.isDefined(folder) and self.getOrDefault(folder)
            else None
        )

    def _solve(self, dataset, classify: bool, problem_for, **options):
        """``fit_glm``'s solution on ``dataset`` by these Params (``problem_for(facts)``: the
        problem from the data's ``glm_start.GlmFacts``; ``options``: more of ``fit_glm``'s), watched
        as every fit (MLflow's autolog, one child run per fit under CrossValidator;
        ``tensorboardDir``), its errors naming ``resumeFrom`` as the user set it."""
        from allreduce_param.train.driver.lbfgs_fit import estimator_watch, watched_fit_glm

        columns = (self.getFeaturesCol(), self.getLabelCol(), self.weight_column())
        with resume_named(self):
            solution, _ = watched_fit_glm(
                dataset,
                *columns,
                classify,
                problem_for,
                estimator_watch(self, dataset, *columns, self.tensorboard_directory()),
                **options,
                **self.fit_options(),
            )
        return solution

    def weight_column(self) -> str | None:
        """The ``weightCol`` to fit with, or None where it is unset or empty (as MLlib)."""
        weight = self.getParam("weightCol")
        return (
            self.getOrDefault(weight)
            if self.isDefined(weight) and self.getOrDefault(weight)
            else None
        )


@contextlib.contextmanager
def resume_named(stage: Params) -> Iterator[None]:
    """Errors raised in the ``with`` block naming ``resume_from=`` (``fit_glm``'s words)
    name ``stage``'s Param ``resumeFrom=`` instead, as the user set it."""
    try:
        yield
    except InputError as error:
        if "resume_from=" in str(error):
            error.args = (
                f"{type(stage).__name__}: " + str(error).replace("resume_from=", "resumeFrom="),
            )
        raise


def set_by_name(stage: Params, params: dict[str, Any]):
    """Set ``params`` on ``stage`` by name, refusing (before setting any) a name it has no
    Param of, naming its Params: what every Estimator's ``setParams`` does."""
    unknown = sorted(name for name in params if not stage.hasParam(name))
    if unknown:
        raise ConfigurationError(
            f"{type(stage).__name__} has no Param {', '.join(map(repr, unknown))}; "
            f"its Params are {', '.join(sorted(param.name for param in stage.params))}"
        )
    return stage._set(**params)
