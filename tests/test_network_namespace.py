"""A fit on an address other than loopback: a standalone cluster and its driver inside a
private network namespace whose only addresses are 127.0.0.1 and 192.0.2.1 (a documentation
address: a simulated host of ``harness.sim_hosts``, its one link to nothing else), every
process of the fit on 192.0.2.1 (``SPARK_LOCAL_IP``). The cluster is the ``two_workers`` one
of the conftest, which test_standalone_cluster's README recipe shares.

The engine's own listeners (the driver's message server, each task's block server) must be
on 192.0.2.1 and in the ``spark.allreduce.portRange`` given on the spark-submit command line,
and none of them on 127.0.0.1 (PySpark's own gateway may listen there). The driver
(``namespace_driver.py``) snapshots the namespace's listening sockets when the tasks meet.

Root only (a network namespace and a link), skipped otherwise, and when ``unshare``,
``nsenter`` or ``ip`` is missing or refused (a container may forbid them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from harness.spark_standalone import SPARK_SUBMIT, class_archive_submit_options
from namespace_driver import MARKER

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.netns]

ADDRESS = "192.0.2.1"
#: the engine's ports: below the namespace's ephemeral ports (32768-60999, where Spark's own
#: port-0 listeners land), so all are free in a fresh namespace; one for the driver and one
#: per task, and some to spare
PORTS = (23100, 23107)
EPOCHS = 3
DRIVER = Path(__file__).resolve().parent / "namespace_driver.py"


@pytest.fixture(scope="module")
def namespace(two_workers):
    """The simulated host's network namespace (``net:[inode]``) and what enters it."""
    cluster, host, refusal = two_workers
    if host is None:
        pytest.skip(refusal)
    assert host.address == cluster.host == ADDRESS, (host, cluster.host)
    shown = subprocess.run(
        [*host.prefix, "ip", "-4", "-o", "addr", "show"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert shown.returncode == 0, shown.stderr
    addresses = sorted(re.findall(r"inet (\S+)", shown.stdout))
    assert addresses == ["127.0.0.1/8", f"{ADDRESS}/24"], shown.stdout
    return {"prefix": host.prefix, "namespace": host.namespace}


@pytest.fixture(scope="module")
def cluster(two_workers, namespace):
    return two_workers[0]


@pytest.fixture(scope="module")
def fit(cluster, tmp_path_factory):
    """The driver's report of a fit through spark-submit in the namespace, and its output."""
    command = [
        str(SPARK_SUBMIT),
        "--master",
        cluster.url,
        "--properties-file",
        "conf/cluster/standalone.conf",
        "--conf",
        f"spark.allreduce.portRange={PORTS[0]}-{PORTS[1]}",
        *class_archive_submit_options(),  # the JVMs start sooner; nothing here is counted in them
        str(DRIVER),
        str(EPOCHS),
    ]
    status, output = cluster.run(
        command, tmp_path_factory.mktemp("namespace-fit") / "submit.log", timeout=240
    )
    assert status == 0, f"spark-submit exited with {status}:\n{output[-6000:]}\n{cluster.logs()}"
    lines = [line for line in output.splitlines() if line.startswith(MARKER)]
    assert len(lines) == 1, output[-6000:]
    return json.loads(lines[0][len(MARKER) :]), output


def _listing(sockets: list[dict]) -> str:
    return "\n".join(
        f"  {s['address']}:{s['port']} ({s['table']}) {s['process']}"
        for s in sorted(sockets, key=lambda s: (s["address"], s["port"]))
    )


def test_the_fit_trains_on_both_workers_inside_the_namespace(fit, cluster, namespace):
    report, output = fit
    assert report["namespace"] == namespace["namespace"] != os.readlink("/proc/self/ns/net")
    assert report["driver_host"] == ADDRESS, report["driver_host"]
    assert report["epochs"] == EPOCHS and report["accuracy"] > 0.85, (
        report["accuracy"],
        output[-3000:],
    )
    # an executor of the application in each worker's work dir, and the barrier stage on both
    # (a worker may hold two: the standalone master relaunches an executor that exited, which
    # a run of fresh-ci once saw while the fit itself trained on both)
    (application,) = set(re.findall(r"app ID (app-[\d-]+)", output))
    executors = [sorted(work.glob(f"{application}/*/stderr")) for work in cluster.worker_dirs()]
    assert len(executors) == 2 and all(executors), executors
    assert "scheduled all the 2 tasks for barrier stage" in output, output[-3000:]


def test_the_engines_listeners_are_on_the_address_and_none_on_loopback(fit):
    report, _ = fit
    assert report["meetings"], "the fit's listener heard no meeting"
    meeting = report["meetings"][-1]
    fields, sockets = meeting["fields"], meeting["listening"]
    everything = f"the namespace's listening sockets when the tasks met:\n{_listing(sockets)}"
    engine = [fields["driver"], *fields["servers"]]
    assert len(fields["servers"]) == 2, fields
    hosts = {address.rsplit(":", 1)[0] for address in engine}
    assert hosts == {ADDRESS}, f"the engine advertised {engine}, not {ADDRESS} alone; {everything}"
    ports = [int(address.rsplit(":", 1)[1]) for address in engine]
    assert len(set(ports)) == len(ports) and all(PORTS[0] <= port <= PORTS[1] for port in ports), (
        f"{engine}: not distinct ports of spark.allreduce.portRange={PORTS[0]}-{PORTS[1]}; {everything}"
    )
    # each advertised port is listened on at 192.0.2.1 exactly, by one socket: not on every
    # address (0.0.0.0, ::), not on 127.0.0.1 too
    for address, port in zip(engine, ports):
        on_port = [s for s in sockets if s["port"] == port]
        assert [s["address"] for s in on_port] == [ADDRESS], f"{address}: {on_port}\n{everything}"
    # the driver's own server is this driver's
    driver_socket = next(s for s in sockets if s["port"] == ports[0])
    assert driver_socket["pid"] == report["pid"], (
        f"{driver_socket}, driver pid {report['pid']}\n{everything}"
    )
    # whatever does listen on loopback is not the engine's (here: the py4j gateway in the
    # driver's JVM, PySpark's accumulator server in the driver's Python, each executor's
    # Python daemon and the executor's socket for it): no socket of the engine's range there
    loopback = [s for s in sockets if s["address"] in ("127.0.0.1", "::1")]
    engines = [s for s in loopback if PORTS[0] <= s["port"] <= PORTS[1]]
    assert not engines, (
        f"listening on loopback in the engine's port range:\n{_listing(engines)}\n"
        f"every loopback listener:\n{_listing(loopback)}"
    )
    # and nothing of the engine's on every address either
    wildcard = [
        s
        for s in sockets
        if s["address"] in ("0.0.0.0", "::") and PORTS[0] <= s["port"] <= PORTS[1]
    ]
    assert not wildcard, (
        f"listening on every address in the engine's port range:\n{_listing(wildcard)}"
    )
