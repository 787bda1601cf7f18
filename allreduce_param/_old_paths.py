"""Old import paths of the modules that moved into the layer folders keep working.

``import allreduce_param.parameter`` (or ``from allreduce_param.network import
NetworkSettings``, or a pickle that names an old module) loads the module at its new home and
registers it under the old name too: one module object, reached by two names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: old module name -> where it lives now
MOVED = {
    "allreduce_param.vectors": "allreduce_param.engine.vectors",
    "allreduce_param.layout": "allreduce_param.engine.layout",
    "allreduce_param.strategy": "allreduce_param.engine.strategy",
    "allreduce_param.stream": "allreduce_param.engine.stream",
    "allreduce_param.owner": "allreduce_param.engine.owner",
    "allreduce_param.parameter": "allreduce_param.engine.parameter",
    "allreduce_param.store": "allreduce_param.engine.blocks.store",
    "allreduce_param.shm": "allreduce_param.engine.blocks.shm",
    "allreduce_param.codec": "allreduce_param.engine.blocks.codec",
    "allreduce_param.channels": "allreduce_param.engine.movement.channels",
    "allreduce_param.movements": "allreduce_param.engine.movement.movements",
    "allreduce_param.peers": "allreduce_param.engine.movement.peers",
    "allreduce_param.rendezvous": "allreduce_param.engine.movement.rendezvous",
    "allreduce_param.events": "allreduce_param.engine.wire.events",
    "allreduce_param.sealing": "allreduce_param.engine.wire.sealing",
    "allreduce_param.messages": "allreduce_param.engine.wire.messages",
    "allreduce_param.network": "allreduce_param.engine.wire.settings",
    "allreduce_param.transport": "allreduce_param.engine.wire.blocks",
    "allreduce_param.class_archive": "allreduce_param.spark.class_archive",
    "allreduce_param.session": "allreduce_param.spark.session",
    "allreduce_param.train.spark_info": "allreduce_param.spark.info",
    "allreduce_param.train.slots": "allreduce_param.spark.slots",
    "allreduce_param.train.arrow": "allreduce_param.spark.arrow",
    "allreduce_param.train.distri": "allreduce_param.train.driver.distri",
    "allreduce_param.train.data": "allreduce_param.train.driver.data",
    "allreduce_param.train.partitioning": "allreduce_param.train.driver.partitioning",
    "allreduce_param.train.worker": "allreduce_param.train.task.worker",
    "allreduce_param.train.batching": "allreduce_param.train.task.batching",
    # the driver's end (ProgressBar, ProgressMerger); the task's reporter is train.task.reporter
    "allreduce_param.train.progress": "allreduce_param.train.driver.progress",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:  # the target module ran already, at its own name
        pass


class OldPaths(importlib.abc.MetaPathFinder):
    """Finds a moved module by its old name and hands back the module at its new name."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (at the package's import)."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())
