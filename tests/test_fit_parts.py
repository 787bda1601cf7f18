"""The task's fit as parts, each alone, without Spark: the plan and its rows, the gradient
path chosen once per fit (and what it refuses), the updater, the recorder, the evaluator
and the checkpoint keeper, on one real partition's handle where a part needs one."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import blobs

from allreduce_param import ConfigurationError, FitSettings, models, optim
from allreduce_param.engine import AllReduceParameter, LocalRendezvous, Strategy
from allreduce_param.engine.owner import Update
from allreduce_param.train.checkpoint import CheckpointSettings, load_part, newest
from allreduce_param.train.early_stopping import EarlyStopping
from allreduce_param.train.records import STEP_FIELDS, UPDATE_FIELDS, EpochDone, StepDone
from allreduce_param.train.regularisation import OwnedRegularisation
from allreduce_param.train.task.batching import StepPlan, epoch_order, share_bounds
from allreduce_param.train.task.checkpoint_keeper import CheckpointKeeper
from allreduce_param.train.task.compute import SubBatches, evaluate
from allreduce_param.train.task.evaluator import Evaluator
from allreduce_param.train.task.gradient_path import (
    BufferPut,
    DensePut,
    EncodedPut,
    EncodedStreamedPut,
    StreamedPut,
    TouchedPut,
    choose_path,
    clips_own,
)
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.memory_rows import Rows
from allreduce_param.train.task.recorder import StepRecorder
from allreduce_param.train.task.step_rows import StepRows
from allreduce_param.train.task.updater import Updater


@contextmanager
def one_partition(param: AllReduceParameter):
    """The one partition's handle of ``param`` (a stage of one), closed afterwards."""
    with param.connect(LocalRendezvous(1).member(0)) as p:
        yield p


def job_of(model, settings: FitSettings, optimizer=None, sparse: bool = False, **param_args):
    param = AllReduceParameter(1, model.size, codec="raw", timeout=30, **param_args)
    return TrainingJob(
        model, optimizer or optim.SGD(lr=0.1), param, settings, 4, False, sparse=sparse
    )


# ---- the plan and its rows ---------------------------------------------------------------


def test_the_plan_holds_the_steps_with_rows_and_this_partitions_cuts():
    """Counts 5, 0 and 7 in batches of 4: 3 steps an epoch, every one with rows; epochs
    numbered on from an earlier fit's (2 and 3)."""
    plan = StepPlan([5, 0, 7], partition_id=2, batch_size=4, first_epoch=2, last_epoch=3)
    assert plan.steps == [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2)]
    assert plan.steps_per_epoch == 3 and len(plan) == 6 and plan[3] == (3, 0)
    assert plan.cuts.tolist() == share_bounds(7, 2, 3, 3).tolist()
    assert [plan.ends_epoch(i) for i in range(6)] == [False, False, True, False, False, True]
    assert plan.at(99) == (3, 2)  # past the end: the last step, which errors name
    assert (plan.epoch_after(4), plan.epoch_after(6)) == (3, 3)
    assert plan.steps_before_epoch(3) == 3
    # a checkpoint after 3 steps: BSP had not yet evaluated epoch 2, local SGD had
    assert plan.evaluated_before(3, local_sgd=False) == 2
    assert plan.evaluated_before(3, local_sgd=True) == 3
    assert (plan.evaluated_before(0, False), plan.evaluated_before(6, False)) == (2, 3)


def test_a_plan_leaves_out_the_steps_no_partition_has_rows_for():
    """Two rows in batches of 1 over 4 partitions' counts: 2 steps an epoch, not 2 empty ones
    more (steps_per_epoch counts only the steps with rows)."""
    plan = StepPlan([1, 0, 0, 1], partition_id=0, batch_size=1, first_epoch=0, last_epoch=0)
    assert len(plan) == plan.steps_per_epoch == 2


def test_step_rows_are_the_epochs_shuffled_cut_in_one_room():
    X, y = blobs(10, 3, 2, seed=0)
    rows = Rows(X, y, None)
    plan = StepPlan([10], 0, batch_size=4, first_epoch=0, last_epoch=1)
    step_rows = StepRows(rows, plan, seed=7, partition_id=0)
    for epoch in (0, 1):
        order = epoch_order(10, 7, epoch, 0)
        for step in range(plan.steps_per_epoch):
            taken = step_rows.of(epoch, step)
            chosen = order[plan.cuts[step] : plan.cuts[step + 1]]
            assert np.array_equal(taken.X, X[chosen]) and np.array_equal(taken.y, y[chosen])
    # dense rows in memory: views of one room, sized for the largest share
    first, second = step_rows.of(0, 0), step_rows.of(0, 1)
    assert np.shares_memory(first.X, second.X)
    sparse = StepRows(Rows(sp.csr_matrix(X), y, None), plan, seed=7, partition_id=0)
    assert sp.issparse(sparse.of(0, 0).X)  # CSR rows: fresh, no room


# ---- the gradient path -------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, param_args, chosen",
    [
        ({"overlap": False}, {}, BufferPut),
        ({"overlap": True}, {}, StreamedPut),
        ({"overlap": "auto"}, {}, BufferPut),  # no peer over TCP, no GPU: nothing to hide
        ({"threads": 2, "overlap": True}, {}, DensePut),  # summed over threads: no buffer
        ({"sync_every": 2}, {}, DensePut),  # local SGD's loop computes, its check ran
        ({}, {"strategy": Strategy("ssp", 1)}, DensePut),
        ({}, {"strategy": Strategy("asp")}, DensePut),
    ],
    ids=["buffer", "streamed", "auto", "threads", "local SGD", "ssp", "asp"],
)
def test_the_path_is_chosen_once_from_the_settings(settings, param_args, chosen):
    model = models.MLP([4, 8, 3])
    job = job_of(model, FitSettings(batch_size=8, **settings), **param_args)
    compute = SubBatches(model, job.settings.threads)
    try:
        with one_partition(job.param) as p:
            path = choose_path(job, p, compute)
            assert type(path) is chosen
            assert not clips_own(job, p)  # no clip_norm
    finally:
        compute.close()


def test_a_background_owners_strategy_clips_what_each_partition_puts():
    model = models.MLP([4, 8, 3])
    clipped = job_of(
        model, FitSettings(batch_size=8), optim.SGD(lr=0.1, clip_norm=1.0), strategy=Strategy("asp")
    )
    bsp = job_of(model, FitSettings(batch_size=8), optim.SGD(lr=0.1, clip_norm=1.0))
    compute = SubBatches(model, None)
    with one_partition(clipped.param) as p:
        assert clips_own(clipped, p)
        seen = []
        path = choose_path(clipped, p, compute, clip=lambda g, count: seen.append(count))
        assert type(path) is DensePut and path.clip is not None
    with one_partition(bsp.param) as p:
        assert not clips_own(bsp, p)  # BSP clips the owners' sum by the global norm


def test_the_touched_path_serves_sparse_rows_and_is_refused_where_it_cannot():
    model = models.LogisticRegression(4)
    touched = job_of(model, FitSettings(batch_size=8, sparse_sync="touched"), sparse=True)
    compute = SubBatches(model, None)
    with one_partition(touched.param) as p:
        assert type(choose_path(touched, p, compute)) is TouchedPut
    local = job_of(
        model, FitSettings(batch_size=8, sparse_sync="touched", sync_every=2), sparse=True
    )
    with one_partition(local.param) as p:
        with pytest.raises(ConfigurationError, match="sparse_sync='touched' cannot serve"):
            choose_path(local, p, compute)


@pytest.mark.parametrize("overlap, chosen", [(False, EncodedPut), (True, EncodedStreamedPut)])
def test_a_torch_model_encoding_on_its_device_takes_the_encoded_path(overlap, chosen):
    torch = pytest.importorskip("torch")
    model = models.TorchModel(torch.nn.Linear(4, 3), encode_on_device=True)
    job = job_of(model, FitSettings(batch_size=8, overlap=overlap), gradient_codec="bf16")
    compute = SubBatches(model, None)
    with one_partition(job.param) as p:
        assert type(choose_path(job, p, compute)) is chosen


def test_encoding_on_the_device_is_refused_under_local_sgd_by_name():
    torch = pytest.importorskip("torch")
    model = models.TorchModel(torch.nn.Linear(4, 3), encode_on_device=True)
    job = job_of(model, FitSettings(batch_size=8, sync_every=2), gradient_codec="bf16")
    compute = SubBatches(model, None)
    with one_partition(job.param) as p:
        with pytest.raises(ConfigurationError, match="encode_on_device=True.*local SGD"):
            choose_path(job, p, compute)


def test_each_host_path_puts_the_gradient_the_model_computes_with_the_same_bits():
    """One step on one partition by each path: the owner's aggregate is the model's gradient
    over the batch divided by its rows, the same bits whichever path put it; the record is
    kept once, with the batch's count."""
    X, y = blobs(12, 4, 3, seed=1)
    model = models.MLP([4, 8, 3])
    weights = model.init(np.random.default_rng(0))
    _, expected, count = model.loss_and_grad(weights, X, y)
    expected = (expected / np.float32(count)).astype(np.float32)
    compute = SubBatches(model, None)
    aggregates = {}
    for path_type in (DensePut, BufferPut, StreamedPut):
        param = AllReduceParameter(1, model.size, codec="raw", timeout=30)
        kept: list = []
        with one_partition(param) as p:
            p.init(weights.copy())
            read = p.get_weights()
            path = path_type(p, compute)
            put_s = path.step(read, Rows(X, y, None), lambda *given, kept=kept: kept.append(given))
            aggregates[path_type] = p.aggregate_gradient_partition().copy()
        assert len(kept) == 1 and kept[0][1] == 12 and kept[0][2] >= 0 and put_s >= 0
    np.testing.assert_allclose(aggregates[DensePut], expected, rtol=1e-6, atol=1e-7)
    assert aggregates[BufferPut].tobytes() == aggregates[DensePut].tobytes()
    assert aggregates[StreamedPut].tobytes() == aggregates[DensePut].tobytes()


# ---- the updater -------------------------------------------------------------------------


def test_the_updater_steps_as_the_optimizer_counting_on_from_earlier_fits():
    model = models.LinearRegression(4)
    settings = FitSettings(batch_size=8, fit_intercept=False)
    regularisation = OwnedRegularisation(
        settings.regularization, settings.fit_intercept, model, model.size, slice(0, model.size)
    )
    optimizer = optim.Adam(lr=0.1)
    updater = Updater(optimizer, regularisation, steps_before=5)
    updater.start(None, model.size)
    assert set(updater.state) == set(optimizer.init_state(1))
    gradient = np.arange(1, model.size + 1, dtype=np.float32)
    updater.hold(gradient)  # no intercept: its gradient is held at 0
    assert gradient[~model.penalized()].tolist() == [0.0]
    weights, reference = np.ones(model.size, np.float32), np.ones(model.size, np.float32)
    state = optimizer.init_state(model.size)
    updater.step(weights, gradient, 2, grad_scale=0.5)
    optimizer.step(reference, gradient, state, 7, grad_scale=0.5)  # 5 earlier steps + 2
    assert weights.tobytes() == reference.tobytes()
    assert updater.state_slice(slice(1, 3))["exp_avg"].tobytes() == state["exp_avg"][1:3].tobytes()


def test_the_updater_clips_by_the_own_norm_only_with_clip_norm():
    model = models.LinearRegression(4)
    settings = FitSettings()
    regularisation = OwnedRegularisation(
        settings.regularization, settings.fit_intercept, model, model.size, slice(0, model.size)
    )
    clipped = Updater(optim.SGD(lr=0.1, clip_norm=1.0), regularisation, 0)
    gradient = np.full(model.size, 10.0, np.float32)  # summed over 2 rows: norm 5 * sqrt(5)
    clipped.clip_own(gradient, 2)
    assert np.isclose(np.linalg.norm(gradient / 2), 1.0, rtol=1e-5)
    plain = Updater(optim.SGD(lr=0.1), regularisation, 0)
    untouched = np.full(model.size, 10.0, np.float32)
    plain.clip_own(untouched, 2)
    assert (untouched == 10.0).all()


# ---- the recorder ------------------------------------------------------------------------


def test_the_recorder_keeps_each_step_and_reports_it():
    reports = []
    recorder = StepRecorder(3, reports.append)
    recorder.at(1, 4)
    assert recorder.where == {"epoch": 1, "step": 4}
    record = recorder.keep(1, 4, 2.5, 8, (0.1, 0.2, 0.0, 0.0, 0.0, 0.0), staleness=2)
    assert record.tolist() == [1, 4, 2.5, 8, 0.1, 0.2, 0, 0, 0, 0, 2]
    assert len(record) == len(STEP_FIELDS) and recorder.records == [record]
    record[STEP_FIELDS.index("put_s")] = 0.3  # the put's time, filled in after
    recorder.report_step(record)
    assert reports == [StepDone(record.tolist(), 3)]
    # a straggler's steps the others went on without: zeros after its own
    steps = recorder.steps_until(3, [(1, 4), (1, 5), (2, 0)])
    assert steps[0] == record.tolist()
    assert steps[1:] == [[1, 5] + [0.0] * (len(STEP_FIELDS) - 2), [2, 0] + [0.0] * 9]
    StepRecorder(0).report_step(record)  # without a driver to report to: nothing sent


def test_the_recorder_tables_the_owners_updates_after_an_earlier_runs():
    recorder = StepRecorder(1)
    width = len(UPDATE_FIELDS) + 2
    assert recorder.updates_table(None, 2).shape == (0, width)
    earlier = [[1, 0, 5, 1, 1]]
    recorder.restore([[0, 0, 1.0, 2] + [0.0] * 7], earlier, [1])
    assert recorder.resumed == [1] and recorder.records[0].dtype == np.float64
    table = recorder.updates_table([Update(1, (0,), 3), Update(2, (0, 1), 6)], 2, before=2)
    assert table.tolist() == [[1, 0, 5, 1, 1], [1, 1, 3, 1, 0]]


# ---- the evaluator -----------------------------------------------------------------------


def test_the_evaluator_evaluates_each_epoch_once_and_stops_early_with_the_best_weights():
    X, y = blobs(20, 4, 1, seed=2)
    y = y.astype(np.float64)
    model = models.LinearRegression(4)
    rows = Rows(X.astype(np.float32), y, None)
    plan = StepPlan([20], 0, batch_size=10, first_epoch=0, last_epoch=3)
    reports = []
    recorder = StepRecorder(0, reports.append)
    param = AllReduceParameter(1, model.size, codec="raw", timeout=30)
    good, bad = np.zeros(model.size, np.float32), np.full(model.size, 5.0, np.float32)
    with one_partition(param) as p:
        evaluator = Evaluator(model, p, plan, rows, rows, EarlyStopping(1).tracker(), recorder)
        weights = good.copy()
        assert not evaluator.epochs_before(2, weights)  # step 2 is epoch 1's first: epoch 0
        assert [share["epoch"] for share in evaluator.epochs] == [0]
        assert not evaluator.epochs_before(3, weights)  # epoch 0 done already
        weights[:] = bad  # epoch 1 worse: patience 1 ends the fit, the best put back
        assert evaluator.epochs_before(4, weights)
    assert evaluator.stopped and evaluator.next_epoch == 2
    assert weights.tobytes() == good.tobytes()
    last = evaluator.epochs[-1]
    assert last["val"] == evaluate(model, bad, rows.X, rows.y)
    assert last["train"] == evaluate(model, good, rows.X, rows.y)  # the best epoch's
    assert (last["best_epoch"], last["stopped"]) == (0, True)
    assert [type(report) for report in reports] == [EpochDone, EpochDone]
    assert evaluator.reached() == (4, 2)  # the steps of epochs 0 and 1


def test_a_restored_evaluator_drops_the_shares_it_has_not_reached():
    model = models.LinearRegression(4)
    plan = StepPlan([8], 0, batch_size=4, first_epoch=0, last_epoch=2)
    rows = Rows(np.zeros((8, 4), np.float32), np.zeros(8), None)
    param = AllReduceParameter(1, model.size, codec="raw", timeout=30)
    with one_partition(param) as p:
        evaluator = Evaluator(model, p, plan, rows, None, None, StepRecorder(0))
        evaluator.restore(1, [{"epoch": 0}, {"epoch": 1}])
        assert evaluator.epochs == [{"epoch": 0}] and evaluator.next_epoch == 1
        assert evaluator.shares_before(1) == [{"epoch": 0}]
        weights = np.zeros(model.size, np.float32)
        evaluator.last_done(weights)  # epoch 1, then the last, 2, with its training metrics
    assert [share["epoch"] for share in evaluator.epochs] == [0, 1, 2]
    assert "train" in evaluator.epochs[-1] and "val" not in evaluator.epochs[-1]
    assert evaluator.reached() == (6, 3)


# ---- the checkpoint keeper ---------------------------------------------------------------


def test_the_checkpoint_keeper_writes_a_checkpoint_the_fit_can_find(tmp_path):
    model = models.LinearRegression(4)
    settings = FitSettings(batch_size=4, epochs=2)
    plan = StepPlan([8], 0, batch_size=4, first_epoch=0, last_epoch=1)
    checkpoints = CheckpointSettings(str(tmp_path), every=3, keep=2)
    param = AllReduceParameter(1, model.size, codec="raw", timeout=30)
    job = TrainingJob(model, optim.Adam(lr=0.1), param, settings, 4, False, checkpoints=checkpoints)
    regularisation = OwnedRegularisation(
        settings.regularization, settings.fit_intercept, model, model.size, slice(0, model.size)
    )
    updater = Updater(job.optimizer, regularisation, 0)
    updater.start(None, model.size)
    updater.state["exp_avg"][:] = 0.25
    recorder = StepRecorder(0)
    rows = Rows(np.zeros((8, 4), np.float32), np.zeros(8), None)
    weights = np.arange(model.size, dtype=np.float32)
    with one_partition(param) as p:
        evaluator = Evaluator(model, p, plan, rows, None, None, recorder)
        keeper = CheckpointKeeper(job, p, plan, updater, evaluator, recorder, rows=8)
        assert [keeper.due(i) for i in range(4)] == [False, False, True, True]  # every 3, last
        p.init(weights.copy())
        for index in range(3):
            recorder.keep(*plan[index], 1.0, 4, (0.0,) * 6)
        keeper.write(3)
    manifest = newest(str(tmp_path))
    assert manifest is not None and manifest.step == 3
    assert set(manifest.state_names) == {"exp_avg", "exp_avg_sq"}
    arrays, records = load_part(manifest, 0, param.layout)
    assert arrays["weights"].tobytes() == weights.tobytes()
    assert (arrays["state/exp_avg"] == 0.25).all()
    assert len(records["steps"]) == 3 and records["rows"] == 8
    none = TrainingJob(model, optim.Adam(lr=0.1), param, settings, 4, False)
    with one_partition(param) as p:
        evaluator = Evaluator(model, p, plan, rows, None, None, recorder)
        keeper = CheckpointKeeper(none, p, plan, updater, evaluator, recorder, rows=8)
        assert not any(keeper.due(i) for i in range(4))  # no checkpoints asked for
