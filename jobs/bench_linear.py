"""Benchmark: MLlib's LogisticRegression and LinearRegression against allreduce_param.ml's drop-ins.

The same objective on the same cached rows, alternating rounds (ours, MLlib, ours, ...):
hashed text at 2^18 features, a hashed click log at 2^20 and 2^24, and a dense linear
regression (1M x 512 at full size). Per fit: seconds, iterations, the final objective, the
seconds to MLlib's final objective (ours from its tasks' iteration stamps), the largest
relative difference of the coefficients, and the peaks of the driver JVM's RSS and heap and
of the Python workers' RSS; where a fit fails (MLlib's driver out of memory at 2^24, say),
its reason, in a few words from its error; each fit's line is printed as soon as it ends,
the table at the end. A plot per problem of the objective against time goes to ``--out``
(out/). ``benchkit/linear.py`` says how each figure is taken.

The dense problem (``--isolate``, by default) runs each fit in a Spark session of its own,
in a child process: MLlib's fit at 1M x 512 runs out of Java heap and takes its JVM down,
and its row then says so while the job goes on (``benchkit/linear_rounds.py``).

    python jobs/bench_linear.py                                  # the full run: long
    python jobs/bench_linear.py --problems text --text-rows 20000 --rounds 1
    python jobs/bench_linear.py --problems dense --dense-rows 1000000 --dense-features 512 \
        --rounds 1 --mllib-curve 0
"""

from __future__ import annotations

import argparse

from benchkit import linear_rounds


def command_line() -> argparse.ArgumentParser:
    """The command line's options (``--help`` prints them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="local[2]", help="Spark master (default: local[2])")
    parser.add_argument("--driver-memory", default="4g", help="spark.driver.memory (default 4g)")
    parser.add_argument("--problems", default="text,clicks,dense", help="text, clicks, dense")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-rows", type=int, default=100_000)
    parser.add_argument("--text-features", type=int, default=18, help="HashingTF's 2^this")
    parser.add_argument("--click-rows", type=int, default=1_000_000)
    parser.add_argument("--click-features", default="20,24", help="FeatureHasher's 2^these")
    parser.add_argument("--dense-rows", type=int, default=1_000_000)
    parser.add_argument("--dense-features", type=int, default=512)
    parser.add_argument("--reg-param", type=float, default=0.001, help="regParam for both (L2)")
    parser.add_argument("--max-iter", type=int, default=100, help="maxIter for both")
    parser.add_argument("--tol", type=float, default=1e-6, help="tol for both")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per problem")
    parser.add_argument(
        "--mllib-curve", type=int, default=3, help="MLlib maxIter=k fits for its curve (0: none)"
    )
    parser.add_argument(
        "--isolate",
        default="dense",
        help="the problems whose every fit runs in a Spark session of its own, in a child "
        "process, so that a fit that takes its JVM down fails alone, its row saying why "
        "(comma list; 'none': all share one session; default: dense)",
    )
    parser.add_argument(
        "--mllib-driver-memory",
        default=None,
        help="spark.driver.memory of MLlib's fits in sessions of their own (default: "
        "--driver-memory)",
    )
    parser.add_argument(
        "--fit-timeout",
        type=float,
        default=7200,
        help="seconds a fit in a session of its own may take before it is killed (default 7200)",
    )
    parser.add_argument("--out", default="out", help="where the plots go (default out/)")
    parser.add_argument("--no-plot", dest="plot", action="store_false", help="no plots")
    return parser


if __name__ == "__main__":
    print(linear_rounds.run(command_line().parse_args()))
