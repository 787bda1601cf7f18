"""bench_linear's output: the table of every round (``table``), a line per fit as it ends
(``fit_line``), why a fit failed in a few words (``failure_phrase``), and a plot per problem
of the objective against time for both contenders (``plot``, matplotlib)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from benchkit.tables import render

#: ours "reaches" MLlib's objective within this relative distance (the issue's criterion)
SAME_OBJECTIVE = 1e-6

HEADER = (
    "problem",
    "fit",
    "s",
    "iterations",
    "final objective",
    "s to MLlib's objective",
    "max rel. coef. diff",
    "objective diff",
    "peak MiB JVM RSS / heap / workers",
)


#: The causes a failed fit's error text (and its JVM's output) may name, most telling first:
#: quoted as found, to the end of their line
_CAUSES = (
    re.compile(r"java\.lang\.OutOfMemoryError[^\n]*"),
    re.compile(r"TaskResultLost[^\n]*"),
    re.compile(r"(?:Insufficient driver memory: )?System memory \d+ must be at least \d+"),
    re.compile(r"ExecutorLostFailure[^\n]*"),
)
#: What a failure said without a cause of ``_CAUSES``: a needle, and the phrase for it
_SIGNS = (
    ("Python worker exited unexpectedly", "a Python worker died"),
    ("MemoryError", "MemoryError (Python worker)"),
    ("maxResultSize", "spark.driver.maxResultSize exceeded"),
    ("SparkContext was shut down", "the SparkContext was shut down"),
    ("stopped SparkContext", "the SparkContext was shut down"),
    ("Answer from Java side is empty", "the driver JVM died"),
    ("Py4JNetworkError", "the driver JVM died"),
    ("Connection refused", "the driver JVM died"),
)
#: Spark's reason for a failed stage: the last task failure's own words
_LOST_TASK = re.compile(r"most recent failure: Lost task [^:]*\): ([^\n]*)")


def failure_phrase(text: str, limit: int = 100) -> str:
    """Why a fit failed, in a few words taken from ``text`` (its error, and where the fit
    ran in a process of its own, what that process and its JVM printed): ``named_cause``'s,
    else the error's first line; at most ``limit`` characters."""
    found = named_cause(text, limit)
    if found is not None:
        return found
    lines = [line for line in text.splitlines() if line.strip()]
    java = [line[2:] for line in lines if line.startswith(": ")]  # a Py4JJavaError's cause
    return (java or lines or ["no error text"])[0].strip()[:limit]


def named_cause(text: str, limit: int = 100) -> str | None:
    """The first cause in ``text`` that names a reason (``java.lang.OutOfMemoryError: Java
    heap space``), else what the failure shows (the JVM died, the SparkContext was shut
    down), else Spark's reason for the failed task; None where it shows none of these."""
    for cause in _CAUSES:
        found = cause.search(text)
        if found:
            return found.group(0).strip()[:limit]
    for needle, said in _SIGNS:
        if needle in text:
            return said
    lost = _LOST_TASK.search(text)
    return lost.group(1).strip()[:limit] if lost else None


def fit_line(name: str, run) -> str:
    """One fit's own figures in a line, printed as soon as it ends (the table, which needs
    both fits of a round, comes at the end)."""
    memory = f"peak MiB JVM RSS / heap / workers {_memory(run)}"
    if run.problem:
        return f"{name}: {run.contender} failed: {run.problem} ({memory})"
    return (
        f"{name}: {run.contender} {run.seconds:.1f} s, {run.iterations} iterations, "
        f"objective {run.objective:.9g} ({memory})"
    )


def _memory(run) -> str:
    return (
        f"{run.jvm_peak / 2**20:,.0f} / {run.heap_peak / 2**20:,.0f} / "
        f"{run.workers_peak / 2**20:,.0f}"
    )


def reached(ours, theirs) -> float | None:
    """Seconds from ours' start to its first value within ``SAME_OBJECTIVE`` of MLlib's
    final objective; None where it never got there (or a fit failed)."""
    if theirs.objective is None or not ours.times:
        return None
    goal = theirs.objective + SAME_OBJECTIVE * abs(theirs.objective)
    for value, at in zip(ours.history, ours.times):
        if value <= goal:
            return at
    return None


def _round_rows(name: str, ours, theirs) -> list[tuple]:
    difference = objective = "-"
    if ours.coefficients is not None and theirs.coefficients is not None:
        scale = max(float(np.abs(theirs.coefficients).max()), 1e-12)
        difference = f"{float(np.abs(ours.coefficients - theirs.coefficients).max()) / scale:.1e}"
        objective = f"{(ours.objective - theirs.objective) / abs(theirs.objective):+.1e}"
    at = reached(ours, theirs)
    reach = {
        id(ours): "-" if theirs.objective is None else "not reached" if at is None else f"{at:.1f}",
        id(theirs): "" if theirs.seconds is None else f"{theirs.seconds:.1f}",
    }
    lines = []
    for run in (ours, theirs):
        memory = _memory(run)
        if run.problem:
            lines.append(
                (name, run.contender, "failed: " + run.problem, "", "", "", "", "", memory)
            )
            continue
        lines.append(
            (
                name,
                run.contender,
                f"{run.seconds:.1f}",
                str(run.iterations),
                f"{run.objective:.9g}",
                reach[id(run)],
                difference if run is ours else "",
                objective if run is ours else "",
                memory,
            )
        )
    return lines


def table(results) -> str:
    """Every problem's rounds, two rows each (ours, MLlib), and the median ratio of the fit
    times per problem under it."""
    lines, notes = [], []
    for name, size, rounds in results:
        for ours, theirs in rounds:
            lines.extend(_round_rows(f"{name} ({size})", ours, theirs))
        ratios = [o.seconds / t.seconds for o, t in rounds if o.seconds and t.seconds]
        if ratios:
            notes.append(
                f"{name}: ours' fit time / MLlib's, median of {len(ratios)} rounds "
                f"{np.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})"
            )
    return "\n".join([render(HEADER, lines), "", *notes])


def plot(results, out: Path) -> list[Path]:
    """One PNG per problem under ``out``: objective less the best value seen, log scale,
    against seconds from the fit's start, ours per iteration, MLlib at its curve points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, size, rounds in results:
        ours, theirs = rounds[0]
        values = [*ours.history, *(v for _, v in theirs.curve)]
        if theirs.objective is not None:
            values.append(theirs.objective)
        if not values:
            continue
        best = min(values)
        figure, axes = plt.subplots(figsize=(6, 4))
        if ours.times:
            gaps = np.maximum(np.array(ours.history) - best, 1e-12)
            axes.plot(ours.times, gaps, "o-", markersize=3, label="allreduce_param.ml")
        if theirs.seconds is not None:
            points = [*theirs.curve, (theirs.seconds, theirs.objective)]
            gaps = np.maximum(np.array([v for _, v in points]) - best, 1e-12)
            axes.plot([t for t, _ in points], gaps, "s-", label="pyspark.ml (maxIter = k)")
        axes.set_yscale("log")
        axes.set_xlabel("seconds from the fit's start")
        axes.set_ylabel("objective - best value seen")
        axes.set_title(f"{name} ({size})")
        axes.legend()
        path = out / f"bench_linear_{name.replace(' ', '_').replace('^', '')}.png"
        figure.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(figure)
        written.append(path)
    return written
