"""The engine's settings read from Spark: the driver's conf, read once, handed on as values.

``spark_setting`` reads one setting from this process's active Spark session (or
SparkContext): the driver. The engine's ``NetworkSettings.of`` takes it for what its
explicit values leave unset (``spark.allreduce.*``, Spark's own encryption settings).
"""

from __future__ import annotations


def spark_setting(name: str) -> str | None:
    """Setting ``name`` of this process's active Spark session or SparkContext (the
    driver); None where it is unset or the process has no Spark."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if SparkContext._active_spark_context is None:
        return None
    session = SparkSession.getActiveSession()
    if session is not None:
        return session.conf.get(name, None)
    return SparkContext._active_spark_context.getConf().get(name, None)
