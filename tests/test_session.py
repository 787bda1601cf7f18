"""The Java check that both README commands run before Spark starts, what a local session
leaves out where it must not apply (a cluster's master, runs under spark-submit), and what it
leaves behind for the next session of the process (none of its own settings)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from allreduce_param import ConfigurationError
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


TWO_SESSIONS = textwrap.dedent("""
    import sys
    from allreduce_param.spark.session import local_spark
    own = {"spark.authenticate": "true", "spark.sql.shuffle.partitions": "3"}
    first = local_spark("local[1]", "first", sys.argv[1], **own)
    conf = first.sparkContext.getConf()
    print("first", conf.get("spark.authenticate"), first.conf.get("spark.sql.shuffle.partitions"))
    first.stop()
    second = local_spark("local[1]", "second", sys.argv[1])
    conf = second.sparkContext.getConf()
    print("second", conf.get("spark.authenticate"), second.conf.get("spark.sql.shuffle.partitions"))
    second.stop()
""")


@pytest.mark.slow
@pytest.mark.spark
def test_the_next_session_of_a_process_has_the_conf_folder_but_not_the_first_ones_settings():
    """The first session starts the JVM, whose system properties every later session's conf
    loads: its own settings must not stay there (a ``local-cluster`` session after one with
    ``spark.authenticate`` failed to start), the conf folder's must."""
    done = subprocess.run(
        [sys.executable, "-c", TWO_SESSIONS, str(REPO / "conf" / "local")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "first true 3" in done.stdout
    assert "second None 4" in done.stdout  # 4: conf/local/spark-defaults.conf
