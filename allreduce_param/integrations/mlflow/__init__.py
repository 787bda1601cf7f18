"""MLflow for allreduce-param's fits (``pip install 'allreduce-param[mlflow]'``).

- ``autolog()``: every later fit (``DistriOptimizer.fit``, the Estimators', each micro-batch
  of ``fit_stream``) is logged: its settings as params, its epochs' metrics by epoch, its
  history and loss curve, its model; one child run per fit inside ``CrossValidator`` and
  ``TrainValidationSplit`` (``autologging``). A fit's ``tracking`` setting overrides it
  (``True``: log this fit, ``False``: never).
- ``log_model``, ``save_model``, ``load_model``: a ``TrainedModel`` as an MLflow Model of the
  ``allreduce_param`` flavor, which also loads as a pyfunc
  (``mlflow.pyfunc.load_model(uri).predict(pandas_df)``, ``mlflow.pyfunc.spark_udf``) over a
  features column of arrays (``flavor``).

An Estimator's Model (a pyspark.ml Model, in a ``PipelineModel`` or alone) logs with
MLflow's own ``mlflow.spark.log_model``, as any Spark ML model does.
"""

import mlflow as _mlflow  # noqa: F401  (the extra is missing: an ImportError here, at once)

from allreduce_param.integrations.mlflow.autologging import autolog
from allreduce_param.integrations.mlflow.flavor import (
    FLAVOR_NAME,
    load_model,
    log_model,
    save_model,
)

__all__ = ["FLAVOR_NAME", "autolog", "load_model", "log_model", "save_model"]
