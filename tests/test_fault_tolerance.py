"""A fit survives a lost task (local[2], as Spark runs it): the stage is retried, the new
attempt resumes from the newest checkpoint, and ends with the uninterrupted fit's weights."""

from __future__ import annotations

import glob
import os
import shutil
import sys

import numpy as np
import pytest
from pyspark import cloudpickle

from allreduce_param import DistriOptimizer, InputError, models, optim
from allreduce_param.train import Checkpoints

cloudpickle.register_pickle_by_value(sys.modules[__name__])


SPARK_MASTER = "local[2]"


@pytest.fixture(scope="module")
def data(spark):
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 3, 240)
    X = np.eye(3, 6, dtype=np.float32)[labels] * 3 + rng.standard_normal((240, 6)).astype(
        np.float32
    )
    frame = (
        spark.createDataFrame(
            [(row.tolist(), float(label)) for row, label in zip(X, labels)],
            "features array<float>, label double",
        )
        .repartition(3)
        .cache()
    )
    frame.count()
    yield frame
    frame.unpersist()


class FailsOnce(models.MLP):
    """Partition 1 fails once, at its ``at``-th gradient: it raises, or its Python worker
    process dies on the spot, after truncating a part of the newest checkpoint under
    ``damage`` (a checkpoint_dir) where one is given. A file counts the calls and marks the
    failure as done, so the retried attempt (maybe in a new process) goes through."""

    def __init__(self, folder: str, at: int, kill: bool, damage: str | None = None) -> None:
        super().__init__([6, 8, 3])
        self.folder, self.at, self.kill, self.damage = folder, at, kill, damage

    def loss_and_grad(self, weights, X, y):
        from pyspark import TaskContext

        context = TaskContext.get()  # None on the driver, which tries the model on one row
        done = os.path.join(self.folder, "failed")
        if context is not None and context.partitionId() == 1 and not os.path.exists(done):
            with open(os.path.join(self.folder, "calls"), "ab") as calls:
                calls.write(b".")
                count = calls.tell()
            if count == self.at:
                open(done, "w").close()
                if self.damage is not None:
                    newest = sorted(glob.glob(os.path.join(self.damage, "fit-*", "step-*")))[-1]
                    with open(os.path.join(newest, "part-00000-of-00002.npz"), "r+b") as part:
                        part.truncate(100)
                if self.kill:
                    os._exit(1)
                raise ValueError(f"a fault injected at call {count}")
        return super().loss_and_grad(weights, X, y)


def fit(data, model, folder, resume_from=None, **settings):
    return DistriOptimizer(
        model,
        optim.Adam(lr=0.01),
        batch_size=40,
        epochs=4,
        codec="raw",
        seed=1,
        progress=False,
        num_workers=2,
        checkpoints=Checkpoints(str(folder), every=4),
        **settings,
    ).fit(data, resume_from=resume_from)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    return fit(data, models.MLP([6, 8, 3]), tmp_path_factory.mktemp("whole"))


@pytest.mark.slow
@pytest.mark.parametrize("kill", [False, True], ids=["a step raises", "the worker process dies"])
def test_a_lost_task_is_retried_and_resumes_from_the_newest_checkpoint(
    data, uninterrupted, tmp_path, kill
):
    marks = tmp_path / "marks"
    marks.mkdir()
    result = fit(data, FailsOnce(str(marks), at=11, kill=kill), tmp_path / "checkpoints")
    assert (marks / "failed").exists()  # the fault did happen
    # 6 steps an epoch; checkpoints after 4 and 8 steps; call 11 of partition 1 is step 10
    assert result.history.resumed == [8]
    assert np.array_equal(result.weights, uninterrupted.weights)
    assert len(result.history.steps) == len(uninterrupted.history.steps) == 24
    assert [s["loss"] for s in result.history.steps] == [
        s["loss"] for s in uninterrupted.history.steps
    ]
    assert result.history.checkpoints.startswith(str(tmp_path / "checkpoints"))


def test_a_finished_fit_continues_from_its_last_checkpoint(data, uninterrupted, tmp_path):
    longer = DistriOptimizer(
        models.MLP([6, 8, 3]),
        optim.Adam(lr=0.01),
        batch_size=40,
        epochs=6,
        codec="raw",
        seed=1,
        progress=False,
        num_workers=2,
    )
    continued = longer.fit(data, resume_from=uninterrupted.history.checkpoints)
    straight = longer.fit(data)
    assert continued.history.resumed == [24]
    assert np.array_equal(continued.weights, straight.weights)


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_older_intact_one(
    data, uninterrupted, tmp_path
):
    marks, root = tmp_path / "marks", tmp_path / "checkpoints"
    marks.mkdir()
    # the checkpoint of step 8 is cut short, then the worker dies in step 10
    failing = FailsOnce(str(marks), at=11, kill=True, damage=str(root))
    with pytest.warns(UserWarning, match=r"step-0000000008/part-00000-of-00002.npz: truncated"):
        result = fit(data, failing, root)
    assert result.history.resumed == [4]
    assert np.array_equal(result.weights, uninterrupted.weights)
    # resume_from a fit's folder whose newest checkpoint is damaged: the older one, a warning
    copy = tmp_path / "copy"
    shutil.copytree(uninterrupted.history.checkpoints, copy)
    (copy / "step-0000000024" / "part-00001-of-00002.npz").unlink()
    with pytest.warns(UserWarning, match=r"step-0000000024/part-00001-of-00002.npz: missing"):
        again = fit(data, models.MLP([6, 8, 3]), tmp_path / "again", resume_from=str(copy))
    assert again.history.resumed == [20]
    assert np.array_equal(again.weights, uninterrupted.weights)
    # resume_from that damaged checkpoint itself: refused on the driver, naming the way on
    with pytest.raises(
        InputError, match=f"The newest intact checkpoint of its fit is {copy}/step-0000000020"
    ):
        fit(
            data,
            models.MLP([6, 8, 3]),
            tmp_path / "refused",
            resume_from=str(copy / "step-0000000024"),
        )
