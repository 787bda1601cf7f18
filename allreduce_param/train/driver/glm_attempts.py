"""A linear model's stage run again after a lost task, from the fit's newest checkpoint.

Spark never retries a barrier stage that returns its results itself, so the driver does, as
DistriOptimizer's fits do (``stage.run_stage``): up to ``spark.stage.maxConsecutiveAttempts``
runs in all, each announced with a ``RuntimeWarning``. A new run resumes from the newest
intact checkpoint of the fit's folder (``checkpoint.find``, a damaged newer one passed over
with a warning), once it is checked to be of this very problem (``glm_checkpoint``); without
checkpoints, or before the first, it starts over. A task's error that every run would meet
again (``failures.recurs``: a setting, an input) ends the fit after the first run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from allreduce_param.train.checkpoint import CheckpointSettings, Manifest, find
from allreduce_param.train.checkpoint_space import SETTING_NAMES
from allreduce_param.train.driver.failures import run_until_done
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
        resume = restart_from(checkpoints, description) or first
        _warn_again(error, failures, attempts, checkpoints, resume)
        return resume

    return run_until_done(run, first, attempts, again)


def restart_from(checkpoints: CheckpointSettings | None, description: dict) -> Manifest | None:
    """The newest intact checkpoint of the fit's folder (None: no checkpoints, or none
    written yet); an ``InputError`` naming what differs where it is of another problem."""
    if checkpoints is None:
        return None
    found = find(checkpoints.directory)
    if found.damaged:
        used = "the start" if found.manifest is None else found.manifest.folder
        warnings.warn(
            f"damaged checkpoint{'s' if len(found.damaged) > 1 else ''} passed over: "
            f"{'; '.join(str(damage) for damage in found.damaged)}; the stage runs again "
            f"from {used} instead",
            UserWarning,
            stacklevel=6,
        )
    if found.manifest is not None:
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
    warnings.warn(
        f"the linear model's stage failed, run {failures} of at most {attempts} "
        f"(spark.stage.maxConsecutiveAttempts): {error}. It runs again, {start}",
        RuntimeWarning,
        stacklevel=6,
    )
