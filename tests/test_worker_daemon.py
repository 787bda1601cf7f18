"""The Python worker daemon of local sessions: pyspark from the installed package, not its archive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pyspark

from allreduce_param.spark.worker_daemon import ARCHIVE_NAME

#: Runs ``use_installed_pyspark`` in a fresh Python (pyspark not yet imported) with
#: ``PYTHONPATH`` as Spark gives its workers (the archive first), and prints what it did.
PROBE = textwrap.dedent("""
    import json, os, sys
    from allreduce_param.spark.worker_daemon import use_installed_pyspark
    used = use_installed_pyspark()
    print(json.dumps({"used": used, "path": sys.path, "env": os.environ["PYTHONPATH"],
                      "imported": "pyspark" in sys.modules}))
""")


def _archive(folder: Path, version_text: str) -> Path:
    """A ``pyspark.zip`` in ``folder`` whose ``pyspark/version.py`` says ``version_text``."""
    archive = folder / ARCHIVE_NAME
    with zipfile.ZipFile(archive, "w") as opened:
        opened.writestr("pyspark/__init__.py", "")
        opened.writestr("pyspark/version.py", version_text)
    return archive


def _probe(archive: Path) -> dict:
    other = str(archive.parent / "other-entry")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(archive), other])}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=environment, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


INSTALLED_VERSION = (Path(pyspark.__file__).parent / "version.py").read_text()


def test_the_archive_of_the_installed_version_is_taken_off_the_path(tmp_path):
    archive = _archive(tmp_path, INSTALLED_VERSION)
    probe = _probe(archive)
    assert probe["used"] and not probe["imported"]
    assert str(archive) not in probe["path"]
    assert probe["env"] == str(tmp_path / "other-entry")  # what a task's own processes get


def test_an_archive_of_another_version_stays_first(tmp_path):
    archive = _archive(tmp_path, INSTALLED_VERSION + "\n# another build\n")
    probe = _probe(archive)
    assert not probe["used"]
    assert probe["path"][1] == str(archive)  # after the script's own entry, as Spark made it
    assert probe["env"].split(os.pathsep)[0] == str(archive)


def test_spark_workers_import_the_installed_pyspark(spark):
    def where(_):
        import pyspark as worker_pyspark

        yield worker_pyspark.__file__, [entry for entry in sys.path if ARCHIVE_NAME in entry]

    found = spark.sparkContext.parallelize(range(2), 2).mapPartitions(where).collect()
    assert found == [(pyspark.__file__, [])] * 2
