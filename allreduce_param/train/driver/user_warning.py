"""A warning from a fit's driver side, shown at the user's own call: the first frame up the
stack outside this package and pyspark (whose ``Estimator.fit`` calls ours), however deep
the fit's own calls run. A fixed ``stacklevel`` breaks as soon as a call is added between the
fit and the warning, and then names a line of ours, which the user can do nothing about.
(Python 3.12's ``warnings.warn(skip_file_prefixes=...)`` does this; the package supports
3.10.)"""

from __future__ import annotations

import os
import sys
import warnings

#: Where this package's modules lie: their frames are passed over.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def warn_user(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` at the first frame, from the caller up, whose
    file is outside this package and outside pyspark."""
    warnings.warn(message, category, stacklevel=_user_level())


def _user_level() -> int:
    """The ``stacklevel`` that ``warn_user``'s ``warnings.warn`` call needs (1 would name
    ``warn_user`` itself, 2 its caller, ...) to name the user's frame."""
    internal = _internal_prefixes()
    frame = sys._getframe(2)  # warn_user's caller (0: this function, 1: warn_user)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


def _internal_prefixes() -> tuple[str, ...]:
    """This package's folder, and pyspark's where it is loaded (it cannot be on the stack
    otherwise; importing it here would load it into a process that needs none)."""
    pyspark = sys.modules.get("pyspark")
    location = getattr(pyspark, "__file__", None)
    if location is None:
        return (_PACKAGE,)
    return (_PACKAGE, os.path.dirname(os.path.abspath(location)) + os.sep)
