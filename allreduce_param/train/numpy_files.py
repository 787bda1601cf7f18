"""Reading numpy's ``.npy`` and ``.npz`` files one thread at a time, and writing ``.npz``
archives of plain arrays.

numpy parses each array's header with ``ast.literal_eval``, and CPython 3.11 builds the
syntax tree with a recursion counter shared by every thread: two threads reading headers at
once can fail with ``SystemError: AST constructor recursion depth mismatch`` (CPython issue
gh-106905), which a checkpoint's reader would take for a damaged file. Partitions that run as
threads of one process (the engine's tests and benchmarks, a driver that loads models on
several threads) read checkpoints and models at the same moment, so every read goes through
``NUMPY_READS``.
"""

from __future__ import annotations

import os
import threading
import zipfile
from typing import IO

import numpy as np

#: Held while numpy reads a file's arrays (their headers are parsed as Python literals).
NUMPY_READS = threading.Lock()


def read_arrays(file: IO[bytes]) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` in ``file`` (no pickles), read whole under the lock."""
    with NUMPY_READS, np.load(file, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def read_array(file: IO[bytes]) -> np.ndarray:
    """The array of the ``.npy`` in ``file`` (no pickles), read under the lock."""
    with NUMPY_READS:
        return np.load(file, allow_pickle=False)


def write_npz(path: str | os.PathLike | IO[bytes], arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as a numpy ``.npz`` at exactly ``path``, or into a binary file open for
    writing, without pickles (``np.savez`` would add ``.npz`` and takes names as keywords, so
    a tensor called ``file`` would clash)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, value in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as entry:
                np.lib.format.write_array(entry, np.asanyarray(value), allow_pickle=False)
