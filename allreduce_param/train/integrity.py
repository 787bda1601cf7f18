"""Whether a checkpoint's files are what its manifest says: each part's size and xxh3
checksum, and a format check of its contents, which never unpickles anything.

A checkpoint's manifest records, for every part it names, how many bytes it holds and
their ``xxh3_64`` digest (``PartCheck``). Reading a part checks both before numpy sees a
byte, then opens it as an ``.npz`` archive with ``allow_pickle=False``: a part that is
missing, cut short, overwritten or not an archive of plain arrays is a ``Damage`` naming the
file and what is wrong with it, never a ``BadZipFile`` or numpy's advice to unpickle
from deep inside a task. Checkpoints written before manifests held checksums have only the
format check (and the zip archive's own CRC-32 of each array).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import xxhash

from allreduce_param.errors import DamagedCheckpointError
from allreduce_param.train.numpy_files import read_arrays


@dataclass(frozen=True)
class PartCheck:
    """What a manifest records of one part: its size in bytes and the xxh3_64 of them (hex)."""

    size: int
    xxh3: str

    @classmethod
    def of(cls, data: bytes) -> PartCheck:
        return cls(len(data), xxhash.xxh3_64_hexdigest(data))

    def to_json(self, file: str) -> dict:
        return {"file": file, "bytes": self.size, "xxh3_64": self.xxh3}

    @classmethod
    def from_json(cls, entry: dict, file: str) -> PartCheck:
        """The check of ``file`` from its manifest entry; ValueError where the entry is not one."""
        if not isinstance(entry, dict) or entry.get("file") != file:
            raise ValueError(f"its entry for {file} is {entry!r}")
        size, digest = entry.get("bytes"), entry.get("xxh3_64")
        if isinstance(size, bool) or not isinstance(size, int) or not isinstance(digest, str):
            raise ValueError(f"its entry for {file} is {entry!r}")
        return cls(size, digest)


@dataclass(frozen=True)
class Damage:
    """Why the checkpoint in ``folder`` cannot be used: ``file`` (a part or the manifest)
    and what is wrong with it (missing, truncated, checksum mismatch, unreadable, ...)."""

    folder: str
    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}"


def damaged(folder: str, file: str, problem: str) -> DamagedCheckpointError:
    """The error that says ``file`` of the checkpoint in ``folder`` is damaged, and how."""
    return DamagedCheckpointError(
        f"the checkpoint {folder} is damaged: {file}: {problem}", file, problem
    )


def read_bytes(fs, url: str, folder: str) -> bytes:
    """The whole file ``url`` of the checkpoint in ``folder``; a missing one is damage."""
    try:
        with fs.open(url, "rb") as file:
            return file.read()
    except FileNotFoundError:
        raise damaged(folder, url, "missing (deleted?)") from None


def open_part(data: bytes, url: str, folder: str, check: PartCheck | None) -> dict[str, np.ndarray]:
    """The arrays of the part ``url`` whose bytes are ``data``: checked against ``check``
    (None: a manifest without checksums), then read as an ``.npz`` of plain arrays.
    ``DamagedCheckpointError`` names the file and the problem where it is not that."""
    if check is not None:
        if len(data) != check.size:
            kind = "truncated" if len(data) < check.size else "longer than written"
            raise damaged(folder, url, f"{kind}: {len(data)} bytes, the manifest says {check.size}")
        digest = xxhash.xxh3_64_hexdigest(data)
        if digest != check.xxh3:
            raise damaged(
                folder,
                url,
                f"checksum mismatch: xxh3_64 {digest}, the manifest says {check.xxh3} "
                "(overwritten or corrupted)",
            )
    try:
        return read_arrays(io.BytesIO(data))
    # whatever reading these bytes raises (BadZipFile, numpy's ValueError for an object
    # array or a bad header, EOFError, the TypeError of a bare .npy array, which is no
    # archive to enter): they are not a part as written
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else ""
        raise damaged(
            folder,
            url,
            f"not an .npz archive of arrays ({type(error).__name__}"
            + (f": {reason[:120]}" if reason else "")
            + ")",
        ) from None
