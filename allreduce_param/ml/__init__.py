"""pyspark.ml Estimators: ``AllReduceClassifier`` and ``AllReduceRegressor`` (any dense network,
trained by the sharded optimizers over ``DistriOptimizer``), and MLlib's ``LogisticRegression``
and ``LinearRegression`` as drop-ins (the same Params, objective and Model attributes, solved by
full-batch L-BFGS / OWL-QN or the normal equations over the engine), with their Models.

Imports pyspark; ``allreduce_param.ml`` is loaded when first named, so ``import
allreduce_param`` in a task loads none of it.
"""

from allreduce_param.ml.estimators import AllReduceClassifier, AllReduceRegressor
from allreduce_param.ml.linear_regression import LinearRegression, LinearRegressionModel
from allreduce_param.ml.logistic import LogisticRegression, LogisticRegressionModel
from allreduce_param.ml.models import AllReduceClassificationModel, AllReduceRegressionModel

__all__ = [
    "AllReduceClassificationModel",
    "AllReduceClassifier",
    "AllReduceRegressionModel",
    "AllReduceRegressor",
    "LinearRegression",
    "LinearRegressionModel",
    "LogisticRegression",
    "LogisticRegressionModel",
]

# Spark's saved metadata names a stage's class by its module: keep the public one, so Models
# saved before and after a change of the modules inside load alike.
for _public in (
    AllReduceClassificationModel,
    AllReduceClassifier,
    AllReduceRegressionModel,
    AllReduceRegressor,
    LinearRegression,
    LinearRegressionModel,
    LogisticRegression,
    LogisticRegressionModel,
):
    _public.__module__ = __name__
