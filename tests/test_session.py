"""The Java check that both README commands run before Spark starts, what a local session
leaves out where it must not apply (a cluster's master, runs under spark-submit), and what it
leaves behind: for the next session of the process none of its own settings, for the next
process the driver JVM's class archive (one pair of processes serves both)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from allreduce_param import ConfigurationError
from allreduce_param.spark.class_archive import CLASS_PATH_FOLDERS, SUFFIX
from allreduce_param.spark.session import java_problem, local_spark

REPO = Path(__file__).resolve().parents[1]


def fake_java(folder: Path, version_line: str) -> Path:
    """A `java` that reports ``version_line``, as an old JDK would (we cannot install one here)."""
    java = folder / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    return java


def test_the_java_here_is_good_enough():
    assert java_problem() is None


def test_no_java_on_the_path_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    problem = java_problem()
    assert "Spark needs Java 17+" in problem and "no 'java' on the PATH" in problem
    assert "apt-get install openjdk-17-jre-headless" in problem and "JAVA_HOME" in problem


def test_java_home_without_java(monkeypatch, tmp_path):
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    assert f"JAVA_HOME={tmp_path} has no bin/java" in java_problem()


@pytest.mark.parametrize(
    "line, major", [('openjdk version "11.0.2" 2019-01-15', 11), ('java version "1.8.0_392"', 8)]
)
def test_an_old_java_is_named(monkeypatch, tmp_path, line, major):
    fake_java(tmp_path, line)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    assert f"is Java {major}." in java_problem()
    with pytest.raises(ConfigurationError, match=f"is Java {major}"):
        local_spark()  # refuses before any JVM starts


@pytest.mark.slow
def test_the_main_job_says_so_and_exits_without_a_traceback(tmp_path):
    environment = {
        **os.environ,
        "JAVA_HOME": str(tmp_path),
        "PATH": str(Path(sys.executable).parent),
    }
    done = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "bench_allreduce.py")],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "has no bin/java" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_the_train_command_says_so_and_exits_without_a_traceback(tmp_path):
    environment = {
        **os.environ,
        "JAVA_HOME": str(tmp_path),
        "PATH": str(Path(sys.executable).parent),
    }
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "jobs" / "train.py"),
            "--conf",
            str(REPO / "conf" / "digits.toml"),
        ],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert (
        "has no bin/java" in done.stderr
        and "apt-get install" in done.stderr
        and "Traceback" not in done.stderr
    )


@pytest.mark.parametrize(
    "master, example",
    [
        ("spark://10.0.3.2:7077", "standalone.conf"),
        ("yarn", "yarn.conf"),
        ("k8s://https://10.0.3.1:6443", "kubernetes.conf"),
    ],
)
def test_a_cluster_master_is_refused_with_the_spark_submit_command(master, example):
    # a local session's loopback addresses would keep that cluster's executors from the driver
    with pytest.raises(
        ConfigurationError,
        match=rf"spark-submit --master {master} --properties-file "
        rf"conf/cluster/{example} jobs/train.py",
    ):
        local_spark(master)  # refused before any JVM starts


def test_under_spark_submit_nothing_of_this_machine_is_applied(monkeypatch, tmp_path):
    import allreduce_param.spark.session as session

    built = []

    class Builder:  # stands in for SparkSession.builder: records what the session would be built with
        def appName(self, name):
            return self

        def master(self, master):
            built.append(("master", master))
            return self

        def config(self, key, value):
            built.append((key, value))
            return self

        def getOrCreate(self):
            return "session"

    from pyspark.sql import SparkSession

    monkeypatch.setattr(SparkSession, "builder", Builder())
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")  # as spark-submit's Python has it
    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.setattr(
        session, "_java", lambda: pytest.fail("no Java check: the JVM runs already")
    )
    assert (
        local_spark(None, conf_dir=tmp_path / "missing", **{"spark.task.maxFailures": "1"})
        == "session"
    )
    assert built == [
        ("spark.task.maxFailures", "1")
    ]  # no conf_dir, no SPARK_CONF_DIR for the executors
    assert "SPARK_LOCAL_IP" not in os.environ and "PYSPARK_PYTHON" not in os.environ


#: Sessions in a process of their own: argv[1] their folder (its conf/ and cache/), argv[2]
#: "first" or "next". A "first" process starts the JVM with a session of its own settings,
#: whose JVM saves the class archive when the process ends, then runs a second session
#: without them (no query in either: the saving JVM writes every class it loaded, and a
#: query's are a quarter of its CPU time); a "next" process maps the archive, with the JVM's
#: class loading logged to argv[3], and runs a query.
SESSIONS = textwrap.dedent("""
    import sys
    from allreduce_param.spark.session import local_spark
    folder, which = sys.argv[1], sys.argv[2]
    place = {"conf_dir": folder + "/conf", "class_archive": folder + "/cache"}
    if which == "first":
        own = {"spark.authenticate": "true", "spark.sql.shuffle.partitions": "3"}
        first = local_spark("local[1]", "first", **place, **own)
        conf = first.sparkContext.getConf()
        print("first", conf.get("spark.authenticate"), first.conf.get("spark.sql.shuffle.partitions"))
        first.stop()
        second = local_spark("local[1]", "second", **place)
        conf = second.sparkContext.getConf()
        print("second", conf.get("spark.authenticate"), second.conf.get("spark.sql.shuffle.partitions"))
        system = second.sparkContext._jvm.java.lang.System
        print("log4j", system.getProperty("log4j2.configurationFile"))
        second.stop()
    else:
        logged = {"spark.driver.extraJavaOptions": f"-Xlog:class+load=info:file={sys.argv[3]}"}
        spark = local_spark("local[1]", "next", **place, **logged)
        print("rows", spark.range(5).count())
        spark.stop()
""")


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """The outputs of a "first" process of sessions, then a "next" one (``SESSIONS``), their
    folder holding a copy of conf/local, and the next one's class loading log."""
    folder = tmp_path_factory.mktemp("sessions")
    (folder / "conf").mkdir()
    for name in ("spark-defaults.conf", "log4j2.properties"):
        (folder / "conf" / name).write_text((REPO / "conf" / "local" / name).read_text())
    environment = {key: value for key, value in os.environ.items() if key not in CLASS_PATH_FOLDERS}

    def process(*arguments: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [sys.executable, "-c", SESSIONS, str(folder), *arguments],
            env=environment,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        return done

    first = process("first")
    saved = sorted((folder / "cache").iterdir())
    loaded = folder / "loaded.log"
    return {"folder": folder, "first": first, "saved": saved, "next": process("next", str(loaded))}


@pytest.mark.slow
@pytest.mark.spark
def test_the_next_session_of_a_process_has_the_conf_folder_but_not_the_first_ones_settings(
    sessions,
):
    """The first session starts the JVM, whose system properties every later session's conf
    loads: its own settings must not stay there (a ``local-cluster`` session after one with
    ``spark.authenticate`` failed to start), the conf folder's must."""
    first = sessions["first"]
    assert "first true 3" in first.stdout
    assert "second None 4" in first.stdout  # 4: conf/local/spark-defaults.conf
    assert f"log4j {sessions['folder'] / 'conf' / 'log4j2.properties'}" in first.stdout


@pytest.mark.slow
@pytest.mark.spark
def test_a_session_saves_the_archive_and_the_next_process_maps_it(sessions):
    """The driver JVM's class archive (``spark.class_archive``), saved as the first process
    ends, whole; the next process's driver maps it, and its query runs."""
    assert "saving the Spark driver's classes" in sessions["first"].stderr
    saved = sessions["saved"]
    assert len(saved) == 1 and saved[0].name.endswith(SUFFIX) and saved[0].stat().st_size > 0
    after = sessions["next"]
    assert "rows 5" in after.stdout and "saving" not in after.stderr
    spark_classes = [
        line
        for line in (sessions["folder"] / "loaded.log").read_text().splitlines()
        if " org.apache.spark.SparkContext " in line
    ]
    assert spark_classes and "shared objects file (top)" in spark_classes[0]
