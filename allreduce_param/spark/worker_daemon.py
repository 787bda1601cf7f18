"""Spark's Python worker daemon for sessions on this machine: pyspark from its compiled files.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` first on every Python worker's path. Where
PySpark was installed by pip, that archive holds the installed package's own sources, but
sources only, and Python caches nothing it compiles from a zip: every worker process
compiles again the pyspark modules it imports (``pyspark.worker``, which PySpark imports
after each fork, and what it needs), about 1.5 s of CPU a worker on a 2-core machine, paid
for each task slot of each session and again for each worker that a failed task ends.

``local_spark`` names this module as ``spark.python.daemon.module``. Started by Spark in
place of ``pyspark.daemon``, it takes the archive off the path when the installed package
is the same version (the same ``pyspark/version.py``), so the daemon and the workers it
forks import the installed, compiled package; then it runs PySpark's own daemon. Where the
two differ, or pyspark is not installed beside the archive (a cluster's ``SPARK_HOME``),
the path stays as Spark made it.
"""

from __future__ import annotations

import os
import sys
import zipfile
from importlib.machinery import PathFinder

#: the archive of PySpark's sources that Spark puts first on its Python workers' path
ARCHIVE_NAME = "pyspark.zip"


def _archive_version(archive: str) -> str | None:
    """The text of ``pyspark/version.py`` in ``archive``; None when it cannot be read."""
    try:
        with zipfile.ZipFile(archive) as opened:
            return opened.read("pyspark/version.py").decode("utf-8")
    except (OSError, KeyError, zipfile.BadZipFile, UnicodeDecodeError):
        return None


def _installed_version(path: list[str]) -> str | None:
    """The text of the ``pyspark/version.py`` that ``path`` (without the archive) finds."""
    spec = PathFinder.find_spec("pyspark", path)
    if spec is None or not spec.submodule_search_locations:
        return None
    version = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
    try:
        with open(version, encoding="utf-8") as file:
            return file.read()
    except OSError:
        return None


def use_installed_pyspark() -> bool:
    """Take PySpark's source archive off ``sys.path`` and ``PYTHONPATH`` when the package
    installed beside it is the same version; whether it did. Call before pyspark is imported.
    """
    archives = [entry for entry in sys.path if os.path.basename(entry) == ARCHIVE_NAME]
    if not archives or "pyspark" in sys.modules:
        return False
    rest = [entry for entry in sys.path if entry not in archives]
    installed = _installed_version(rest)
    if installed is None or any(_archive_version(archive) != installed for archive in archives):
        return False
    sys.path[:] = rest
    # processes a task starts (their own Python) find the same package as the task
    kept = [
        entry
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry and entry not in archives
    ]
    os.environ["PYTHONPATH"] = os.pathsep.join(kept)
    return True


def main() -> None:
    """Run PySpark's daemon, from the installed package where it is the archive's twin."""
    use_installed_pyspark()
    from pyspark.daemon import manager

    manager()


if __name__ == "__main__":
    main()
