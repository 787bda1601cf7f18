"""A fit interrupted, and a fit whose disk fills up: what stops, what is named, what is left.

- SIGINT to a real driver process (what a notebook's stop button sends) while its
  ``data_in="disk"`` fit trains: the fit raises ``KeyboardInterrupt`` within seconds, its
  stage is cancelled, a second fit in the same process and session trains, and nothing of
  the first is left (row files, their lock, a checkpoint without its manifest, a shared
  memory segment). The Spark UI's REST API names every job of both fits, each fit's jobs
  in one group of its own (``spark/jobs.py``); ``interrupted_driver.py`` is the driver.
- A ``checkpoint_dir`` on a real 2 MiB tmpfs (a mount namespace of the test's own) that
  fills up with the fit's second checkpoint: one ``ConfigurationError`` naming the folder
  and the setting, after one run of the stage, and only complete checkpoints left. The same
  driver process runs it after the two fits above (one Spark start for the three), in that
  mount namespace where one can be made.
- The row files of a fit no task holds any more are removed by the next task; a running
  fit's stay (``train/task/row_claims.py``), with the locks held by real processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from allreduce_param import ConfigurationError
from allreduce_param.train.checkpoint import CheckpointSettings, CheckpointWriter, remove_incomplete
from allreduce_param.train.task.row_claims import claimed, sweep
from allreduce_param.train.task.spill import Place

HERE = Path(__file__).resolve().parent
#: how long a driver process may take in all (starting Spark on a busy 2-core machine)
PROCESS_LIMIT = 420


def _lines(command: list[str], on_line=None) -> dict[str, str]:
    """Run ``command``; its stdout's lines by their first word, each passed to ``on_line``
    with the process as it comes."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent
    )
    found: dict[str, str] = {}
    try:
        for line in process.stdout:
            word, _, rest = line.rstrip("\n").partition(" ")
            found[word] = rest
            found.setdefault("at " + word, str(time.monotonic()))
            if on_line is not None:
                on_line(word, process)
        process.wait(timeout=PROCESS_LIMIT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    found["stderr"] = process.stderr.read()
    found["returncode"] = str(process.returncode)
    return found


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """The driver's lines: SIGINT sent once its first fit reports a step. Where a tmpfs can
    be mounted, the driver runs in a mount namespace with a 2 MiB one at ``small`` and
    fills it with its third fit's checkpoints; elsewhere ``refusal`` says why not."""
    folder = tmp_path_factory.mktemp("interrupted")
    sent = {}

    def on_line(word, process):
        if word == "training":
            sent["at"] = time.monotonic()
            process.send_signal(signal.SIGINT)

    command = [sys.executable, str(HERE / "interrupted_driver.py"), str(folder)]
    refusal = _tmpfs_refusal()
    if refusal is None:
        small = folder / "small"
        small.mkdir()
        # sh execs Python: the pid the test signals is the driver's; a /dev/shm of its own,
        # so that what the test finds there is what the driver's processes left
        mounted = (
            f"mount -t tmpfs -o size=2m tmpfs {small} && mount -t tmpfs tmpfs /dev/shm"
            ' && exec "$0" "$@"'
        )
        command = ["unshare", "-m", "sh", "-c", mounted, *command, str(small)]
    before = set(os.listdir("/dev/shm"))
    found = _lines(command, on_line)
    found["shm before"] = before
    assert found["returncode"] == "0", found["stderr"][-3000:]
    found["sent"] = sent["at"]
    found["folder"] = folder
    found["refusal"] = refusal
    return found


@pytest.mark.slow
@pytest.mark.spark
def test_sigint_stops_the_fit_and_the_next_fit_in_the_process_trains(interrupted):
    assert interrupted["interrupted"] == "KeyboardInterrupt"
    assert float(interrupted["at interrupted"]) - interrupted["sent"] < 30
    epochs = interrupted["trained"].split()[0]
    assert epochs == "2"  # the second fit ran all its epochs on the executors the first had
    folder = interrupted["folder"]
    left = [p.name for p in (folder / "local").iterdir() if p.name.startswith("allreduce-rows-")]
    assert left == []
    (fit_folder,) = (folder / "checkpoints").iterdir()
    steps = list(fit_folder.iterdir())
    assert steps and all((step / "manifest.json").exists() for step in steps)
    # no named shared memory of the fits (the engine's is memfds, which go with their
    # processes): in the driver's own /dev/shm where it has one, else what is new in this
    # machine's (where the other pytest-xdist worker's processes write too)
    if interrupted["refusal"] is None:
        shm = json.loads(interrupted["shm"])
        assert shm["device"] != os.stat("/dev/shm").st_dev  # its own indeed
        left = shm["names"]
    else:
        left = sorted(set(os.listdir("/dev/shm")) - interrupted["shm before"])
    assert not [name for name in left if "allreduce" in name]


@pytest.mark.slow
@pytest.mark.spark
def test_the_spark_ui_names_every_job_of_a_fit_in_one_group_per_fit(interrupted):
    jobs = json.loads(interrupted["ui"])
    groups = {job["jobGroup"] for job in jobs}
    assert len(groups) == 2 and all(g.startswith("allreduce-param-fit-") for g in groups)
    by_group = {g: [job["description"] for job in jobs if job["jobGroup"] == g] for g in groups}
    for descriptions in by_group.values():
        assert any(d.endswith(": checking the data") for d in descriptions)
        assert any(d.endswith(": training") and "on 2 partitions" in d for d in descriptions)
        assert all(d.startswith("allreduce-param fit of LogisticRegression") for d in descriptions)
    assert {"100000 epochs" in " ".join(d) for d in by_group.values()} == {True, False}


def _tmpfs_refusal() -> str | None:
    """Why a tmpfs cannot be mounted in a mount namespace here, or None."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare to mount a small tmpfs in a mount namespace"
    tried = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
        text=True,
    )
    return None if tried.returncode == 0 else f"unshare -m and mount refused: {tried.stderr}"


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.mounts
def test_a_full_checkpoint_dir_is_one_clear_error_after_one_run(interrupted):
    if interrupted["refusal"]:
        pytest.skip(interrupted["refusal"])
    small = interrupted["folder"] / "small"
    kind, _, message = interrupted["error"].partition(" ")
    assert kind == "ConfigurationError"
    assert f"checkpoint_dir='{small}' is full" in message
    assert "No space left on device" in message and "Checkpoints(dir=...)" in message
    assert interrupted["runs"] == "0"  # no run again of the stage: it would fail the same way
    left = json.loads(interrupted["left"])
    assert left and all(left.values()), left  # complete checkpoints only


def _holding(lock: Path) -> subprocess.Popen:
    """A process holding a shared lock on ``lock`` until its stdin closes."""
    code = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "held\n"
    return process


def test_the_rows_of_a_fit_no_task_holds_go_with_the_next_task(tmp_path):
    running, over = (tmp_path / f"allreduce-rows-{fit}-p0-s1t1-train.rows" for fit in "ab")
    running.write_bytes(b"rows")
    over.write_bytes(b"rows")
    (tmp_path / "allreduce-rows-b.lock").touch()  # its task was killed: nobody holds it
    holder = _holding(tmp_path / "allreduce-rows-a.lock")
    try:
        with claimed(Place(str(tmp_path), "c", 0, "s2t2")):
            assert sorted(p.name for p in tmp_path.iterdir()) == [
                "allreduce-rows-a-p0-s1t1-train.rows",
                "allreduce-rows-a.lock",
                "allreduce-rows-c.lock",
            ]
    finally:
        holder.stdin.close()
        holder.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "allreduce-rows-a-p0-s1t1-train.rows",
        "allreduce-rows-a.lock",
    ]  # c's own lock went as its task ended
    assert sorted(Path(p).name for p in sweep(str(tmp_path))) == [
        "allreduce-rows-a-p0-s1t1-train.rows"
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_part_that_meets_a_full_disk_is_a_configuration_error(tmp_path):
    settings = CheckpointSettings(str(tmp_path / "ckpt" / "fit-1"), 1, 1)
    step = tmp_path / "ckpt" / "fit-1" / "step-0000000001"
    step.mkdir(parents=True)
    (step / "part-00000-of-00001.npz").symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(ConfigurationError, match=r"checkpoint_dir='.*/ckpt' is full") as raised:
        CheckpointWriter(settings).write_part(1, 0, 1, {"weights": np.zeros(4, np.float32)}, {})
    assert "Checkpoints(dir=...)" in str(raised.value) and "not run again" in str(raised.value)
    assert remove_incomplete(settings.directory) == [str(step)]
    assert not step.exists()
