"""Starting Spark on one machine for jobs, notebooks and tests: Java check, loopback, settings.

This is for ``local[*]`` and ``local-cluster[...]`` runs, where everything stays on
127.0.0.1 (the settings in ``conf/local``). A cluster run goes through ``spark-submit`` with
a cluster's settings (``conf/cluster/``), and there ``local_spark`` adds nothing of this
machine's: the loopback addresses would keep the executors from reaching the driver.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from allreduce_param.errors import ConfigurationError
from allreduce_param.spark.class_archive import ClassArchive

MIN_JAVA = 17
#: the Python worker daemon ``local_spark`` starts its workers with (``worker_daemon``)
WORKER_DAEMON = "allreduce_param.spark.worker_daemon"
DAEMON_SETTING = "spark.python.daemon.module"

_JAVA_HELP = (
    "Install a Java runtime 17 or newer, then run the command again: "
    "'sudo apt-get install openjdk-17-jre-headless' on Debian/Ubuntu, "
    "'sudo dnf install java-17-openjdk-headless' on Fedora/RHEL, "
    "'brew install openjdk@17' on macOS, or any JDK from https://adoptium.net; "
    "if it is installed already, set JAVA_HOME to its folder."
)


def java_problem() -> str | None:
    """Why Spark cannot start on this machine's Java, or None when Java 17+ is there."""
    return _java()[2]


def _java() -> tuple[str | None, str, str | None]:
    """The ``java`` Spark will run, its ``-version`` report, and ``java_problem()``."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not java or not Path(java).exists():
        where = f"JAVA_HOME={home} has no bin/java" if home else "no 'java' on the PATH"
        return (
            None,
            "",
            f"Spark needs Java {MIN_JAVA}+, and there is none here ({where}). {_JAVA_HELP}",
        )
    try:
        report = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=60
        ).stderr
    except (OSError, subprocess.SubprocessError) as error:
        return (
            java,
            "",
            f"Spark needs Java {MIN_JAVA}+, but '{java} -version' failed: {error}. {_JAVA_HELP}",
        )
    found = re.search(r'version "(\d+)(?:\.(\d+))?', report)
    if not found:
        return java, report, None  # an unusual build; let Spark judge it
    major = int(found.group(1))
    if major == 1 and found.group(2):  # "1.8.0" style
        major = int(found.group(2))
    if major < MIN_JAVA:
        return (
            java,
            report,
            f"Spark 4 needs Java {MIN_JAVA}+, but {java} is Java {major}. {_JAVA_HELP}",
        )
    return java, report, None


def under_spark_submit() -> bool:
    """Whether this Python was started by ``spark-submit`` (its JVM is already running)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def is_local_master(master: str) -> bool:
    """Whether ``master`` runs Spark on this machine alone: ``local``, ``local[...]`` or
    ``local-cluster[...]`` (``spark://``, ``yarn``, ``k8s://`` are clusters)."""
    return master == "local" or master.startswith(("local[", "local-cluster["))


#: the example settings in conf/cluster/ for each kind of cluster master
_CLUSTER_FILES = {"spark://": "standalone.conf", "yarn": "yarn.conf", "k8s://": "kubernetes.conf"}


def _cluster_master_problem(master: str) -> str:
    """Why a local session refuses the cluster ``master``, and the spark-submit command instead."""
    example = next(
        (name for prefix, name in _CLUSTER_FILES.items() if master.startswith(prefix)),
        "standalone.conf, yarn.conf or kubernetes.conf",
    )
    return (
        f"the Spark master {master!r} is a cluster, but this session is for one machine: it keeps Spark "
        "on loopback addresses (SPARK_LOCAL_IP=127.0.0.1, conf/local) that executors elsewhere cannot "
        f"reach. Run the job with spark-submit instead: spark-submit --master {master} --properties-file "
        f"conf/cluster/{example} jobs/train.py --conf <job file> (README: Running on a cluster); "
        "in code of your own, build the SparkSession yourself"
    )


def prepare_local_environment() -> None:
    """Set what a one-machine Spark run needs before its JVM starts.

    Loopback addresses (``SPARK_LOCAL_IP=127.0.0.1``) and executors that run this very Python
    (``PYSPARK_PYTHON``, which ``local-cluster`` executors start). Values already set in the
    environment win.
    """
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def local_spark(
    master: str | None = "local[*]",
    app_name: str = "allreduce-param",
    conf_dir: str | os.PathLike | None = None,
    class_archive: bool | str | os.PathLike = True,
    **settings: str,
):
    """A ``SparkSession`` on this machine only, after checking Java; stop it when done.

    ``master``: ``local[N]``, ``local[*]`` or ``local-cluster[...]``; a cluster's master
    (``spark://``, ``yarn``, ``k8s://``) is refused with a ``ConfigurationError`` that gives
    the ``spark-submit`` command instead, because this session's loopback addresses would
    keep that cluster's executors from reaching the driver. ``None`` leaves the master to
    whoever starts the JVM (``spark-submit --master``; ``local[*]`` otherwise).

    Under ``spark-submit`` (``under_spark_submit()``) the JVM is running already, started
    with ``spark-submit``'s own settings, which rule: this only builds the session, with
    ``master`` and ``settings`` when given. ``conf_dir``, the loopback environment
    (``prepare_local_environment``), the Java check and the class archive are left out, so
    nothing meant for one machine reaches a cluster run.

    ``conf_dir``: a folder with a ``spark-defaults.conf`` (and optionally a
    ``log4j2.properties``), e.g. ``conf/local``, read as ``SPARK_CONF_DIR`` would be, but
    kept off the driver's class path, where a folder would rule out the class archive.

    ``class_archive``: when this call starts the driver JVM, it maps the classes an earlier
    session saved (``class_archive.ClassArchive``), which shortens its start and first query, and the first
    session saves them as its JVM exits. True keeps them in ``~/.cache/allreduce-param``
    (about 160 MB); a folder keeps them there; False turns this off.

    ``settings``: extra Spark settings by their full names, e.g.
    ``**{"spark.task.maxFailures": "1"}``. Unless they name one, the Python workers start
    from ``worker_daemon`` (``spark.python.daemon.module``): PySpark's daemon, importing the
    installed pyspark's compiled files instead of compiling its source archive in each worker.
    """
    if not isinstance(class_archive, (bool, str, os.PathLike)):
        raise ConfigurationError(
            f"class_archive must be True, False or a folder, got {class_archive!r}"
        )
    from pyspark import SparkContext
    from pyspark.find_spark_home import _find_spark_home
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    if under_spark_submit():  # spark-submit's settings rule: add nothing of this machine's
        for key, value in settings.items():
            builder = builder.config(key, value)
        return builder.getOrCreate()
    if master and not is_local_master(master):
        raise ConfigurationError(_cluster_master_problem(master))
    java, report, problem = _java()
    if problem:
        raise ConfigurationError(problem)
    prepare_local_environment()
    driver_options: list[str] = []
    submit_args = os.environ.get("PYSPARK_SUBMIT_ARGS", "pyspark-shell")
    if conf_dir is not None:
        conf_dir = Path(conf_dir).resolve()
        if not (conf_dir / "spark-defaults.conf").is_file():
            raise ConfigurationError(f"{conf_dir} has no spark-defaults.conf")
        submit_args = (
            f"--properties-file {shlex.quote(str(conf_dir / 'spark-defaults.conf'))} {submit_args}"
        )
        if (conf_dir / "log4j2.properties").is_file():
            driver_options.append(f"-Dlog4j2.configurationFile={conf_dir / 'log4j2.properties'}")
        # executors of local-cluster masters are JVMs of their own: they read the folder itself
        settings.setdefault("spark.executorEnv.SPARK_CONF_DIR", str(conf_dir))
    if conf_dir is None or not _file_sets(conf_dir / "spark-defaults.conf", DAEMON_SETTING):
        # the Python workers import the installed, compiled pyspark, not its source archive
        settings.setdefault(DAEMON_SETTING, WORKER_DAEMON)
    for key, value in settings.items():
        builder = builder.config(key, value)
    archive = None
    starting_jvm = SparkContext._gateway is None
    if (
        starting_jvm
        and class_archive is not False
        and "spark.driver.extraClassPath" not in settings
    ):
        archive = ClassArchive.for_driver(
            java, report, _find_spark_home(), None if class_archive is True else class_archive
        )
        if archive is not None:
            driver_options += archive.java_options()
    if not starting_jvm:
        return builder.getOrCreate()
    launch = {
        "PYSPARK_SUBMIT_ARGS": submit_args,
        "SPARK_SUBMIT_OPTS": " ".join(
            [
                os.environ.get("SPARK_SUBMIT_OPTS", ""),
                *(shlex.quote(option) for option in driver_options),
            ]
        ).strip(),
    }
    with _environment(launch):
        session = builder.getOrCreate()
    launched = {"spark.app.name", *settings, *(["spark.master"] if master else [])}
    _forget_session_settings(SparkContext._jvm, launched, conf_dir)
    if archive is not None:
        archive.save_when_jvm_exits(SparkContext._gateway.proc)
    return session


def _file_sets(properties: Path, key: str) -> bool:
    """Whether the Spark properties file ``properties`` sets ``key``."""
    with open(properties, encoding="utf-8") as file:
        return any(re.match(rf"\s*{re.escape(key)}\s*[=:\s]", line) for line in file)


def _forget_session_settings(jvm, keys, conf_dir: Path | None) -> None:
    """Take a session's own settings (``keys``) back out of its JVM's system properties.

    PySpark starts the driver JVM with the first session's settings as ``--conf``, which
    makes them system properties for the JVM's life, and every later ``SparkConf`` of this
    process loads those: a next session would inherit them (``spark.authenticate`` would
    make a ``local-cluster`` session ask for a secret). The running context keeps its own
    copy; the system properties go back to what ``conf_dir``'s spark-defaults.conf says,
    which later sessions of this JVM are meant to share.
    """
    defaults = jvm.java.util.Properties()
    if conf_dir is not None:
        reader = jvm.java.io.InputStreamReader(
            jvm.java.io.FileInputStream(str(conf_dir / "spark-defaults.conf")), "UTF-8"
        )
        try:
            defaults.load(reader)
        finally:
            reader.close()
    system = jvm.java.lang.System
    for key in keys:
        value = defaults.getProperty(key)
        if value is None:
            system.clearProperty(key)
        else:
            system.setProperty(key, value.strip())


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``values`` in ``os.environ`` while the block runs (Spark's launcher reads them), then as before."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_python_workers(spark) -> threading.Thread:
    """Start the executors' Python workers in the background, on a thread of the driver's.

    A new session's first Python job pays for Spark's first job and for forking each task
    slot's Python worker and importing numpy, Arrow and the trainer there: seconds that a
    job which reads its data first (on the driver) can spend meanwhile instead. This runs one
    task per slot through ``mapInArrow`` (the path a fit's data takes) that imports the
    trainer; Spark then reuses those workers. Join the thread before stopping the session;
    a failure here is ignored (the fit would meet it itself, with its own message).
    """
    slots = spark.sparkContext.defaultParallelism

    def import_trainer(batches):
        import importlib

        importlib.import_module("allreduce_param.train.task.worker")  # what a fit's task unpickles
        yield from batches

    def run() -> None:
        try:
            spark.range(0, slots, numPartitions=slots).mapInArrow(
                import_trainer, "id long"
            ).collect()
        except Exception:  # noqa: BLE001 - only a head start; the fit reports its own errors
            pass

    thread = threading.Thread(target=run, name="allreduce-warm-up", daemon=True)
    thread.start()
    return thread
