"""pyspark.ml Estimators over ``DistriOptimizer``: ``AllReduceClassifier``, ``AllReduceRegressor``.

A thin layer on the driver: Params in, one ``DistriOptimizer.fit``, a Model out. The
Estimators go in a ``Pipeline`` after ``VectorAssembler`` and ``StandardScaler``, run under
``CrossValidator`` and ``TrainValidationSplit``, and their Models save and load with Spark's
own persistence (``PipelineModel.save``): the Params as Spark writes them, the weights as a
Parquet array beside them (no pickle), at any path Spark writes to.

The network is a dense one: ``hiddenLayers`` widths between the features and the outputs,
``[]`` (the default) for a linear model (softmax regression for the classifier, least
squares for the regressor). Training logic lives in ``train``, not here.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
from pyspark.ml.base import Predictor
from pyspark.ml.classification import ProbabilisticClassifier
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsWritable, MLWriter

from allreduce_param.errors import AllReduceError, ConfigurationError, InputError
from allreduce_param.ml.allreduce_params import OPTIMIZERS, _AllReduceParams, _network
from allreduce_param.ml.labels import inferred_class_count
from allreduce_param.ml.linear_params import set_by_name
from allreduce_param.ml.models import AllReduceClassificationModel, AllReduceRegressionModel
from allreduce_param.ml_params import FitSettingSetters
from allreduce_param.train.driver.data import check_label_column
from allreduce_param.train.driver.distri import DistriOptimizer
from allreduce_param.train.rows import features_column, is_vector_type
from allreduce_param.train.settings import FitSettings, estimator_params

#: ``DistriOptimizer.fit``'s arguments, as the Params that set them.
_ARGUMENT_PARAMS = {
    "features_col": "featuresCol",
    "label_col": "labelCol",
    "weight_col": "weightCol",
}
#: The fit's settings (and the optimizer's learning rate), as the Params that set them.
_SETTING_PARAMS = [(spec.name, spec.setting) for spec in estimator_params()] + [("stepSize", "lr")]
#: What ``fit(initial=...)``'s checks name, as the Estimators' Params: in any error.
_START_PARAMS = (
    ("initialModel", r"\binitial(?= holds| must|=)"),
    ("keepOptimizerState", r"\bkeep_optimizer_state(?==)"),
)


class _AllReduceEstimator(_AllReduceParams, FitSettingSetters):
    """What both Estimators do: describe the data, build the network, fit, wrap the result.

    ``initialModel``: a Model of this Estimator's (a fit's, or ``load``'s) to continue
    training from, as MLlib's KMeans ``initialModel`` and xgboost.spark's ``xgb_model``:
    its weights, where its training stopped (the epochs are numbered on, the optimizer's
    step count goes on), and with ``keepOptimizerState=True`` (set on both fits) its
    optimizer state, so two fits of k epochs give one fit of 2k epochs' weights. It is not
    written with the Estimator (``write()`` leaves it out: save the Model itself).
    """

    _task = ""

    initialModel = Param(
        Params._dummy(),
        "initialModel",
        "a Model of this Estimator's to continue training from (its weights, and with "
        "keepOptimizerState its optimizer state); not written with the Estimator",
        typeConverter=TypeConverters.identity,
    )

    def __init__(self, **params: Any) -> None:
        super().__init__()
        self.setParams(**params)

    def setParams(self, **params: Any):
        """Set Params by name (any of ``explainParams()``'s), e.g. ``setParams(maxEpochs=5)``."""
        return set_by_name(self, params)

    def setHiddenLayers(self, value: list[int]):
        """Set the widths of the hidden layers."""
        return self._set(hiddenLayers=value)

    def setOptimizer(self, value: str):
        """Set the optimizer's name."""
        return self._set(optimizer=value)

    def setStepSize(self, value: float):
        """Set the optimizer's learning rate."""
        return self._set(stepSize=value)

    def setWeightCol(self, value: str):
        """Set the column of sample weights."""
        return self._set(weightCol=value)

    def setValidationIndicatorCol(self, value: str):
        """Set the boolean column that marks validation rows."""
        return self._set(validationIndicatorCol=value)

    def setInitialModel(self, value):
        """Set the Model to continue training from (``initialModel``)."""
        return self._set(initialModel=value)

    def getInitialModel(self):
        """The Model training continues from (None: from the start)."""
        return self.getOrDefault(self.initialModel) if self.isDefined(self.initialModel) else None

    def write(self) -> MLWriter:
        """A writer of the Params, ``initialModel`` left out (a Model is no JSON value)."""
        if not self.isSet(self.initialModel):
            return super().write()
        kept = self.copy()
        kept.clear(kept.initialModel)
        return kept.write()

    def _fit(self, dataset):
        settings = self._settings()  # a bad setting fails here, before the data's first Spark job
        if settings.solver == "lbfgs":
            self._refuse_minibatch_params(settings)
        features_col, label_col = self.getFeaturesCol(), self.getLabelCol()
        weight_col = (
            self.getWeightCol() if self.isDefined(self.weightCol) and self.getWeightCol() else None
        )
        train, validation = self._split(dataset)
        n_features, num_classes = _describe(train, features_col, label_col, self._task)
        network = _network(self._task, n_features, self.getHiddenLayers(), num_classes)
        trainer = self._trainer(network, settings)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", UserWarning)
                trained = trainer.fit(
                    train,
                    features_col=features_col,
                    label_col=label_col,
                    validation=validation,
                    weight_col=weight_col,
                    initial=self.getInitialModel(),
                )
        except (InputError, ConfigurationError) as error:  # named as DistriOptimizer's
            renamed = self._naming_params(error)
            if renamed is error:
                raise
            raise renamed from error
        finally:
            for warning in caught:  # the fit's warnings, naming this Estimator's Params
                text = str(warning.message)
                if issubclass(warning.category, UserWarning):
                    text = _param_names(text, settings=True)
                # at the caller of Estimator.fit (through pyspark's fit, which calls _fit)
                warnings.warn(text, warning.category, stacklevel=3)
        return self._copyValues(self._model_class(trained))

    def _refuse_minibatch_params(self, settings: FitSettings) -> None:
        """Under ``solver="lbfgs"`` (its own optimizer, one full-batch solve), each Param only
        the mini-batch solver reads that the user set, refused by name, before any Spark job,
        by ``DistriOptimizer(solver="lbfgs")``'s rule (``lbfgs_fit.refuse_unused``): this
        Estimator's own (``optimizer``, ``stepSize``, ``hiddenLayers``,
        ``validationIndicatorCol``, ``initialModel``) and the fit settings' Params
        (``lbfgs_fit.unused_settings``, named as the Params)."""
        from allreduce_param.train.driver.lbfgs_fit import refuse_unused, unused_settings

        changed = [
            f"{param.name}={self.getOrDefault(param)!r}"
            for param in (self.optimizer, self.stepSize)
            if self.isSet(param)
        ]
        if self.getHiddenLayers():
            changed.append(f"hiddenLayers={self.getHiddenLayers()!r}")
        if self.isDefined(self.validationIndicatorCol) and self.getValidationIndicatorCol():
            changed.append(f"validationIndicatorCol={self.getValidationIndicatorCol()!r}")
        if self.getInitialModel() is not None:
            changed.append("initialModel")
        try:
            refuse_unused(changed + unused_settings(settings))
        except ConfigurationError as error:
            renamed = self._naming_params(error)
            told = str(renamed).replace("max_iter and tol", "maxIter and tol")
            raise ConfigurationError(told) from None

    def _split(self, dataset):
        """(training rows, validation rows or None), by ``validationIndicatorCol``."""
        from pyspark.sql import functions as F
        from pyspark.sql.types import BooleanType

        if not self.isDefined(self.validationIndicatorCol) or not self.getValidationIndicatorCol():
            return dataset, None
        column = self.getValidationIndicatorCol()
        if column not in dataset.columns:
            raise InputError(
                f"validationIndicatorCol={column!r} is not a column of the data; its columns "
                f"are {sorted(dataset.columns)}"
            )
        if not isinstance(dataset.schema[column].dataType, BooleanType):
            raise InputError(
                f"validationIndicatorCol={column!r} is {dataset.schema[column].dataType.simpleString()}; "
                "it must be boolean (true: a validation row)"
            )
        marked = F.coalesce(F.col(column), F.lit(False))
        return dataset.filter(~marked), dataset.filter(marked)

    def _settings(self) -> FitSettings:
        """The FitSettings these Params describe, checked (on the driver, before any Spark
        job: a conflict such as ``topology='hierarchical'`` with ``strategy='ssp'`` fails
        first); its errors name the Params."""
        try:
            return FitSettings.of_flat(
                {spec.setting: self.getOrDefault(spec.name) for spec in estimator_params()},
                where=type(self).__name__,
            )
        except ConfigurationError as error:
            raise self._naming_params(error) from error

    def _trainer(self, network, settings: FitSettings | None = None) -> DistriOptimizer:
        """The DistriOptimizer these Params describe (with ``settings``, when already made
        from them); its errors name the Params."""
        name = self.getOptimizer().lower()
        if name not in OPTIMIZERS:
            raise ConfigurationError(
                f"optimizer={self.getOptimizer()!r} is not one of {', '.join(OPTIMIZERS)}"
            )
        settings = settings or self._settings()
        # solver="lbfgs" is its own optimizer (stepSize and optimizer mean nothing to it)
        lbfgs = settings.solver == "lbfgs"
        optimizer = None if lbfgs else OPTIMIZERS[name](lr=self.getStepSize())
        try:
            return DistriOptimizer(network, optimizer, settings)
        except ConfigurationError as error:
            raise self._naming_params(error) from error

    def _naming_params(self, error: AllReduceError) -> AllReduceError:
        """``error`` with what it names as ``DistriOptimizer`` writes it written as this
        Estimator's Params: the one place the Estimators rename an error's text.

        ``fit()``'s arguments where the data checks name them (``(features_col)``:
        ``(featuresCol)``) in any error; and for a bad setting (a ``ConfigurationError``)
        the settings it names (``batch_size=``, ``batch_size must``: ``batchSize``), after
        this Estimator's name. ``error`` itself where nothing needs renaming."""
        configuration = isinstance(error, ConfigurationError)
        message = _param_names(str(error), settings=configuration)
        if configuration:
            return ConfigurationError(f"{type(self).__name__}: {message}")
        return error if message == str(error) else type(error)(message)


def _param_names(message: str, settings: bool) -> str:
    """``message`` with ``fit()``'s arguments (``(features_col)``) written as the Params
    (``(featuresCol)``), and where ``settings`` the settings it names (``batch_size=``,
    ``batch_size must``) as theirs (``batchSize``)."""
    for argument, param in _ARGUMENT_PARAMS.items():
        message = message.replace(f"({argument})", f"({param})")
    for param, pattern in _START_PARAMS:
        message = re.sub(pattern, param, message)
    if settings:
        for param, setting in _SETTING_PARAMS:
            message = re.sub(rf"\b{setting}(?==| must)", param, message)
    return message


class AllReduceClassifier(
    _AllReduceEstimator, ProbabilisticClassifier, DefaultParamsReadable, DefaultParamsWritable
):
    """A classifier trained data-parallel by allreduce; labels are class ids 0..k-1 (e.g. from
    ``StringIndexer``). k comes from the label column's metadata, or else its largest value.

    The Model adds ``predictionCol``, ``rawPredictionCol`` (the class scores) and
    ``probabilityCol`` (their softmax); ``thresholds`` work as MLlib's classifiers' do.
    Params by name: ``AllReduceClassifier(hiddenLayers=[64], maxEpochs=20)``;
    ``explainParams()`` lists them all, the fit's settings (``FitSettings``) among them.
    """

    _task = "classification"

    @property
    def _model_class(self):
        return AllReduceClassificationModel


class AllReduceRegressor(
    _AllReduceEstimator, Predictor, DefaultParamsReadable, DefaultParamsWritable
):
    """A regressor trained data-parallel by allreduce (squared error); the Model adds
    ``predictionCol``."""

    _task = "regression"

    @property
    def _model_class(self):
        return AllReduceRegressionModel


def _describe(train, features_col: str, label_col: str, task: str) -> tuple[int, int | None]:
    """(features per row, classes) of the training rows: from the columns' ML metadata
    (``VectorAssembler``, ``StringIndexer``) where it says, else from one small Spark job."""
    from pyspark.sql import functions as F

    features = features_column(train, features_col, role="featuresCol")
    vector = is_vector_type(train.schema[features_col].dataType)
    check_label_column(train, label_col, role="labelCol")
    features_meta = train.schema[features_col].metadata.get("ml_attr", {})
    n_features = features_meta.get("num_attrs")
    num_classes = None
    if task == "classification":
        label_meta = train.schema[label_col].metadata.get("ml_attr", {})
        num_classes = label_meta.get("num_vals") or (
            len(label_meta["vals"]) if "vals" in label_meta else None
        )
    if n_features is None and vector:  # a vector's size, without making it dense
        row = train.select(features).where(features.isNotNull()).first()
        if row is None:
            raise InputError("the training data has no rows with features")
        n_features = row[0].size
    if n_features is None or (task == "classification" and num_classes is None):
        width = F.lit(n_features) if n_features is not None else F.size(features)
        row = train.agg(
            F.max(label_col).alias("largest"), F.first(width, ignorenulls=True).alias("width")
        ).first()
        if row is None or row["width"] is None:
            raise InputError("the training data has no rows with features")
        n_features = n_features or int(row["width"])
        if task == "classification" and num_classes is None:
            largest = row["largest"]
            if (
                largest is None
                or not np.isfinite(largest)
                or largest < 0
                or largest != int(largest)
            ):
                raise InputError(
                    f"the labels in {label_col!r} must be class ids 0, 1, 2, ... (the largest is "
                    f"{largest!r}); index string classes with StringIndexer"
                )
            num_classes = max(inferred_class_count(largest, label_col), 2)
    return int(n_features), (None if num_classes is None else int(num_classes))
