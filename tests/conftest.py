"""Shared test set-up: loopback only, the project's Spark settings, and partition groups.

Engine tests run N partitions as N threads of this process (real sockets on 127.0.0.1,
``LocalRendezvous``); Spark tests take the ``spark`` fixture: a session on ``local[4]``, or
the module's ``SPARK_MASTER`` and ``SPARK_SETTINGS``. Modules that ask for the same master
and settings share one session: they run one after another (``pytest_collection_finish``
puts each such group of modules together, ``module_groups``; modules that stop the session
on their own, ``SPARK_STOPS_SESSION = True``, last among them), and the session stops when the
last of them is done. Starting a session and its Python workers takes seconds of a 2-core
machine's time, and most modules need nothing of a session but its master and settings.
Modules that take the ``two_workers`` standalone cluster share it the same way. Whether a
session or cluster outlives a module is decided on the test this process runs next (pytest's
``nextitem``), never on the collection's order.

The README's ``pytest`` runs on two pytest-xdist workers (``pytest_cmdline_main``), each
group whole on one worker, the longest groups first (``xdist_scheduling``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import module_groups
import pytest
from module_groups import spark_kind, uses_spark

from allreduce_param.engine import AllReduceParameter, LocalRendezvous
from allreduce_param.spark.session import java_problem, prepare_local_environment

#: the job files (digits.toml, synthetic.toml)
JOB_FILES = Path(__file__).resolve().parents[1] / "conf"
#: the Spark settings for this machine (loopback addresses) that the tests start Spark with
CONF_DIR = JOB_FILES / "local"
prepare_local_environment()

#: The driver JVMs the tests start compile Java with C1 alone: this process's sessions, and
#: the jobs, Connect servers, notebooks and sessions the tests run in processes of their own
#: (they inherit the environment; spark-submit passes ``SPARK_SUBMIT_OPTS`` to the driver
#: JVM). A test's JVM lives seconds to minutes, and on a 2-core machine C2's compiler threads
#: take a third of its CPU time for code that ends before it pays back; what runs is the same.
#: The executors of a ``local-cluster`` session get it too (``_session_settings``), and every
#: JVM of the tests' standalone clusters (``standalone_cluster(java_options=...)``).
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1"
if TEST_JVM_OPTIONS not in os.environ.get("SPARK_SUBMIT_OPTS", ""):
    os.environ["SPARK_SUBMIT_OPTS"] = (
        f"{os.environ.get('SPARK_SUBMIT_OPTS', '')} {TEST_JVM_OPTIONS}".strip()
    )


def _session_settings(kind: tuple) -> dict:
    """The settings a session of ``kind`` starts with: the module's, and on a
    ``local-cluster`` the executors' JVMs (each a process of its own, launched by the
    workers in the driver's JVM, which ``SPARK_SUBMIT_OPTS`` does not reach) with
    ``TEST_JVM_OPTIONS`` too, after the module's own executor options."""
    master, settings = kind[0], dict(kind[1])
    if master.startswith("local-cluster"):
        key = "spark.executor.extraJavaOptions"
        settings[key] = f"{settings.get(key, '')} {TEST_JVM_OPTIONS}".strip()
    return settings


#: the session modules of one kind share: {"kind": ..., "session": ...} while one runs
_shared_spark: dict = {}


def _stop_shared_spark() -> None:
    session = _shared_spark.pop("session", None)
    _shared_spark.pop("kind", None)
    if session is not None:
        context = session.sparkContext
        # a stopped context has no application id; only a running local-cluster's is needed
        cluster = context.master.startswith("local-cluster") and _running(session)
        application = context.applicationId if cluster else None
        session.stop()
        if application is not None:
            _remove_worker_folder(application)


def _remove_worker_folder(application: str) -> None:
    """A ``local-cluster`` session's workers keep each application's executor logs in
    ``SPARK_HOME/work/<application id>``, and SPARK_HOME of a pip install is the installed
    pyspark package: remove the stopped application's folder (and ``work`` once empty), so
    the tests leave nothing in the installed packages."""
    from pyspark.find_spark_home import _find_spark_home

    work = Path(_find_spark_home()) / "work"
    if (work / application).exists():
        shutil.rmtree(work / application)
    if work.exists() and not any(work.iterdir()):
        # another test process's local-cluster may put its application there meanwhile
        with contextlib.suppress(OSError):
            work.rmdir()


def _running(session) -> bool:
    """Whether ``session``'s SparkContext is still the active one (a test may stop it)."""
    from pyspark import SparkContext

    return SparkContext._active_spark_context is session.sparkContext


@pytest.fixture(scope="module")
def spark(request):
    """The module's SparkSession: ``local[4]`` unless the module sets ``SPARK_MASTER``, with its
    ``SPARK_SETTINGS``; shared with the modules of the same kind that run right after it, and
    stopped when the last of them is done."""
    from allreduce_param.spark.session import local_spark

    kind = spark_kind(request.module)
    session = _shared_spark.get("session")
    if session is None or _shared_spark.get("kind") != kind or not _running(session):
        _stop_shared_spark()
        session = local_spark(
            kind[0],
            f"allreduce-param {request.module.__name__}",
            CONF_DIR,
            **_session_settings(kind),
        )
        _shared_spark.update(kind=kind, session=session)
    yield session
    if not _next_module_shares(request.session.items, request.module, kind):
        _stop_shared_spark()


#: module-spanning fixtures while the modules that take them run: name -> (value, ExitStack)
_shared_fixtures: dict = {}


def _shared_fixture(request, name: str, start: Callable):
    """``start(stack)``'s value, made for the first module that takes fixture ``name`` and
    kept for the modules that take it right after (``pytest_collection_modifyitems`` runs
    them one after another); ``stack`` (an ExitStack) closed after the last of them."""
    if name not in _shared_fixtures:
        stack = contextlib.ExitStack()
        try:
            _shared_fixtures[name] = (start(stack), stack)
        except BaseException:
            stack.close()
            raise
    yield _shared_fixtures[name][0]
    if not _next_module_takes(request.session.items, request.module, name):
        _shared_fixtures.pop(name)[1].close()


def _next_module_takes(items, module, name: str) -> bool:
    """Whether the module this process runs after ``module`` takes fixture ``name``."""
    following = _following_module(module)
    return following is not None and any(
        name in getattr(item, "fixturenames", ())
        for item in items
        if getattr(item, "module", None) is following
    )


#: the test this process runs after the one running now: pytest's ``nextitem`` (None after
#: the last). Under pytest-xdist a worker runs only the groups sent to it, in the order they
#: come, and it knows its next test before it starts one.
_following: list = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Note the test that runs after ``item``; returns None, so pytest runs ``item`` as ever."""
    _following[0] = nextitem


def _following_module(module):
    """The module of the test this process runs next, if that is another module than
    ``module`` (asked while ``module``'s last test is torn down)."""
    following = getattr(_following[0], "module", None)
    return None if following is module else following


@pytest.fixture(scope="module")
def two_workers(request, tmp_path_factory):
    """A standalone cluster (``harness.spark_standalone``) of a master and two one-core
    workers, and its simulated host: on 192.0.2.1 inside a simulated host
    (``harness.sim_hosts``: a network namespace of its own, whose only addresses are that
    and 127.0.0.1) where one can be made, else on 127.0.0.1 with ``host`` None and
    ``refusal`` saying why. ``(cluster, host, refusal)``. Shared by the modules that take it
    (test_network_namespace, test_standalone_cluster: a cluster's three JVMs start once).
    Every JVM of it (the daemons, and the drivers and executors of what ``cluster.run``
    submits) compiles with C1 alone and maps the class archive, when there is one
    (``class_archive_options``): both only shorten a JVM's start; what runs is the same."""

    def start(stack: contextlib.ExitStack):
        from harness.sim_hosts import simulated_hosts
        from harness.spark_standalone import (
            class_archive_options,
            python_environment,
            standalone_cluster,
        )

        host, refusal, where = None, None, {}
        try:
            host = stack.enter_context(simulated_hosts(1)).hosts[0]
            where = {"host": host.address, "prefix": host.prefix}
        except pytest.skip.Exception as skipped:
            refusal = str(skipped)
        cluster = stack.enter_context(
            standalone_cluster(
                tmp_path_factory.mktemp("two-workers"),
                environment=python_environment(),
                # every JVM of the cluster, the applications' drivers and executors too
                java_options=f"{TEST_JVM_OPTIONS} {class_archive_options()}".strip(),
                **where,
            )
        )
        return cluster, host, refusal

    yield from _shared_fixture(request, "two_workers", start)


def _next_module_shares(items, module, kind) -> bool:
    """Whether the module this process runs after ``module`` takes a session of the same kind."""
    following = _following_module(module)
    rest = [item for item in items if getattr(item, "module", None) is following]
    return following is not None and spark_kind(following) == kind and uses_spark(rest)


def pytest_collection_modifyitems(session, config, items):
    """Mark the tiers (see ``_mark_tiers``)."""
    _mark_tiers(items)


@pytest.hookimpl(tryfirst=True)  # the tests -k and -m left, before a worker reports them
def pytest_collection_finish(session):
    """Run the modules that take a session of the same kind one after another (see the
    module's docstring), the groups so made the costliest first (``module_groups``); the
    order within each module stays as it was. A pytest-xdist worker cuts the costliest
    groups into parts and writes every test's part where the controller's scheduler reads
    it (``xdist_scheduling``)."""
    worker = getattr(session.config, "workerinput", {})
    made = module_groups.parts(session.items, split=bool(worker))
    session.items[:] = [item for _, part in made for item in part]
    if SCOPES in worker:
        module_groups.write_scopes(worker[SCOPES], made)


def _mark_tiers(items) -> None:
    """The markers a test's set-up implies, so that ``-m`` selects by what a test needs: a
    test that takes the ``spark`` fixture is ``spark``, and ``cluster`` too where the module's
    master is a ``local-cluster`` (a JVM per executor). The others are written on the tests:
    ``spark`` on tests that start Spark in a process of their own, ``netns`` on tests that make
    network namespaces, ``slow`` on those the fast tier (``-m "not slow"``) leaves out."""
    for item in items:
        if "spark" not in getattr(item, "fixturenames", ()):
            continue
        item.add_marker(pytest.mark.spark)
        if spark_kind(item.module)[0].startswith("local-cluster"):
            item.add_marker(pytest.mark.cluster)


#: The README's ``pytest`` runs on this many pytest-xdist workers: two, not ``auto``. The
#: README's machine has 2 cores, and every worker starts JVMs and Python workers of its own
#: (a 16-core machine under ``auto`` would start 16 Spark drivers and their executors at once).
WORKERS = 2
#: the key of a worker's ``workerinput`` naming the file where it writes its tests' groups
SCOPES = "allreduce_param_scopes"
#: the controller's file of the tests' groups, while a distributed run lasts
_scopes_file: list = []


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Run the whole suite (no test files named: ``testpaths``) on ``WORKERS`` pytest-xdist
    workers, each group of modules whole on one worker (``--dist loadgroup``, scheduled by
    ``xdist_scheduling``). A run that names its tests, ``-n`` (``-n 0``: serial), ``--dist``,
    ``-p no:xdist`` (or no pytest-xdist installed), ``--pdb`` and ``--collect-only`` run as
    asked; a worker itself never starts workers."""
    if (
        config.pluginmanager.hasplugin("xdist")
        and not hasattr(config, "workerinput")
        and config.option.numprocesses is None
        and config.option.dist == "no"
        and not config.option.usepdb
        and not config.option.collectonly
        and config.args_source is pytest.Config.ArgsSource.TESTPATHS
    ):
        config.option.numprocesses = WORKERS
        config.option.dist = "loadgroup"


def _scopes() -> str:
    """The controller's file of the tests' groups (made on first use)."""
    if not _scopes_file:
        handle, path = tempfile.mkstemp(prefix="allreduce-param-groups-", suffix=".json")
        os.close(handle)
        _scopes_file.append(path)
    return _scopes_file[0]


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: none without it
def pytest_configure_node(node):
    """Tell each worker where to write its tests' groups."""
    node.workerinput[SCOPES] = _scopes()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadgroup``, send each group of modules (``module_groups``) whole to
    one worker, the costliest first (``xdist_scheduling``)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist_scheduling import GroupScheduling

    return GroupScheduling(config, log, _scopes())


def pytest_unconfigure(config):
    while _scopes_file:
        with contextlib.suppress(OSError):
            os.remove(_scopes_file.pop())
    stop_class_archive_driver()


def pytest_sessionfinish(session, exitstatus):
    _stop_shared_spark()  # after -x or an interruption, a shared session may still run
    while _shared_fixtures:  # and a shared cluster
        _shared_fixtures.popitem()[1][1].close()


def pytest_sessionstart(session):
    problem = java_problem()
    if problem:
        pytest.exit(problem, returncode=3)
    start_class_archive_driver(session.config)


#: the process saving the class archive for this run (``class_archive_driver.py``), if any
_archive_driver: list = []
#: how long the run's end waits for that process to finish its save, in seconds
ARCHIVE_DRIVER_PATIENCE = 120


def start_class_archive_driver(config) -> None:
    """In the controller of a whole distributed run (the README's ``pytest``: no test files
    named) where this Java and Spark have no class archive yet (a fresh clone's new
    environment), start ``class_archive_driver.py``, which saves it within a minute or two,
    before the workers start their sessions (pytest-xdist starts them after this hook): the
    run's later JVMs map it (see that script). Nothing where the archive is there, in a
    worker, in a serial run or one that names its tests (its first session saves the archive
    as it ends, as before), or where ``-m`` leaves out every Spark test."""
    distributed = getattr(config.option, "numprocesses", None) and config.option.dist != "no"
    if (
        hasattr(config, "workerinput")
        or not distributed
        or config.args_source is not pytest.Config.ArgsSource.TESTPATHS
        or config.option.collectonly
        or "not spark" in (config.option.markexpr or "")
        or not _class_archive_missing()
    ):
        return
    _archive_driver.append(
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("class_archive_driver.py")),
                str(CONF_DIR),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # stop_class_archive_driver ends its JVM and workers too
        )
    )


def _class_archive_missing() -> bool:
    """Whether this Java and Spark can have a class archive in the default folder and have
    none, nor a live process saving one (``ClassArchive.unsaved``)."""
    from pyspark.find_spark_home import _find_spark_home

    from allreduce_param.spark.class_archive import ClassArchive, default_folder
    from allreduce_param.spark.session import _java

    java, report, problem = _java()
    if not java or problem:
        return False
    return ClassArchive.unsaved(java, report, _find_spark_home(), default_folder())


def stop_class_archive_driver() -> None:
    """Let the archive's process finish its save (``ARCHIVE_DRIVER_PATIENCE``), then end it
    and what it started (a run shorter than its save loses the save, nothing else)."""
    while _archive_driver:
        process = _archive_driver.pop()
        try:
            process.wait(ARCHIVE_DRIVER_PATIENCE)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


#: Each test process's ports for ``free_ports``: a block of its own below the kernel's
#: ephemeral ports (``/proc/sys/net/ipv4/ip_local_port_range``, 32768 up by default), which
#: the kernel hands out for port 0 and for every outgoing connection, Spark's and the other
#: pytest-xdist worker's included; the blocks of up to 16 workers end below it.
PORT_BLOCK_START, PORT_BLOCK_SIZE = 20000, 750


#: where ``free_ports`` looks next in this process's block: after the last run it gave, so
#: that no test is given a port an earlier one's connections may still hold (TIME_WAIT)
_port_cursor: list = [0]


def free_ports(count: int) -> tuple[int, int]:
    """A run of ``count`` ports that are free on 127.0.0.1 now (first, last), for a server
    the test starts on a port it names. From this test process's own block
    (``PORT_BLOCK_START``), so that no other process is given one of them between this probe
    and the test's own bind: not the other pytest-xdist worker (``PYTEST_XDIST_WORKER``,
    ``gw<n>``), which probes a block of its own, and not a connection made meanwhile."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    start = PORT_BLOCK_START + PORT_BLOCK_SIZE * int(worker.removeprefix("gw") or 0)
    for step in range(PORT_BLOCK_SIZE // count):
        first = start + (_port_cursor[0] + step * count) % (PORT_BLOCK_SIZE - count + 1)
        held = []
        try:
            for port in range(first, first + count):
                held.append(socket.create_server(("127.0.0.1", port)))
            _port_cursor[0] = first + count - start
            return first, first + count - 1
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise AssertionError(
        f"no run of {count} free ports on 127.0.0.1 in {start}-{start + PORT_BLOCK_SIZE - 1}"
    )


def run_partitions(
    param: AllReduceParameter,
    body: Callable,
    timeout: float = 120.0,
    hosts: list[list[int]] | None = None,
) -> list:
    """Run ``body(p)`` on every partition of ``param``, one thread each; their results.

    ``p`` is the partition's connected handle, opened and closed here. Each result is the
    body's return value, or the exception it raised (for tests of failures). ``hosts``
    places the partitions on hosts (lists of partition ids): the meeting tells each
    partition the others' scopes as if each list were a machine of its own, so peers of
    one list meet over Unix sockets and shared memory and the others over TCP on
    127.0.0.1, as on several hosts (the real thing, namespaces, is ``test_sim_hosts``).
    """
    group = LocalRendezvous(param.partition_num, hosts=hosts)
    results: list = [None] * param.partition_num

    def partition(partition_id: int) -> None:
        member = group.member(partition_id)
        try:
            with param.connect(member) as p:
                results[partition_id] = body(p)
        except BaseException as error:  # the test inspects it
            results[partition_id] = error

    threads = [threading.Thread(target=partition, args=(i,)) for i in range(param.partition_num)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), f"a partition is still running after {timeout} s"
    return results


def train_on_threads(job, parts: list) -> list:
    """``train_partition(job, X, y, split, weight)`` for each ``(X, y)``, ``(X, y, split)``
    or ``(X, y, split, weight)`` of ``parts``, one thread each (named ``partition-<i>``);
    without ``split`` all rows train, without ``weight`` each counts once. Each partition's
    records by kind, or its error."""
    import numpy as np

    from allreduce_param.train.task.worker import train_partition

    group = LocalRendezvous(len(parts))
    outputs: list = [None] * len(parts)

    def run(i):
        X, y, *rest = parts[i]
        split = rest[0] if rest else np.zeros(X.shape[0], np.int32)
        weight = rest[1] if len(rest) > 1 else None
        try:
            outputs[i] = dict(train_partition(job, X, y, split, weight, rendezvous=group.member(i)))
        except BaseException as error:  # the test inspects it
            outputs[i] = error

    threads = [
        threading.Thread(target=run, args=(i,), name=f"partition-{i}") for i in range(len(parts))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a partition is still training after 120 s"
    return outputs


def random_rows(spark, seed: int, rows: int = 120, features: int = 6, classes: int = 3):
    """A DataFrame ``features array<float>, label double`` of normal features and uniform
    class labels (nothing to learn: for tests of what happens around a fit)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, rows)
    X = rng.standard_normal((rows, features)).astype(np.float32)
    return spark.createDataFrame(
        [(row.tolist(), float(label)) for row, label in zip(X, labels)],
        "features array<float>, label double",
    )


def blobs(rows: int, features: int, classes: int, seed: int):
    """A classification problem: Gaussian blobs around random centres; (X float32, y float64)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, rows)
    centres = rng.standard_normal((classes, features)).astype(np.float32) * 3
    return (
        centres[labels] + rng.standard_normal((rows, features)).astype(np.float32)
    ), labels.astype(np.float64)


def raise_first(results: list) -> list:
    """``results`` when no partition failed; otherwise re-raise the first failure."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
