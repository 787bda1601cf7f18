"""A ``TrainedModel``'s folder: the files ``save`` writes and ``load`` reads, none of which
runs code when read unless the caller allows a pickle.

::

    meta.json            the format, the model's kind and config (``models.saving``),
                         n_features, how far training came, the optimizer's kind, the history
    weights.npy          the flat weights
    module_state.npz     a TorchModel's module's state_dict, as plain arrays
    buffers.npz          the fit's buffers, where the model has them
    optimizer_state.npz  the optimizer's state, where the fit kept it
    model.pkl            only with allow_pickle=True: a model of a kind ``models.saving``
                         does not know, pickled

Every array file is read with ``allow_pickle=False``; one that is not a plain numpy file (a
pickle put in its place) is an ``InputError`` naming it, and nothing in it runs. The model
of the formats before /4 (``PICKLED``), and of a /4 folder saved with ``allow_pickle=True``,
is a pickle: read only with ``allow_pickle=True``.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from allreduce_param.errors import InputError
from allreduce_param.models.saving import SavedForm, rebuilt, saved_form
from allreduce_param.train.numpy_files import read_array, read_arrays, write_npz
from allreduce_param.train.storage import Location

# /2: buffers.npz when the model has buffers; /3: where training stopped, and
# optimizer_state.npz when the fit kept it; /4: the model as its kind and config, no pickle
FORMAT = "allreduce-param-model/4"
#: The formats whose model is a pickle (``model.pkl``), read only with ``allow_pickle=True``.
PICKLED = ("allreduce-param-model/1", "allreduce-param-model/2", "allreduce-param-model/3")
READS = (*PICKLED, FORMAT)
#: ``meta.json``'s ``kind`` of a model saved with ``allow_pickle=True``.
PICKLE_KIND = "pickle"
_OPTIONAL = ("buffers.npz", "optimizer_state.npz", "module_state.npz", "model.pkl")


@dataclass(frozen=True)
class ModelFiles:
    """What a model's folder holds: the model, its weights, the buffers and optimizer state
    (None where it has none), and ``meta.json``'s fields."""

    model: Any
    weights: np.ndarray
    buffers: dict[str, np.ndarray] | None
    optimizer_state: dict[str, np.ndarray] | None
    meta: dict


def write_model(folder: Location, files: ModelFiles, allow_pickle: bool = False) -> None:
    """Write ``files`` into ``folder`` (made if missing; an earlier save's files that this one
    has not, removed), ``meta.json`` last. A model ``models.saving`` has no saved form for
    is pickled where ``allow_pickle``, else an ``InputError`` before anything is written."""
    try:
        form = saved_form(files.model)
    except InputError:  # a TorchModel whose state holds more than tensors
        if not allow_pickle:
            raise
        form = None
    if form is None and not allow_pickle:
        raise InputError(
            f"{files.model!r} is not one of the built-in models or a TorchModel, so it saves "
            "only as a pickle, which runs code when it is loaded: pass allow_pickle=True to "
            "TrainedModel.save to pickle it (TrainedModel.load then needs allow_pickle=True too)"
        )
    folder.make_folder()
    with folder.child("weights.npy").open_write() as file:
        np.save(file, files.weights, allow_pickle=False)
    written = {
        "buffers.npz": files.buffers or None,
        "optimizer_state.npz": files.optimizer_state,
        "module_state.npz": form.arrays if form is not None and form.arrays else None,
    }
    for name in _OPTIONAL:
        if written.get(name) is not None:
            with folder.child(name).open_write() as file:
                write_npz(file, written[name])
        elif folder.child(name).exists():  # an earlier save's in the same folder
            folder.child(name).remove()
    if form is None:
        from pyspark import cloudpickle

        folder.child("model.pkl").write_bytes(cloudpickle.dumps(files.model))
    kind = {"kind": PICKLE_KIND} if form is None else {"kind": form.kind, "config": form.config}
    meta = {"format": FORMAT, "model": repr(files.model), **kind, **files.meta}
    folder.child("meta.json").write_bytes(json.dumps(meta, indent=1).encode())


def read_model(folder: Location, module: Any = None, allow_pickle: bool = False) -> ModelFiles:
    """The model saved in ``folder`` (which holds a ``meta.json``). ``module``: a
    ``TorchModel``'s module to load into (see ``models.torch_saving``). A pickled model is
    an ``InputError`` naming the file and ``allow_pickle`` unless ``allow_pickle``."""
    meta = json.loads(folder.child("meta.json").read_bytes())
    if meta.get("format") not in READS:
        raise InputError(
            f"{folder} was saved in format {meta.get('format')!r}; this version reads "
            f"{' and '.join(READS)}"
        )
    if meta["format"] in PICKLED or meta.get("kind") == PICKLE_KIND:
        model = _unpickled(folder, module, allow_pickle)
    else:
        arrays = _arrays(folder, "module_state.npz") or {}
        form = SavedForm(str(meta.get("kind")), dict(meta.get("config") or {}), arrays)
        model = rebuilt(form, module, str(folder))
    with folder.child("weights.npy").open_read() as file:
        weights = _plain(folder.child("weights.npy"), read_array, file)
    buffers = _arrays(folder, "buffers.npz")
    return ModelFiles(model, weights, buffers, _arrays(folder, "optimizer_state.npz"), meta)


def _unpickled(folder: Location, module: Any, allow_pickle: bool) -> Any:
    """The pickled model of ``folder``, where the caller allows it."""
    pickled = folder.child("model.pkl")
    if not allow_pickle:
        raise InputError(
            f"{pickled} holds the model as a pickle (saved by an earlier version, or with "
            "allow_pickle=True), and reading a pickle runs whatever code it names: "
            "TrainedModel.load does not unpickle unless you pass allow_pickle=True, which "
            "only files you trust may get"
        )
    if module is not None:
        raise InputError(
            f"{folder} holds a pickled model: module= is for a TorchModel saved as data; "
            "leave it out"
        )
    import pickle

    return pickle.loads(pickled.read_bytes())


def _arrays(folder: Location, name: str) -> dict[str, np.ndarray] | None:
    """The arrays of ``folder``'s ``name`` (an ``.npz`` ``save`` wrote), or None where it has
    none (a model without buffers, or one saved without its optimizer state)."""
    location = folder.child(name)
    if not location.is_file():
        return None
    with location.open_read() as file:
        return _plain(location, read_arrays, file)


def _plain(location: Location, read: Any, file: Any) -> Any:
    """``read(file)`` of a numpy file without pickles, or an ``InputError`` naming it where it
    is anything else (numpy refuses a pickle before running any of it)."""
    try:
        return read(file)
    except (ValueError, EOFError, zipfile.BadZipFile) as error:
        raise InputError(
            f"{location} is not a numpy file of plain arrays ({error}); it was not written "
            "by TrainedModel.save, or was changed since. Nothing in it was run"
        ) from None
