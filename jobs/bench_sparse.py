"""Benchmark: time to accuracy on wide, sparse features, this project against MLlib's LogisticRegression.

Two generated problems, each regenerated from ``--seed`` in the executors (never collected to
the driver), hashed into sparse vectors by Spark's own transformers, cached and counted once
before any clock starts:

- ``text``: documents whose words follow a Zipf law over a vocabulary of ``--vocabulary``
  words; each class multiplies the frequency of ``--tilted`` words of its own (drawn among
  the middle ranks) by ``--tilt``; a document has 8 + Poisson(``--doc-words`` - 8) words.
  ``Tokenizer`` -> ``HashingTF(numFeatures=--text-features)`` (2^18). The words are drawn
  independently given the class, so naive Bayes over the word counts is the Bayes-optimal
  classifier: its accuracy (on the generator's first 20,000 rows) is printed as the ceiling.
- ``clicks``: a click log of ``--fields`` categorical fields, field f with a number of levels
  spaced log-uniformly from 10 to ``--max-levels``, each value drawn from a power law
  (Zipf, exponent 1.2, folded into the levels). The label is drawn from a hidden logistic
  model: each value of the first ``--informative`` fields has a weight (a normal deviate
  hashed from seed, field and value), the click probability is the sigmoid of their sum. The
  Bayes accuracy, mean(max(p, 1 - p)), is printed. ``FeatureHasher`` (the fields as
  categorical columns) hashes it into 2^20 and 2^24 features (``--click-features``): one
  non-zero per field.

Each row goes to the test set with probability ``--test-fraction``. The contenders, in one
Spark session on the same cached rows, alternating (ours, MLlib, ours, MLlib, ...) for
``--rounds`` rounds on each problem:

- ours: ``allreduce_param.ml.AllReduceClassifier(hiddenLayers=[])``, softmax regression over
  the CSR rows, as a pyspark.ml user writes it: Adam (``--lr``), ``--batch-size``,
  ``--epochs``, the test rows marked by ``validationIndicatorCol`` so that the fit evaluates
  the test accuracy after every epoch. Its ``logPath`` (JSON lines, written by the driver as
  each epoch's event comes in) is read as it grows, and each epoch stamped when it appears:
  "s to MLlib's" is the stamp of the first epoch whose test accuracy reached the MLlib
  run's of the same round. The fit time includes these evaluations.
- MLlib: ``pyspark.ml.classification.LogisticRegression(maxIter=--mllib-iters)``, L-BFGS,
  with the same regularisation (``--reg-param``, elastic net 0, standardized as MLlib's
  default on both; 0 by default), its other settings MLlib's defaults (for two classes its
  binomial family; ours is a softmax over two outputs); fit time, then its test accuracy
  (evaluated after the clock).

Every fit has ``--budget`` seconds: its Spark jobs are cancelled then, and the table says so;
a fit that fails (the driver's ``spark.driver.maxResultSize``, ``OutOfMemoryError``, a
Python worker that died) has its reason in the table instead of figures. An
``OutOfMemoryError`` ends a local JVM: the JVM's ``-XX:OnOutOfMemoryError`` hook (a script
in a temporary folder) marks it for the table, Spark starts again with the rows cached
again, and MLlib is not run again on that problem.

Peak memory, sampled every 0.1 s from /proc during each fit: the driver (its JVM, which in
local mode also runs the executors, plus the Python driver) and the Python workers (the
``pyspark.daemon`` processes under the driver's JVM and the workers they fork; sum of their
RSS, shared pages counted in each). A JVM keeps the heap it has grown, so the driver's peak
after a fit that grew it includes what that fit took.

    python jobs/bench_sparse.py                               # about 7 minutes on 2 cores
    python jobs/bench_sparse.py --problems text --text-rows 200000 --rounds 3
    python jobs/bench_sparse.py --problems clicks --click-rows 1000000 --click-features 24
    python jobs/bench_sparse.py --breakdown-only              # the step breakdown, no Spark
    python jobs/bench_sparse.py --problems clicks --epochs 1 --compare-syncs  # dense vs touched

``--breakdown`` (on by default; ``--breakdown-only`` alone, without Spark or Java) times one
step's parts at 2^20 and 2^24 features in this process, on one thread, for one partition's
share of a batch of the click log (``sparse_steps.py`` says what each column is), and a
BSP step's compute, put and aggregate with the dense sync and the touched one, alternating,
at 2^20, 2^22 and 2^24 (``sparse_steps.sync_comparison``, partitions as threads); each
fit's own step phases (medians over its steps, the slowest partition's) are printed too.

``--compare-syncs`` runs ours alone, ``sparseSync="dense"`` and ``"touched"`` alternating
(dense, touched, dense, ...) for ``--rounds`` rounds on each problem's same cached rows, and
prints one table: each sync's step phases (medians over every step), its median step, fit
time and test accuracy (the same bits either way, so the same accuracy), and the rounds'
dense / touched ratios of their median steps.
"""

from __future__ import annotations

import argparse
import sys

from benchkit import sparse


def command_line() -> argparse.ArgumentParser:
    """The command line's options (``--help`` prints them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="local[2]", help="Spark master (default: local[2])")
    parser.add_argument("--driver-memory", default="4g", help="spark.driver.memory (default 4g)")
    parser.add_argument(
        "--problems",
        default="text,clicks",
        help="comma-separated: text (hashed documents), clicks (hashed click log)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the data, the split, the weights")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--text-rows", type=int, default=40_000, help="documents")
    parser.add_argument("--text-features", type=int, default=18, help="HashingTF's 2^this")
    parser.add_argument("--classes", type=int, default=2, help="the text's classes")
    parser.add_argument("--vocabulary", type=int, default=20_000)
    parser.add_argument("--tilted", type=int, default=2_000, help="words each class favours")
    parser.add_argument("--tilt", type=float, default=2.5, help="how much it favours them")
    parser.add_argument("--doc-words", type=int, default=40, help="mean words a document")
    parser.add_argument("--click-rows", type=int, default=100_000)
    parser.add_argument(
        "--click-features",
        default="20,24",
        help="FeatureHasher's 2^these, comma-separated (a fit at each)",
    )
    parser.add_argument("--fields", type=int, default=26, help="the click log's fields")
    parser.add_argument("--informative", type=int, default=13, help="fields the label depends on")
    parser.add_argument(
        "--max-levels", type=int, default=1_000_000, help="the widest field's levels"
    )
    add_training_options(parser)
    return parser


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """The options of the fits, the rounds, their budget and the tables."""
    parser.add_argument("--lr", type=float, default=0.02, help="ours: the learning rate")
    parser.add_argument(
        "--optimizer", default="adam", help="ours: the optimizer Param (adam, sgd, ...)"
    )
    parser.add_argument("--batch-size", type=int, default=4096, help="ours: the global batch")
    parser.add_argument("--epochs", type=int, default=4, help="ours: maxEpochs")
    parser.add_argument("--mllib-iters", type=int, default=100, help="MLlib: maxIter (its default)")
    parser.add_argument(
        "--reg-param",
        type=float,
        default=0.0,
        help="regParam for both (L2; elastic net 0)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per problem")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds a fit may take")
    parser.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time one step's parts at 2^20 and 2^24 features (no Spark)",
    )
    parser.add_argument(
        "--breakdown-only", action="store_true", help="the step breakdown alone, without Spark"
    )
    parser.add_argument("--breakdown-repeats", type=int, default=5)
    parser.add_argument(
        "--compare-syncs",
        action="store_true",
        help="ours alone, sparseSync dense against touched alternating (no MLlib)",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: a bad option stops here, naming it."""
    parser = command_line()
    args = parser.parse_args(argv)
    args.problem_names = [name.strip() for name in args.problems.split(",") if name.strip()]
    if not args.problem_names or set(args.problem_names) - {"text", "clicks"}:
        parser.error(f"--problems {args.problems!r}: choose of text, clicks")
    try:
        args.click_powers = [int(power) for power in args.click_features.split(",")]
    except ValueError:
        parser.error(f"--click-features {args.click_features!r}: powers of 2, e.g. 20,24")
    for name in ("text_rows", "click_rows", "batch_size", "epochs", "mllib_iters", "rounds"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    if not 0 < args.test_fraction < 1 or args.classes < 2 or args.reg_param < 0:
        parser.error("need 0 < --test-fraction < 1, --classes >= 2 and --reg-param >= 0")
    if args.tilted * args.classes > args.vocabulary // 2:
        parser.error(
            f"--tilted {args.tilted} x --classes {args.classes} is more than half the "
            f"--vocabulary {args.vocabulary}: the classes would favour the same words"
        )
    if args.informative > args.fields:
        parser.error(f"--informative {args.informative} is more than --fields {args.fields}")
    if not all(4 <= power <= 30 for power in [args.text_features, *args.click_powers]):
        parser.error("--text-features and --click-features: powers of 2 from 4 to 30")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark as the command line (``argv``, else ``sys.argv``) says; the exit status."""
    return sparse.run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
