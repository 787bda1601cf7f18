"""Which test modules run together, in what order, and on which pytest-xdist worker's turn.

Modules that take a Spark session of the same kind (master and settings) share one session,
and so do the modules that take the ``two_workers`` cluster (``tests/conftest.py``): each
such set is a *group* that one process runs one module after another; every other module
is a group of its own. Under pytest-xdist each group goes whole to one worker
(``xdist_scheduling``), the groups the costliest first, so that the last ones a worker is
given are short and both workers end together; a group that would hold one worker far
longer than the rest is cut into *parts* of whole modules, each starting its session anew.

The costs are the seconds each module took in a whole run (``module_seconds.json``: setup,
call and teardown summed over its tests). They only order and cut the work: a stale figure
makes a run longer, never wrong. A module not in the file is guessed from its tests'
markers. Write the file again from a whole run's JUnit XML report:

    .venv/bin/python -m pytest --junitxml=run.xml
    .venv/bin/python tests/module_groups.py run.xml
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

#: {module name: seconds}, from the newest whole run
FILE = Path(__file__).with_name("module_seconds.json")
#: a guess for a test of a module not in the file, by its markers: slow, Spark, neither
GUESS = {"slow": 10.0, "spark": 2.0, "other": 0.2}
#: A group estimated at more than this many seconds is cut into parts, so that no part
#: holds a worker long after the other ran out. Each part starts its session anew: a driver
#: JVM, its Python workers and the first fit's warm-up, about 12 s of CPU more than a fit
#: in a running session (measured on the 2-core VM), so a part is made no smaller than
#: needed. With two workers and the groups the costliest first, parts of up to 300 s still
#: leave enough small groups to even the workers out (a whole run is ~1,450 s of work).
PART_SECONDS = 300.0
#: the module-spanning fixtures (other than the session) whose modules make a group
SHARED_FIXTURES = ("two_workers",)


def spark_kind(module) -> tuple:
    """What a module's session is started with: its master and its settings."""
    settings = getattr(module, "SPARK_SETTINGS", {})
    return getattr(module, "SPARK_MASTER", "local[4]"), tuple(sorted(settings.items()))


def uses_spark(items) -> bool:
    """Whether any of ``items`` takes the ``spark`` fixture."""
    return any("spark" in getattr(item, "fixturenames", ()) for item in items)


def groups(items) -> tuple[dict, dict]:
    """The modules of ``items`` ({module: its items, in order}), and the groups they make
    ({key: its modules}): the modules that take a shared fixture (``("shared fixture",
    name)``), else a session of one kind (the key: its master and settings), else each
    module alone (the key: the module)."""
    modules: dict = {}
    for item in items:
        modules.setdefault(getattr(item, "module", None), []).append(item)
    found: dict = {}
    for module, members in modules.items():
        key = spark_kind(module) if module is not None and uses_spark(members) else module
        shared = [
            name
            for name in SHARED_FIXTURES
            if any(name in getattr(item, "fixturenames", ()) for item in members)
        ]
        if module is not None and shared:
            key = ("shared fixture", shared[0])
        found.setdefault(key, []).append(module)
    return modules, found


def parts(items, split: bool) -> list[tuple[str, list]]:
    """The groups of ``items``, each a name and its items in the order they run (modules
    that stop the shared session, ``SPARK_STOPS_SESSION``, last), the costliest first. With
    ``split``, a group of more than ``PART_SECONDS`` is cut into parts of whole modules, as
    even as the modules allow, each named after its group."""
    figures = load_seconds()
    modules, found = groups(items)
    seconds = {module: module_cost(module, modules[module], figures) for module in modules}
    made = []
    for key, group in found.items():
        total = sum(seconds[module] for module in group)
        count = min(len(group), int(total // PART_SECONDS) + 1) if split else 1
        loads: list = [[0.0, []] for _ in range(count)]
        for module in sorted(group, key=lambda m: -seconds[m]):
            lightest = min(loads, key=lambda load: load[0])
            lightest[0] += seconds[module]
            lightest[1].append(module)
        for index, (load, members) in enumerate(loads):
            members.sort(
                key=lambda m: (bool(getattr(m, "SPARK_STOPS_SESSION", False)), group.index(m))
            )
            name = group_name(key, members[0]) + (f"-part{index + 1}" if count > 1 else "")
            made.append((load, name, [item for module in members for item in modules[module]]))
    made.sort(key=lambda part: -part[0])
    return [(name, part) for _, name, part in made]


def group_name(key, module) -> str:
    """A group's name: its shared fixture, its session's master and a digest of its
    settings, or the module's own name."""
    if isinstance(key, tuple) and key and key[0] == "shared fixture":
        return f"fixture-{key[1]}"
    if isinstance(key, tuple):
        digest = hashlib.sha256(repr(key[1]).encode()).hexdigest()[:8]
        return f"spark-{re.sub(r'[^A-Za-z0-9]+', '-', key[0]).strip('-')}-{digest}"
    return getattr(module, "__name__", "no-module")


def module_cost(module, items, figures: dict) -> float:
    """``module``'s seconds in the newest whole run (``figures``), else a guess from the
    markers of its ``items``."""
    name = getattr(module, "__name__", "")
    if name in figures:
        return figures[name]
    return sum(
        GUESS["slow"]
        if item.get_closest_marker("slow")
        else GUESS["spark"]
        if item.get_closest_marker("spark")
        else GUESS["other"]
        for item in items
    )


def write_scopes(path: str, made: list[tuple[str, list]]) -> None:
    """Write ``{test id: its group's name}`` to ``path`` whole (a reader never sees half)."""
    scopes = {item.nodeid: name for name, part in made for item in part}
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as file:
        json.dump(scopes, file)
    os.replace(partial, path)


def read_scopes(path: str) -> dict[str, str]:
    """What ``write_scopes`` wrote to ``path``; nothing when it is missing."""
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return {}


def load_seconds() -> dict[str, float]:
    """The figures of ``FILE``; none when it is missing or unreadable (a guess for each)."""
    try:
        return {str(name): float(value) for name, value in json.loads(FILE.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def from_junit(report: Path) -> dict[str, float]:
    """Each module's seconds in a JUnit XML report (``pytest --junitxml``), by module name."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(report).iter("testcase"):
        named = [part for part in case.get("classname", "").split(".") if part.startswith("test_")]
        if named:
            seconds[named[0]] += float(case.get("time", 0))
    return {name: round(value, 1) for name, value in sorted(seconds.items())}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/module_groups.py REPORT.xml", file=sys.stderr)
        return 2
    figures = from_junit(Path(argv[0]))
    FILE.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"{FILE}: {len(figures)} modules, {sum(figures.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
