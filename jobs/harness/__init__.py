"""The test harness the tests and the benchmarks share: simulated hosts (network namespaces
on a bridge, ``sim_hosts``) and a Spark standalone cluster started from the installed
pyspark (``spark_standalone``).

Imported as ``harness`` with jobs/ on the path: a script run as ``python jobs/x.py`` has it
there already, and pytest puts it there (``pythonpath`` in pyproject.toml). It imports
nothing from the scripts or from ``benchkit``.
"""
