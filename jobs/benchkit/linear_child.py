"""One bench_linear fit in a Spark session of its own, in a child process: a contender that
takes its JVM or its SparkContext down (MLlib's fit out of Java heap on the dense 1M x 512
problem) then costs only its own row, which says why, and the benchmark goes on.

The parent (``fit_in_child``) writes the request (the contender, the problem, the command
line's options, the driver's memory) to a fresh folder and runs ``python -m
benchkit.linear_child FOLDER``; the child (``main``) starts its session, makes the problem's
rows as ``linear.frame_of`` does (seeded: the same rows in every child, in the same
partitions), fits once (``linear.fit_once``: timed, its memory watched as in one session),
and writes its figures back (JSON, the coefficients as ``.npy``, no pickle). Everything
the child and its JVM print reaches this process's stderr as it comes, and where the fit
failed, or the child died without an answer, the row's phrase is taken from the error and
that output together (``linear_report.failure_phrase``: the JVM's ``OutOfMemoryError`` is
printed there, not raised), with the driver's memory it ran with.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from benchkit.linear import LinearRun, fit_once, frame_of, mllib_curve
from benchkit.linear_report import failure_phrase, named_cause
from benchkit.machine import CONF_DIR

#: How many of the child's last output lines are kept to find a failure's cause in (a JVM
#: out of memory may print a stack trace for each of its threads after the cause).
TAIL_LINES = 5000


@dataclasses.dataclass(frozen=True)
class FitRequest:
    """One fit for a child: ``contender`` ("ours" or "mllib") on the problem ``kind`` with
    ``features`` (``linear.problems``), the command line's ``options``, the driver's
    ``memory`` (spark.driver.memory), and with ``curve``, MLlib's curve fits after it."""

    contender: str
    kind: str
    features: int
    options: dict
    memory: str
    curve: bool = False


def fit_in_child(request: FitRequest, timeout: float) -> LinearRun:
    """``request``'s fit, run in a child process with a Spark session of its own; its
    figures, or its row's reason where it failed, died, or ran past ``timeout`` seconds
    (its process group killed then)."""
    folder = Path(tempfile.mkdtemp(prefix="bench-linear-"))
    try:
        (folder / "request.json").write_text(json.dumps(dataclasses.asdict(request)))
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        child = subprocess.Popen(
            [sys.executable, "-m", "benchkit.linear_child", str(folder)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_child_environment(),
            start_new_session=True,  # its JVM in its group: one kill ends both
        )
        echo = threading.Thread(target=_echo, args=(child.stdout, tail), daemon=True)
        echo.start()
        try:
            code = child.wait(timeout)
            ended = f"the fit's process ended with exit code {code} and no answer"
        except subprocess.TimeoutExpired:
            _kill(child)
            ended = f"no answer within {timeout:.0f} s (--fit-timeout): killed"
        except BaseException:  # interrupted: the child and its JVM go too
            _kill(child)
            raise
        echo.join(60)  # the output ends with the child's JVM, which ends with the child
        return read_answer(request, folder, "\n".join(list(tail)), ended)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _kill(child: subprocess.Popen) -> None:
    """The child and everything in its process group (its JVM, its Python workers)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:  # gone already
        pass
    child.wait()


def _child_environment() -> dict[str, str]:
    """This environment, with jobs/ (for ``benchkit``) and the package's folder first on
    the child's path, where this process found them."""
    import allreduce_param

    found = [
        str(Path(__file__).resolve().parents[1]),
        str(Path(allreduce_param.__file__).resolve().parents[1]),
    ]
    if os.environ.get("PYTHONPATH"):
        found.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(found)}


def _echo(stream, tail: collections.deque[str]) -> None:
    """Every line the child and its JVM print, to this process's stderr as it comes, the
    last ``TAIL_LINES`` kept."""
    for raw in stream:
        line = raw.decode(errors="replace")
        sys.stderr.write(line)
        tail.append(line.rstrip("\n"))
    sys.stderr.flush()


def read_answer(request: FitRequest, folder: Path, output: str, ended: str) -> LinearRun:
    """The child's figures from ``folder``; where the fit failed or none came back, its
    reason from the error and the child's ``output`` (else ``ended``), with the memory."""
    answer = folder / "answer.json"
    if answer.exists():
        figures = json.loads(answer.read_text())
        run = LinearRun(**figures)
        if (folder / "coefficients.npy").exists():
            run.coefficients = np.load(folder / "coefficients.npy", allow_pickle=False)
        if not run.problem:
            return run
        why = failure_phrase(f"{run.error}\n{output}")
    else:
        run = LinearRun(request.contender)
        why = named_cause(output) or ended
    run.problem = f"{why}, driver {request.memory}"
    return run


def main(folder: Path) -> None:
    """The child's side: the session, the rows, the fit (and MLlib's curve), the answer;
    any failure written as the answer's error, the session stopped as well as it can be."""
    from allreduce_param.spark.session import local_spark

    request = FitRequest(**json.loads((folder / "request.json").read_text()))
    args = argparse.Namespace(**request.options)
    run = LinearRun(request.contender)
    spark = None
    try:
        spark = local_spark(
            args.master,
            f"allreduce-param linear benchmark: {request.contender}",
            CONF_DIR,
            **{"spark.driver.memory": request.memory},
        )
        jvm_pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
        frame = frame_of(spark, request.kind, request.features, args)
        rows = frame.count()
        run = fit_once(spark, request.contender, request.kind, frame, args, jvm_pid)
        run.rows = rows
        if request.curve and not run.problem:
            run.curve = mllib_curve(request.kind, frame, args, run.iterations)
    except Exception as error:  # the session or the rows: the fit's own are fit_once's
        run.error = f"{type(error).__name__}: {error}"
        run.problem = failure_phrase(run.error)
    finally:
        if spark is not None:
            try:
                spark.stop()
            except Exception:  # its JVM gone already
                pass
    write_answer(run, folder)


def write_answer(run: LinearRun, folder: Path) -> None:
    """``run``'s figures as the parent reads them: JSON, the coefficients as ``.npy``."""
    figures = dataclasses.asdict(run)
    coefficients = figures.pop("coefficients")
    if coefficients is not None:
        np.save(folder / "coefficients.npy", coefficients, allow_pickle=False)
    (folder / "answer.json").write_text(json.dumps(figures, default=_plain))


def _plain(value):
    """A numpy scalar as the Python number JSON writes (an iteration count, say)."""
    return value.item()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
