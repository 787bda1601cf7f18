"""jobs/bench_train.py end to end on tiny data: one table, a row per contender, figures that hang together.

No speed is checked (that belongs in the benchmark's own runs). The job's ``main`` runs in
this process, as tests/test_benchmarks.py runs the other jobs: it starts and stops its own
session, in the driver JVM that this process's sessions share (``local_spark`` starts a JVM
only where none runs), instead of a Python and a JVM of its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io

import bench_train
import numpy as np
import pytest
from benchkit import training

pytestmark = [pytest.mark.slow, pytest.mark.spark]

#: Low enough that one round of MLlib's L-BFGS (``--mllib-iters-per-round`` below: 0.28 after
#: 4 iterations) and an epoch or two of the others reach it: the test checks the table, not
#: how far each contender gets, and every round or epoch more is seconds of the suite.
TARGET = 0.25
#: Seconds each contender may take: several times what any needs on a quiet machine (the
#: job stops each at the target). On a starved one TorchDistributor's processes can hang
#: after reaching the target (gloo, not this project); its row then says "budget".
BUDGET = 120
#: Epochs of ours (which has no early stop) and at most of TorchDistributor: every contender
#: of torch is above TARGET after its first, the numpy MLP after its second (0.40 at seed 0);
#: a third leaves it a margin. Each epoch more is steps and an evaluation more in each fit,
#: and nothing more in the table to check.
EPOCHS = 3


def run_here(*args: str) -> tuple[int, str, str]:
    """The job's ``main`` with the command line ``args``, in this process: its exit status,
    and what it printed to stdout and to stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = bench_train.main(list(args))
    return status, out.getvalue(), err.getvalue()


def table_rows(out: str) -> list[list[str]]:
    """The table's data rows, cells stripped (not the header or the rule)."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_every_contender_reaches_a_low_target_and_the_table_says_when():
    contenders = ["mlp", "mllib"]
    if importlib.util.find_spec("torch") is not None:
        contenders += ["torchmodel", "torchdistributor"]
    status, out, err = run_here(
        "--master",
        "local[2]",
        "--rows",
        "4000",
        "--batch-size",
        "128",
        "--epochs",
        str(EPOCHS),
        "--target",
        str(TARGET),
        "--budget",
        str(BUDGET),
        "--mllib-iters-per-round",
        "4",
        "--contenders",
        ",".join(contenders),
    )
    assert status == 0, err[-3000:]
    assert "Bayes accuracy" in out and "machine:" in out
    rows = table_rows(out)
    labels = {
        "mlp": "allreduce-param MLP (numpy)",
        "mllib": "MLlib MultilayerPerceptron (L-BFGS)",
        "torchmodel": "allreduce-param TorchModel",
        "torchdistributor": "TorchDistributor DDP (gloo)",
    }
    assert [row[0] for row in rows] == [labels[name] for name in contenders], out
    for label, seconds, to_target, best, total, ended in rows:
        assert not seconds.startswith("not reached"), f"{label} did not reach {TARGET}:\n{out}"
        count, unit = to_target.split()
        assert int(count) >= 1 and unit in ("epoch", "epochs", "iterations"), to_target
        # plus a cancel's lag
        assert 0 < float(seconds) <= float(total) <= BUDGET + 15, (
            label,
            seconds,
            total,
        )
        assert TARGET <= float(best) <= 1, (label, best)
        # "budget": cut at the budget (a hung contender), and then its total says so
        assert ended in ("target", "epochs") or (
            ended == "budget" and float(total) >= BUDGET - 5
        ), (label, ended, total)


def test_a_row_counts_only_what_came_within_the_budget():
    late = training.Run(
        "mlp",
        "epochs",
        started=100.0,
        evaluations=[(105.0, 1, 0.6), (112.0, 2, 0.9)],
        ended=113.0,
        stopped="epochs",
    )
    label, seconds, to_target, best, total, ended = training.summary_row(
        "mlp", [late], 0.8, budget=10
    )
    assert (seconds, to_target, best, total, ended) == (
        "not reached (0.6000)",
        "",
        "0.6000",
        "13.0",
        "epochs",
    )
    on_time = training.Run(
        "mlp",
        "epochs",
        started=0.0,
        evaluations=[(4.0, 1, 0.7), (6.0, 2, 0.85)],
        ended=7.0,
        stopped="epochs",
    )
    row = training.summary_row("mlp", [on_time, late], 0.8, budget=10)
    assert row[1:] == ("6.0 (1 of 2 rounds)", "2 epochs", "0.7250", "10.0", "epochs")  # medians
    missing = training.Run("torchdistributor", "", 0.0, problem="torch not installed")
    assert training.summary_row("torchdistributor", [missing], 0.8, 10)[1] == "torch not installed"


def test_unknown_contender_is_refused_before_spark_starts(capsys):
    """The job's parser, in this process (the race above runs the script itself)."""
    with pytest.raises(SystemExit) as stopped:
        bench_train.main(["--contenders", "mlp,xgboost"])
    assert stopped.value.code == 2
    assert "unknown contenders ['xgboost']" in capsys.readouterr().err


def test_the_data_is_fixed_by_the_seed_and_overlaps():
    data = training.Dataset(rows=25_000, seed=3)
    X, y, is_test = data.block(2, data.centres())
    X_again, y_again, is_test_again = training.Dataset(rows=25_000, seed=3).block(2, data.centres())
    assert X.shape == (5_000, 50) and X.dtype == np.float32  # the last block is the remainder
    assert (
        np.array_equal(X, X_again)
        and np.array_equal(y, y_again)
        and np.array_equal(is_test, is_test_again)
    )
    assert not np.array_equal(X, training.Dataset(rows=25_000, seed=4).block(2, data.centres())[0])
    assert 0.05 < is_test.mean() < 0.15 and set(np.unique(y)) == set(range(10))
    assert abs(float(X[:, 30:].std()) - 1) < 0.05  # the noise features: N(0, 1)
    assert 0.7 < data.bayes_accuracy(20_000) < 0.9  # overlapping classes: well below 1
