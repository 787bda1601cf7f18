"""Simulated hosts for the tests and ``bench_hosts.py``: network namespaces joined by a
bridge, made and torn down here.

``simulated_hosts(count)`` is a context manager that gives ``count`` hosts h1..hN, each a
network namespace of its own with ``lo`` up and one link, ``eth0``, at ``192.0.2.i/24`` (a
documentation range: nothing leaves the machine), all joined by a bridge. Traffic between
hosts crosses real links (veth pairs and the bridge), so 127.0.0.1 is no shortcut, and
each host has its own abstract Unix sockets (the engine's same-host path stays on a host).
A command runs on a host after its ``prefix`` (``nsenter --net=/proc/PID/ns/net``), which
execs it, so its process group is the command's. As a network-namespace host tool would, but
without ``ip netns add`` (no ``/run/netns`` mount to make or undo) and without a private
mount namespace around the test.

How they are made, nothing in this process's own network namespace:

- a switch namespace and one namespace per host, each held by ``unshare --net sh -c
  '<configure>; echo ready; exec sleep infinity'``: it configures itself from inside (lo up;
  the switch's bridge ``br0``) and only then says ``ready``, so ``/proc/PID/ns/net`` is the
  new namespace by the time anything enters it (``nsenter`` before that would enter this
  host's own, the race ``test_network_namespace`` describes);
- each veth pair from inside the switch namespace, by a script that first checks it runs
  in that namespace: ``v<i>`` joins the bridge, its peer goes to host i's namespace by its
  holder's pid (``peer name eth0 netns PID``), where a script that checks its namespace
  the same way gives it the address; ready once every bridge port forwards and every
  ``eth0`` is up.

``simulated_hosts(count, rate="1gbit")`` also shapes every link both ways, as the shell
tool does with ``RATE``: a ``tc`` token bucket (``tbf rate RATE burst 256kb latency 50ms``)
on each end of each veth pair, ``eth0`` in the host (what the host sends) and ``v<i>`` in
the switch (what it receives). Without a rate the links are left as the kernel makes them.

Torn down on every path: any process left in a host's or the switch's namespace is killed
(and named in the teardown's error), then the holders; the kernel frees a namespace, its
veth ends and the bridge with its last process. Checked afterwards: no process or open
descriptor holds any of the namespaces, and this process's namespace has the links it
had before. Skipped, with the reason, when not root or when ``unshare``, ``nsenter`` or
``ip`` (and, given a rate, ``tc``) is missing or refused (a container may forbid
namespaces, bridges, veth or the tbf queueing discipline).

It lives in jobs/harness/, the package the tests and ``bench_hosts.py`` share, so that no
benchmark reaches into tests/ (a script under jobs/ has jobs/ on its path; pytest gets it
from ``pythonpath`` in pyproject.toml). Its skips and failures are pytest's: a test reports
them as such, and ``bench_hosts.py`` catches them to say why it cannot run.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

SUBNET = "192.0.2"
#: how long making the namespaces and links may take, in all
READY_TIMEOUT = 60.0
#: tbf's settings besides the rate: the burst must exceed
#: one packet (up to 64 KiB with segmentation offload), the latency bounds the queue
LINK_BURST, LINK_LATENCY = "256kb", "50ms"


@dataclass(frozen=True)
class Host:
    """One simulated host: its name (``h1``), address, namespace (``net:[inode]``), and what
    a command starts with to run there."""

    name: str
    address: str
    namespace: str
    prefix: tuple[str, ...]


@dataclass
class SimulatedHosts:
    hosts: list[Host]
    switch: str  # the bridge's namespace
    rate: str | None = None  # what tc limits each link to, each way (None: not limited)

    def run(self, host: Host, script: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """``sh -c script`` on ``host``, after checking it runs in that host's namespace."""
        return _in_namespace(host.prefix, host.namespace, script, timeout)


def _namespace_of(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _in_namespace(
    prefix: tuple[str, ...], namespace: str, script: str, timeout: float = 30.0
) -> subprocess.CompletedProcess:
    """``sh -c script`` after ``prefix``, refusing (exit 97) to run anywhere but in ``namespace``."""
    guarded = f'[ "$(readlink /proc/self/ns/net)" = "{namespace}" ] || {{ echo "not in {namespace}" >&2; exit 97; }}\n'
    return subprocess.run(
        [*prefix, "sh", "-c", guarded + script],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _holder(script: str, what: str, holders: list[subprocess.Popen], deadline: float) -> str:
    """Start a namespace's holder, ``script`` configuring it from inside; its namespace once
    it said ``ready``. Skips the test when the holder fails (namespaces refused, a missing
    kernel module), with its error."""
    holder = subprocess.Popen(
        ["unshare", "--net", "sh", "-c", f"{script} && echo ready && exec sleep infinity"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    holders.append(holder)
    ready, _, _ = select.select([holder.stdout], [], [], max(0.0, deadline - time.monotonic()))
    line = holder.stdout.readline() if ready else ""  # "" when it exited
    if line.strip() != "ready":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(30)
        pytest.skip(
            f"could not make the {what}'s network namespace (unshare --net; {script}): exit "
            f"{holder.returncode}: {holder.stderr.read().strip()}"
        )
    namespace = _namespace_of(holder.pid)
    assert namespace != _namespace_of(os.getpid()), (
        f"the {what}'s holder said ready in this process's namespace"
    )
    return namespace


def _processes_in(namespaces: set[str], but: set[int]) -> dict[int, str]:
    """The processes (pid: namespace) in any of ``namespaces``, except ``but``."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in but:
            with contextlib.suppress(OSError):
                namespace = os.readlink(f"/proc/{name}/ns/net")
                if namespace in namespaces:
                    found[int(name)] = namespace
    return found


def _descriptors_on(namespaces: set[str]) -> list[str]:
    """Open descriptors of any process that refer to one of ``namespaces`` (which keep it alive)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{name}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{name}/fd/{fd}") in namespaces:
                        found.append(f"pid {name} fd {fd}")
    return found


def describe(pid: int) -> str:
    """A process, shortly: the start of its command line, and its pid."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            command = b" ".join(file.read().split(b"\0")).decode(errors="replace").strip()
    except OSError:
        return f"pid {pid} (gone)"
    return f"{command[:160]} (pid {pid})"


def _links_here() -> list[str]:
    """This process's network namespace's link names (read only)."""
    listed = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30
    )
    return sorted(
        line.split(":")[1].strip().split("@")[0]
        for line in listed.stdout.splitlines()
        if ":" in line
    )


@contextlib.contextmanager
def simulated_hosts(count: int, rate: str | None = None) -> Iterator[SimulatedHosts]:
    """``count`` simulated hosts (h1..hN at 192.0.2.1..N) on one bridge; with ``rate``
    (as tc writes it: ``100mbit``, ``1gbit``), each host's link limited to it both ways.
    See the module."""
    if os.geteuid() != 0:
        pytest.skip("simulated hosts need root (network namespaces, a bridge, veth links)")
    tools = ("unshare", "nsenter", "ip") + (("tc",) if rate else ())
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)} on this machine (util-linux, iproute2)")
    if not 1 <= count <= 254:
        raise ValueError(f"{count} hosts: 1 to 254 fit {SUBNET}.0/24")
    if rate is not None and not re.fullmatch(r"\d+(\.\d+)?([kmgt]i?)?(bit|bps)", rate):
        raise ValueError(f"rate {rate!r}: write it as tc does, e.g. 100mbit, 1gbit")
    links_before = _links_here()
    holders: list[subprocess.Popen] = []
    deadline = time.monotonic() + READY_TIMEOUT
    try:
        switch = _holder(
            "ip link set lo up && ip link add br0 type bridge && ip link set br0 up",
            "switch",
            holders,
            deadline,
        )
        switch_prefix = ("nsenter", f"--net=/proc/{holders[0].pid}/ns/net")
        hosts = [
            _host(i, (switch, switch_prefix), rate, holders, deadline) for i in range(1, count + 1)
        ]
        assert len({host.namespace for host in hosts} | {switch}) == count + 1, (
            "namespaces not distinct"
        )
        simulated = SimulatedHosts(hosts, switch, rate)
        _wait_until_linked(simulated, switch_prefix, deadline)
        yield simulated
    finally:
        namespaces = set()
        for holder in holders:
            with contextlib.suppress(OSError):
                namespaces.add(_namespace_of(holder.pid))
        pids = {holder.pid for holder in holders}
        left = _processes_in(namespaces, but=pids) if namespaces else {}
        stray = [describe(pid) for pid in left]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for holder in holders:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(holder.pid, signal.SIGKILL)
            holder.wait(30)
            holder.stdout.close()
            holder.stderr.close()
        remaining = _wait_for_none(namespaces, pids)
        links_after = _links_here()
    assert not stray, f"processes left running on the simulated hosts (killed now): {stray}"
    assert not remaining, f"the simulated hosts' namespaces are still held: {remaining}"
    assert links_after == links_before, (
        f"this namespace's links changed: {links_before} -> {links_after}"
    )


def _host(
    i: int,
    switch: tuple[str, tuple[str, ...]],
    rate: str | None,
    holders: list[subprocess.Popen],
    deadline: float,
) -> Host:
    """Host hi: a namespace of its own (its holder added to ``holders``), linked to the
    ``switch`` (its namespace and prefix) by a veth pair, at ``SUBNET.i``, both ends shaped
    to ``rate`` if given."""
    switch_namespace, switch_prefix = switch
    namespace = _holder("ip link set lo up", f"host h{i}", holders, deadline)
    host = Host(
        f"h{i}",
        f"{SUBNET}.{i}",
        namespace,
        ("nsenter", f"--net=/proc/{holders[-1].pid}/ns/net"),
    )
    made = _in_namespace(
        switch_prefix,
        switch_namespace,
        f"ip link add v{i} type veth peer name eth0 netns "
        f"{holders[-1].pid} && ip link set v{i} master br0 && ip link set v{i} up",
    )
    if made.returncode != 0:
        pytest.skip(f"could not link host h{i} to the bridge (veth): {made.stderr.strip()}")
    addressed = _in_namespace(
        host.prefix,
        namespace,
        f"ip addr add {host.address}/24 dev eth0 && ip link set eth0 up",
    )
    assert addressed.returncode == 0, f"h{i}: {addressed.stderr}"
    if rate:
        _shape(host.prefix, namespace, "eth0", rate, f"h{i}")
        _shape(switch_prefix, switch_namespace, f"v{i}", rate, f"the switch's end of h{i}'s link")
    return host


def _shape(prefix: tuple[str, ...], namespace: str, device: str, rate: str, where: str) -> None:
    """Limit what ``device`` sends to ``rate`` (tc tbf); skips the test when tc refuses (a
    kernel without the tbf queueing discipline, say), with tc's error."""
    shaped = _in_namespace(
        prefix,
        namespace,
        f"tc qdisc add dev {device} root tbf rate {rate} burst {LINK_BURST} latency {LINK_LATENCY}",
    )
    if shaped.returncode != 0:
        pytest.skip(
            f"could not limit {where}'s {device} to {rate} (tc qdisc add ... tbf): {shaped.stderr.strip()}"
        )


def _wait_until_linked(
    simulated: SimulatedHosts, switch_prefix: tuple[str, ...], deadline: float
) -> None:
    """Until every bridge port forwards and every host's eth0 is up (state UP)."""
    while True:
        ports = _in_namespace(switch_prefix, simulated.switch, "bridge -o link show")
        forwarding = {
            line.split(":")[1].strip().split("@")[0]
            for line in ports.stdout.splitlines()
            if "state forwarding" in line
        }
        up = [
            host.name
            for host in simulated.hosts
            if "state UP" in simulated.run(host, "ip -o link show dev eth0").stdout
        ]
        if forwarding >= {f"v{i}" for i in range(1, len(simulated.hosts) + 1)} and len(up) == len(
            simulated.hosts
        ):
            return
        if time.monotonic() > deadline:
            pytest.fail(
                f"the simulated hosts' links did not come up in time: bridge ports forwarding "
                f"{sorted(forwarding)}, eth0 up on {up}\n{ports.stdout}{ports.stderr}",
                pytrace=False,
            )
        time.sleep(0.1)


def _wait_for_none(namespaces: set[str], holders: set[int], timeout: float = 30.0) -> list[str]:
    """Until no process or descriptor holds any of ``namespaces``; what still does after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        held = [describe(pid) for pid in _processes_in(namespaces, but=set())] + _descriptors_on(
            namespaces
        )
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.1)
