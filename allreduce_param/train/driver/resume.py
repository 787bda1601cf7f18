"""Where a fit starts, decided on the driver (``start_point``): the start, a trained model,
or a checkpoint, each verified before a task reads it: ``resume_from``'s
(``resume_point``), and after a failed attempt the newest intact one of the fit's own
(``restart_point``).

A damaged checkpoint (a part missing, cut short or overwritten, a manifest unreadable:
``train.integrity``) is never used. Where the user named a fit's folder, or the stage runs
again, the newest intact one is taken instead, with a ``UserWarning`` naming the damaged
file, what is wrong with it and the checkpoint used; where the user named that one
checkpoint's folder, ``DamagedCheckpointError`` (an ``InputError``) says which file is
damaged and where the newest intact alternative is. Every task of an attempt thus starts from the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Any

from allreduce_param.errors import DamagedCheckpointError, InputError
from allreduce_param.train.checkpoint import Found, Manifest, find
from allreduce_param.train.driver.checks import check_initial
from allreduce_param.train.driver.user_warning import warn_user
from allreduce_param.train.integrity import Damage
from allreduce_param.train.settings import FitSettings
from allreduce_param.train.start import StartPoint
from allreduce_param.train.task.job import TrainingJob


def start_point(
    resume_from: str | None, initial: Any, model: Any, optimizer: Any, settings: FitSettings
) -> StartPoint:
    """Where a fit of ``model`` with ``optimizer`` starts, from ``fit()``'s arguments,
    checked before any Spark job: ``resume_from``'s checkpoint (verified), ``initial``'s
    model, or the start."""
    if resume_from is not None and initial is not None:
        raise InputError(
            f"fit() got both resume_from={resume_from!r} and initial=: pass one, resume_from "
            "to continue a fit from its checkpoint, or initial to continue from a trained model"
        )
    if initial is not None:
        trained = check_initial(initial, model, optimizer, settings)
        return StartPoint.of_model(trained, settings.keep_optimizer_state)
    if resume_from is not None:
        return StartPoint.of_checkpoint(resume_point(resume_from))
    return StartPoint()


def resume_point(location: str) -> Manifest:
    """The checkpoint ``fit(resume_from=location)`` continues from: the one there, or the
    newest intact one of a fit's folder."""
    location = str(location).rstrip("/")
    found = find(location)
    if found.single and found.manifest is None:
        damage = found.damaged[0]
        alternative = find(posixpath.dirname(location)).manifest
        if alternative is not None:
            way_on = (
                f"The newest intact checkpoint of its fit is {alternative.folder} (step "
                f"{alternative.step}): resume_from={alternative.folder!r}"
            )
        else:
            way_on = (
                f"Its fit's folder {posixpath.dirname(location)} holds no intact checkpoint: "
                "train from the start"
            )
        raise DamagedCheckpointError(
            f"resume_from={location!r} is a damaged checkpoint: {damage}. {way_on}",
            damage.file,
            damage.problem,
        )
    if found.manifest is None and found.damaged:
        newest_damage = found.damaged[0]
        raise DamagedCheckpointError(
            f"resume_from={location!r} holds no intact checkpoint: {_listed(found.damaged)}. "
            "Train from the start, or name another checkpoint",
            newest_damage.file,
            newest_damage.problem,
        )
    if found.manifest is None:
        raise InputError(
            f"resume_from={location!r} holds no complete checkpoint (no manifest.json "
            "there, nor in a step-... folder of it)"
        )
    if found.damaged:
        warn_damaged(found, f"resume_from={location!r}")
    return found.manifest


def restart_point(job: TrainingJob) -> TrainingJob:
    """The job a stage runs again with after a failed attempt: resuming from the newest
    intact checkpoint of the fit's folder, else from where the first attempt started
    (``resume_from``'s checkpoint, ``initial``'s model, or the start). ``job``: the fit's
    first attempt's."""
    if job.checkpoints is None:
        return job
    found = find(job.checkpoints.directory)
    if found.damaged:
        warn_damaged(
            found, "the stage runs again and", "the job's own start: " + job.start.describe()
        )
    if found.manifest is None:
        return job
    # the fit's own checkpoint: it records how far the fit's start had come (steps_before)
    return dataclasses.replace(job, start=StartPoint.of_checkpoint(found.manifest))


def warn_damaged(found: Found, who: str, otherwise: str = "the start") -> None:
    """The one warning for damaged checkpoints passed over (``found.damaged``), at the
    user's call: a ``UserWarning`` naming each damaged file, what is wrong with it, and where
    ``who`` resumes instead: ``found``'s intact checkpoint, else ``otherwise``."""
    used = (
        f"{found.manifest.folder} (step {found.manifest.step})"
        if found.manifest is not None
        else otherwise
    )
    warn_user(
        f"damaged checkpoint{'s' if len(found.damaged) > 1 else ''} passed over: "
        f"{_listed(found.damaged)}; {who} resumes from {used} instead",
        UserWarning,
    )


def _listed(damaged: tuple[Damage, ...]) -> str:
    return "; ".join(str(damage) for damage in damaged)
