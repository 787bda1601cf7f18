"""The child process of a rank that runs a script (``python -m allreduce_param.torch.launch
FD``, started by ``script.ScriptRun``): it reads what its task sends on stdin, connects the
engine's handle (meeting the peers through its task, over stdin and the pipe ``FD``), sets
torchrun's environment and the default group, and runs the script as ``__main__``.

The secret of the run travels on stdin, never on the command line or in the environment.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time

from allreduce_param.engine.movement.rendezvous import Address, Rendezvous
from allreduce_param.torch.rank import (
    KeptAddresses,
    default_group,
    environment,
    gpu_environment,
    rank_environment,
)
from allreduce_param.torch.script import read_frame, send_frame

#: How often the child looks whether its task's process is still there.
PARENT_LOOK = 1.0


class ThroughTask(Rendezvous):
    """The child meets its peers through its task: its address up the pipe, every rank's
    back on stdin."""

    def __init__(self, rank: int, world: int, bind: Address, up, down) -> None:
        self.partition_id, self.partition_num = rank, world
        self._bind, self._up, self._down = bind, up, down

    def bind_address(self) -> Address:
        return self._bind

    def exchange(self, address: Address) -> list[Address]:
        send_frame(self._up, json.dumps(list(address)).encode())
        answer = read_frame(self._down)
        if answer is None:
            raise ConnectionError("the rank's task ended while this process met its peers")
        return [tuple(each) for each in json.loads(answer)]


def _end_with_the_task() -> None:
    """End this process when its task's process is gone (a killed Python worker leaves
    no one to kill its child)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_LOOK)
        os._exit(1)

    threading.Thread(target=watch, name="allreduce-task-watch", daemon=True).start()


def main() -> None:
    from pyspark import cloudpickle

    _end_with_the_task()
    down = sys.stdin.buffer
    start = cloudpickle.loads(read_frame(down))
    param, rank = start["param"], start["rank"]
    with os.fdopen(int(sys.argv[1]), "wb") as up:
        met = KeptAddresses(ThroughTask(rank, param.partition_num, tuple(start["bind"]), up, down))
        with param.connect(met) as handle:
            variables = rank_environment(rank, handle.info.hosts, met.addresses[0])
            if start["gpus"] == "local":
                variables.update(gpu_environment("local", int(variables["LOCAL_RANK"])))
            with environment(variables), default_group(handle, rank, param.partition_num):
                sys.argv = [start["script"], *start["args"]]
                runpy.run_path(start["script"], run_name="__main__")


if __name__ == "__main__":
    main()
