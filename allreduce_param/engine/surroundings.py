"""What the Spark-free engine asks of the process it runs in, when its caller leaves it unset.

Two things: the driver's settings (``NetworkSettings`` reads ``spark.allreduce.*`` and
Spark's encryption settings for what ``AllReduceParameter``'s arguments leave unset), and the
rendezvous of a task that ``connect()`` is given none. The engine imports nothing of Spark:
the Spark layer (``allreduce_param.spark.surroundings``) installs its answers when the
package is imported. Without it (``Standalone``), there are no settings to read and
``connect()`` needs a rendezvous (``StaticRendezvous``, ``LocalRendezvous``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from allreduce_param.errors import UsageError

if TYPE_CHECKING:
    from allreduce_param.engine.movement.rendezvous import Rendezvous


class Surroundings(Protocol):
    def setting(self, name: str) -> str | None:
        """The value of setting ``name`` in this process's configuration (the driver's
        Spark conf), or None where it has none."""

    def rendezvous(self) -> Rendezvous:
        """How a task meets its peers when ``connect()`` is given no rendezvous."""


class Standalone:
    """A process outside Spark: no settings, and every rendezvous given by the caller."""

    def setting(self, name: str) -> str | None:
        return None

    def rendezvous(self) -> Rendezvous:
        raise UsageError(
            "connect() without a rendezvous meets through a Spark barrier stage, and this process "
            "has no Spark layer: pass StaticRendezvous(...) or LocalRendezvous(...)"
        )


_current: Surroundings = Standalone()


def use(surroundings: Surroundings) -> None:
    """Make ``surroundings`` the engine's answer from now on (the Spark layer does, once)."""
    global _current
    _current = surroundings


def current() -> Surroundings:
    """What the engine asks, now."""
    return _current
