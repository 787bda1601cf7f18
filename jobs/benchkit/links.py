"""Hosts joined by a link of a given rate, simulated: a benchmark runs itself again in a
private network namespace (``unshare -n``, root needed) whose loopback ``tc`` limits to the
rate, and prints the rows of all runs in one table (``bench_allreduce.py --link``,
``bench_overlap.py --link``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

#: The link of a run outside any namespace.
HOST = "host"
#: tbf's settings besides the rate; the burst must exceed one packet (lo's MTU is 64 KiB).
LINK_BURST, LINK_LATENCY = "256kb", "50ms"
#: lo's MTU on Linux: a tbf burst below it lets no full-size packet through.
LOOPBACK_MTU = 65536
#: Bursts to try when tc refuses the one asked for.
LARGER_BURSTS = ("512kb", "1mb", "2mb")


def ring_bound_ms(size_bytes: float, partitions: int, bytes_per_second: float) -> float:
    """The ring allreduce's bound: each of N partitions sends (and receives) at least
    2(N-1)/N x the vector's bytes (nccl-tests' bus bandwidth), here at ``bytes_per_second``."""
    return 2 * (partitions - 1) / partitions * size_bytes / bytes_per_second * 1e3


def bits_per_second(rate: str) -> float:
    """``1gbit`` -> 1e9, as tc reads rates (k, m, g: powers of 1000)."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not found:
        raise SystemExit(
            f"cannot read link rate {rate!r}: write it as tc does, e.g. 100mbit, 1gbit, 10gbit "
            f"(or '{HOST}' for no limit)"
        )
    return float(found.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[found.group(2)]


def link_setup(rate: str, burst: str) -> str:
    """The shell commands that make a namespace's loopback a link of ``rate``; exit status 91
    when ``ip`` fails, 92 when ``tc`` does."""
    return (
        f"ip link set lo up || exit 91; "
        f"tc qdisc add dev lo root tbf rate {rate} burst {burst} latency {LINK_LATENCY} || exit 92; "
    )


def link_problem(rate: str, burst: str) -> tuple[str | None, str]:
    """Try the namespace and the shaping once, running nothing in it: ``(None, burst)`` with
    the burst tc took (``burst`` or, if tc refuses it, a larger one), else ``(why, '')``."""
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (
            f"--link needs the tools unshare (util-linux), ip and tc (iproute2); missing: {', '.join(missing)}"
            " (apt-get install util-linux iproute2)"
        ), ""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)(b|k|kb|m|mb)?", burst.strip().lower())
    if not found:
        return f"--link-burst {burst!r}: write it as tc does, e.g. 256kb, 1mb", ""
    if (
        float(found.group(1))
        * {None: 1, "b": 1, "k": 1024, "kb": 1024, "m": 2**20, "mb": 2**20}[found.group(2)]
        < LOOPBACK_MTU
    ):
        # tc takes it, but tbf then drops every full-size packet on lo and the run hangs
        return (
            f"--link-burst {burst} is below the loopback's MTU ({LOOPBACK_MTU} bytes): take 256kb or more",
            "",
        )
    refused = []
    for candidate in dict.fromkeys((burst, *LARGER_BURSTS)):
        done = subprocess.run(
            ["unshare", "-n", "sh", "-c", link_setup(rate, candidate)],
            capture_output=True,
            text=True,
        )
        said = done.stderr.strip().replace("\n", "; ")
        if done.returncode == 0:
            if refused:
                print(
                    f"note: tc refused burst {burst} ({refused[0]}); using burst {candidate}",
                    file=sys.stderr,
                )
            return None, candidate
        if done.returncode == 91:
            return f"--link: 'ip link set lo up' failed inside the namespace: {said}", ""
        if done.returncode != 92:
            why = (
                "not running as root"
                if os.geteuid() != 0
                else "root without CAP_SYS_ADMIN (a container?)"
            )
            return f"--link: 'unshare -n' is not permitted here ({why}): {said}", ""
        refused.append(f"burst {candidate}: {said}")
    return (
        f"--link: tc refused 'tbf rate {rate} latency {LINK_LATENCY}' with every burst tried: "
        + "; ".join(refused),
        "",
    )


def without_link(argv: list[str]) -> list[str]:
    """The command line without ``--link RATES`` / ``--link=RATES``."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--link":
            skip = True
        elif not arg.startswith("--link="):
            rest.append(arg)
    return rest


def run_in_links(
    rates: list[str],
    argv: list[str],
    burst: str,
    script: str,
    print_all: Callable[[list[dict]], None],
    group: str = "size",
) -> int:
    """Run the benchmark ``script`` (its file) again once per rate, each inside a
    private network namespace with its loopback limited to the rate (``host``: as it is, no
    namespace); then ``print_all`` of their rows, grouped by the field ``group``, in the
    order of the rates within a group. The script takes ``--inside-link RATE``,
    ``--link-burst`` and ``--results FILE`` (where it leaves its rows as JSON). The exit
    status is that of the first run that failed, else 0."""
    rates = [rate.strip() for rate in rates if rate.strip()]
    for rate in rates:
        if rate != HOST:
            bits_per_second(rate)  # a bad rate fails before anything starts
    bursts = {}
    for rate in rates:
        if rate != HOST:
            problem, bursts[rate] = link_problem(rate, burst)
            if problem:
                print(f"error: {problem}", file=sys.stderr)
                return 2
    rest = without_link(argv)
    script = os.path.abspath(script)
    status, rows = 0, []
    with tempfile.TemporaryDirectory(prefix="bench-link-") as scratch:
        for number, rate in enumerate(rates):
            results = os.path.join(scratch, f"{number}.json")
            if rate == HOST:
                command = [sys.executable, script, *rest, "--results", results]
                environment = None
            else:
                command = [
                    "unshare",
                    "-n",
                    "sh",
                    "-c",
                    link_setup(rate, bursts[rate]) + 'exec "$0" "$@"',
                    sys.executable,
                    script,
                    *rest,
                    "--link-burst",
                    bursts[rate],
                    "--inside-link",
                    rate,
                    "--results",
                    results,
                ]
                # c10d's reverse lookups of 127.0.0.1 fail without a resolver in the namespace: harmless
                environment = {
                    **os.environ,
                    "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
                }
            print(
                f"== link {rate}" + ("" if rate == HOST else f" (tc tbf burst {bursts[rate]})"),
                flush=True,
            )
            done = subprocess.run(command, env=environment)
            if done.returncode:
                print(
                    f"error: the run on link {rate} failed (exit status {done.returncode})",
                    file=sys.stderr,
                )
            status = status or done.returncode
            if os.path.exists(results):
                rows += json.loads(Path(results).read_text())
    if len(rates) > 1 and rows:
        order = {rate: i for i, rate in enumerate(rates)}
        groups = {row[group]: None for row in rows}  # in the order they first came
        # stable within
        rows.sort(key=lambda row: (list(groups).index(row[group]), order[row["link"]]))
        print(f"\n== all links ({', '.join(rates)})")
        print_all(rows)
    return status
