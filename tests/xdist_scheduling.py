"""pytest-xdist's scheduling by the groups of ``module_groups``: each group whole to one
worker, in the order the workers collected them (the costliest first).

xdist's own ``--dist loadgroup`` learns a test's group from a suffix its workers append to
the test's id, and from pytest 9.2 on a test's id can no longer be changed that way
(pytest-dev/pytest-xdist#1386): every test would be sent alone, and modules that share a
Spark session would each start one of their own, on both workers. Here each worker writes
the groups of its tests to a file the controller named (``write_scopes``), before it
reports its collection, and the controller's scheduler reads them from there: no test's id
is touched, and it holds for every pytest. Imported only where pytest-xdist is installed.
"""

from __future__ import annotations

from module_groups import read_scopes
from xdist.scheduler import LoadScopeScheduling


class GroupScheduling(LoadScopeScheduling):
    """``--dist loadgroup`` with the groups of ``module_groups``, read from ``scopes_file``;
    a test the file does not name is scheduled with the other tests of its module."""

    def __init__(self, config, log, scopes_file: str) -> None:
        super().__init__(config, log)
        # the groups in the workers' order (the costliest first), not by their test counts
        config.option.loadscopereorder = False
        self._scopes_file = scopes_file
        self._scopes: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        """The group of test ``nodeid`` (read once every worker has collected)."""
        if self._scopes is None:
            self._scopes = read_scopes(self._scopes_file)
        return self._scopes.get(nodeid) or nodeid.split("::", 1)[0]
