"""Checkpoints of a fit: each owner writes its own slice; a manifest written last makes one
complete, so a checkpoint is complete or absent, never half.

Under a fit's directory (a local path, or any URL fsspec opens: ``file://``, ``hdfs://``,
``s3://`` with its package installed; on a cluster it must be storage every executor sees;
the tasks write there, so not through the driver's Hadoop, see ``storage``):

    step-0000000880/part-00001-of-00004.npz partition 1's weight slice, its optimizer state
                                            slice, its model's buffers (if it has any), its
                                            slice of early stopping's best weights (if the
                                            fit stops early), and its records of the fit so far
    step-0000000880/manifest.json           written last, by partition 0, after every
                                            partition has signalled its part written

A checkpoint of step k holds the weights after the fit's first k global steps (under SSP
and ASP: each slice once its owner had every partition's steps before k; gradients some
partitions had computed past k are computed again on resume). Everything else a resumed
fit needs (which rows come in which step) follows from the step, the seed and the settings,
which the fit keeps.

A fit resumes from a checkpoint on any number of workers: each new slice is cut from the
old ones, optimizer state included (every optimizer here is elementwise). The history of
the steps before the checkpoint comes along when the number of workers is the same.
With local SGD each partition's own optimizer state is saved whole and needs the same
number of workers. A model's buffers (``Model.buffers()``, e.g. BatchNorm's statistics) are
each partition's own: a resume on the same number of workers gives each its own back; on
another number every partition starts from their merge (``merge_buffers``, weighted by the
old partitions' training rows).
"""

from __future__ import annotations

import io
import json
import logging
import posixpath
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from allreduce_param.engine.layout import SliceLayout
from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.models.base import merge_buffers
from allreduce_param.train.storage import fsspec_filesystem

log = logging.getLogger(__name__)

FORMAT = "allreduce-param-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_FOLDER = re.compile(r"step-(\d+)$")
#: what the storage is for, in the error when fsspec cannot open it (e.g. s3:// without s3fs)
_PURPOSE = "checkpoint storage"


@dataclass(frozen=True)
class CheckpointSettings:
    """Where a fit writes its checkpoints and how often; made on the driver.

    ``every``: after every that many global steps, or ``"epoch"``; a fit also writes one
    after its last step. ``keep``: how many complete checkpoints stay; older ones go.
    """

    directory: str
    every: int | str
    keep: int

    @classmethod
    def for_new_fit(cls, root: str, every: int | str | None, keep: int) -> CheckpointSettings:
        """Settings for a new fit: its own folder under ``root``, named by time and a random tag."""
        if every is None:
            every = "epoch"
        if every != "epoch" and (
            isinstance(every, bool) or not isinstance(every, int) or every < 1
        ):
            raise ConfigurationError(
                f"checkpoint_every must be a positive whole number of steps or 'epoch', "
                f"got {every!r}"
            )
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigurationError(f"checkpoint_keep must be a whole number >= 1, got {keep!r}")
        # a URL the tasks could not write fails here, on the driver
        fsspec_filesystem(str(root), _PURPOSE)
        name = f"fit-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        return cls(posixpath.join(str(root).rstrip("/"), name), every, keep)

    def probe(self) -> None:
        """Check, on the driver and before any stage, that the folder above this fit's one
        can be created and written: a probe file written and removed there, through the same
        storage layer the tasks write with. ConfigurationError naming ``checkpoint_dir`` and
        the reason where it cannot (a path under a regular file, no permission, a full or
        read-only disk), instead of the same error in every task of every stage attempt."""
        root = posixpath.dirname(self.directory)
        fs, path = fsspec_filesystem(root, _PURPOSE)
        probe = posixpath.join(path, f".probe-{secrets.token_hex(4)}")
        try:
            fs.makedirs(path, exist_ok=True)
            with fs.open(probe, "wb") as file:
                file.write(b"allreduce-param checks that the tasks can write here")
            fs.rm(probe)
        except OSError as error:
            raise ConfigurationError(
                f"checkpoint_dir={root!r} cannot hold the fit's checkpoints: writing {probe!r} "
                f"failed ({type(error).__name__}: {error}). Give a folder that every task can "
                "create and write (a path every machine shares, or a URL such as hdfs://...)"
            ) from None

    def due(self, index: int, plan: list[tuple[int, int]]) -> bool:
        """Whether a checkpoint follows global step ``index`` of ``plan`` ((epoch, step) each)."""
        done = index + 1
        if done == len(plan):
            return True
        if self.every == "epoch":
            return plan[index + 1][0] != plan[index][0]
        return done % self.every == 0


@dataclass(frozen=True)
class Manifest:
    """A complete checkpoint: where it is, after how many global steps, and how it is cut."""

    folder: str
    step: int
    partitions: int
    size: int
    state_names: tuple[str, ...]
    local_state: bool
    settings: dict
    # EarlyStopping.state() at the checkpoint, if the fit stops early
    early_stopping: dict | None = None

    @property
    def parts(self) -> list[str]:
        return [
            posixpath.join(self.folder, _part_name(i, self.partitions))
            for i in range(self.partitions)
        ]


def _part_name(partition: int, partitions: int) -> str:
    return f"part-{partition:05d}-of-{partitions:05d}.npz"


def read_manifest(folder: str) -> Manifest | None:
    """The checkpoint in ``folder``, or None when it is not complete (no readable manifest)."""
    fs, path = fsspec_filesystem(folder, _PURPOSE)
    try:
        with fs.open(posixpath.join(path, MANIFEST), "r") as file:
            meta = json.load(file)
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if meta.get("format") != FORMAT:
        raise InputError(
            f"{folder} holds a checkpoint in format {meta.get('format')!r}; this version "
            f"reads {FORMAT}"
        )
    return Manifest(
        folder.rstrip("/"),
        int(meta["step"]),
        int(meta["partitions"]),
        int(meta["size"]),
        tuple(meta["state_names"]),
        bool(meta["local_state"]),
        dict(meta.get("settings", {})),
        meta.get("early_stopping"),
    )


def newest(location: str) -> Manifest | None:
    """The checkpoint at ``location`` itself, or the newest complete one in the fit folder
    ``location``; None when there is none."""
    fs, path = fsspec_filesystem(location, _PURPOSE)
    if fs.exists(posixpath.join(path, MANIFEST)):
        return read_manifest(location)
    for _step, folder in sorted(_step_folders(fs, path), reverse=True):
        manifest = read_manifest(posixpath.join(location.rstrip("/"), posixpath.basename(folder)))
        if manifest is not None:
            return manifest
    return None


def _step_folders(fs, path: str) -> list[tuple[int, str]]:
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        match = _STEP_FOLDER.search(entry.rstrip("/"))
        if match:
            found.append((int(match.group(1)), entry.rstrip("/")))
    return found


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


class CheckpointWriter:
    """Inside a task: writes this partition's part of a checkpoint and, on partition 0, the
    manifest; the caller signals and waits in between (every part written before the
    manifest)."""

    def __init__(self, settings: CheckpointSettings) -> None:
        self.settings = settings
        self._fs, self._root = fsspec_filesystem(settings.directory, _PURPOSE)

    def _folder(self, step: int) -> str:
        return posixpath.join(self._root, f"step-{step:010d}")

    def write_part(
        self,
        step: int,
        partition: int,
        partitions: int,
        arrays: dict[str, np.ndarray],
        records: dict[str, Any],
    ) -> None:
        """Write this partition's part of the checkpoint of ``step``: ``arrays`` (its weight
        slice and optimizer state) and ``records`` (its step records, epoch shares, ...)."""
        folder = self._folder(step)
        self._fs.makedirs(folder, exist_ok=True)
        payload = dict(arrays)
        payload["records.json"] = np.frombuffer(json.dumps(records).encode(), dtype=np.uint8)
        with self._fs.open(posixpath.join(folder, _part_name(partition, partitions)), "wb") as file:
            file.write(_npz_bytes(payload))

    def write_manifest(
        self,
        step: int,
        partitions: int,
        size: int,
        state_names: tuple[str, ...],
        local_state: bool,
        settings: dict,
        early_stopping: dict | None = None,
    ) -> None:
        """Partition 0, once every part of ``step`` is written: make the checkpoint complete,
        then remove complete ones beyond ``keep`` and incomplete ones older than it.
        ``early_stopping``: the fit's ``EarlyStopping.state()``, the same on every partition."""
        folder = self._folder(step)
        meta = {
            "format": FORMAT,
            "step": step,
            "partitions": partitions,
            "size": size,
            "state_names": list(state_names),
            "local_state": local_state,
            "settings": settings,
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if early_stopping is not None:
            meta["early_stopping"] = early_stopping
        temporary = posixpath.join(folder, f".{MANIFEST}.{secrets.token_hex(4)}")
        with self._fs.open(temporary, "w") as file:
            json.dump(meta, file, indent=1)
        self._fs.mv(temporary, posixpath.join(folder, MANIFEST))  # a rename: whole or absent
        complete, kept = [], 0
        for found_step, found in sorted(_step_folders(self._fs, self._root), reverse=True):
            if self._fs.exists(posixpath.join(found, MANIFEST)):
                complete.append(found_step)
                kept += 1
                if kept <= self.settings.keep:
                    continue
            elif found_step >= step:
                continue  # another partition may be writing a later checkpoint right now
            self._fs.rm(found, recursive=True)


def load_part(
    manifest: Manifest, partition: int, layout: SliceLayout
) -> tuple[dict[str, np.ndarray], dict]:
    """This partition's slice of a checkpoint (``weights``, and ``state/<name>`` for each
    optimizer state, cut to ``layout``'s slice whatever the checkpoint's own cut), and its
    records when the number of partitions is the same (else empty). With local SGD,
    ``local/<name>``: this partition's own whole optimizer state."""
    if layout.size != manifest.size:
        raise InputError(
            f"the checkpoint {manifest.folder} holds {manifest.size} weights; this model has "
            f"{layout.size}"
        )
    start, stop = layout.start(partition), layout.start(partition) + layout.length(partition)
    names = ["weights"] + [f"state/{name}" for name in manifest.state_names]
    pieces: dict[str, list[np.ndarray]] = {name: [] for name in names}
    old = SliceLayout(manifest.size, manifest.partitions)
    fs, _ = fsspec_filesystem(manifest.folder, _PURPOSE)
    records: dict = {}
    same = manifest.partitions == layout.partition_num
    for index, url in enumerate(manifest.parts):
        old_start, old_length = old.start(index), old.length(index)
        wanted = same and index == partition
        if not wanted and (old_start >= stop or old_start + old_length <= start or old_length == 0):
            continue
        with fs.open(url, "rb") as file, np.load(io.BytesIO(file.read())) as part:
            low, high = (
                max(start, old_start) - old_start,
                min(stop, old_start + old_length) - old_start,
            )
            for name in names:
                pieces[name].append(part[name][low : max(low, high)])
            if wanted:
                records = json.loads(part["records.json"].tobytes())
                for name in part.files:
                    if name.startswith("local/"):
                        records.setdefault("arrays", {})[name] = part[name]
    arrays = {
        name: np.ascontiguousarray(np.concatenate(chunks), dtype=np.float32)
        if chunks
        else np.zeros(0, np.float32)
        for name, chunks in pieces.items()
    }
    arrays.update(records.pop("arrays", {}))
    return arrays, records


def load_best(manifest: Manifest) -> np.ndarray | None:
    """The whole vector of early stopping's best weights: each part's slice of it
    (``best/weights``) in order; None when the checkpoint holds none (written before any
    epoch improved, or without early stopping)."""
    fs, _ = fsspec_filesystem(manifest.folder, _PURPOSE)
    slices = []
    for url in manifest.parts:
        with fs.open(url, "rb") as file, np.load(io.BytesIO(file.read())) as part:
            if "best/weights" not in part.files:
                return None
            slices.append(part["best/weights"])
    best = np.concatenate(slices).astype(np.float32, copy=False)
    if best.size != manifest.size:
        raise InputError(
            f"the checkpoint {manifest.folder} holds best weights of {best.size} elements, "
            f"not {manifest.size}: its parts do not belong together"
        )
    return best


def load_buffers(
    manifest: Manifest, partition: int, partitions: int
) -> dict[str, np.ndarray] | None:
    """The model buffers partition ``partition`` of ``partitions`` resumes with: its own
    part's when the checkpoint has as many partitions, else every part's merged (weighted by
    their training rows); None when the checkpoint holds no buffers."""
    fs, _ = fsspec_filesystem(manifest.folder, _PURPOSE)
    urls = [manifest.parts[partition]] if manifest.partitions == partitions else manifest.parts
    pieces = []
    for url in urls:
        with fs.open(url, "rb") as file, np.load(io.BytesIO(file.read())) as part:
            buffers = {
                name[len("buffers/") :]: part[name]
                for name in part.files
                if name.startswith("buffers/")
            }
            if not buffers:
                return None
            pieces.append((buffers, json.loads(part["records.json"].tobytes()).get("rows", 1)))
    return merge_buffers(pieces)
