"""Row files of fits that are over, removed: each running task of a ``data_in="disk"`` fit
holds a shared lock on its fit's lock file in the local directory
(``allreduce-rows-<fit>.lock``, beside the row files ``spill.Place`` names), and every task
of any fit, as it starts, removes the row files of the fits whose lock nobody holds.

A task removes its own files on every way out it lives through; one whose Python worker is
killed (a cancelled fit: Spark kills the workers of interrupted tasks; the OOM killer) does
not, and the kernel drops its lock with the process. So the files of a fit that was
interrupted or failed go with the next task of the session in that directory, whichever fit
it belongs to; a fit still running keeps its files, as its tasks hold the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
from collections.abc import Iterator

from allreduce_param.train.task.spill import FILE_PREFIX, Place


def lock_path(place: Place) -> str:
    """The fit's lock file in ``place``'s directory, held (shared) by each of its running tasks."""
    return os.path.join(place.directory, f"{FILE_PREFIX}{place.fit}.lock")


@contextlib.contextmanager
def claimed(place: Place, writes: bool = True) -> Iterator[None]:
    """This task's claim on its fit's files at ``place`` for the ``with`` block: a shared
    lock on the fit's lock file, which the kernel drops when the process dies. First the
    files of fits whose lock no task holds any more (a fit cancelled or failed while its
    Python workers were killed, before their own clean-up ran) are removed (``sweep``), so
    an interrupted ``data_in="disk"`` fit's rows go with the next task in that directory.
    ``writes``: whether this task may write row files (not under ``data_in="memory"``,
    whose tasks only sweep)."""
    sweep(place.directory, but=place.fit)
    held = None
    if writes:
        with contextlib.suppress(OSError):  # a directory the rows cannot go to: their writer says
            held = _lock(lock_path(place), fcntl.LOCK_SH)
    try:
        yield
    finally:
        if held is not None:
            os.close(held)
            sweep(place.directory)  # its lock file too, once no task of the fit holds it


def sweep(directory: str, but: str = "") -> list[str]:
    """Remove the row files of every fit in ``directory`` (but ``but``) that no running task
    holds the lock of; the paths removed. A lock is taken exclusively, without waiting, to
    know: a running task's shared one refuses it."""
    removed = []
    for lock in glob.glob(os.path.join(glob.escape(directory), f"{FILE_PREFIX}*.lock")):
        fit = os.path.basename(lock)[len(FILE_PREFIX) : -len(".lock")]
        if fit == but:
            continue
        try:
            held = _lock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False)
        except OSError:  # held by a running task, or gone meanwhile
            continue
        try:
            for path in glob.glob(os.path.join(glob.escape(directory), f"{FILE_PREFIX}{fit}-*")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed.append(path)
            os.unlink(lock)  # while held: a task that opened it meanwhile opens it again
        finally:
            os.close(held)
    return removed


def _lock(path: str, how: int, create: bool = True) -> int:
    """An open file descriptor of ``path`` holding ``flock(how)``; reopened where the file
    was removed while this waited for the lock (``sweep`` removes a lock file it holds)."""
    while True:
        fd = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, how)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:  # removed meanwhile
            if not create:
                os.close(fd)
                raise
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
