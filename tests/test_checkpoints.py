"""Checkpoints on partitions run as threads, into real folders: complete or absent, pruned,
and a fit resumed from one ends where the uninterrupted fit ends."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from conftest import blobs, train_on_threads

from allreduce_param import (
    ConfigurationError,
    DamagedCheckpointError,
    FitSettings,
    InputError,
    models,
    optim,
)
from allreduce_param.engine import AllReduceParameter, SliceLayout, Strategy
from allreduce_param.train.checkpoint import (
    MANIFEST,
    CheckpointSettings,
    find,
    load_part,
    newest,
)
from allreduce_param.train.driver.resume import restart_point, resume_point
from allreduce_param.train.result import STEP_FIELDS
from allreduce_param.train.start import StartPoint
from allreduce_param.train.task.job import TrainingJob


def parts_of(rows: int, partitions: int, seed: int = 1):
    X, y = blobs(rows, 5, 3, seed)
    return [(X[i::partitions], y[i::partitions]) for i in range(partitions)]


def run(job: TrainingJob, parts) -> list[dict]:
    outputs = train_on_threads(job, parts)
    for output in outputs:
        assert isinstance(output, dict), output
    return outputs


def job_for(
    parts, directory=None, every="epoch", keep=2, resume=None, strategy=None, epochs=3, **settings
):
    model = models.MLP([5, 8, 3])
    optimizer = settings.pop("optimizer", optim.Adam(lr=0.01))
    param = AllReduceParameter(len(parts), model.size, codec="raw", timeout=60, strategy=strategy)
    checkpoints = None if directory is None else CheckpointSettings(str(directory), every, keep)
    return TrainingJob(
        model,
        optimizer,
        param,
        FitSettings(batch_size=18, epochs=epochs, seed=3, threads=None, **settings),
        n_features=5,
        has_validation=False,
        checkpoints=checkpoints,
        start=StartPoint() if resume is None else StartPoint.of_checkpoint(resume),
    )


def weights(outputs) -> np.ndarray:
    return np.frombuffer(outputs[0]["weights"], np.float32)


def losses(outputs, partition: int = 0) -> np.ndarray:
    return np.frombuffer(outputs[partition]["steps"], np.float64).reshape(-1, len(STEP_FIELDS))[
        :, 2
    ]


def folders(directory) -> dict[int, bool]:
    """step -> whether the checkpoint folder of that step is complete."""
    return {int(f.name.split("-")[1]): (f / MANIFEST).exists() for f in directory.iterdir()}


def test_a_fit_keeps_its_newest_complete_checkpoints(tmp_path):
    parts = parts_of(90, 3)  # 30 rows a partition, 5 steps an epoch, 15 in all
    run(job_for(parts, tmp_path, every=4, keep=2), parts)
    assert folders(tmp_path) == {12: True, 15: True}  # 4, 8, 12 and the last step; two kept
    manifest = newest(str(tmp_path))
    assert manifest.step == 15 and manifest.partitions == 3
    assert sorted(p.name for p in (tmp_path / "step-0000000015").iterdir()) == [MANIFEST] + [
        f"part-{i:05d}-of-00003.npz" for i in range(3)
    ]
    assert json.loads((tmp_path / "step-0000000015" / MANIFEST).read_text())["state_names"] == [
        "exp_avg",
        "exp_avg_sq",
    ]


def test_each_epoch_by_default(tmp_path):
    parts = parts_of(90, 3)
    run(job_for(parts, tmp_path, every="epoch", keep=5), parts)
    assert folders(tmp_path) == {5: True, 10: True, 15: True}


def test_a_fit_resumed_from_a_checkpoint_ends_as_the_uninterrupted_one(tmp_path):
    parts = parts_of(90, 3)
    whole = run(job_for(parts, tmp_path / "whole", every=4, keep=10), parts)
    middle = newest(str(tmp_path / "whole" / "step-0000000008"))
    assert middle.step == 8
    resumed = run(job_for(parts, tmp_path / "resumed", every=4, resume=middle), parts)
    assert np.array_equal(weights(resumed), weights(whole))
    # the history before the checkpoint came along, and what came after is the same
    for partition in range(3):
        assert np.array_equal(losses(resumed, partition), losses(whole, partition))
    assert json.loads(resumed[0]["resumed"]) == [8] and json.loads(whole[0]["resumed"]) == []


def test_a_retried_stage_resumes_from_its_fits_newest_checkpoint(tmp_path):
    """What the driver does when a task failed: the same job, resuming from the newest
    complete checkpoint of its folder (a newer one that never completed is passed over)."""
    parts = parts_of(90, 3)
    whole = run(job_for(parts, tmp_path / "whole", every=5, keep=1), parts)
    job = job_for(parts, tmp_path / "retried", every=5, keep=3)
    run(job, parts)  # the "first attempt" leaves checkpoints behind; drop the ones after step 5
    for step, _ in folders(tmp_path / "retried").items():
        if step > 5:
            shutil.rmtree(tmp_path / "retried" / f"step-{step:010d}")
    (tmp_path / "retried" / "step-0000000010").mkdir()  # a checkpoint that never completed
    (tmp_path / "retried" / "step-0000000010" / "part-00000-of-00003.npz").write_bytes(b"half")
    again = run(restart_point(job), parts)
    assert json.loads(again[0]["resumed"]) == [5]
    assert np.array_equal(weights(again), weights(whole))


def test_a_checkpoint_loads_on_another_number_of_workers(tmp_path):
    parts = parts_of(90, 3)
    run(job_for(parts, tmp_path, every="epoch", keep=1, epochs=2), parts)
    manifest = newest(str(tmp_path))
    full = {
        name: np.concatenate(
            [load_part(manifest, i, SliceLayout(manifest.size, 3))[0][name] for i in range(3)]
        )
        for name in ("weights", "state/exp_avg", "state/exp_avg_sq")
    }
    for workers in (1, 2, 5):
        layout = SliceLayout(manifest.size, workers)
        for i in range(workers):
            arrays, records = load_part(manifest, i, layout)
            for name, whole in full.items():
                assert np.array_equal(arrays[name], whole[layout.bounds(i)])
            assert records == {}  # another cut: the earlier history does not map onto it
    two = parts_of(90, 2)
    resumed = run(job_for(two, tmp_path / "on-two", epochs=3, resume=manifest), two)
    assert json.loads(resumed[0]["resumed"]) == [manifest.step]
    assert len(losses(resumed)) == 5  # the third epoch only
    # the epochs it evaluates keep their numbers: the second (it ended at the checkpoint) and
    # the third, not the earlier history over again
    for output in resumed:
        assert [share["epoch"] for share in json.loads(output["epochs"])] == [1, 2]


@pytest.mark.parametrize(
    "strategy",
    [Strategy("bsp", backup_workers=1), Strategy("ssp", 2), Strategy("asp")],
    ids=["backup workers", "ssp", "asp"],
)
def test_the_background_owners_write_checkpoints_a_fit_continues_from(tmp_path, strategy):
    parts = parts_of(90, 3)
    first = run(job_for(parts, tmp_path, every="epoch", keep=5, strategy=strategy, epochs=2), parts)
    assert folders(tmp_path) == {5: True, 10: True}
    manifest = newest(str(tmp_path))
    loaded = np.concatenate(
        [load_part(manifest, i, SliceLayout(manifest.size, 3))[0]["weights"] for i in range(3)]
    )
    assert np.array_equal(loaded, weights(first))  # the last checkpoint holds the final weights
    more = run(
        job_for(parts, tmp_path / "more", strategy=strategy, epochs=4, resume=manifest), parts
    )
    steps = np.frombuffer(more[0]["steps"], np.float64).reshape(-1, len(STEP_FIELDS))
    assert len(steps) == 20 and list(steps[10:, 0]) == [2] * 5 + [3] * 5


def test_local_sgd_checkpoints_at_syncs_and_resumes_exactly(tmp_path):
    parts = parts_of(90, 3)
    whole = run(job_for(parts, tmp_path / "whole", every=3, keep=10, sync_every=2), parts)
    # syncs after 2, 4, 5 steps in each 5-step epoch (every 2, and at its end); checkpoints
    # due after 3, 6, 9, 12 and 15 steps are written at the syncs that follow
    assert folders(tmp_path / "whole") == {4: True, 7: True, 9: True, 12: True, 15: True}
    middle = newest(str(tmp_path / "whole" / "step-0000000007"))
    assert middle.local_state
    resumed = run(job_for(parts, tmp_path / "resumed", resume=middle, sync_every=2), parts)
    assert np.array_equal(weights(resumed), weights(whole))


def test_settings_and_bad_checkpoints_are_refused_clearly(tmp_path):
    with pytest.raises(
        ConfigurationError,
        match="checkpoint_every must be a positive whole number of steps or 'epoch'",
    ):
        CheckpointSettings.for_new_fit(str(tmp_path), 0, 2)
    with pytest.raises(
        ConfigurationError, match="checkpoint_keep must be a whole number >= 1, got 0"
    ):
        CheckpointSettings.for_new_fit(str(tmp_path), "epoch", 0)
    assert newest(str(tmp_path)) is None
    (tmp_path / "step-0000000003").mkdir()
    (tmp_path / "step-0000000003" / MANIFEST).write_text('{"format": "something-else/9"}')
    with pytest.raises(InputError, match="holds a checkpoint in format 'something-else/9'"):
        newest(str(tmp_path))
    parts = parts_of(30, 1)
    run(job_for(parts, tmp_path / "one", every="epoch", keep=1), parts)
    manifest = newest(str(tmp_path / "one"))
    with pytest.raises(InputError, match=f"holds {manifest.size} weights; this model has 7"):
        load_part(manifest, 0, SliceLayout(7, 1))


def test_a_checkpoint_dir_the_tasks_could_not_write_fails_on_the_driver(tmp_path, monkeypatch):
    from allreduce_param import DistriOptimizer
    from allreduce_param.train import Checkpoints

    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigurationError,
        match=r"'dbfs:/ckpt': fsspec reads a scheme only before '://', so "
        r"this would be a local folder named 'dbfs:'",
    ):
        DistriOptimizer(
            models.LinearRegression(3), optim.SGD(lr=0.1), checkpoints=Checkpoints("dbfs:/ckpt")
        )
    with pytest.raises(ConfigurationError, match=r"cannot open checkpoint storage 'nosuch://ckpt'"):
        DistriOptimizer(
            models.LinearRegression(3), optim.SGD(lr=0.1), checkpoints=Checkpoints("nosuch://ckpt")
        )
    assert list(tmp_path.iterdir()) == []  # no folder named 'dbfs:' here


def test_the_probe_writes_and_removes_one_file_or_names_checkpoint_dir(tmp_path):
    settings = CheckpointSettings.for_new_fit(str(tmp_path / "root"), "epoch", 1)
    settings.probe()
    assert [p.name for p in tmp_path.iterdir()] == ["root"]
    assert list((tmp_path / "root").iterdir()) == []  # the probe file is gone, no fit folder yet
    (tmp_path / "file").write_text("a regular file")
    under_a_file = CheckpointSettings.for_new_fit(str(tmp_path / "file" / "ckpt"), "epoch", 1)
    with pytest.raises(
        ConfigurationError, match=r"^checkpoint_dir='.*/file/ckpt' cannot hold the fit's"
    ):
        under_a_file.probe()


# ---- damaged checkpoints ----------------------------------------------------------------


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _replace(path):  # other bytes of the same size
    path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))


#: each kind of damage: (the file it hits in a checkpoint folder, what it does, the problem named)
DAMAGE = {
    "truncated part": ("part-00001-of-00003.npz", _truncate, r"truncated: \d+ bytes, the manifest"),
    "replaced part": ("part-00001-of-00003.npz", _replace, "checksum mismatch"),
    "deleted part": ("part-00002-of-00003.npz", lambda path: path.unlink(), "missing"),
    "manifest cut short": (MANIFEST, _truncate, "manifest unreadable"),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One uninterrupted fit's checkpoints (after steps 5, 10 and 15) and final weights."""
    folder = tmp_path_factory.mktemp("written")
    parts = parts_of(90, 3)
    return folder, weights(run(job_for(parts, folder, every=5, keep=3), parts))


def damaged_copy(written, tmp_path, kind: str, step: int = 15):
    """A copy of the written fit's folder with the checkpoint of ``step`` damaged by ``kind``."""
    copy = tmp_path / "fit"
    shutil.copytree(written[0], copy)
    name, damage, _ = DAMAGE[kind]
    damage(copy / f"step-{step:010d}" / name)
    return copy, copy / f"step-{step:010d}" / name


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_retried_stage_passes_over_a_damaged_checkpoint_and_ends_as_the_uninterrupted_fit(
    written, tmp_path, kind
):
    copy, file = damaged_copy(written, tmp_path, kind)
    parts = parts_of(90, 3)
    first = job_for(parts, copy, every=5, keep=3)
    with pytest.warns(UserWarning, match=f"{file}: {DAMAGE[kind][2]}.*step-0000000010 .step 10."):
        job = restart_point(first)
    assert job.start.step == 10
    resumed = run(job, parts)
    assert json.loads(resumed[0]["resumed"]) == [10]
    assert np.array_equal(weights(resumed), written[1])
    assert newest(str(copy)).step == 15  # the damaged checkpoint was written over, intact


def test_resume_from_a_fit_folder_warns_and_from_a_damaged_step_folder_is_refused(
    written, tmp_path
):
    copy, file = damaged_copy(written, tmp_path, "replaced part")
    with pytest.warns(UserWarning, match=f"{file}: checksum mismatch.*resume_from="):
        assert resume_point(str(copy)).step == 10
    with pytest.raises(
        DamagedCheckpointError,  # an InputError
        match=f"is a damaged checkpoint: {file}: checksum mismatch.* The newest intact "
        f"checkpoint of its fit is {copy}/step-0000000010 .step 10.: resume_from=",
    ) as refused:
        resume_point(str(copy / "step-0000000015"))
    assert isinstance(refused.value, InputError) and refused.value.file == str(file)
    for step in (5, 10):  # none intact: refused, or a retried stage starts over
        DAMAGE["deleted part"][1](copy / f"step-{step:010d}" / "part-00002-of-00003.npz")
    with pytest.raises(InputError, match="holds no intact checkpoint: .*step-0000000015/part"):
        resume_point(str(copy))
    with pytest.raises(InputError, match="holds no intact checkpoint: train from the start"):
        resume_point(str(copy / "step-0000000015"))
    first = job_for(parts_of(90, 3), copy)
    with pytest.warns(UserWarning, match="checkpoints passed over: .* from the job's own start"):
        assert restart_point(first).start.fresh


def test_a_part_damaged_after_the_driver_looked_fails_its_task_naming_the_file(written, tmp_path):
    copy, file = damaged_copy(written, tmp_path, "replaced part", step=10)
    manifest = find(str(copy)).manifest  # step 15, intact
    _replace(copy / "step-0000000015" / "part-00000-of-00003.npz")
    with pytest.raises(DamagedCheckpointError, match="part-00000-of-00003.npz: checksum mismatch"):
        load_part(manifest, 0, SliceLayout(manifest.size, 3))
    old = dataclasses.replace(manifest, checks=None)  # the format check alone
    with pytest.raises(DamagedCheckpointError, match=r"part-00000.*: not an .npz archive of arr"):
        load_part(old, 0, SliceLayout(manifest.size, 3))


def test_a_checkpoint_written_before_checksums_still_resumes_exactly(written, tmp_path):
    copy = tmp_path / "old"
    shutil.copytree(written[0], copy)
    manifest_file = copy / "step-0000000010" / MANIFEST
    meta = json.loads(manifest_file.read_text())
    del meta["parts"]
    manifest_file.write_text(json.dumps(meta))
    middle = newest(str(copy / "step-0000000010"))
    assert middle.checks is None and newest(str(copy / "step-0000000015")).checks is not None
    parts = parts_of(90, 3)
    resumed = run(job_for(parts, tmp_path / "resumed", every=5, resume=middle), parts)
    assert np.array_equal(weights(resumed), written[1])


@pytest.mark.parametrize(
    "loop",
    [{}, {"strategy": Strategy("ssp", 1)}, {"sync_every": 2}],
    ids=["bsp", "ssp", "local sgd"],
)
def test_a_fit_resumed_into_fit_intercept_false_starts_and_keeps_its_intercepts_at_0(
    tmp_path, loop
):
    """As a fresh fit with fit_intercept=False, and as MLlib's initialModel under
    fitIntercept=false: the earlier fit's intercepts and their Adam moments do not come along
    (a local SGD checkpoint part, a slice of the whole copy, is zeroed too)."""
    parts = parts_of(90, 3)
    run(job_for(parts, tmp_path, every="epoch", keep=5, epochs=1, **loop), parts)
    manifest = newest(str(tmp_path))
    resumed = weights(
        run(job_for(parts, epochs=2, resume=manifest, fit_intercept=False, **loop), parts)
    )
    biases = ~models.MLP([5, 8, 3]).penalized()
    assert (resumed[biases] == 0).all()
    assert (resumed[~biases] != 0).all()


def test_a_checkpoint_part_is_read_while_no_other_thread_reads_numpy_headers():
    """numpy parses headers with ``ast``, which CPython 3.11 cannot run on two threads at
    once (a SystemError a reader took for a damaged checkpoint): a part is read under
    ``NUMPY_READS``, so a reader waits while another thread holds it."""
    import io
    import threading

    from allreduce_param.train.integrity import open_part
    from allreduce_param.train.numpy_files import NUMPY_READS

    stream = io.BytesIO()
    np.savez(stream, w=np.arange(4, dtype=np.float32))
    data, read = stream.getvalue(), {}
    reader = threading.Thread(target=lambda: read.update(open_part(data, "part", "ckpt", None)))
    with NUMPY_READS:
        reader.start()
        reader.join(0.5)
        assert reader.is_alive() and not read  # waiting for the lock, not reading
    reader.join(30)
    np.testing.assert_array_equal(read["w"], np.arange(4, dtype=np.float32))
