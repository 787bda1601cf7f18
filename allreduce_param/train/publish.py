"""Published models: a folder that always holds the latest complete model of a streaming fit.

``DistriOptimizer.fit_stream`` trains on each micro-batch and publishes the result here.
A reader (``TrainedModel.load(folder)``, a serving job) must never see half a model, and a
restarted query must know which micro-batch the newest model has trained on, so:

    <folder>/batch-0000000007/     a TrainedModel.save of the model after micro-batch 7
    <folder>/batch-0000000006/     the one before (kept, so a reader that has just read the
                                   pointer still finds its model)
    <folder>/LATEST.json           the pointer: the newest batch's folder, its batch id, the
                                   streaming query's checkpoint and the training columns' types

Each model is saved into a hidden temporary folder, then renamed to its ``batch-`` name;
then ``LATEST.json`` is written to a temporary file and renamed over the old one. On a local
disk and HDFS a rename is whole or absent, so the pointer always names a complete model; on
an object store (``s3://``), which copies instead, a reader may see the old pointer a little
longer, never a half-written model. A publish that fails leaves the pointer as it was.

One folder belongs to one streaming query, named by its checkpoint: ``OWNER.json``, made
whole or not at all by the first query's start (a hard link on a local disk, a rename that
never replaces on HDFS). A query whose checkpoint it does not name is refused before it
starts, and every publish checks it again, with the pointer's batch id, just before the
pointer moves (on a local disk under a lock the claim takes too): two queries never
overwrite each other's models, and the pointer never goes back to an older micro-batch.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.train.result import LATEST, TrainedModel
from allreduce_param.train.storage import Location, locate

FORMAT = "allreduce-param-published/1"
#: the record of the streaming query a folder of published models belongs to
OWNER = "OWNER.json"
OWNER_FORMAT = "allreduce-param-owner/1"
#: how many of the newest published models stay
KEEP = 2


@dataclass(frozen=True)
class Latest:
    """What ``LATEST.json`` says: the newest model's ``folder`` (a name in the published
    folder), the micro-batch it trained last (``batch_id``), the streaming query's
    checkpoint it belongs to and that query's id (None: unknown), and the training
    columns' types (name -> Spark type)."""

    folder: str
    batch_id: int
    query_checkpoint: str
    columns: dict[str, str]
    query_id: str | None = None


class PublishedModels:
    """The published models under ``path`` (a local path or a URL, as ``TrainedModel.save``
    takes them), on the driver."""

    def __init__(self, path: str | os.PathLike, allow_pickle: bool = False) -> None:
        self.root: Location = locate(path, "publish the streaming fit's models to")
        #: whether a model of the caller's own may be saved and read back as a pickle
        #: (``TrainedModel.save``'s and ``load``'s flag); the built-in ones never need it
        self.allow_pickle = allow_pickle

    def latest(self) -> Latest | None:
        """The pointer to the newest model; None when nothing was published yet."""
        pointer = self.root.child(LATEST)
        if not pointer.is_file():
            if self.root.child("meta.json").is_file():
                raise InputError(
                    f"model_path={self.root.url!r} holds a model saved by TrainedModel.save, not "
                    "a streaming fit's published models: give a folder of its own (pass the "
                    "saved model as initial= to continue from it)"
                )
            return None
        try:
            meta = json.loads(pointer.read_bytes())
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, this version reads {FORMAT}")
            return Latest(
                str(meta["folder"]),
                int(meta["batch_id"]),
                str(meta["query_checkpoint"]),
                dict(meta["columns"]),
                meta.get("query_id"),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise InputError(
                f"{pointer.url} cannot be read ({error}): it was not written by fit_stream, or "
                "was changed since"
            ) from None

    def claim(self, query_checkpoint: str) -> None:
        """Make the folder the models of the query with ``query_checkpoint``, before it
        starts: its owner record written where there is none (which also proves the folder
        writable, as the checkpoint folder is probed), else checked to name this query. A
        folder that cannot be written is a ConfigurationError, another query's an InputError,
        each naming ``model_path``."""
        with self._publishing():
            owner = self._owner()
            if owner is None:
                record = json.dumps({"format": OWNER_FORMAT, "query_checkpoint": query_checkpoint})
                temporary = self.root.child(f".tmp-{OWNER}-{secrets.token_hex(4)}")
                try:
                    temporary.write_bytes(record.encode())
                    if temporary.rename_if_absent(self.root.child(OWNER)):
                        return
                except OSError as error:
                    raise ConfigurationError(
                        f"model_path={self.root.url!r} cannot hold the streaming fit's models: "
                        f"writing {temporary.url!r} failed ({type(error).__name__}: {error}). "
                        "Give a folder this driver can create and write"
                    ) from None
                owner = self._owner()  # another query claimed it between the look and the write
            self._check_owner(owner, query_checkpoint)

    def _owner(self) -> str | None:
        """The query checkpoint the owner record names; None where there is no record."""
        record = self.root.child(OWNER)
        try:
            meta = json.loads(record.read_bytes())
        except FileNotFoundError:
            return None
        except OSError as error:
            raise ConfigurationError(
                f"model_path={self.root.url!r}: its owner record {record.url} cannot be read "
                f"({type(error).__name__}: {error})"
            ) from None
        except ValueError as error:
            raise InputError(f"{record.url} cannot be read ({error}): it was changed") from None
        if not isinstance(meta, dict) or meta.get("format") != OWNER_FORMAT:
            raise InputError(f"{record.url} was not written by fit_stream, or was changed since")
        return str(meta["query_checkpoint"])

    def _check_owner(self, owner: str | None, query_checkpoint: str) -> None:
        if owner is not None and owner != query_checkpoint:
            raise InputError(
                f"model_path={self.root.url!r} belongs to another streaming query, the one "
                f"with checkpoint_location={owner!r} ({OWNER} there says so), not this one's "
                f"{query_checkpoint!r}: two queries publishing to one folder would overwrite "
                "each other's models. Give this query a model_path of its own (initial=... "
                "can start it from that query's model)"
            )

    @contextlib.contextmanager
    def _publishing(self) -> Iterator[None]:
        """Held while the owner is checked and the pointer moves: on a local disk an
        exclusive lock on a file in the folder (every claim and publish takes it); elsewhere
        nothing (the storage offers none), so there the check comes just before the move."""
        try:
            self.root.make_folder()
        except OSError as error:
            raise ConfigurationError(
                f"model_path={self.root.url!r} cannot hold the streaming fit's models: "
                f"making the folder failed ({type(error).__name__}: {error}). Give a folder "
                "this driver can create and write"
            ) from None
        if not self.root.local:
            yield
            return
        import fcntl

        descriptor = os.open(self.root.child(".publish.lock").url, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # releases the lock

    def load(self, latest: Latest, module: Any = None) -> TrainedModel:
        """The model ``latest`` points to; ``module``: a ``TorchModel``'s module to load its
        state into (``TrainedModel.load``'s)."""
        return TrainedModel.load(
            self.root.child(latest.folder).url, module=module, allow_pickle=self.allow_pickle
        )

    def publish(
        self,
        trained: TrainedModel,
        batch_id: int,
        query_checkpoint: str,
        columns: dict[str, str],
        query_id: str | None = None,
    ) -> Latest:
        """Save ``trained`` as the model after micro-batch ``batch_id``, then point
        ``LATEST.json`` at it, each step whole or absent; then remove older models beyond
        ``KEEP`` and what failed publishes left."""
        self.root.make_folder()
        name = f"batch-{batch_id:010d}"
        temporary = self.root.child(f".tmp-{name}-{secrets.token_hex(4)}")
        trained.save(temporary.url, allow_pickle=self.allow_pickle)
        latest = Latest(name, batch_id, query_checkpoint, columns, query_id)
        pointer = self.root.child(f".tmp-{LATEST}-{secrets.token_hex(4)}")
        pointer.write_bytes(json.dumps({"format": FORMAT, **latest.__dict__}, indent=1).encode())
        try:
            with self._publishing():
                self._check_owner(self._owner(), query_checkpoint)
                self._check_newer(batch_id)
                final = self.root.child(name)
                final.remove_tree()  # a publish of this batch that never reached the pointer
                temporary.rename(final)
                pointer.rename(self.root.child(LATEST))
        except BaseException:
            temporary.remove_tree()
            if pointer.exists():
                pointer.remove()
            raise
        self._prune(name)
        return latest

    def _check_newer(self, batch_id: int) -> None:
        """Refuse a publish that would move the pointer back to an older micro-batch."""
        current = self.latest()
        if current is not None and current.batch_id >= batch_id:
            raise InputError(
                f"model_path={self.root.url!r} already points at the model after micro-batch "
                f"{current.batch_id}; publishing micro-batch {batch_id} would move it back. "
                "Does another fit publish to this folder? Give each its own model_path"
            )

    def _prune(self, newest: str) -> None:
        """Remove the models beyond the newest ``KEEP``, and temporary folders of failed
        publishes (of batches before ``newest``: only one fit publishes here at a time)."""
        names = self.root.names()
        published = sorted((name for name in names if name.startswith("batch-")), reverse=True)
        for name in published[KEEP:]:
            self.root.child(name).remove_tree()
        for name in names:
            if name.startswith(".tmp-batch-") and name[len(".tmp-") :][: len(newest)] < newest:
                self.root.child(name).remove_tree()


def query_id_of(query_checkpoint: str) -> str | None:
    """The id of the streaming query whose checkpoint folder this is (Spark writes it in
    the folder's ``metadata`` file when the query starts, and keeps it across restarts);
    None where it cannot be read."""
    try:
        metadata = locate(query_checkpoint, "read the streaming query's checkpoint").child(
            "metadata"
        )
        return str(json.loads(metadata.read_bytes().decode().splitlines()[0])["id"])
    except (OSError, ValueError, KeyError, IndexError, InputError):
        return None


def columns_of(schema: Any, names: list[str]) -> dict[str, str]:
    """The types of the training columns ``names`` of a DataFrame's ``schema`` (name ->
    Spark's simple type string), those there."""
    fields = {field.name: field for field in schema.fields}
    return {name: fields[name].dataType.simpleString() for name in names if name in fields}
