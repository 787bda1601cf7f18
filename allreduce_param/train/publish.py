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
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

from allreduce_param.errors import InputError
from allreduce_param.train.result import LATEST, TrainedModel
from allreduce_param.train.storage import Location, locate

FORMAT = "allreduce-param-published/1"
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
        final = self.root.child(name)
        final.remove_tree()  # a publish of this batch that never reached the pointer
        temporary.rename(final)
        latest = Latest(name, batch_id, query_checkpoint, columns, query_id)
        pointer = self.root.child(f".tmp-{LATEST}-{secrets.token_hex(4)}")
        pointer.write_bytes(json.dumps({"format": FORMAT, **latest.__dict__}, indent=1).encode())
        pointer.rename(self.root.child(LATEST))
        self._prune(name)
        return latest

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
