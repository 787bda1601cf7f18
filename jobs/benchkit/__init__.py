"""What the benchmarks in jobs/ share: timing in alternating rounds, tables, machine facts,
the peers measured against (gloo, MLlib), link shaping, sparse data; and each benchmark's
own logic, one module each, behind its thin script ``jobs/bench_*.py``.

Imported as ``benchkit`` with jobs/ on the path (a script run as ``python jobs/x.py`` has it
there already; pytest gets it from ``pythonpath`` in pyproject.toml). It never imports a
script (an import contract in pyproject.toml says so). Spark's executors cannot import
jobs/, so the package travels by value: whatever a task here calls is pickled with its code.
"""

from __future__ import annotations

import sys

from pyspark import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])
