"""The driver JVM's class archive: saved once, whole or not at all, used by the next session.

That a real session saves it and the next process's session maps it is test_session's
(``test_a_session_saves_the_archive_and_the_next_process_maps_it``): its processes of
sessions serve that and its check of what a session leaves the next one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from allreduce_param import ConfigurationError
from allreduce_param.spark.class_archive import (
    CLASS_PATH_FOLDERS,
    PARTIAL,
    SUFFIX,
    UNUSED_DAYS,
    ClassArchive,
    archive_name,
)

REPO = Path(__file__).resolve().parents[1]
HOTSPOT = 'openjdk version "17.0.9"\nOpenJDK Runtime Environment\nOpenJDK 64-Bit Server VM (build 17.0.9, mixed mode)'


def spark_home(folder: Path, jars: dict[str, bytes]) -> Path:
    (folder / "jars").mkdir(parents=True)
    for name, content in jars.items():
        (folder / "jars" / name).write_bytes(content)
    return folder


@pytest.fixture
def home(tmp_path, monkeypatch):
    for name in CLASS_PATH_FOLDERS:
        monkeypatch.delenv(name, raising=False)
    return spark_home(
        tmp_path / "spark", {"spark-core.jar": b"core", "scala-library.jar": b"scala"}
    )


def test_the_name_follows_the_java_and_the_class_path(home, tmp_path):
    name = archive_name("/usr/bin/java", HOTSPOT, home)
    assert name.endswith(SUFFIX) and name == archive_name("/usr/bin/java", HOTSPOT, home)
    assert archive_name("/usr/bin/java", HOTSPOT.replace("17.0.9", "17.0.10"), home) != name
    (home / "jars" / "spark-core.jar").write_bytes(b"a newer core")
    assert archive_name("/usr/bin/java", HOTSPOT, home) != name


def test_no_archive_where_hotspot_could_not_make_one(home, monkeypatch):
    openj9 = 'openjdk version "17.0.9"\nEclipse OpenJ9 VM (build openj9-0.41.0)'
    assert archive_name("/usr/bin/java", openj9, home) is None
    (home / "conf").mkdir()
    assert archive_name("/usr/bin/java", HOTSPOT, home) is not None  # an empty folder is allowed
    (home / "conf" / "spark-defaults.conf").write_text("spark.ui.enabled false\n")
    assert archive_name("/usr/bin/java", HOTSPOT, home) is None
    (home / "conf" / "spark-defaults.conf").unlink()
    monkeypatch.setenv("SPARK_CONF_DIR", str(REPO / "conf" / "local"))
    assert archive_name("/usr/bin/java", HOTSPOT, home) is None


def test_a_folder_that_cannot_hold_it_is_named(home, tmp_path, monkeypatch):
    taken = tmp_path / "a-file"
    taken.write_text("")
    with pytest.raises(
        ConfigurationError, match="a-file.*cannot hold the JVM's class archive.*class_archive=False"
    ):
        ClassArchive.for_driver("/usr/bin/java", HOTSPOT, home, taken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(taken))  # the default folder: quietly none
    assert ClassArchive.for_driver("/usr/bin/java", HOTSPOT, home) is None


def test_a_setting_that_is_not_a_folder_is_named():
    from allreduce_param.spark.session import local_spark

    with pytest.raises(
        ConfigurationError, match="class_archive must be True, False or a folder, got 1"
    ):
        local_spark(class_archive=1)


def test_one_session_at_a_time_saves_it(home, tmp_path):
    cache = tmp_path / "cache"
    assert ClassArchive.unsaved("/usr/bin/java", HOTSPOT, home, cache)
    first = ClassArchive.for_driver("/usr/bin/java", HOTSPOT, home, cache)
    assert first.saving and first.java_options()[0] == f"-XX:ArchiveClassesAtExit={first.partial}"
    assert ClassArchive.for_driver("/usr/bin/java", HOTSPOT, home, cache) is None
    assert not ClassArchive.unsaved("/usr/bin/java", HOTSPOT, home, cache)  # being saved
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    first.claim.write_text(str(ended.pid))  # its session ended without saving: taken over
    assert ClassArchive.unsaved("/usr/bin/java", HOTSPOT, home, cache)
    assert ClassArchive.for_driver("/usr/bin/java", HOTSPOT, home, cache).saving
    first.path.write_bytes(b"classes")  # saved
    assert not ClassArchive.unsaved("/usr/bin/java", HOTSPOT, home, cache)


def test_only_a_whole_archive_is_put_in_place(home, tmp_path):
    folder = tmp_path / "cache"
    archive = ClassArchive.for_driver("/usr/bin/java", HOTSPOT, home, folder)
    archive.partial.write_bytes(b"classes")
    failed = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.exit(1)"], stdin=subprocess.PIPE
    )
    archive._save(failed)
    assert not archive.path.exists() and not archive.partial.exists() and not archive.claim.exists()

    archive = ClassArchive.for_driver("/usr/bin/java", HOTSPOT, home, folder)
    old_archive, old_partial, recent = (
        folder / f"spark-driver-old{SUFFIX}",
        folder / f"x{PARTIAL}",
        folder / f"new{SUFFIX}",
    )
    for file in (old_archive, old_partial, recent):
        file.write_bytes(b"x")
    long_ago = time.time() - (UNUSED_DAYS + 1) * 86400
    os.utime(old_archive, (long_ago, long_ago))
    os.utime(old_partial, (long_ago, long_ago))
    archive.partial.write_bytes(b"classes")
    # a process that runs until its stdin ends, as Spark's gateway JVM does
    running = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    archive._save(running)
    assert running.returncode == 0 and archive.path.read_bytes() == b"classes"
    assert sorted(file.name for file in folder.iterdir()) == sorted(
        [archive.path.name, recent.name]
    )
    user = ClassArchive.for_driver("/usr/bin/java", HOTSPOT, home, folder)
    assert not user.saving and user.java_options()[0] == f"-XX:SharedArchiveFile={archive.path}"
