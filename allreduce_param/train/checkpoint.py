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
                                            partition has signalled its part written; it
                                            names each part with its size and xxh3 checksum

A resume verifies a checkpoint before it uses it (``find``, ``integrity``): every part
there, of the size and checksum the manifest records, and an ``.npz`` of plain arrays with
the slices the manifest promises. A damaged checkpoint is passed over for the newest intact
one (``Found.damaged`` says which file and why); the driver decides, and warns or refuses
(``train.driver.resume``).

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
import os
import posixpath
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from allreduce_param.engine.layout import SliceLayout
from allreduce_param.errors import ConfigurationError, DamagedCheckpointError, InputError
from allreduce_param.models.base import merge_buffers
from allreduce_param.train.checkpoint_space import write_error
from allreduce_param.train.integrity import Damage, PartCheck, damaged, open_part, read_bytes
from allreduce_param.train.storage import fsspec_filesystem

log = logging.getLogger(__name__)

FORMAT = "allreduce-param-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_FOLDER = re.compile(r"step-(\d+)$")
#: what the storage is for, in the error when fsspec cannot open it (e.g. s3:// without s3fs)
_PURPOSE = "checkpoint storage"


@dataclass(frozen=True)
class Checkpoints:
    """A fit's checkpoints, as the user asks for them: ``FitSettings(checkpoints=...)``.

    ``dir``: where the fit writes them, a folder of its own per fit (a local path, or a
    URL such as ``hdfs://`` or ``s3://`` that fsspec opens; on a cluster, storage every
    executor sees). ``every``: after every that many global steps, or ``"epoch"`` (None:
    each epoch); a fit also writes one after its last step. ``keep``: how many of the
    newest complete checkpoints stay. Checked when made, with the job files' names
    (``checkpoint_every``, ``checkpoint_keep``) in the messages.
    """

    dir: str
    every: int | str = "epoch"
    keep: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.dir, (str, os.PathLike)) or not str(self.dir):
            raise ConfigurationError(
                f"checkpoint_dir must be a folder's path or URL, got {self.dir!r}"
            )
        object.__setattr__(self, "dir", os.fspath(self.dir))
        every = "epoch" if self.every is None else self.every
        if every != "epoch" and (
            isinstance(every, bool) or not isinstance(every, int) or every < 1
        ):
            raise ConfigurationError(
                f"checkpoint_every must be a positive whole number of steps or 'epoch', "
                f"got {every!r}"
            )
        object.__setattr__(self, "every", every)
        keep = self.keep
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigurationError(f"checkpoint_keep must be a whole number >= 1, got {keep!r}")
        # a URL the tasks could not write fails here, on the driver
        fsspec_filesystem(self.dir, _PURPOSE)

    def for_new_fit(self) -> CheckpointSettings:
        """A new fit's settings: its own folder under ``dir``, named by time and a random tag."""
        name = f"fit-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        return CheckpointSettings(posixpath.join(self.dir.rstrip("/"), name), self.every, self.keep)


@dataclass(frozen=True)
class CheckpointSettings:
    """Where one fit writes its checkpoints and how often; made on the driver
    (``Checkpoints.for_new_fit``).

    ``every``: after every that many global steps, or ``"epoch"``; a fit also writes one
    after its last step. ``keep``: how many complete checkpoints stay; older ones go.
    """

    directory: str
    every: int | str
    keep: int

    @classmethod
    def for_new_fit(cls, root: str, every: int | str | None, keep: int) -> CheckpointSettings:
        """Settings for a new fit: its own folder under ``root``, named by time and a random tag."""
        return Checkpoints(root, every, keep).for_new_fit()

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
    # EarlyStopper.state() at the checkpoint, if the fit stops early
    early_stopping: dict | None = None
    # each part's size and checksum, in order; None in a checkpoint written before they were
    checks: tuple[PartCheck, ...] | None = None
    # how far training had come before the fit that wrote it (a fit continued from a
    # TrainedModel: ``train.start``): global steps and epochs of the earlier fits
    steps_before: int = 0
    epochs_before: int = 0

    @property
    def parts(self) -> list[str]:
        return [
            posixpath.join(self.folder, _part_name(i, self.partitions))
            for i in range(self.partitions)
        ]


def _part_name(partition: int, partitions: int) -> str:
    return f"part-{partition:05d}-of-{partitions:05d}.npz"


def _check_name(part_name: str) -> str:
    """The file beside a part that holds its size and checksum until the manifest does."""
    return f".{part_name}.check.json"


def read_manifest(folder: str) -> Manifest | Damage | None:
    """The checkpoint in ``folder`` as its manifest describes it (its parts not yet read);
    None when it is not complete (no manifest: never written, or still being written); a
    ``Damage`` when the manifest is there but unreadable (it is written whole, by a
    rename, so one cut short or garbled was damaged afterwards)."""
    folder = folder.rstrip("/")
    fs, path = fsspec_filesystem(folder, _PURPOSE)
    url = posixpath.join(folder, MANIFEST)
    try:
        with fs.open(posixpath.join(path, MANIFEST), "rb") as file:
            meta = json.loads(file.read().decode())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return Damage(folder, url, f"manifest unreadable, cut short or overwritten ({error})")
    if not isinstance(meta, dict):
        return Damage(folder, url, f"manifest unreadable: a JSON {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise InputError(
            f"{folder} holds a checkpoint in format {meta.get('format')!r}; this version "
            f"reads {FORMAT}"
        )
    try:
        partitions = int(meta["partitions"])
        entries = meta.get("parts")  # absent from checkpoints written before checksums
        if entries is not None and (not isinstance(entries, list) or len(entries) != partitions):
            raise ValueError(f"it names {len(entries)} parts of {partitions}")
        return Manifest(
            folder,
            int(meta["step"]),
            partitions,
            int(meta["size"]),
            tuple(meta["state_names"]),
            bool(meta["local_state"]),
            dict(meta.get("settings", {})),
            meta.get("early_stopping"),
            None
            if entries is None
            else tuple(
                PartCheck.from_json(entry, _part_name(index, partitions))
                for index, entry in enumerate(entries)
            ),
            int(meta.get("steps_before", 0)),
            int(meta.get("epochs_before", 0)),
        )
    except (KeyError, TypeError, ValueError) as error:
        return Damage(folder, url, f"manifest unreadable ({type(error).__name__}: {error})")


@dataclass(frozen=True)
class Found:
    """What ``find`` found at a location: ``manifest``, the newest intact checkpoint (None:
    none); ``damaged``, the newer complete ones passed over, newest first, each with its
    damaged file and why; ``single``, whether the location was one checkpoint's folder
    (then ``damaged`` is about that one) rather than a fit's."""

    manifest: Manifest | None
    damaged: tuple[Damage, ...] = ()
    single: bool = False


def find(location: str) -> Found:
    """The checkpoint at ``location`` itself (a ``step-...`` folder), or the newest intact
    one in the fit folder ``location``, each verified (``verify``). Reads every part of the
    checkpoints it looks at, newest first, until one is intact."""
    location = location.rstrip("/")
    fs, path = fsspec_filesystem(location, _PURPOSE)
    if fs.exists(posixpath.join(path, MANIFEST)) or (
        _STEP_FOLDER.search(location) and fs.isdir(path)
    ):
        inspected = _inspect(location)
        if inspected is None:
            inspected = Damage(
                location,
                posixpath.join(location, MANIFEST),
                "missing: the checkpoint never completed (or its manifest was deleted)",
            )
        if isinstance(inspected, Damage):
            return Found(None, (inspected,), single=True)
        return Found(inspected, single=True)
    damaged = []
    for _step, folder in sorted(_step_folders(fs, path), reverse=True):
        inspected = _inspect(posixpath.join(location, posixpath.basename(folder)))
        if isinstance(inspected, Manifest):
            return Found(inspected, tuple(damaged))
        if inspected is not None:  # None: no manifest, a checkpoint that never completed
            damaged.append(inspected)
    return Found(None, tuple(damaged))


def newest(location: str) -> Manifest | None:
    """The checkpoint at ``location`` itself, or the newest intact one in the fit folder
    ``location``; None when there is none (``find`` says what was damaged)."""
    return find(location).manifest


def _inspect(folder: str) -> Manifest | Damage | None:
    """The verified checkpoint in ``folder``, its damage, or None where it never completed."""
    manifest = read_manifest(folder)
    if not isinstance(manifest, Manifest):
        return manifest
    damage = verify(manifest)
    return manifest if damage is None else damage


def verify(manifest: Manifest) -> Damage | None:
    """Whether every part of ``manifest``'s checkpoint is there and what it says (size,
    checksum, an archive of the slices it promises); the first damage found, else None."""
    fs, _ = fsspec_filesystem(manifest.folder, _PURPOSE)
    try:
        for index in range(manifest.partitions):
            _records(manifest, index, _part(manifest, index, fs))
    except DamagedCheckpointError as error:
        return Damage(manifest.folder, error.file, error.problem)
    return None


def remove_incomplete(location: str) -> list[str]:
    """Remove the step folders of the fit folder ``location`` that hold no manifest (a
    checkpoint cut short: a full disk, a fit interrupted or failed while writing it); the
    folders removed. Only once no task of that fit runs: the driver's, after its stage."""
    fs, path = fsspec_filesystem(location.rstrip("/"), _PURPOSE)
    removed = []
    for _step, folder in _step_folders(fs, path):
        if not fs.exists(posixpath.join(folder, MANIFEST)):
            fs.rm(folder, recursive=True)
            removed.append(folder)
    return removed


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


def _part(manifest: Manifest, index: int, fs) -> dict[str, np.ndarray]:
    """Part ``index`` of the checkpoint, checked: its size and checksum (where the manifest
    records them), an archive of plain arrays, with the weight and optimizer state slices
    the manifest promises; ``DamagedCheckpointError`` naming the file where it is not."""
    url = manifest.parts[index]
    data = read_bytes(fs, url, manifest.folder)
    check = None if manifest.checks is None else manifest.checks[index]
    arrays = open_part(data, url, manifest.folder, check)
    length = SliceLayout(manifest.size, manifest.partitions).length(index)
    for name in ["weights"] + [f"state/{name}" for name in manifest.state_names]:
        array = arrays.get(name)
        if array is None or array.ndim != 1 or array.dtype.kind != "f" or len(array) != length:
            found = "none" if array is None else f"{array.dtype} {array.shape}"
            raise damaged(
                manifest.folder,
                url,
                f"not the part its manifest names: its {name!r} is {found}, not {length} floats",
            )
    return arrays


def _records(manifest: Manifest, index: int, part: dict[str, np.ndarray]) -> dict:
    """The records (JSON) in part ``index`` of the checkpoint."""
    try:
        records = json.loads(part["records.json"].tobytes())
        if not isinstance(records, dict):
            raise ValueError(f"a JSON {type(records).__name__}")
        return records
    except (KeyError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError included
        raise damaged(
            manifest.folder, manifest.parts[index], f"its records are unreadable ({error})"
        ) from None


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
        payload = dict(arrays)
        payload["records.json"] = np.frombuffer(json.dumps(records).encode(), dtype=np.uint8)
        data, name = _npz_bytes(payload), _part_name(partition, partitions)
        path = posixpath.join(folder, name)
        try:
            self._fs.makedirs(folder, exist_ok=True)
            with self._fs.open(path, "wb") as file:
                file.write(data)
            # its size and checksum, for partition 0 to put in the manifest (after the part:
            # a check file says its part is whole)
            path = posixpath.join(folder, _check_name(name))
            with self._fs.open(path, "w") as file:
                json.dump(PartCheck.of(data).to_json(name), file)
        except OSError as error:  # a full disk: one clear error, not another run of the stage
            raise write_error(self.settings.directory, path, error) from error

    def write_manifest(
        self,
        step: int,
        partitions: int,
        size: int,
        state_names: tuple[str, ...],
        local_state: bool,
        settings: dict,
        early_stopping: dict | None = None,
        before: tuple[int, int] = (0, 0),
    ) -> None:
        """Partition 0, once every part of ``step`` is written: make the checkpoint complete,
        then remove complete ones beyond ``keep`` and incomplete ones older than it.
        ``early_stopping``: the fit's ``EarlyStopper.state()``, the same on every partition;
        ``before``: the global steps and epochs of earlier fits this one continues."""
        folder = self._folder(step)
        names = [_part_name(index, partitions) for index in range(partitions)]
        checks = [posixpath.join(folder, _check_name(name)) for name in names]
        meta = {
            "format": FORMAT,
            "step": step,
            "partitions": partitions,
            "size": size,
            "state_names": list(state_names),
            "local_state": local_state,
            "settings": settings,
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "parts": [self._read_check(url, folder, name) for url, name in zip(checks, names)],
            "steps_before": before[0],
            "epochs_before": before[1],
        }
        if early_stopping is not None:
            meta["early_stopping"] = early_stopping
        temporary = posixpath.join(folder, f".{MANIFEST}.{secrets.token_hex(4)}")
        try:
            with self._fs.open(temporary, "w") as file:
                json.dump(meta, file, indent=1)
            self._fs.mv(temporary, posixpath.join(folder, MANIFEST))  # a rename: whole or absent
        except OSError as error:
            raise write_error(self.settings.directory, temporary, error) from error
        self._fs.rm(checks)  # the manifest holds them now
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

    def _read_check(self, url: str, folder: str, name: str) -> dict:
        """A part's size and checksum, as its writer left them beside it."""
        try:
            with self._fs.open(url, "r") as file:
                return json.load(file)
        except (FileNotFoundError, json.JSONDecodeError) as error:
            raise damaged(
                folder, url, f"unreadable after its partition wrote {name} ({error})"
            ) from None


def read_part(manifest: Manifest, index: int) -> dict[str, np.ndarray]:
    """Part ``index`` of a verified checkpoint as it was written (its arrays in their own
    dtype and shape, ``records.json`` among them), checked as ``verify`` checks it: for a
    fit whose state is not a set of float32 slices (the linear models' solver state)."""
    fs, _ = fsspec_filesystem(manifest.folder, _PURPOSE)
    return _part(manifest, index, fs)


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
    for index in range(manifest.partitions):
        old_start, old_length = old.start(index), old.length(index)
        wanted = same and index == partition
        if not wanted and (old_start >= stop or old_start + old_length <= start or old_length == 0):
            continue
        part = _part(manifest, index, fs)
        low, high = (
            max(start, old_start) - old_start,
            min(stop, old_start + old_length) - old_start,
        )
        for name in names:
            pieces[name].append(part[name][low : max(low, high)])
        if wanted:
            records = _records(manifest, index, part)
            for name in part:
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
    for index in range(manifest.partitions):
        part = _part(manifest, index, fs)
        if "best/weights" not in part:
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
    indices = [partition] if manifest.partitions == partitions else range(manifest.partitions)
    pieces = []
    for index in indices:
        part = _part(manifest, index, fs)
        buffers = {
            name[len("buffers/") :]: part[name] for name in part if name.startswith("buffers/")
        }
        if not buffers:
            return None
        pieces.append((buffers, _records(manifest, index, part).get("rows", 1)))
    return merge_buffers(pieces)
