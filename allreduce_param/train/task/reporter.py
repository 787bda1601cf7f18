"""A task's end of the fit's live progress: it reports its steps and epochs to the driver.

The task sends one message per step and one per epoch over its connection to the
driver's ``messages.MessageServer`` (the one it met at); the driver's end is
``driver.progress``. Reporting is best effort: a task whose report fails goes on training.
"""

from __future__ import annotations

import logging

from allreduce_param.engine.wire.messages import MessageClient
from allreduce_param.errors import AllReduceError
from allreduce_param.train.records import EpochDone, Started, StepDone

log = logging.getLogger(__name__)


class ProgressReporter:
    """The task's end: sends its steps and epochs over ``link``, quietly giving up after a failure."""

    def __init__(self, link: MessageClient) -> None:
        self.link = link
        self._broken = False

    def report(self, report: Started | StepDone | EpochDone) -> None:
        """Send one of ``records``' progress reports (best effort, as ``send``)."""
        self.send(**report.message())

    def send(self, kind: str, **fields) -> None:
        """Send one report; after a failure, stay quiet (training goes on without progress)."""
        if self._broken:
            return
        try:
            self.link.send({"kind": kind, **fields})
        except (
            OSError,
            AllReduceError,
        ) as error:  # out of reach, or what answers is not our driver
            log.warning(
                "progress reports to the driver at %s:%s stopped: %s", *self.link.address[:2], error
            )
            self._broken = True
            self.close()

    def close(self) -> None:
        self.link.close()
