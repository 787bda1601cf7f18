"""A Spark standalone cluster for the tests and ``bench_hosts.py``: a master and workers
started from the installed pyspark (``spark-class``), each in a process group of its own,
stopped on every path.

``standalone_cluster(folder, host=..., prefix=...)`` is a context manager: the master and
the workers bind ``host`` (``--host`` and ``SPARK_LOCAL_IP``) on free ports (port 0, the
chosen ones read from the master's log), keep their logs and the workers' work dirs in
``folder``, and the cluster is ready when the master's log says every worker registered.
Everything is read from log files, not over the network, and every command starts with
``prefix``: so the same cluster runs inside a network namespace (``host="192.0.2.1"``,
``prefix=["nsenter", "--net=/proc/PID/ns/net"]``) as well as on 127.0.0.1, and
``cluster.run(...)`` runs ``spark-submit`` there too. ``worker_places`` puts each worker on
a host of its own instead (its address and prefix: simulated hosts, ``sim_hosts.py``).
The master and the workers map the class archive a local session saved, when there is one
(``class_archive_options``), which shortens each daemon's start.

It lives in jobs/harness/ beside ``sim_hosts.py``, for the same reason: the benchmark and
the tests share it, and no benchmark reaches into tests/.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyspark
import pytest

REPO = Path(__file__).resolve().parents[2]
SPARK_HOME = Path(pyspark.__file__).resolve().parent
#: ``spark-submit`` as the README's recipe runs it: the one next to this Python (the venv's
#: ``.venv/bin/spark-submit``), or else the installed pyspark's own
SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"
if not SPARK_SUBMIT.is_file():
    SPARK_SUBMIT = SPARK_HOME / "bin" / "spark-submit"


@dataclass
class StandaloneCluster:
    """A running cluster: its ``spark://`` URL, and what runs a command beside it."""

    url: str
    host: str
    folder: Path
    #: the environment the master and the workers run with: this machine's, less any Spark
    #: settings of the test process, plus SPARK_LOCAL_IP and ``environment``
    environment: dict[str, str]
    prefix: tuple[str, ...] = ()
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def worker_dirs(self) -> list[Path]:
        """The workers' work dirs (``--work-dir``): an application's executors keep their
        stdout and stderr in ``<dir>/<app id>/<executor id>/``."""
        return sorted(self.folder.glob("worker-*-work"))

    def logs(self, characters: int = 3000) -> str:
        """The end of each daemon's log, for a failure's message."""
        return "\n".join(
            f"--- {log.name}:\n{log.read_text(errors='replace')[-characters:]}"
            for log in sorted(self.folder.glob("*.log"))
        )

    def run(
        self,
        command: Sequence[str],
        log: Path,
        timeout: float,
        cwd: Path = REPO,
        environment: dict[str, str] | None = None,
    ) -> tuple[int, str]:
        """Run ``command`` (after ``prefix``) with the cluster's environment and
        ``environment`` over it, its output in ``log``; (exit status, output). Its process
        group is killed when it ends, and when it runs past ``timeout`` (then a failure)."""
        with open(log, "w") as out:
            process = subprocess.Popen(
                [*self.prefix, *command],
                cwd=cwd,
                env={**self.environment, **(environment or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"{command[0]} ran past {timeout} s:\n{log.read_text(errors='replace')[-5000:]}\n{self.logs()}",
                pytrace=False,
            )
        finally:
            _stop(process)
        return process.returncode, log.read_text(errors="replace")


def python_environment() -> dict[str, str]:
    """What the driver and the executors need to run this checkout's allreduce_param:
    ``PYSPARK_PYTHON``, this Python (the venv's); and ``PYTHONPATH``, this checkout, unless
    that Python imports the package from it on its own (installed editable, as in a fresh
    clone's ``.venv``), as when the tests run from a worktree with ``PYTHONPATH``."""
    return dict(_python_environment())


@functools.cache
def _python_environment() -> dict[str, str]:
    """``python_environment()``, found once per test run (it starts a Python to find out)."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    found = subprocess.run(
        [sys.executable, "-c", "import allreduce_param; print(allreduce_param.__file__)"],
        env=environment,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )
    installed = (
        found.returncode == 0
        and Path(found.stdout.strip()).resolve().parent == REPO / "allreduce_param"
    )
    return {"PYSPARK_PYTHON": sys.executable, **({} if installed else {"PYTHONPATH": str(REPO)})}


@contextlib.contextmanager
def standalone_cluster(
    folder: Path,
    host: str = "127.0.0.1",
    workers: int = 2,
    cores: int = 1,
    memory: str = "1g",
    prefix: Sequence[str] = (),
    environment: dict[str, str] | None = None,
    timeout: float = 120.0,
    worker_places: Sequence[tuple[str, Sequence[str]]] | None = None,
    java_options: str = "",
):
    """A master and ``workers`` workers of ``cores`` cores and ``memory`` each, on ``host``;
    the ``StandaloneCluster`` once every worker has registered. Stopped (process groups
    killed) when the block ends, whether it fails or not, and when the start fails.

    ``prefix``: what every command starts with, e.g. ``["nsenter", "--net=/proc/PID/ns/net"]``
    to run the cluster (and ``cluster.run``) in that network namespace; it must exec the
    command (as nsenter and unshare without --fork do), so the process group is the
    daemon's. PID must already be in the new namespace: ``unshare -n CMD`` switches only
    after it starts, and an nsenter before that enters this host's own (configure the
    namespace from inside the unshare'd command, as test_network_namespace does).
    ``environment``: more variables for the daemons and ``cluster.run``, e.g.
    ``python_environment()``. ``timeout``: seconds the start may take in all.
    ``worker_places``: one worker at each ``(address, prefix)`` given, with that
    ``SPARK_LOCAL_IP``, in place of ``workers`` workers on ``host`` (the master and
    ``cluster.run`` stay on ``host`` with ``prefix``).
    ``java_options``: options for every JVM of the cluster, e.g. the tests' C1-only JIT
    (``-XX:TieredStopAtLevel=1``): the daemons, the executors the workers launch and the
    drivers ``cluster.run`` starts, through ``JAVA_TOOL_OPTIONS`` (the one variable every
    JVM reads, whatever launched it: a worker's executors inherit its environment, and a
    recipe's command line stays as written). Each JVM then says "Picked up
    JAVA_TOOL_OPTIONS" on its stderr.
    """
    folder.mkdir(parents=True, exist_ok=True)
    base = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SPARK_", "PYSPARK_")) and key != "PYTHONPATH"
    }  # no setting of this process's
    if java_options:
        base["JAVA_TOOL_OPTIONS"] = f"{base.get('JAVA_TOOL_OPTIONS', '')} {java_options}".strip()
    cluster = StandaloneCluster(
        "", host, folder, {**base, "SPARK_LOCAL_IP": host, **(environment or {})}, tuple(prefix)
    )
    daemon_options = class_archive_options()
    # the master's REST submission server would take port 6066 (or the next free one): off
    daemons = folder / "daemons.conf"
    daemons.write_text("spark.master.rest.enabled false\n")
    deadline = time.monotonic() + timeout
    try:
        cluster.processes["master"] = _start(
            cluster,
            "master",
            [*_daemon("master", host, daemons)],
            java_options=daemon_options,
        )
        cluster.url = _wait_for(
            cluster, "master", r"Starting Spark master at (spark://\S+)", 1, deadline
        )[0]
        places = (
            [(host, cluster.prefix)] * workers if worker_places is None else list(worker_places)
        )
        for i, (address, where) in enumerate(places):
            cluster.processes[f"worker-{i}"] = _start(
                cluster,
                f"worker-{i}",
                [
                    *_daemon("worker", address, daemons),
                    *("--cores", str(cores), "--memory", memory),
                    *("--work-dir", str(folder / f"worker-{i}-work"), cluster.url),
                ],
                prefix=where,
                local_ip=address,
                java_options=daemon_options,
            )
        _wait_for(cluster, "master", r"Registering worker (\S+) with", len(places), deadline)
        yield cluster
    finally:
        # all asked to stop at once, workers (and their executors) first, then each waited
        # for: their shutdowns overlap instead of taking a second or so each in turn
        stopping = list(reversed(cluster.processes.values()))
        for process in stopping:
            _terminate(process)
        for process in stopping:
            _stop(process)


def _daemon(kind: str, address: str, properties: Path) -> list[str]:
    """``spark-class`` starting a standalone ``master`` or ``worker`` bound to ``address`` on
    free ports (its own and its web UI's), with the daemons' ``properties`` file."""
    main = {"master": "master.Master", "worker": "worker.Worker"}[kind]
    return [
        str(SPARK_HOME / "bin" / "spark-class"),
        f"org.apache.spark.deploy.{main}",
        *("--host", address, "--port", "0", "--webui-port", "0"),
        *("--properties-file", str(properties)),
    ]


def _start(
    cluster: StandaloneCluster,
    name: str,
    command: list[str],
    prefix: Sequence[str] | None = None,
    local_ip: str | None = None,
    java_options: str = "",
) -> subprocess.Popen:
    """``command`` (after the prefix: the cluster's, or ``prefix``) in a process group of its
    own, its output in ``<name>.log``; with ``local_ip`` as its SPARK_LOCAL_IP, when given,
    and ``java_options`` as the daemon's (``SPARK_DAEMON_JAVA_OPTS``)."""
    environment = {
        **cluster.environment,
        **({} if local_ip is None else {"SPARK_LOCAL_IP": local_ip}),
        **({"SPARK_DAEMON_JAVA_OPTS": java_options} if java_options else {}),
    }
    with open(cluster.folder / f"{name}.log", "w") as out:
        return subprocess.Popen(
            [*(cluster.prefix if prefix is None else prefix), *command],
            env=environment,
            cwd=cluster.folder,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def class_archive_options() -> str:
    """Java options that make a JVM of this Spark map the class archive a local session of
    this Java and Spark saved (``allreduce_param.spark.class_archive``), when there is one;
    "" when there is none. A JVM whose class path is the driver's (the standalone daemons, a
    Spark Connect server, a driver or an executor of this Spark) then starts and answers its
    first queries seconds sooner; what it runs is the same. For the tests' JVMs (their
    daemons and servers, and through ``java_options`` the drivers and executors of what
    they submit), never a user's."""
    from allreduce_param.spark.class_archive import QUIET, archive_name, default_folder
    from allreduce_param.spark.session import _java

    java, report, problem = _java()  # the java and -version report local_spark goes by
    name = archive_name(java, report, SPARK_HOME) if java and not problem else None
    if name is None or not (default_folder() / name).is_file():
        return ""
    return f"-XX:SharedArchiveFile={default_folder() / name} {QUIET}"


def class_archive_submit_options() -> list[str]:
    """``spark-submit`` options that make the driver's and the executors' JVMs map the class
    archive (``class_archive_options``), when there is one; none when there is none. For
    tests whose driver is a test's own, not a recipe under test."""
    archive = class_archive_options()
    if not archive:
        return []
    return [
        "--driver-java-options",
        archive,
        "--conf",
        f"spark.executor.extraJavaOptions={archive}",
    ]


def _wait_for(
    cluster: StandaloneCluster, name: str, pattern: str, count: int, deadline: float
) -> list[str]:
    """The first group of ``pattern``'s matches in ``<name>.log`` once there are ``count`` of
    them; a failure, with the logs, when a daemon exits or the deadline passes first."""
    log = cluster.folder / f"{name}.log"
    while True:
        found = re.findall(pattern, log.read_text(errors="replace"))
        if len(found) >= count:
            return found
        for other, process in cluster.processes.items():
            if process.poll() is not None:
                pytest.fail(
                    f"the standalone cluster's {other} exited with {process.returncode} while we waited "
                    f"for {count} x {pattern!r} in {log.name}:\n{cluster.logs()}",
                    pytrace=False,
                )
        if time.monotonic() > deadline:
            pytest.fail(
                f"the standalone cluster did not start in time: {len(found)} of {count} x {pattern!r} "
                f"in {log.name}:\n{cluster.logs()}",
                pytrace=False,
            )
        time.sleep(0.2)


def _terminate(process: subprocess.Popen) -> None:
    """SIGTERM to ``process``'s group (a worker then stops its executors); nothing waited for."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)


def _stop(process: subprocess.Popen) -> None:
    """End ``process`` and its process group: SIGTERM (a worker then stops its executors),
    SIGKILL after 30 s, and SIGKILL to whatever of the group is left once it exited."""
    _terminate(process)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
