"""Checkpoints of a linear model's fit (``LogisticRegression``, ``LinearRegression``): each
slice owner's part of the quasi-Newton solver's state, in the format and folders every fit
of this project writes (``train.checkpoint``: a part per partition, a manifest written last
by partition 0 once every part is there, the newest ``keep`` kept).

A part holds what ``SolverState.to_arrays`` gives, all float64: the owner's slice of the
iterate as ``weights``, its slices of the gradient and the pseudo-gradient as the state
``grad`` and ``adjusted_grad``, and under ``solver/`` its slices of the m kept pairs, their
summed dot products and the scalars every partition shares (the objective's history, the
stopping rule's window, the iteration). A resumed solve (``solve_glm(resume=...)``) takes the
same steps as the one that wrote it, so its coefficients and objective history are the
uninterrupted fit's, bit for bit.

The manifest's ``settings`` describe the problem (``describe``): a checkpoint is resumed
only by a fit of the same problem on as many partitions, and ``differences`` names what
differs where it is not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from allreduce_param.engine.parameter import ConnectedParameter
from allreduce_param.errors import InputError
from allreduce_param.models.glm import GlmProblem
from allreduce_param.train.checkpoint import (
    CheckpointSettings,
    CheckpointWriter,
    Manifest,
    read_part,
)

#: What the manifest's settings say the checkpoint is of.
KIND = "linear model (MLlib's objective, L-BFGS / OWL-QN)"
#: The solver state's slices that ``train.checkpoint`` checks as a part's optimizer state.
STATE_NAMES = ("grad", "adjusted_grad")
_SOLVER = "solver/"
#: The problem's fields as the Estimators' Params name them, for ``differences``.
_PARAM_NAMES = {
    "family": "family",
    "num_features": "numFeatures (the features' width)",
    "num_classes": "numClasses",
    "fit_intercept": "fitIntercept",
    "reg_param": "regParam",
    "elastic_net_param": "elasticNetParam",
    "standardization": "standardization",
    "max_iter": "maxIter",
    "tol": "tol",
    "history": "the L-BFGS memory",
    "solver": "solver",
    "partitions": "the partitions (tasks) of the fit",
    "kind": "the kind of fit",
}


def describe(problem: GlmProblem, partitions: int) -> dict:
    """The manifest's ``settings`` of a fit of ``problem`` on ``partitions`` tasks (JSON)."""
    told = {name: value for name, value in dataclasses.asdict(problem).items()}
    return {"kind": KIND, "partitions": int(partitions), **_plain(told)}


def differences(expected: dict, found: dict) -> list[str]:
    """What differs between two ``describe`` answers, each as "name: A there, B here"."""
    order = list(_PARAM_NAMES)  # the Params' order; a field named nowhere there comes last
    names = sorted(
        set(expected) | set(found),
        key=lambda name: (order.index(name) if name in order else len(order), name),
    )
    return [
        f"{_PARAM_NAMES.get(name, name)}: {found.get(name)!r} there, {expected.get(name)!r} here"
        for name in names
        if found.get(name) != expected.get(name)
    ]


#: What to do where the fit's own checkpoint folder holds another problem's checkpoint.
OWN_FOLDER = (
    "Give this fit a checkpointDir of its own (each fit writes into a new fit-... folder "
    "under it), or fit with the Params and data that wrote it"
)
#: What to do where ``resume_from`` names another problem's checkpoint.
OTHER_CHECKPOINT = (
    "Name a checkpoint of a fit with these Params and data in resume_from=, fit with the "
    "Params and data that wrote it, or leave resume_from unset to fit from the start"
)


def check_same_problem(manifest: Manifest, expected: dict, way_on: str = OWN_FOLDER) -> None:
    """An ``InputError`` naming what differs where ``manifest``'s checkpoint is not of the
    problem ``expected`` describes (another fit's, other Params, other data), and
    ``way_on``: what to do."""
    found = differences(expected, manifest.settings)
    if found:
        raise InputError(
            f"the checkpoint {manifest.folder} is of another problem than this fit's, so it "
            f"cannot be resumed: {'; '.join(found)}. {way_on}"
        )


def _plain(values: dict) -> dict:
    """``values`` with numpy scalars as plain Python ones, for JSON."""
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in values.items()}


def part_arrays(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``SolverState.to_arrays``'s arrays as a checkpoint part's names."""
    named = {"weights": arrays["x"]}
    for name, value in arrays.items():
        if name in STATE_NAMES:
            named[f"state/{name}"] = value
        elif name != "x":
            named[_SOLVER + name] = value
    return named


def solver_arrays(part: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A checkpoint part's arrays as ``SolverState.from_arrays`` takes them."""
    arrays = {"x": part["weights"]}
    for name, value in part.items():
        if name.startswith("state/"):
            arrays[name[len("state/") :]] = value
        elif name.startswith(_SOLVER):
            arrays[name[len(_SOLVER) :]] = value
    return arrays


def resume_arrays(manifest: Manifest, partition: int) -> dict[str, np.ndarray]:
    """Partition ``partition``'s solver state in ``manifest``'s checkpoint (written by a
    fit on as many partitions: the driver checked, ``check_same_problem``)."""
    return solver_arrays(read_part(manifest, partition))


class GlmCheckpointKeeper:
    """``solve_glm``'s ``on_iteration``: after each iteration the checkpoint is due at
    (every ``settings.every`` iterations; ``"epoch"``, the default, is each iteration, as
    each passes over every row), this partition's part is written, then partition 0 waits
    for every partition's signal and writes the manifest."""

    def __init__(
        self, settings: CheckpointSettings, handle: ConnectedParameter, description: dict
    ) -> None:
        self.settings, self.handle, self.description = settings, handle, description
        self.writer = CheckpointWriter(settings)

    def due(self, iteration: int) -> bool:
        """Whether a checkpoint follows ``iteration``."""
        every = self.settings.every
        return iteration > 0 and (every == "epoch" or iteration % every == 0)

    def __call__(self, arrays: dict[str, np.ndarray]) -> None:
        iteration = int(arrays["flags"][0])
        if not self.due(iteration):
            return
        info = self.handle.info
        self.writer.write_part(
            iteration,
            info.partition_id,
            info.partition_num,
            part_arrays(arrays),
            {"iteration": iteration},
        )
        self.handle.collectives.signal(iteration)
        if info.partition_id == 0:
            self.handle.collectives.wait_for_signals(iteration)
            self.writer.write_manifest(
                iteration,
                info.partition_num,
                info.layout.size,
                STATE_NAMES,
                False,
                self.description,
            )


def iteration_hooks(
    *hooks: Callable[[dict[str, np.ndarray]], None] | None,
) -> Callable[[dict[str, np.ndarray]], None] | None:
    """One ``on_iteration`` calling each of ``hooks`` that is not None, in order (None: none)."""
    chosen = [hook for hook in hooks if hook is not None]
    if not chosen:
        return None

    def each(arrays: dict[str, np.ndarray]) -> None:
        for hook in chosen:
            hook(arrays)

    return each
