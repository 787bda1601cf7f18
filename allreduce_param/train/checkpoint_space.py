"""A checkpoint that could not be written: one error naming its folder, the setting and what
to do, of the kind that tells the driver whether another run of the stage could succeed.

A full disk (``ENOSPC``), a quota (``EDQUOT``), a read-only one (``EROFS``) or a folder the
task may not write (``EACCES``, ``EPERM``) fails the same way on every run of the stage:
that is a ``ConfigurationError``, which the driver raises after the first run instead of
running the stage again (``driver.failures.RECURRING``). Any other ``OSError`` (a network
file system that timed out) is a ``TrainingError``, and the stage runs again from the
newest checkpoint. The step folder the failed checkpoint left without its manifest is
removed on the driver once the fit's tasks are gone (``checkpoint.remove_incomplete``).
"""

from __future__ import annotations

import errno
import posixpath

from allreduce_param.errors import AllReduceError, ConfigurationError, TrainingError

#: the errors of a write that every run of the stage would meet again
_LASTING = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
#: the setting as each way of fitting spells it (an Estimator's error is renamed from the
#: first: ``checkpoint_dir=`` is ``checkpointDir=`` there)
SETTING_NAMES = (
    "checkpoints=Checkpoints(dir=...) in Python, checkpoint_dir in a job file, "
    "checkpointDir on an Estimator"
)


def write_error(fit_folder: str, path: str, error: OSError) -> AllReduceError:
    """The error for ``error`` met writing ``path``, a file of a checkpoint in the fit's
    folder ``fit_folder`` (under ``checkpoint_dir``)."""
    root = posixpath.dirname(fit_folder.rstrip("/"))
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    why = "is full" if full else f"cannot be written ({error.strerror or error})"
    lasting = error.errno in _LASTING
    advice = (
        "Free space there (the fit's incomplete checkpoint was removed), or point the "
        f"checkpoints at storage with room ({SETTING_NAMES}), or keep fewer (keep=, "
        "checkpoint_keep, checkpointKeep)"
        if full
        else f"Point the checkpoints at a folder every task can write ({SETTING_NAMES})"
    )
    message = (
        f"checkpoint_dir={root!r} {why}: writing {path} failed ({type(error).__name__}: "
        f"{error}). {advice}"
    )
    if lasting:
        return ConfigurationError(
            message + "; the stage was not run again, as it would fail the same way"
        )
    return TrainingError(message)
