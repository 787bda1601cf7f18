"""What PySpark 3.5 and 4.x do differently, answered in one place.

The package runs on PySpark 3.5 and 4.x. Most of what a fit uses (``mapInArrow`` with
``barrier=True``, barrier tasks, broadcasts, the ML persistence API) is the same in both;
what is not is wrapped here, so that the rest of the code calls one function and never asks
which version it runs on:

- ``to_arrow``: a DataFrame's rows as a pyarrow Table. ``DataFrame.toArrow`` came in 4.0;
  a classic 3.5 DataFrame collects its Arrow batches with ``_collect_as_arrow``.
- ``from_arrow``: a DataFrame of a pyarrow Table. ``createDataFrame`` takes a Table from
  4.0; 3.5 takes Arrow data only by way of a pandas DataFrame.
- ``ml_metadata``: the metadata a pyspark.ml writer saved. ``DefaultParamsReader.loadMetadata``
  takes the SparkSession from 4.0; on 3.5 it takes the SparkContext.

Spark Connect is used from PySpark 4.0 (the ``[connect]`` extra says so); a 3.5 Connect
client is refused by these functions with a message rather than half served.
"""

from __future__ import annotations

import functools
from typing import Any

from allreduce_param.errors import ConfigurationError
from allreduce_param.spark.info import is_connect


@functools.lru_cache(maxsize=1)
def pyspark_version() -> tuple[int, int]:
    """(major, minor) of the installed PySpark."""
    import pyspark

    major, minor = pyspark.__version__.split(".")[:2]
    return int(major), int("".join(digit for digit in minor if digit.isdigit()) or 0)


def arrow_tables_native() -> bool:
    """Whether DataFrames and pyarrow Tables convert directly (``toArrow`` and
    ``createDataFrame(table)``: PySpark 4.0 and later)."""
    return pyspark_version() >= (4, 0)


def to_arrow(frame: Any):
    """All of ``frame``'s rows as a pyarrow Table, with its columns' Arrow types."""
    if arrow_tables_native():
        return frame.toArrow()
    _refuse_connect(frame.sparkSession, "a DataFrame read as Arrow")
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    batches = frame._collect_as_arrow()
    if batches:
        return pa.Table.from_batches(batches)
    return to_arrow_schema(frame.schema).empty_table()


def from_arrow(session: Any, table: Any):
    """A DataFrame of ``session`` holding ``table``'s rows, with the Spark types of its
    Arrow types (``list<float>`` is ``array<float>``, ``double`` is ``double``, ...).

    The rows go to the JVM as Arrow batches, so that scanning the DataFrame later needs no
    Python worker. PySpark 3.5 takes them only from pandas: its own Arrow path for a pandas
    DataFrame is used directly, whatever ``spark.sql.execution.arrow.pyspark.enabled`` says.
    """
    if arrow_tables_native():
        return session.createDataFrame(table)
    _refuse_connect(session, "a DataFrame made from Arrow")
    from pyspark.sql.pandas.types import from_arrow_schema

    return session._create_from_pandas_with_arrow(
        table.to_pandas(),
        from_arrow_schema(table.schema),
        session.conf.get("spark.sql.session.timeZone"),
    )


def ml_metadata(session: Any, path: str) -> dict[str, Any]:
    """The metadata (class, uid, Params, extra fields) that Spark's ML persistence saved
    under ``path``/metadata, read through ``session``."""
    from pyspark.ml.util import DefaultParamsReader

    if pyspark_version() >= (4, 0):
        return DefaultParamsReader.loadMetadata(path, session)
    _refuse_connect(session, "a saved model read")
    return DefaultParamsReader.loadMetadata(path, session.sparkContext)


def _refuse_connect(session: Any, purpose: str) -> None:
    """Spark Connect is served from PySpark 4.0 on: say so where a 3.5 client gets here."""
    if is_connect(session):
        import pyspark

        raise ConfigurationError(
            f"{purpose} under Spark Connect needs PySpark 4.0 or newer; this client is "
            f"PySpark {pyspark.__version__}: pip install 'allreduce-param[connect]', or use "
            "a classic SparkSession"
        )
