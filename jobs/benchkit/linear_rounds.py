"""bench_linear's run: every problem's alternating rounds (ours, MLlib, ours, MLlib, ...),
each fit's line printed as soon as it ends, then the table with the machine's line, and
the plots.

The problems named by ``--isolate`` (by default the dense one) run each fit in a Spark
session of its own, in a child process (``linear_child``): a contender that takes its JVM
or its SparkContext down (MLlib out of Java heap at 1M x 512) then fails alone, its row
saying why, and MLlib's driver may get a memory of its own (``--mllib-driver-memory``).
Each fit then starts a JVM and makes the problem's rows anew (neither is timed), and every
fit is its session's first, for both contenders alike. The other problems share one
session in this process, their rows made and cached once for both contenders; they run
first, and that session stops before any child starts, so that no JVM of this process
holds memory beside the children's. The table lists the problems in the command line's
order.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from benchkit.linear import KINDS, LinearRun, fit_once, frame_of, mllib_curve, problems
from benchkit.linear_child import FitRequest, fit_in_child
from benchkit.linear_report import failure_phrase, fit_line, plot, table
from benchkit.machine import CONF_DIR, copy_bandwidth, machine

#: One problem's rounds as the table takes them: (name, size, [(ours, MLlib's), ...]).
Rounds = tuple[str, str, list[tuple[LinearRun, LinearRun]]]


def isolated_kinds(args: argparse.Namespace) -> set[str]:
    """The problem kinds ``--isolate`` names (a comma list; "" or "none": none), checked
    against ``--mllib-driver-memory``, which only a fit in a session of its own can use."""
    named = {kind for kind in args.isolate.split(",") if kind and kind != "none"}
    unknown = sorted(named - set(KINDS))
    if unknown:
        raise SystemExit(f"--isolate: {', '.join(unknown)} not among {', '.join(KINDS)}")
    asked = {kind for _, kind, _ in problems(args)}
    if args.mllib_driver_memory and not named & asked:
        raise SystemExit(
            "--mllib-driver-memory sets the driver of MLlib's fits that run in a Spark "
            "session of their own, and none of --problems does: name the problem in "
            "--isolate too (e.g. --isolate dense)"
        )
    return named


def run(args: argparse.Namespace) -> str:
    """Every problem's alternating rounds; the table with the machine's line, the plots."""
    isolated = isolated_kinds(args)
    bandwidth = copy_bandwidth()
    chosen = problems(args)
    found = {
        rounds[0]: rounds
        for rounds in in_session([p for p in chosen if p[1] not in isolated], args)
    }
    for problem in chosen:
        if problem[1] in isolated:
            found[problem[0]] = in_children(problem, args)
    results = [found[name] for name, _, _ in chosen]
    plotted = plot(results, Path(args.out)) if args.plot else []
    return "\n".join(
        [
            f"machine: {machine()}",
            f"memory copy: {bandwidth / 1e9:.2f} GB/s (np.copyto of 40 MB, median of 5)",
            f"master {args.master}, spark.driver.memory={args.driver_memory}; regParam="
            f"{args.reg_param}, maxIter={args.max_iter}, tol={args.tol} for both",
            *(_isolation_line(args, isolated) if isolated & {k for _, k, _ in chosen} else []),
            "",
            table(results),
            "",
            *(f"plot: {path}" for path in plotted),
        ]
    )


def _isolation_line(args: argparse.Namespace, isolated: set[str]) -> list[str]:
    memory = args.mllib_driver_memory or args.driver_memory
    return [
        f"each fit of {', '.join(sorted(isolated))} in a Spark session of its own (a child "
        f"process), MLlib's with spark.driver.memory={memory}"
    ]


def in_session(chosen: list[tuple[str, str, int]], args: argparse.Namespace) -> list[Rounds]:
    """The ``chosen`` problems' rounds in one session of this process, each problem's rows
    cached once for both contenders; no session where none is chosen."""
    if not chosen:
        return []
    from allreduce_param.spark.session import local_spark

    spark = local_spark(
        args.master,
        "allreduce-param linear benchmark",
        CONF_DIR,
        **{"spark.driver.memory": args.driver_memory},
    )
    results = []
    try:
        jvm_pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
        for name, kind, features in chosen:
            try:
                frame = frame_of(spark, kind, features, args)
            except Exception as error:  # the session gone with an earlier fit: say so
                why = failure_phrase(f"{type(error).__name__}: {error}")
                runs = (LinearRun("ours", problem=why), LinearRun("mllib", problem=why))
                results.append((name, "no rows made", [runs]))
                continue
            size = f"{frame.count():,} rows"
            print(f"{name}: {size} cached", file=sys.stderr, flush=True)
            rounds = []
            for number in range(args.rounds):
                ours = _said(name, fit_once(spark, "ours", kind, frame, args, jvm_pid))
                theirs = _said(name, fit_once(spark, "mllib", kind, frame, args, jvm_pid))
                if number == 0 and not theirs.problem and args.mllib_curve:
                    theirs.curve = mllib_curve(kind, frame, args, theirs.iterations)
                rounds.append((ours, theirs))
                if theirs.problem and ours.problem:
                    break
            results.append((name, size, rounds))
            with contextlib.suppress(Exception):  # (a session a fit took down)
                frame.unpersist()
    finally:
        with contextlib.suppress(Exception):
            spark.stop()
    return results


def in_children(problem: tuple[str, str, int], args: argparse.Namespace) -> Rounds:
    """``problem``'s rounds, each fit in a child process with a session of its own
    (``linear_child``); MLlib's with ``--mllib-driver-memory`` where given."""
    name, kind, features = problem
    options = vars(args)
    mllib_memory = args.mllib_driver_memory or args.driver_memory
    rounds = []
    for number in range(args.rounds):
        ours = fit_in_child(
            FitRequest("ours", kind, features, options, args.driver_memory), args.fit_timeout
        )
        _said(name, ours)
        curve = number == 0 and args.mllib_curve > 0
        theirs = fit_in_child(
            FitRequest("mllib", kind, features, options, mllib_memory, curve), args.fit_timeout
        )
        _said(name, theirs)
        rounds.append((ours, theirs))
        if theirs.problem and ours.problem:
            break
    rows = next((run.rows for pair in rounds for run in pair if run.rows is not None), None)
    return name, "no rows made" if rows is None else f"{rows:,} rows", rounds


def _said(name: str, run: LinearRun) -> LinearRun:
    """``run``, its line printed as soon as it ends (on stderr, with the progress)."""
    print(fit_line(name, run), file=sys.stderr, flush=True)
    return run
