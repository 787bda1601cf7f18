"""Experiment: does a warm start by one averaged-SGD pass (Vowpal Wabbit's) save L-BFGS
iterations on MLlib's logistic objective? Spark-free, one partition (``LocalSums``).

A seeded CSR problem (``--rows`` rows of 40 Zipf-distributed columns among 2^``--bits``, a
hidden linear label) is solved by the project's L-BFGS from MLlib's start (cold), and from
the average of one pass of mini-batch SGD (``--batch`` rows, step ``--eta``, in the solver's
scaled space) over the rows in a seeded order (warm). Printed: each run's start objective,
iterations, seconds, and the iteration and seconds at which it reached the cold run's final
objective (within 1e-6 relative), and the pass's own seconds.

    python jobs/bench_warm_start.py --rows 20000 --bits 18 --etas 0.05,0.01
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.sparse as sp

from allreduce_param.models.glm import GlmProblem, first_moments, row_stats, second_moments
from allreduce_param.models.glm_loss import GlmObjective
from allreduce_param.optim.quasi_newton import LocalSums, QuasiNewtonSettings, minimize


def problem_of(args: argparse.Namespace):
    """(X, y, the objective, its L2 and L1 weights, the weight sum)."""
    rng = np.random.default_rng(args.seed)
    n, d = args.rows, 2**args.bits
    columns = rng.zipf(1.1, size=n * 40) % d
    X = sp.csr_matrix((np.ones(n * 40), (np.repeat(np.arange(n), 40), columns)), shape=(n, d))
    X.sum_duplicates()
    y = (X @ (rng.normal(size=d) * 0.1) + rng.normal(size=n) > 0).astype(float)
    problem = GlmProblem("binomial", d, 2, reg_param=args.reg_param, max_iter=args.max_iter)
    first = first_moments(X, y, None, 2)
    means = first[4 : 4 + d] / first[0]
    stats = row_stats(first, second_moments(X, y, None, means, first[3] / first[0]), d)
    objective = GlmObjective(problem, stats)
    return X, y, objective, *objective.penalty_weights(), stats.weight_sum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--bits", type=int, default=18)
    parser.add_argument("--reg-param", type=float, default=0.001)
    parser.add_argument("--max-iter", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--etas", default="0.05,0.01", help="SGD steps to try")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    X, y, objective, l2, l1, weight_sum = problem_of(args)

    def evaluate(x):
        loss, grad = objective.data_loss(X, y, None, x)
        return loss / weight_sum + 0.5 * float(l2 @ (x * x)), grad / weight_sum + l2 * x

    def averaged_sgd(eta: float) -> np.ndarray:
        x = objective.initial()
        average = x.copy()
        order = np.random.default_rng(args.seed + 1).permutation(args.rows)
        for i, start in enumerate(range(0, args.rows, args.batch)):
            rows = order[start : start + args.batch]
            _, grad = objective.data_loss(X[rows], y[rows], None, x)
            x -= eta * (grad / len(rows) + l2 * x)
            average += (x - average) / (i + 2)
        return average

    settings = QuasiNewtonSettings(args.max_iter, 1e-6, 10)

    def solve(start, label: str, goal: float | None, extra: float = 0.0):
        began = time.time()
        result = minimize(evaluate, start, LocalSums(), settings, l1)
        seconds = time.time() - began
        goal = result.objective_history[-1] if goal is None else goal
        at = next(
            (i for i, v in enumerate(result.objective_history) if v <= goal * (1 + 1e-6)), None
        )
        reach = "never" if at is None else f"{at} ({result.times[at] - began + extra:.1f} s)"
        print(
            f"{label}: start objective {result.objective_history[0]:.6g}, "
            f"{result.iterations} iterations, {seconds:.1f} s; reaches the cold final "
            f"objective at iteration {reach}"
        )
        return result.objective_history[-1]

    print(f"{args.rows:,} rows x 2^{args.bits}, regParam {args.reg_param}, batch {args.batch}")
    goal = solve(objective.initial(), "cold", None)
    for eta in map(float, args.etas.split(",")):
        began = time.time()
        start = averaged_sgd(eta)
        spent = time.time() - began
        solve(start, f"warm (eta {eta:g}, the pass {spent:.1f} s, counted in)", goal, spent)


if __name__ == "__main__":
    main()
