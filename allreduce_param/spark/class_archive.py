"""A class-data archive for the Spark driver's JVM, so that a local session starts sooner.

A new JVM loads and verifies tens of thousands of Spark classes before it answers its
first query, and that, not our code, is most of a fresh session's start and of its first
fit's first job. HotSpot can save the classes a run loaded to a file when the JVM exits
(AppCDS, ``-XX:ArchiveClassesAtExit``) and map them from that file in later JVMs
(``-XX:SharedArchiveFile``), which skips most of that work. ``session.local_spark`` does this for
the driver JVM it launches: the first session on a machine saves the archive as its JVM
exits, and later ones use it.

HotSpot takes an archive only for the very class path and Java build it was made with, and
makes none when a directory with files in it is on the class path (``SPARK_CONF_DIR``, a
Hadoop configuration folder). The archive's name is a digest of both, so a new Java or
Spark gets an archive of its own; with a directory on the class path there is no archive.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

from allreduce_param.errors import ConfigurationError

SUFFIX = ".jsa"
PARTIAL = ".partial"
#: Environment variables whose folders Spark's launcher puts on the driver's class path.
CLASS_PATH_FOLDERS = (
    "SPARK_CONF_DIR",
    "HADOOP_CONF_DIR",
    "YARN_CONF_DIR",
    "SPARK_DIST_CLASSPATH",
    "SPARK_CLASSPATH",
    "SPARK_PREPEND_CLASSES",
)
#: An archive no session has used for this long (a Java or Spark since replaced) is deleted.
UNUSED_DAYS = 30
#: How long the first session's exit waits for its JVM to write the archive, in seconds.
SAVE_PATIENCE = 300.0
#: Keeps HotSpot from printing its archive notices (skipped classes, an archive it cannot use).
QUIET = "-Xlog:cds*=off"


def default_folder() -> Path:
    """Where archives are kept: ``$XDG_CACHE_HOME/allreduce-param``, or ``~/.cache/allreduce-param``."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "allreduce-param"


def archive_name(java: str, version_report: str, spark_home: str | os.PathLike) -> str | None:
    """The file name of the archive for this Java and this Spark's class path, or None when
    HotSpot could not make one: a JVM other than HotSpot, or a directory on the class path."""
    if (
        not re.search(r"HotSpot|OpenJDK 64-Bit Server VM", version_report)
        or "OpenJ9" in version_report
    ):
        return None
    if any(os.environ.get(name) for name in CLASS_PATH_FOLDERS):
        return None
    spark_home = Path(spark_home)
    conf = spark_home / "conf"
    if conf.is_dir() and any(conf.iterdir()):
        return None
    jars = sorted(
        (jar.name, jar.stat().st_size, int(jar.stat().st_mtime))
        for jar in (spark_home / "jars").glob("*.jar")
    )
    if not jars:
        return None
    identity = repr((os.path.realpath(java), version_report, str(spark_home.resolve()), jars))
    return "spark-driver-" + hashlib.sha256(identity.encode()).hexdigest()[:20] + SUFFIX


class ClassArchive:
    """The archive one driver JVM uses, or saves when it has none yet.

    Made before the JVM starts: ``java_options`` go on its command line. When they save
    the archive, ``save_when_jvm_exits`` must be given the JVM's process once it runs.
    """

    def __init__(self, folder: Path, name: str):
        self.path = folder / name
        self.saving = not self.path.is_file()
        # each saving JVM writes its own file, renamed into place only once it is whole
        self.partial = folder / f"{name}.{uuid.uuid4().hex[:8]}{PARTIAL}"
        self.claim = folder / f"{name}.saving"
        if not self.saving:
            try:
                os.utime(self.path)  # in use: not one to delete as unused
            except OSError:
                pass  # a read-only cache: the archive is still used

    def _claim(self) -> bool:
        """Whether this session is the one to save the archive: one at a time, so that
        sessions started together do not each spend the save's time on the same file."""
        for _ in range(2):
            try:
                with open(self.claim, "x") as file:
                    file.write(str(os.getpid()))
                return True
            except FileExistsError:
                if not self._claim_is_stale():
                    return False
                self.claim.unlink(missing_ok=True)
        return False

    def _claim_is_stale(self) -> bool:
        """A claim whose process has ended, or older than a day."""
        try:
            owner = int(self.claim.read_text() or 0)
            if time.time() - self.claim.stat().st_mtime > 86400 or owner <= 0:
                return True
            os.kill(owner, 0)
            return False
        except ProcessLookupError:
            return True
        except (OSError, ValueError):
            return False

    @classmethod
    def for_driver(
        cls,
        java: str,
        version_report: str,
        spark_home: str | os.PathLike,
        folder: str | os.PathLike | None = None,
    ) -> ClassArchive | None:
        """The archive for a driver JVM about to start, or None when there can be none here.

        ``folder`` None means ``default_folder()``, which is skipped quietly when it cannot be
        made or written to; a folder the caller names that cannot is a ConfigurationError. A
        folder that already holds the archive is only read.
        """
        name = archive_name(java, version_report, spark_home)
        if name is None:
            return None
        where = Path(folder) if folder is not None else default_folder()
        try:
            where.mkdir(parents=True, exist_ok=True)
            archive = cls(where, name)
            # only a session that saves writes there: its claim is the test that it can
            if archive.saving and not archive._claim():
                return None  # another session is saving it now; the next one uses it
        except OSError as error:
            if folder is None:
                return None
            raise ConfigurationError(
                f"class_archive={str(folder)!r} cannot hold the JVM's class archive ({error}); "
                "name a folder you can write to, or pass class_archive=False"
            ) from None
        return archive

    @classmethod
    def unsaved(
        cls, java: str, version_report: str, spark_home: str | os.PathLike, folder: Path
    ) -> bool:
        """Whether this Java and Spark can have an archive in ``folder`` and it has none, nor
        a live session saving one (a claim that is not stale): a driver started now would
        save it."""
        name = archive_name(java, version_report, spark_home)
        if name is None:
            return False
        archive = cls(folder, name)
        return archive.saving and (not archive.claim.exists() or archive._claim_is_stale())

    def java_options(self) -> list[str]:
        """The options that make the JVM map this archive, or save one as it exits."""
        if self.saving:
            return [f"-XX:ArchiveClassesAtExit={self.partial}", QUIET]
        return [f"-XX:SharedArchiveFile={self.path}", QUIET]

    def save_when_jvm_exits(self, jvm) -> None:
        """At this Python's exit, end the JVM (``jvm``, its ``Popen``), wait while it writes
        the archive, and put the archive in place. Nothing to do for a JVM that maps one."""
        if self.saving:
            atexit.register(self._save, jvm)

    def _save(self, jvm) -> None:
        try:
            self._wait_and_place(jvm)
        finally:
            self.claim.unlink(missing_ok=True)

    def _wait_and_place(self, jvm) -> None:
        if jvm.poll() is None:
            print(
                f"allreduce-param: saving the Spark driver's classes to {self.path} "
                "(once: later sessions start sooner)",
                file=sys.stderr,
                flush=True,
            )
            try:
                jvm.stdin.close()  # Spark's gateway JVM exits when its stdin ends
                jvm.wait(timeout=SAVE_PATIENCE)
            except (OSError, subprocess.TimeoutExpired):
                return  # a partial file is left behind; a later save deletes it
        if jvm.returncode == 0 and self.partial.is_file() and self.partial.stat().st_size > 0:
            os.replace(self.partial, self.path)
            self._delete_unused()
        else:
            self.partial.unlink(missing_ok=True)

    def _delete_unused(self) -> None:
        """Archives of a Java or Spark no session has used in ``UNUSED_DAYS``, and partial
        files of saves that never ended."""
        now = time.time()
        for file in self.path.parent.iterdir():
            try:
                age = now - file.stat().st_mtime
                if file != self.path and (
                    file.name.endswith(SUFFIX)
                    and age > UNUSED_DAYS * 86400
                    or file.name.endswith(PARTIAL)
                    and age > 86400
                ):
                    file.unlink()
            except OSError:
                pass  # another session's cleaning got there first
