"""The linear models' checkpoints (``train/task/glm_checkpoint.py``) as their fits write and
find them: each owner's part of the solver's state in the project's checkpoint format, the
newest found and resumed with the uninterrupted run's result, bit for bit; a checkpoint of
another problem refused naming what differs; a full disk one clear error.

Partitions run as threads of this process with real handles and real files, no Spark
(``tests/test_linear_stage.py`` has the Spark stage run again after a lost task)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_partitions

from allreduce_param.engine import AllReduceParameter
from allreduce_param.errors import ConfigurationError, InputError
from allreduce_param.models.glm import GlmProblem, glm_parameter_size
from allreduce_param.train.checkpoint import Checkpoints, find
from allreduce_param.train.driver.glm_attempts import restart_from
from allreduce_param.train.task.glm_checkpoint import (
    GlmCheckpointKeeper,
    describe,
    resume_arrays,
)
from allreduce_param.train.task.glm_solve import solve_glm

PROBLEM = GlmProblem("binomial", 4, num_classes=2, reg_param=0.01, elastic_net_param=0.3)


def _rows(rows: int = 40):
    rng = np.random.default_rng(3)
    X = rng.standard_normal((rows, 4)) * np.array([1.0, 10.0, 0.1, 3.0])
    y = (X @ rng.standard_normal(4) + 0.5 * rng.standard_normal(rows) > 0).astype(float)
    return X, y, rng.uniform(0.5, 2.0, rows)


def _solve(settings=None, resume=None, stop_at=None):
    """Every partition's solution of PROBLEM on 2 partitions, writing checkpoints where
    ``settings`` says, resuming from the ``resume`` manifest; ``stop_at``: every partition
    raises after that iteration (a lost stage)."""
    X, y, w = _rows()
    cuts = np.array_split(np.arange(len(y)), 2)
    param = AllReduceParameter(partition_num=2, size=glm_parameter_size(PROBLEM))
    description = describe(PROBLEM, 2)

    def body(p):
        i = p.info.partition_id
        keeper = None if settings is None else GlmCheckpointKeeper(settings, p, description)

        def after(arrays):
            if keeper is not None:
                keeper(arrays)
            if arrays["flags"][0] == stop_at:
                raise RuntimeError("the stage is lost here")

        return solve_glm(
            p,
            X[cuts[i]],
            y[cuts[i]],
            w[cuts[i]],
            PROBLEM,
            resume=None if resume is None else resume_arrays(resume, i),
            on_iteration=after,
        )

    return run_partitions(param, body)


def test_a_run_resumed_from_its_newest_checkpoint_ends_as_the_uninterrupted_run(tmp_path):
    whole = _solve()[0]
    settings = Checkpoints(str(tmp_path), every=2, keep=2).for_new_fit()
    lost = _solve(settings, stop_at=5)
    assert all(isinstance(result, RuntimeError) for result in lost)
    manifest = restart_from(settings, describe(PROBLEM, 2))
    assert manifest is not None and manifest.step == 4  # the newest of 2 and 4
    steps = sorted(p.name for p in (tmp_path / settings.directory.rsplit("/", 1)[1]).iterdir())
    assert steps == ["step-0000000002", "step-0000000004"]
    # the project's format: float64 slices of the iterate and the gradients, the history
    with np.load(f"{manifest.folder}/part-00001-of-00002.npz", allow_pickle=False) as part:
        assert part["weights"].dtype == np.float64 and part["weights"].shape == (2,)
        assert part["solver/steps"].shape == (4, 2)  # 4 pairs kept after 4 iterations
        assert json.loads(part["records.json"].tobytes()) == {"iteration": 4}
    again = _solve(settings, resume=manifest)
    for solution in again:
        assert np.array_equal(solution.coefficients, whole.coefficients)
        assert np.array_equal(solution.intercepts, whole.intercepts)
        assert solution.objective_history == whole.objective_history
        assert solution.iterations == whole.iterations > 5
    # checkpoints went on after the resume: the newest two of every second iteration
    assert find(settings.directory).manifest.step == whole.iterations // 2 * 2


def test_a_checkpoint_of_another_problem_is_refused_naming_what_differs(tmp_path):
    settings = Checkpoints(str(tmp_path), every=1).for_new_fit()
    _solve(settings, stop_at=2)  # the checkpoint of iteration 1 is complete
    other = GlmProblem("binomial", 4, num_classes=2, reg_param=0.5, elastic_net_param=0.3)
    with pytest.raises(InputError, match="another problem") as raised:
        restart_from(settings, describe(other, 3))
    message = str(raised.value)
    assert "regParam: 0.01 there, 0.5 here" in message
    assert "the partitions (tasks) of the fit: 2 there, 3 here" in message
    assert "tol" not in message  # only what differs


def test_a_full_checkpoint_dir_is_one_configuration_error(tmp_path):
    settings = Checkpoints(str(tmp_path), every=1).for_new_fit()
    step = tmp_path / settings.directory.rsplit("/", 1)[1] / "step-0000000001"
    step.mkdir(parents=True)
    (step / "part-00001-of-00002.npz").symlink_to("/dev/full")  # every write: ENOSPC
    results = _solve(settings)
    failed = results[1]
    assert isinstance(failed, ConfigurationError)
    assert f"checkpoint_dir='{tmp_path}' is full" in str(failed)
    assert "checkpointDir on an Estimator" in str(failed) and "not run again" in str(failed)
