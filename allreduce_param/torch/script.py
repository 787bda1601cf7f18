"""A rank that runs a script file, as torchrun would: its own ``python`` process, started
by the rank's Spark task, the environment set and the default group made inside it
(``launch``) before the script runs as ``__main__`` with its arguments.

The task does for its child what needs Spark: it meets the peers for it (the child sends
its server's address up a pipe, the task exchanges it at the driver or through Spark's
``allGather`` and writes every rank's back), finds the GPUs Spark assigned, streams the
child's output to the driver line by line, and reports its failure: a child that exits
with a status other than 0 is the rank's failure, with the last lines of its stderr. The
child is killed if the task ends first (a peer failed, the stage was cancelled), and it
ends itself if its task's process dies.
"""

from __future__ import annotations

import collections
import json
import os
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO, BinaryIO

from allreduce_param.errors import TrainingError
from allreduce_param.torch.output import RankStream
from allreduce_param.torch.rank import RankJob, driver_link, gpu_environment, meeting, tell_driver

_LENGTH = struct.Struct("<I")
#: How many of the child's last stderr lines a failure quotes.
KEPT_LINES = 60


def send_frame(pipe: BinaryIO, payload: bytes) -> None:
    """One length-prefixed frame on ``pipe``."""
    pipe.write(_LENGTH.pack(len(payload)) + payload)
    pipe.flush()


def read_frame(pipe: BinaryIO) -> bytes | None:
    """The next length-prefixed frame from ``pipe``; None where it ended first."""
    head = pipe.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    payload = pipe.read(length)
    return payload if len(payload) == length else None


@dataclass(frozen=True)
class ScriptRun:
    """A script file and its command-line arguments, run by every rank."""

    path: str
    args: tuple[str, ...]

    @property
    def name(self) -> str:
        """The script's file name, for the Spark UI."""
        return os.path.basename(self.path)

    def rank(self, job: RankJob) -> bytes | None:
        """Run this task's rank as a child process; rank 0's result (None, pickled: a
        script returns nothing)."""
        from pyspark import cloudpickle

        with driver_link(job.link):
            inner = meeting(job)
            rank = inner.partition_id
            gpus = {} if job.gpus != "spark" else gpu_environment("spark", 0)
            up_read, up_write = os.pipe()  # the child's address, up to this task
            child = subprocess.Popen(
                [sys.executable, "-m", "allreduce_param.torch.launch", str(up_write)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(up_write,),
                env={**os.environ, **gpus, "PYTHONUNBUFFERED": "1"},
            )
            os.close(up_write)
            last = collections.deque(maxlen=KEPT_LINES)
            pumps = [
                _pump(child.stdout, RankStream(sys.stdout, job.link, rank, "stdout"), None),
                _pump(child.stderr, RankStream(sys.stderr, job.link, rank, "stderr"), last),
            ]
            try:
                with os.fdopen(up_read, "rb") as up:
                    self._meet_for(child, up, inner, job)
                status = child.wait()
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
                for pump in pumps:
                    pump.join()
            if status != 0:
                error = TrainingError(
                    f"rank {rank}: the script {self.path} exited with status {status}"
                )
                report = "".join(last)
                tell_driver(job.link, rank, error, traceback_text=report)
                raise TrainingError(f"{error}; its last lines:\n{report}")
        return cloudpickle.dumps(None) if rank == 0 else None

    def _meet_for(self, child: subprocess.Popen, up: BinaryIO, inner, job: RankJob) -> None:
        """Hand the child what it needs, and meet the peers for it."""
        from pyspark import cloudpickle

        start = {
            "param": job.param,
            "rank": inner.partition_id,
            "bind": list(inner.bind_address()),
            "gpus": job.gpus,
            "script": self.path,
            "args": list(self.args),
        }
        send_frame(child.stdin, cloudpickle.dumps(start))
        address = read_frame(up)
        if address is None:  # the child ended before it served: its stderr says why
            return
        addresses = inner.exchange(tuple(json.loads(address)))
        send_frame(child.stdin, json.dumps([list(each) for each in addresses]).encode())
        child.stdin.close()


def _pump(source: IO[bytes], target: RankStream, last: collections.deque | None):
    """A thread that copies the child's ``source`` to ``target`` line by line (and keeps
    the last lines in ``last``) until it ends."""

    def copy() -> None:
        for raw in source:
            line = raw.decode(errors="replace")
            target.write(line)
            if last is not None:
                last.append(line)
        target.flush()

    thread = threading.Thread(target=copy, name="allreduce-rank-output", daemon=True)
    thread.start()
    return thread
