"""A linear model's stage run again after a lost task, from the fit's newest checkpoint.

Spark never retries a barrier stage that returns its results itself, so the driver does, as
DistriOptimizer's fits do (``stage.run_stage``): up to ``spark.stage.maxConsecutiveAttempts``
runs in all, each announced with a ``RuntimeWarning``. A new run resumes from the newest
intact checkpoint of the fit's folder (``checkpoint.find``, a damaged newer one passed over
with a warning), once it is checked to be of this very problem (``glm_checkpoint``); without
checkpoints, or before the first, it starts over. A task's error that every run would meet
again (``failures.recurs``: a setting, an input) ends the fit after the first run. The
warnings name the user's call, however deep the fit's own calls run (``user_warning``).
"""

from __future__ import annotations

from collections.abc import Callable

from allreduce_param.train.checkpoint import CheckpointSettings, Manifest, find
from allreduce_param.train.checkpoint_space import SETTING_NAMES
from allreduce_param.train.driver.failures import run_until_done
from allreduce_param.train.driver.resume import warn_damaged
from allreduce_param.train.driver.user_warning import warn_user
from allreduce_param.train.task.glm_checkpoint import check_same_problem

#: One run of the stage: the checkpoint to resume from (None: the start) to the records.
Run = Callable[[Manifest | None], dict[str, bytes]]


def run_attempts(
    run: Run,
    attempts: int,
    checkpoints: CheckpointSettings | None,
    description: dict,
    first: Manifest | None = None,
) -> dict[str, bytes]:
    """The records of the first run of ``run`` that succeeds, of at most ``attempts``
    (``failures.run_until_done``): the first from ``first`` (``resume_from``'s checkpoint;
    None: the start), each after a failed one from the newest checkpoint of ``checkpoints``
    that is of the problem ``description`` describes (``first`` where none was written yet).
    The last failure's error (``stage_error``) where none succeeds, or at once where it
    would recur."""

    def again(error: Exception, failures: int) -> Manifest | None:
        resume = restart_from(checkpoints, description, first)
        _warn_again(error, failures, attempts, checkpoints, resume)
        return resume

    return run_until_done(run, first, attempts, again)


def restart_from(
    checkpoints: CheckpointSettings | None, description: dict, first: Manifest | None = None
) -> Manifest | None:
    """The newest intact checkpoint of the fit's folder, else ``first`` (where the fit
    started: ``resume_from``'s checkpoint; None: the start) where there are no checkpoints
    or none was written yet; an ``InputError`` naming what differs where it is of another
    problem. Damaged checkpoints passed over are named in ``resume.warn_damaged``'s warning."""
    if checkpoints is None:
        return first
    found = find(checkpoints.directory)
    if found.damaged:
        start = "the start" if first is None else f"{first.folder} (step {first.step})"
        warn_damaged(found, "the stage runs again and", start)
    if found.manifest is None:
        return first
    check_same_problem(found.manifest, description)
    return found.manifest


def _warn_again(
    error: Exception,
    failures: int,
    attempts: int,
    checkpoints: CheckpointSettings | None,
    resume: Manifest | None,
) -> None:
    """Say that the stage failed and runs again, and from where."""
    if resume is not None:
        start = f"from its checkpoint after iteration {resume.step}, {resume.folder}"
    elif checkpoints is not None:
        start = "from the start (no checkpoint was written yet)"
    else:
        start = (
            f"from the start; a fit with checkpoints ({SETTING_NAMES}) would resume from "
            "its newest checkpoint"
        )
    warn_user(
        f"the linear model's stage failed, run {failures} of at most {attempts} "
        f"(spark.stage.maxConsecutiveAttempts): {error}. It runs again, {start}",
        RuntimeWarning,
    )
