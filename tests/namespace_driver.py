"""The driver of test_network_namespace's fit, run by ``spark-submit`` inside the network
namespace (not a test module: pytest does not collect it).

It trains a small MLP on the digits with two workers, and when the tasks meet at the
driver (the fit's ``"meeting"`` event) it snapshots the namespace's TCP listening sockets
from ``/proc/net/tcp`` and ``/proc/net/tcp6`` (this process's, so the namespace's), each
with the process that owns it. It prints one line, ``RESULT = {json}``: the meeting's
fields, the snapshot, this process's pid and network namespace, and the fit's accuracy.

    spark-submit --master spark://... tests/namespace_driver.py EPOCHS
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys

#: the line the test looks for
MARKER = "RESULT = "
LISTEN = "0A"  # a socket's state in /proc/net/tcp: TCP_LISTEN


def _address(hexadecimal: str) -> str:
    """A /proc/net/tcp{,6} address (the kernel's words in host order, little-endian here) as
    text; an IPv4-mapped IPv6 one (a JVM's socket) as its IPv4 address."""
    raw = bytes.fromhex(hexadecimal)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    address = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return str(address.ipv4_mapped or address)


def describe(pid: int) -> str:
    """A process, shortly: its program and main class or script, and its pid."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            args = [arg.decode(errors="replace") for arg in file.read().split(b"\0") if arg]
    except OSError:
        return f"pid {pid} (gone)"
    if not args:
        return f"pid {pid}"
    if "-m" in args[:-1]:
        what = "-m " + args[args.index("-m") + 1]
    else:
        what = next(
            (arg for arg in args[1:] if arg.startswith("org.apache.") or arg.endswith(".py")), ""
        )
    return f"{os.path.basename(args[0])} {what} (pid {pid})".replace("  ", " ")


def _socket_owners() -> dict[int, int]:
    """Socket inode: the pid of a process holding it (any one, if several share it)."""
    owners = {}
    for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile
            continue
        for descriptor in descriptors:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{descriptor}")
            except OSError:
                continue
            if target.startswith("socket:["):
                owners.setdefault(int(target[8:-1]), pid)
    return owners


def listening_sockets() -> list[dict]:
    """This network namespace's TCP listening sockets: address, port, table, owner."""
    owners = _socket_owners()
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{table}") as file:
                lines = file.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state != LISTEN:
                continue
            address, port = local.rsplit(":", 1)
            pid = owners.get(inode)
            found.append(
                {
                    "address": _address(address),
                    "port": int(port, 16),
                    "table": table,
                    "pid": pid,
                    "process": describe(pid) if pid else "no process found",
                }
            )
    return found


def main(epochs: int) -> int:
    from pyspark.sql import SparkSession

    from allreduce_param import models, optim
    from allreduce_param.cli import load_data
    from allreduce_param.train import DistriOptimizer

    meetings = []

    def listener(kind: str, fields: dict) -> None:
        if kind == "meeting":  # every task's server, and the driver's, listens now
            meetings.append({"fields": fields, "listening": listening_sockets()})

    spark = SparkSession.builder.appName("allreduce-param network namespace").getOrCreate()
    try:
        train, test = load_data(spark, {"source": "digits", "seed": 0})
        result = DistriOptimizer(
            models.MLP([64, 32, 10]),
            optim.Adam(lr=0.01),
            batch_size=32,
            epochs=epochs,
            num_workers=2,
            progress=False,
            listener=listener,
        ).fit(train, validation=test)
        report = {
            "meetings": meetings,
            "accuracy": result.history.epochs[-1]["val_accuracy"],
            "epochs": len(result.history.epochs),
            "pid": os.getpid(),
            "namespace": os.readlink("/proc/self/ns/net"),
            "driver_host": spark.conf.get("spark.driver.host", None),
        }
    finally:
        spark.stop()
    print(MARKER + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
