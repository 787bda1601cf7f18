"""A block server under a flood: more connections than the process may open files, idle or
sending garbage, and accept() failing for want of descriptors. It keeps admitting, bounds
what it spends on strangers, and the partitions' sync stays exact."""

from __future__ import annotations

import logging
import os
import resource
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import raise_first, run_partitions

from allreduce_param.engine import AllReduceParameter
from allreduce_param.engine.wire.server import MAX_UNPROVEN

FLOODER = """
import os, resource, select, selectors, socket, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = []
def connect(count):
    for i in range(count):  # connect without waiting: the server's queue takes what it can
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex((host, port))
        held.append(sock)
connect(count)
print(len(held), flush=True)
writers = selectors.DefaultSelector()
for sock in held[::3]:  # a third send garbage once connected, never a whole hello
    writers.register(sock, selectors.EVENT_WRITE)
while True:  # a line "more N": N connections more; the end of our stdin: the end
    if select.select([sys.stdin], [], [], 0)[0]:
        line = sys.stdin.readline()
        if not line:
            break
        connect(int(line.split()[1]))
        print("more", flush=True)
    for key, _ in writers.select(0.5):
        try:
            key.fileobj.send(os.urandom(40))
        except OSError:
            pass
        writers.unregister(key.fileobj)
"""


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


class AcceptFailures(logging.Handler):
    """Sets ``seen`` when a block server logs that accept() failed."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = threading.Event()

    def emit(self, record):
        if "accept failed" in record.getMessage():
            self.seen.set()


@pytest.mark.slow
def test_a_flood_past_the_file_limit_leaves_the_server_admitting_and_syncs_exact():
    size, connections = 50_000, 1100
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = open_descriptors() + 300
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    # peers on the flooded port
    param = AllReduceParameter(2, size, codec="raw", timeout=60, unix_sockets=False)
    served, flooded = threading.Event(), threading.Event()
    address, seen = {}, {}

    def body(p):
        grads = np.full(size, p.info.partition_id + 1.0, np.float32)
        p.init(np.zeros(size))
        if p.info.partition_id == 0:
            address["tcp"] = p._peers._server.address
            served.set()
        assert flooded.wait(120)
        results = []
        for _ in range(3):  # the first fetch from each peer opens its connection now, mid-flood
            p.get_weights()
            p.put_gradients(grads, count=1.0)
            p.weight_partition[:] -= p.aggregate_gradient_partition()
            p.send_weight_partition()
            results.append(p.get_weights().copy())
        return results

    def flood():
        assert served.wait(60)
        host, port = address["tcp"]
        filler = []
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOODER, host, str(port), str(connections)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = flooder.stdout.readline()
            assert line, flooder.stderr.read()
            seen["held"] = int(line)
            # no descriptor left here at all: accept() fails, and must not end the server
            while True:
                try:
                    filler.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    break
            # connections that come now: the server may have taken every earlier one already
            flooder.stdin.write("more 20\n")
            flooder.stdin.flush()
            assert flooder.stdout.readline() == "more\n", flooder.stderr.read()
            seen["accept failed"] = failures.seen.wait(60)
            for fd in filler:
                os.close(fd)
            filler.clear()
            seen["after"] = open_descriptors()
            flooded.set()  # the sync runs while the flooder still holds its connections
            finished.wait(120)
            seen["end"] = open_descriptors()
        finally:
            for fd in filler:
                os.close(fd)
            flooded.set()  # whatever happened, the partitions go on (and the test judges them)
            flooder.stdin.close()
            flooder.wait(60)

    finished = threading.Event()
    failures = AcceptFailures()
    logging.getLogger("allreduce_param.engine.wire.server").addHandler(failures)
    flooding = threading.Thread(target=flood)
    flooding.start()
    try:
        results = raise_first(run_partitions(param, body))
    finally:
        finished.set()
        flooding.join(120)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        logging.getLogger("allreduce_param.engine.wire.server").removeHandler(failures)
    # the flood came, and accept() failed
    assert seen["held"] == connections and seen["accept failed"]
    # strangers cost at most MAX_UNPROVEN descriptors, whatever the flood
    assert seen["end"] - seen["after"] <= MAX_UNPROVEN + 16, seen
    expected = np.zeros(size, np.float32)
    for step in range(3):
        expected -= np.float32(1.5)
        assert all(np.array_equal(result[step], expected) for result in results)
