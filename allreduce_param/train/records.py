"""What a fit's task sends back to the driver: each record a small typed class, encoded in
the task and decoded on the driver, here in one module that both sides use.

A task's barrier stage returns its records as ``(kind, payload)`` pairs (Arrow rows of
``kind string, payload binary``, or the pairs themselves for an RDD): ``Record.encode``
makes one, ``decode`` turns one back into its class, and ``StageOutput`` gathers every
partition's on the driver. The kinds, in the order a task sends them:

- ``steps`` (``Steps``): the partition's row of ``STEP_FIELDS`` for every global step;
- ``epochs`` (``Epochs``): its share of each epoch's metrics;
- ``clock`` (``Clock``): when it started, had loaded its rows, met its peers, trained;
- ``updates`` (``Updates``, with backup workers): which partitions' gradients each of
  its owner's updates took;
- ``buffers`` (``Buffers``, a model with buffers): its own final buffers and its count of
  training rows;
- ``optimizer_state`` (``OptimizerState``, with ``keep_optimizer_state``): its slice of
  the optimizer's final state;
- ``resumed``, ``reached`` and ``weights`` (``Resumed``, ``Reached``, ``Weights``,
  partition 0 alone): the steps the fit resumed at, how far training has come in all
  (global steps and epochs, earlier fits' included), and the final weights.

A task that fails raises ``task_failure``'s ``TrainingError``, which names its partition
(and epoch and step); ``recover_task_failure`` finds that message again in the text of
the error Spark gives the driver.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from allreduce_param.errors import TrainingError
from allreduce_param.train.numpy_files import read_arrays

#: The fields of a partition's per-step record (a float64 row). ``staleness``: how many
#: steps older than the step the weights it computed on were (0 under BSP).
STEP_FIELDS = (
    "epoch",
    "step",
    "loss_sum",
    "samples",
    "get_s",
    "compute_s",
    "put_s",
    "aggregate_s",
    "update_s",
    "send_s",
    "staleness",
)

#: The fields of a background owner's update record (with backup workers), followed by
#: one 0/1 column per partition: whether the update took that partition's gradient.
UPDATE_FIELDS = ("owner", "step", "count")

#: The Arrow schema of a stage's output rows: one record each.
STAGE_SCHEMA = "kind string, payload binary"


class Record:
    """One record a task sends the driver: ``kind`` names its class on the wire."""

    kind: ClassVar[str]

    def encode(self) -> tuple[str, bytes]:
        """``(kind, payload)``, as the stage returns it."""
        return self.kind, self._payload()

    def _payload(self) -> bytes:
        raise NotImplementedError

    def gather(self, output: StageOutput) -> None:
        """Add this record to the driver's ``output``."""
        raise NotImplementedError


@dataclass(frozen=True)
class Steps(Record):
    """A partition's record of every global step: steps x ``STEP_FIELDS``, float64."""

    kind: ClassVar[str] = "steps"
    table: np.ndarray

    def _payload(self) -> bytes:
        return np.asarray(self.table, dtype=np.float64).reshape(-1, len(STEP_FIELDS)).tobytes()

    @classmethod
    def decode(cls, payload: bytes, partitions: int) -> Steps:
        return cls(np.frombuffer(payload, dtype=np.float64).reshape(-1, len(STEP_FIELDS)))

    def gather(self, output: StageOutput) -> None:
        output.steps.append(self.table)


@dataclass(frozen=True)
class Epochs(Record):
    """A partition's share of each epoch's metrics (``result.merge_epoch`` merges them)."""

    kind: ClassVar[str] = "epochs"
    shares: list[dict]

    def _payload(self) -> bytes:
        return json.dumps(self.shares).encode()

    @classmethod
    def decode(cls, payload: bytes, partitions: int) -> Epochs:
        return cls(json.loads(bytes(payload)))

    def gather(self, output: StageOutput) -> None:
        output.epochs.extend(self.shares)


@dataclass(frozen=True)
class Clock(Record):
    """A task's ``time.time()`` when it ``started``, had ``loaded`` its rows, ``met`` its
    peers and ``trained`` (``result.fit_phases`` reads them)."""

    kind: ClassVar[str] = "clock"
    marks: dict[str, float]

    def _payload(self) -> bytes:
        return json.dumps(self.marks).encode()

    @classmethod
    def decode(cls, payload: bytes, partitions: int) -> Clock:
        return cls(json.loads(bytes(payload)))

    def gather(self, output: StageOutput) -> None:
        output.clocks.append(self.marks)


@dataclass(frozen=True)
class Updates(Record):
    """With backup workers, a background owner's updates: rows of ``UPDATE_FIELDS`` then one
    0/1 column per partition, float64."""

    kind: ClassVar[str] = "updates"
    table: np.ndarray

    def _payload(self) -> bytes:
        return np.asarray(self.table, dtype=np.float64).tobytes()

    @classmethod
    def decode(cls, payload: bytes, partitions: int) -> Updates:
        columns = len(UPDATE_FIELDS) + partitions
        return cls(np.frombuffer(payload, dtype=np.float64).reshape(-1, columns))

    def gather(self, output: StageOutput) -> None:
        output.updates.append(self.table)


@dataclass(frozen=True)
class Buffers(Record):
    """A partition's final buffers (name -> array) and its count of training rows, as npz."""

    kind: ClassVar[str] = "buffers"
    buffers: dict[str, np.ndarray]
    rows: int

    def _payload(self) -> bytes:
        stream = io.BytesIO()
        arrays = {f"buffer/{name}": value for name, value in self.buffers.items()}
        np.savez(stream, rows=np.int64(self.rows), **arrays)
        return stream.getvalue()

    @classmethod
    def decode(cls, payload: bytes, partitions: int = 0) -> Buffers:
        arrays = read_arrays(io.BytesIO(bytes(payload)))
        buffers = {
            name[len("buffer/") :]: value
            for name, value in arrays.items()
            if name.startswith("buffer/")
        }
        return cls(buffers, int(arrays["rows"]))

    def gather(self, output: StageOutput) -> None:
        output.buffers.append((self.buffers, self.rows))


@dataclass(frozen=True)
class Resumed(Record):
    """The global steps the fit resumed at from checkpoints (partition 0's)."""

    kind: ClassVar[str] = "resumed"
    steps: list[int]

    def _payload(self) -> bytes:
        return json.dumps(self.steps).encode()

    @classmethod
    def decode(cls, payload: bytes, partitions: int) -> Resumed:
        return cls(json.loads(bytes(payload)))

    def gather(self, output: StageOutput) -> None:
        output.resumed = self.steps


@dataclass(frozen=True)
class OptimizerState(Record):
    """A partition's slice of the optimizer's final state (name -> float32 array), as npz;
    the driver joins the slices in partition order (``StageOutput.optimizer_state``)."""

    kind: ClassVar[str] = "optimizer_state"
    partition: int
    state: dict[str, np.ndarray]

    def _payload(self) -> bytes:
        stream = io.BytesIO()
        arrays = {f"state/{name}": value for name, value in self.state.items()}
        np.savez(stream, partition=np.int64(self.partition), **arrays)
        return stream.getvalue()

    @classmethod
    def decode(cls, payload: bytes, partitions: int = 0) -> OptimizerState:
        arrays = read_arrays(io.BytesIO(bytes(payload)))
        state = {
            name[len("state/") :]: value
            for name, value in arrays.items()
            if name.startswith("state/")
        }
        return cls(int(arrays["partition"]), state)

    def gather(self, output: StageOutput) -> None:
        output.state_slices[self.partition] = self.state


@dataclass(frozen=True)
class Reached(Record):
    """How far training has come when the fit ends: global ``steps`` and ``epochs``, the
    earlier fits' it continued included (partition 0's)."""

    kind: ClassVar[str] = "reached"
    steps: int
    epochs: int

    def _payload(self) -> bytes:
        return json.dumps({"steps": self.steps, "epochs": self.epochs}).encode()

    @classmethod
    def decode(cls, payload: bytes, partitions: int) -> Reached:
        fields = json.loads(bytes(payload))
        return cls(int(fields["steps"]), int(fields["epochs"]))

    def gather(self, output: StageOutput) -> None:
        output.reached = (self.steps, self.epochs)


@dataclass(frozen=True)
class Weights(Record):
    """The final weights, one float32 vector (partition 0's)."""

    kind: ClassVar[str] = "weights"
    vector: np.ndarray

    def _payload(self) -> bytes:
        return np.asarray(self.vector, dtype=np.float32).tobytes()

    @classmethod
    def decode(cls, payload: bytes, partitions: int) -> Weights:
        return cls(np.frombuffer(bytes(payload), dtype=np.float32).copy())

    def gather(self, output: StageOutput) -> None:
        output.weights = self.vector


#: Every record class by its kind.
KINDS: dict[str, Any] = {
    record.kind: record
    for record in (
        Steps,
        Epochs,
        Clock,
        Updates,
        Buffers,
        OptimizerState,
        Resumed,
        Reached,
        Weights,
    )
}


def decode(kind: str, payload: bytes, partitions: int) -> Record:
    """The record of ``kind`` a task encoded; ``partitions``: the fit's partition count."""
    try:
        record = KINDS[kind]
    except KeyError:
        raise TrainingError(
            f"a task sent a record of kind {kind!r}; the kinds are {', '.join(KINDS)}"
        ) from None
    return record.decode(payload, partitions)


@dataclass
class StageOutput:
    """Every record of a fit's stage, gathered on the driver by kind, and the driver's
    ``time.time()`` when it ``submitted`` the stage."""

    steps: list[np.ndarray] = field(default_factory=list)
    epochs: list[dict] = field(default_factory=list)
    updates: list[np.ndarray] = field(default_factory=list)
    clocks: list[dict] = field(default_factory=list)
    buffers: list[tuple[dict[str, np.ndarray], int]] = field(default_factory=list)
    resumed: list[int] = field(default_factory=list)
    weights: np.ndarray | None = None
    submitted: float = 0.0
    state_slices: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    reached: tuple[int, int] = (0, 0)

    @property
    def optimizer_state(self) -> dict[str, np.ndarray] | None:
        """The optimizer's whole final state, its partitions' slices joined in order (None:
        the tasks kept none)."""
        if not self.state_slices:
            return None
        ordered = [self.state_slices[index] for index in sorted(self.state_slices)]
        return {
            name: np.concatenate([piece[name] for piece in ordered]).astype(np.float32)
            for name in ordered[0]
        }

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, bytes]], partitions: int) -> StageOutput:
        """The records of the stage's ``(kind, payload)`` pairs, decoded."""
        output = cls()
        for kind, payload in pairs:
            decode(kind, payload, partitions).gather(output)
        return output


# ---- a task's failure ----------------------------------------------------------------------


def task_failure(partition: int | str, where: str, error: BaseException) -> TrainingError:
    """The error a task raises when its fit fails: it names the partition, then ``where``
    (e.g. ``", epoch 2, step 5"`` or ``", meeting its peers"``), then the error."""
    return TrainingError(f"partition {partition}{where}: {type(error).__name__}: {error}")


_TASK_FAILURE = re.compile(r"TrainingError: (partition [^\n]*)")


def recover_task_failure(text: str) -> TrainingError | None:
    """``task_failure``'s error again, from the text of what Spark reports on the driver
    (a Java stack with the Python traceback inside); None when no task's failure is there.
    A partition that lost a failed peer quotes what that peer said: the innermost quote,
    the root cause, is the one returned."""
    found = _TASK_FAILURE.search(text)
    if found is None:
        return None
    return TrainingError(found.group(1).split("TrainingError: ")[-1])


# ---- live progress: what a task reports while it trains ----------------------------------
# Sent as messages (``task.reporter``) over the task's connection to the driver, a dict with
# the report's ``kind`` and its fields, which the driver's listeners get as they are.


@dataclass(frozen=True)
class Started:
    """A partition began its fit: ``steps`` per epoch, ``epochs``; resumed after ``done``
    global steps (0: from the start), at ``resumed``, ``[epoch, step]`` (None: after the last)."""

    kind: ClassVar[str] = "start"
    partition: int | None
    steps: int
    epochs: int
    done: int = 0
    resumed: list[int] | None = None

    def message(self) -> dict:
        fields = {"partition": self.partition, "steps": self.steps, "epochs": self.epochs}
        if self.done:
            fields.update(resumed=self.resumed, done=self.done)
        return {"kind": self.kind, **fields}

    @classmethod
    def of(cls, fields: dict) -> Started:
        return cls(
            fields.get("partition"),
            fields.get("steps", 0),
            fields.get("epochs", 0),
            fields.get("done", 0),
            fields.get("resumed"),
        )


@dataclass(frozen=True)
class StepDone:
    """A partition's ``record`` of one global step (its ``STEP_FIELDS``)."""

    kind: ClassVar[str] = "step"
    record: list[float]
    partition: int | None = None

    @property
    def key(self) -> tuple[str, int, int]:
        """``("step", epoch, step)``: the step the partitions' reports are merged by."""
        return "step", int(self.record[0]), int(self.record[1])

    def message(self) -> dict:
        return {"kind": self.kind, "partition": self.partition, "record": list(self.record)}

    @classmethod
    def of(cls, fields: dict) -> StepDone:
        return cls(fields["record"], fields.get("partition"))


@dataclass(frozen=True)
class EpochDone:
    """A partition's share of an epoch's metrics (``epoch``, ``partition``, ``task``, the
    sums ``val`` and ``train``, early stopping's ``best_epoch`` and ``stopped``)."""

    kind: ClassVar[str] = "epoch"
    metrics: dict

    @property
    def key(self) -> tuple[str, int]:
        """``("epoch", epoch)``: the epoch the partitions' shares are merged by."""
        return "epoch", int(self.metrics["epoch"])

    def message(self) -> dict:
        return {"kind": self.kind, **self.metrics}

    @classmethod
    def of(cls, fields: dict) -> EpochDone:
        return cls(dict(fields))


#: Every progress report by its kind.
REPORTS: dict[str, Any] = {report.kind: report for report in (Started, StepDone, EpochDone)}


def read_report(message: dict) -> Started | StepDone | EpochDone | None:
    """The report a task's progress ``message`` carries; None for a message of another kind."""
    report = REPORTS.get(message.get("kind"))
    if report is None:
        return None
    return report.of({name: value for name, value in message.items() if name != "kind"})
