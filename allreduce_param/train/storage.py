"""Where files go: a local path or a URL, reached through fsspec or, on the driver, Spark's Hadoop.

Checkpoints, a saved ``TrainedModel``, an ``export_npz`` archive and a loss curve may live
on this machine's disk or on cluster storage. Two libraries reach such storage:

- fsspec (a dependency) reaches local paths, ``file://``, ``memory://``, ``hdfs://``
  (through pyarrow's libhdfs) and, with their packages installed, ``s3://`` and ``s3a://``
  (s3fs), ``gs://`` (gcsfs), ``abfs://`` (adlfs) and more. It works in any Python process,
  so checkpoints, which the tasks write, use it alone (``fsspec_filesystem``).
- Hadoop's ``FileSystem`` inside the driver's JVM reaches whatever the Spark application
  is configured for (``s3a://``, ``abfss://``, ``gs://`` with the connector, ``dbfs:/``,
  ``viewfs://``, ``hdfs://``), with Spark's own credentials. The driver's ``TrainedModel``
  files fall back to it (``locate``) when fsspec cannot open a URL and a classic
  SparkSession runs in this process. Under Spark Connect the client has no JVM, so only
  fsspec remains.

A path without a scheme (``out/model``) is always this machine's disk, relative to the
working directory, as ``pathlib`` takes it; Spark's own writers would instead resolve it
against ``fs.defaultFS``.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import sys
from abc import ABC, abstractmethod
from typing import IO, Any

from allreduce_param.errors import ConfigurationError

#: A URL's scheme: two characters or more, so that a Windows drive (``C:/x``) is a path.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]+):")

#: What fsspec needs to open a scheme, for the error when it cannot.
_FSSPEC_NEEDS = {
    **dict.fromkeys(("s3", "s3a"), "pip install s3fs"),
    **dict.fromkeys(("gs", "gcs"), "pip install gcsfs"),
    **dict.fromkeys(("abfs", "abfss", "az", "adl"), "pip install adlfs"),
    "hdfs": "give pyarrow its libhdfs (JAVA_HOME, HADOOP_HOME, CLASSPATH=$(hadoop classpath --glob))",
}

#: How many bytes cross py4j per call on the Hadoop route (each call is one message).
_CHUNK = 4 << 20


def fsspec_filesystem(url: str, purpose: str) -> tuple[Any, str]:
    """(fsspec filesystem, path in it) for a local path or a URL; ``purpose`` names the use in
    the ``ConfigurationError`` raised when fsspec cannot open it (e.g. ``s3://`` without s3fs)."""
    import fsspec

    scheme = scheme_of(url)
    if scheme not in (None, "file", "local") and fsspec.core.split_protocol(url)[0] is None:
        raise ConfigurationError(
            f"cannot open {purpose} {url!r}: fsspec reads a scheme only before '://', so this would be a local "
            f"folder named '{scheme}:'. Give a URL that fsspec opens on every machine (hdfs://..., s3://...), or "
            f"the path of a mount every machine shares (on Databricks: /dbfs/...)"
        )
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as error:
        raise ConfigurationError(f"cannot open {purpose} {url!r}: {error}") from None
    except OSError as error:  # e.g. hdfs:// where pyarrow finds no libhdfs or JVM
        need = _FSSPEC_NEEDS.get(scheme or "", "")
        raise ConfigurationError(
            f"cannot open {purpose} {url!r}: {type(error).__name__}: {error}"
            + (f"; {need}" if need else "")
        ) from None


def scheme_of(path: str | os.PathLike) -> str | None:
    """The scheme of a URL (``s3a`` of ``s3a://bucket/x``, ``dbfs`` of ``dbfs:/x``); None for a
    local path, which a ``pathlib.Path`` always is."""
    if not isinstance(path, str):
        return None
    found = _SCHEME.match(path)
    return found.group(1).lower() if found else None


class Location(ABC):
    """One file or folder on some storage; the operations a ``TrainedModel``'s files need.
    Errors of the storage are ``OSError`` (``FileNotFoundError`` for a missing file), as with
    local files."""

    def __init__(self, url: str, local: bool = False) -> None:
        #: the path or URL, as given (for messages)
        self.url = url
        #: whether this is a plain local path (no scheme), for which results come back as a ``Path``
        self.local = local

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @abstractmethod
    def child(self, name: str) -> Location:
        """The entry ``name`` in this folder."""

    @property
    @abstractmethod
    def parent(self) -> Location:
        """The folder holding this entry."""

    @abstractmethod
    def exists(self) -> bool:
        """Whether anything is there."""

    @abstractmethod
    def is_file(self) -> bool:
        """Whether a file is there."""

    @abstractmethod
    def is_dir(self) -> bool:
        """Whether a folder is there."""

    @abstractmethod
    def make_folder(self) -> None:
        """Make this folder and its parents where missing."""

    @abstractmethod
    def remove(self) -> None:
        """Remove this file."""

    @abstractmethod
    def remove_tree(self) -> None:
        """Remove this folder and everything in it (nothing there: nothing to do)."""

    @abstractmethod
    def rename(self, target: Location) -> None:
        """Move this file or folder to ``target`` on the same storage, replacing a file
        there: one rename, whole or absent, where the storage has one (a local disk, HDFS;
        an object store copies)."""

    def rename_if_absent(self, target: Location) -> bool:
        """Move this file to ``target`` only where nothing is there yet: True when moved;
        False (and this file removed) when ``target`` exists. One step where the storage has
        one (a local disk: a hard link; HDFS: a rename, which never replaces); elsewhere
        (an object store) a look then a move, which two writers at once can both pass."""
        if target.exists():
            self.remove()
            return False
        self.rename(target)
        return True

    @abstractmethod
    def names(self) -> list[str]:
        """The names of the entries in this folder (none there: empty)."""

    @abstractmethod
    def open_write(self) -> IO[bytes]:
        """A binary file to write this file's bytes to, whole, replacing what was there."""

    @abstractmethod
    def open_read(self) -> IO[bytes]:
        """This file's bytes as a seekable binary file."""

    def read_bytes(self) -> bytes:
        """This file's bytes."""
        with self.open_read() as file:
            return file.read()

    def write_bytes(self, data: bytes) -> None:
        """Write ``data`` as this file, replacing what was there."""
        with self.open_write() as file:
            file.write(data)


class FsspecLocation(Location):
    """A location an fsspec filesystem reaches (local disk included)."""

    def __init__(self, url: str, fs: Any, path: str, local: bool = False) -> None:
        super().__init__(url, local)
        self.fs, self.path = fs, path

    def child(self, name: str) -> FsspecLocation:
        url = os.path.join(self.url, name) if self.local else self.url.rstrip("/") + "/" + name
        return FsspecLocation(url, self.fs, posixpath.join(self.path, name), self.local)

    @property
    def parent(self) -> FsspecLocation:
        path = posixpath.dirname(self.path.rstrip("/")) or self.path
        url = (os.path.dirname(self.url) or ".") if self.local else self.fs.unstrip_protocol(path)
        return FsspecLocation(url, self.fs, path, self.local)

    def exists(self) -> bool:
        return self.fs.exists(self.path)

    def is_file(self) -> bool:
        return self.fs.isfile(self.path)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.path)

    def make_folder(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def remove(self) -> None:
        self.fs.rm_file(self.path)

    def remove_tree(self) -> None:
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)

    def rename(self, target: Location) -> None:
        if self.local and getattr(target, "local", False):  # os.replace: one atomic rename
            os.replace(self.path, target.path)
        else:
            self.fs.mv(self.path, target.path, recursive=True)

    def rename_if_absent(self, target: Location) -> bool:
        if not (self.local and getattr(target, "local", False)):
            return super().rename_if_absent(target)
        try:  # link() fails where the name exists: one step, and the file is whole when seen
            os.link(self.path, target.path)
        except FileExistsError:
            os.unlink(self.path)
            return False
        except OSError:  # a file system without hard links
            return super().rename_if_absent(target)
        os.unlink(self.path)
        return True

    def names(self) -> list[str]:
        if not self.fs.isdir(self.path):
            return []
        return [
            posixpath.basename(entry.rstrip("/")) for entry in self.fs.ls(self.path, detail=False)
        ]

    def open_write(self) -> IO[bytes]:
        return self.fs.open(self.path, "wb")

    def open_read(self) -> IO[bytes]:
        return self.fs.open(self.path, "rb")


class HadoopLocation(Location):
    """A location the driver reaches through Hadoop's ``FileSystem`` in Spark's JVM (over
    py4j), so the application's connectors, settings and credentials apply."""

    def __init__(self, url: str, context: Any, java_path: Any = None) -> None:
        super().__init__(url)
        # the classic SparkContext whose JVM and Hadoop configuration are used
        self._context = context
        self._path = (
            java_path if java_path is not None else context._jvm.org.apache.hadoop.fs.Path(url)
        )
        self._fs = self._path.getFileSystem(context._jsc.hadoopConfiguration())

    def child(self, name: str) -> HadoopLocation:
        java_path = self._context._jvm.org.apache.hadoop.fs.Path(self._path, name)
        return HadoopLocation(self.url.rstrip("/") + "/" + name, self._context, java_path)

    @property
    def parent(self) -> HadoopLocation:
        java_path = self._path.getParent()
        if java_path is None:  # the root
            return self
        return HadoopLocation(java_path.toString(), self._context, java_path)

    def exists(self) -> bool:
        return bool(self._call(self._fs.exists, self._path))

    def _status(self) -> Any:
        try:
            return self._call(self._fs.getFileStatus, self._path)
        except FileNotFoundError:
            return None

    def is_file(self) -> bool:
        status = self._status()
        return status is not None and bool(status.isFile())

    def is_dir(self) -> bool:
        status = self._status()
        return status is not None and bool(status.isDirectory())

    def make_folder(self) -> None:
        self._call(self._fs.mkdirs, self._path)

    def remove(self) -> None:
        if not self._call(self._fs.delete, self._path, False):
            raise FileNotFoundError(f"{self.url}: Hadoop's delete removed nothing")

    def remove_tree(self) -> None:
        self._call(self._fs.delete, self._path, True)

    def rename(self, target: Location) -> None:
        if not target.exists():
            if not self._call(self._fs.rename, self._path, target._path):
                raise OSError(f"{self.url}: Hadoop's rename to {target.url} failed")
            return
        # FileSystem.rename never replaces; FileContext's with OVERWRITE does, in one rename
        # where the file system has one (HDFS)
        jvm, configuration = self._context._jvm, self._context._jsc.hadoopConfiguration()
        files = jvm.org.apache.hadoop.fs.FileContext.getFileContext(
            self._path.toUri(), configuration
        )
        options = self._context._gateway.new_array(jvm.org.apache.hadoop.fs.Options.Rename, 1)
        options[0] = jvm.org.apache.hadoop.fs.Options.Rename.OVERWRITE
        self._call(files.rename, self._path, target._path, options)

    def rename_if_absent(self, target: Location) -> bool:
        if self._call(self._fs.rename, self._path, target._path):  # never replaces
            return True
        if not target.exists():
            raise OSError(f"{self.url}: Hadoop's rename to {target.url} failed")
        self.remove()
        return False

    def names(self) -> list[str]:
        if not self.is_dir():
            return []
        return [
            status.getPath().getName() for status in self._call(self._fs.listStatus, self._path)
        ]

    def open_write(self) -> IO[bytes]:
        stream = self._call(self._fs.create, self._path, True)
        return io.BufferedWriter(_HadoopWriter(stream, self), buffer_size=_CHUNK)

    def open_read(self) -> IO[bytes]:
        # read whole, chunk by chunk: np.load seeks, and seeking in Python is cheaper than a py4j call per seek
        stream = self._call(self._fs.open, self._path)
        data = io.BytesIO()
        try:
            while True:
                chunk = self._call(stream.readNBytes, _CHUNK)
                if not chunk:
                    break
                data.write(chunk)
        finally:
            stream.close()
        data.seek(0)
        return data

    def _call(self, method: Any, *args: Any) -> Any:
        """``method(*args)`` in the JVM, with Hadoop's exceptions as Python's ``OSError``s."""
        from py4j.protocol import Py4JJavaError

        try:
            return method(*args)
        except Py4JJavaError as error:
            raise _os_error(error, self.url) from None


class _HadoopWriter(io.RawIOBase):
    """A Hadoop output stream as a Python binary file (the bytes cross py4j in chunks)."""

    def __init__(self, stream: Any, location: HadoopLocation) -> None:
        self._stream, self._location = stream, location

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _CHUNK):
            self._location._call(self._stream.write, bytes(view[start : start + _CHUNK]))
        return len(view)

    def close(self) -> None:
        if not self.closed:
            try:
                self._location._call(self._stream.close)
            finally:
                super().close()


def _os_error(error: Any, url: str) -> OSError:
    """A Java exception from Hadoop as the ``OSError`` a local file would have raised."""
    java = error.java_exception
    name, message = java.getClass().getName(), java.getMessage()
    kind = {
        "java.io.FileNotFoundException": FileNotFoundError,
        "org.apache.hadoop.security.AccessControlException": PermissionError,
        "org.apache.hadoop.fs.FileAlreadyExistsException": FileExistsError,
    }.get(name, OSError)
    return kind(f"{url}: {name}: {message}")


def locate(path: str | os.PathLike, purpose: str) -> Location:
    """Where ``path`` (a local path, or a URL) is, for the driver to read or write files there.

    A local path is this machine's disk. A URL goes to fsspec when fsspec opens it here;
    else (a scheme fsspec does not know, its package missing, no libhdfs) to Hadoop's
    ``FileSystem`` through the classic SparkSession running in this process. When neither
    can, a ``ConfigurationError`` names the scheme and what to install or start; ``purpose``
    (e.g. ``"save the model to"``) says what the path was for.
    """
    from fsspec.implementations.local import LocalFileSystem

    url = os.fspath(path)
    scheme = scheme_of(path)
    if scheme is None:
        return FsspecLocation(url, LocalFileSystem(), os.path.abspath(url), local=True)
    opened, fsspec_problem = _open_with_fsspec(url, scheme)
    if opened is not None:
        return FsspecLocation(url, *opened)
    return _hadoop_location(url, scheme, purpose, fsspec_problem)


def _open_with_fsspec(url: str, scheme: str) -> tuple[tuple[Any, str] | None, str]:
    """(fsspec filesystem, path in it) for ``url``, or (None, why fsspec cannot open it here)."""
    import fsspec

    if scheme not in ("file", "local") and fsspec.core.split_protocol(url)[0] is None:
        return None, "fsspec takes it for a local path (it reads a scheme only before '://')"
    try:
        return fsspec.core.url_to_fs(url), ""
    except Exception as error:  # any failure to make the filesystem: Hadoop may still reach it
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        return None, f"fsspec cannot open it ({type(error).__name__}: {text})"


def _hadoop_location(url: str, scheme: str, purpose: str, fsspec_problem: str) -> HadoopLocation:
    """``url`` through the classic SparkContext's Hadoop, or the ``ConfigurationError`` that
    says why neither library reaches it."""
    fsspec_way = _FSSPEC_NEEDS.get(
        scheme, f"install a package that gives fsspec the scheme {scheme}://"
    )
    context = _classic_context()
    if context is None:
        if _under_connect():
            raise ConfigurationError(
                f"cannot {purpose} {url!r}: {fsspec_problem}, and this process is a Spark Connect client, "
                f"with no JVM of its own to reach it through Spark's Hadoop. Either {fsspec_way}, or use a "
                f"local path and copy the files to {scheme}: with a tool of that storage"
            )
        raise ConfigurationError(
            f"cannot {purpose} {url!r}: {fsspec_problem}, and no classic SparkSession runs in this process "
            f"to reach it through Hadoop. Either {fsspec_way}, or call this on the driver of a classic "
            f"SparkSession whose Hadoop has a FileSystem for {scheme}: (its connector)"
        )
    from py4j.protocol import Py4JJavaError

    try:
        return HadoopLocation(url, context)
    except Py4JJavaError as error:
        java = error.java_exception
        hadoop_problem = f"{java.getClass().getName()}: {str(java.getMessage()).splitlines()[0]}"
    raise ConfigurationError(
        f"cannot {purpose} {url!r}: {fsspec_problem}, and the SparkSession's Hadoop cannot either "
        f"({hadoop_problem}). Either {fsspec_way}, or give Spark a Hadoop connector for {scheme}: (its jar, "
        f"e.g. through spark.jars.packages, and its spark.hadoop.fs.{scheme}.* settings)"
    )


def _classic_context() -> Any:
    """The running classic SparkContext of this process (the driver), or None."""
    if (
        "pyspark" not in sys.modules
    ):  # nobody started Spark here; importing it would not change that
        return None
    from pyspark import SparkContext

    return SparkContext._active_spark_context


def _under_connect() -> bool:
    """Whether this process is a Spark Connect client."""
    if "pyspark" not in sys.modules:
        return False
    from pyspark.sql.utils import is_remote

    return is_remote()
