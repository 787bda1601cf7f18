"""The tables of ``bench_sparse.py``: its results, the rows' sizes, ours' step phases, and
``--compare-syncs``' dense against touched, each a header and its rows, made from
``sparse_runs.Run`` objects.

Kept apart from the runs so that the tables' arithmetic (medians over rounds, the ratios,
a failed run's reason where its figures would be) can be checked without Spark.
"""

from __future__ import annotations

import statistics

from benchkit.sparse_runs import Run

#: phases of a step as History.steps names them, and as the step table heads them
STEP_PHASES = ("get_s", "compute_s", "put_s", "aggregate_s", "update_s", "send_s")


def mb(value: float) -> str:
    return f"{value / 2**20:,.0f}"


def ratio_text(ratios: list[float]) -> str:
    if not ratios:
        return ""
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def result_rows(name: str, ours: list[Run], mllib: list[Run]) -> list[tuple]:
    """Two table rows (ours, MLlib) of one problem: medians over the rounds."""
    lines = []
    for runs, label in ((ours, "allreduce-param softmax"), (mllib, "MLlib LogisticRegression")):
        done = [run for run in runs if not run.problem]
        problems = sorted({run.problem for run in runs if run.problem})
        if not done:  # why, when, and the peaks until then
            afters = [run.failed_after for run in runs if run.failed_after is not None]
            if afters:
                problems[0] += f" (after {statistics.median(afters):.0f} s)"
            peaks = [
                mb(max(run.driver_peak for run in runs)),
                mb(max(run.workers_peak for run in runs)),
            ]
            lines.append((name, label, "; ".join(problems), "", "", "", "", *peaks))
            continue
        seconds = statistics.median(run.seconds for run in done)
        accuracies = [run.accuracy for run in done if run.accuracy is not None]
        to_target, ratio_fit, ratio_target = "", "", ""
        if runs is ours:
            hits, fit_ratios, target_ratios = [], [], []
            for our, their in zip(ours, mllib):
                if our.problem:
                    continue
                hit = our.reached(their.accuracy if not their.problem else None)
                if hit is not None:
                    hits.append(hit)
                if not their.problem:
                    fit_ratios.append(their.seconds / our.seconds)
                    if hit is not None:
                        target_ratios.append(their.seconds / hit)
            if hits:
                to_target = f"{statistics.median(hits):.1f}"
                if len(hits) < len(done):
                    to_target += f" ({len(hits)} of {len(done)})"
            elif any(not run.problem for run in mllib):
                best = max(
                    (a for run in done for _, a in run.epochs if a is not None), default=None
                )
                to_target = f"not reached (best {best:.4f})" if best is not None else "not reached"
            ratio_fit, ratio_target = ratio_text(fit_ratios), ratio_text(target_ratios)
        text = f"{seconds:.1f}" + (
            f" ({len(done)} of {len(runs)})" if len(done) < len(runs) else ""
        )
        if problems:
            text += "; " + "; ".join(problems)
        lines.append(
            (
                name,
                label,
                text,
                f"{statistics.median(accuracies):.4f}" if accuracies else "",
                to_target,
                ratio_fit,
                ratio_target,
                mb(max(run.driver_peak for run in runs)),
                mb(max(run.workers_peak for run in runs)),
            )
        )
    return lines


RESULT_HEADER = (
    "problem",
    "contender",
    "fit s",
    "test accuracy",
    "s to MLlib's accuracy",
    "MLlib fit / ours fit",
    "MLlib fit / ours to its accuracy",
    "driver peak MB",
    "workers peak MB",
)


def size_text(value: float) -> str:
    """One decimal from 1 on, three significant digits below (a tiny run's sizes)."""
    return f"{value:,.1f}" if value >= 1 else f"{value:.3g}"


def size_row(name: str, features: int, sizes: list[tuple[int, int]]) -> tuple:
    """The training rows' non-zeros against the dense-equivalent, per partition."""
    rows = sum(r for r, _ in sizes)
    nonzeros = sum(n for _, n in sizes)
    largest_rows, largest_nonzeros = max(sizes, key=lambda size: size[1])
    csr = largest_nonzeros * (4 + 4) + (largest_rows + 1) * 4  # float32 values, int32 indices
    return (
        name,
        f"{features:,}",
        f"{rows:,}",
        f"{nonzeros:,}",
        f"{nonzeros / max(rows, 1):.1f}",
        f"{len(sizes)}",
        size_text(csr / 2**20),
        size_text(largest_rows * features * 4 / 2**30),
    )


SIZE_HEADER = (
    "problem",
    "features d",
    "train rows N",
    "non-zeros",
    "per row",
    "partitions",
    "CSR MB, largest partition",
    "dense N x d GiB, same partition",
)


def step_row(name: str, features: int, runs: list[Run], partitions: int) -> tuple:
    """Ours' step phases on one problem: medians over every step of every round (ms)."""
    steps = [step for run in runs for step in run.steps]
    if not steps:
        return (name, f"{features:,}", "", *("" for _ in STEP_PHASES), "")
    medians = [
        statistics.median(step.get(phase, 0.0) for step in steps) * 1e3 for phase in STEP_PHASES
    ]
    return (
        name,
        f"{features:,}",
        f"{len(steps):,}",
        *(f"{value:.1f}" for value in medians),
        f"{sum(medians):.1f}",
    )


STEP_HEADER = (
    "problem",
    "features d",
    "steps",
    *(f"{phase[:-2]} ms" for phase in STEP_PHASES),
    "sum ms",
)


def step_seconds(run: Run) -> float | None:
    """A run's median step: over its steps, the sum of each step's phases."""
    if not run.steps:
        return None
    return statistics.median(
        sum(step.get(phase, 0.0) for phase in STEP_PHASES) for step in run.steps
    )


def sync_rows(name: str, features: int, runs: dict[str, list[Run]]) -> list[tuple]:
    """One row per sync on one problem: step phases (medians over every step of every round),
    the median step, fit time and test accuracy (medians of the rounds), and on the touched
    row the rounds' dense / touched ratios of their median steps."""
    rows = []
    for sync, done in runs.items():
        done = [run for run in done if not run.problem]
        steps = [step for run in done for step in run.steps]
        if not steps:
            problems = "; ".join(run.problem for run in runs[sync] if run.problem)
            rows.append((name, sync, f"{features:,}", problems, *("" for _ in range(10))))
            continue
        medians = [
            statistics.median(step.get(phase, 0.0) for step in steps) * 1e3 for phase in STEP_PHASES
        ]
        ratios = [
            step_seconds(dense) / step_seconds(touched)
            for dense, touched in zip(runs["dense"], runs["touched"])
            if sync == "touched" and step_seconds(dense) and step_seconds(touched)
        ]
        rows.append(
            (
                name,
                sync,
                f"{features:,}",
                f"{len(steps):,}",
                *(f"{value:.1f}" for value in medians),
                f"{statistics.median(step_seconds(run) for run in done) * 1e3:.1f}",
                f"{statistics.median(run.seconds for run in done):.1f}",
                f"{statistics.median(run.accuracy for run in done):.4f}",
                ratio_text(ratios),
            )
        )
    return rows


SYNC_HEADER = (
    "problem",
    "sync",
    "features d",
    "steps",
    *(f"{phase[:-2]} ms" for phase in STEP_PHASES),
    "step ms",
    "fit s",
    "test accuracy",
    "dense / touched step",
)
