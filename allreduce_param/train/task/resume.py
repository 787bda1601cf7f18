"""Where a partition's fit starts: the job's ``StartPoint`` (a checkpoint of its own fit, one
to resume from, a trained model to continue, or the model's initial weights), handed to
each part of the fit that holds what it restores."""

from __future__ import annotations

from allreduce_param.engine.parameter import ConnectedParameter
from allreduce_param.models.base import has_buffers
from allreduce_param.train.task.batching import StepPlan
from allreduce_param.train.task.evaluator import Evaluator
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.recorder import StepRecorder
from allreduce_param.train.task.updater import Updater


def begin(
    job: TrainingJob,
    p: ConnectedParameter,
    plan: StepPlan,
    updater: Updater,
    evaluator: Evaluator,
    recorder: StepRecorder,
) -> int:
    """Initialise the weights (``p.init``), the optimizer state, the model's buffers, the
    records and early stopping from where the driver said the fit starts (``job.start``;
    ``train.start``); the global step to start at. Every checkpoint part read is checked
    again (size, checksum, format): damage since the driver looked fails the task with the
    file named, and the next attempt passes over that checkpoint."""
    local = job.local_sgd
    start = job.start
    part = start.part(job.model, job.settings.seed, p.info.partition_id, p.info.layout, local)
    updater.start(part.state, p.info.layout.size if local else p.info.slice_length)
    if part.buffers is not None and has_buffers(job.model):
        job.model.set_buffers(part.buffers)
    records = part.records
    recorder.restore(
        records.get("steps", []),
        records.get("updates", []),
        records.get("resumed", []) + ([start.step] if start.step else []),
    )
    manifest = start.checkpoint
    evaluator.restore(
        plan.evaluated_before(start.step, local),
        records.get("epochs", []),
        None if manifest is None else manifest.early_stopping,
        part.best,
    )
    # before init: no peer can report a step before it
    at = plan[start.step] if 0 < start.step < len(plan) else None
    recorder.started(plan.steps_per_epoch, job.settings.epochs, start.step, at)
    own = p.info.layout.bounds(p.info.partition_id)
    p.init(updater.regularisation.initial(part.weights, own), step=start.step)
    return start.step
