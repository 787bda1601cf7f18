"""The engine's surroundings inside Spark: the driver's conf, and the barrier stage's meeting."""

from __future__ import annotations

from allreduce_param.engine import surroundings
from allreduce_param.spark.conf import spark_setting
from allreduce_param.spark.rendezvous import BarrierRendezvous


class SparkSurroundings:
    """Settings from the active Spark session; tasks meet through their barrier stage."""

    def setting(self, name: str) -> str | None:
        return spark_setting(name)

    def rendezvous(self) -> BarrierRendezvous:
        return BarrierRendezvous()


def install() -> None:
    """Make Spark the engine's surroundings (at the package's import)."""
    surroundings.use(SparkSurroundings())
