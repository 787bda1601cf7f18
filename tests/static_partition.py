"""One partition of a plain-process run, as its own program: ``python static_partition.py
PARAM ID ADDRESSES``, where PARAM is a pickled ``AllReduceParameter`` (made once, so every
process holds the same secret), ID this partition's id and ADDRESSES the JSON list of
``[host, port]``. It meets its peers through ``StaticRendezvous``, runs two BSP steps of
``gradient(partition, step)`` and prints one JSON line: what it saw (``hosts``,
``remote_peers``, whether its step went through the host arena, the family of its
Unix/TCP connections) and a digest of the weights.

For tests that run partitions under other namespaces (``unshare``, ``nsenter``), where a
``multiprocessing`` child cannot go.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys

import numpy as np

from allreduce_param.engine import StaticRendezvous

STEPS = 2


def gradient(partition: int, step: int, size: int) -> np.ndarray:
    """Partition ``partition``'s gradient sum at ``step``: seeded, the same in every process."""
    return np.random.default_rng(1000 * step + partition).standard_normal(size).astype(np.float32)


def expected_digest(size: int, partition_num: int) -> str:
    """The weights after ``STEPS`` steps, summed in partition order (one host's order, and
    the flat order of hosts of one partition each), as their sha256."""
    weights = np.zeros(size, np.float32)
    for step in range(STEPS):
        total = gradient(0, step, size)
        for partition in range(1, partition_num):
            total = total + gradient(partition, step, size)
        weights = weights - total / np.float32(partition_num)
    return hashlib.sha256(weights.tobytes()).hexdigest()


def run(param, partition: int, addresses: list) -> dict:
    with param.connect(StaticRendezvous(partition, addresses)) as p:
        p.init(np.zeros(param.size, np.float32))
        for step in range(STEPS):
            p.get_weights()
            p.put_gradients(gradient(partition, step, param.size), count=1.0)
            p.weight_partition[:] -= p.aggregate_gradient_partition()
            p.send_weight_partition()
        weights = p.get_weights()
        families = sorted(
            {
                client._sock.family.name
                for client in p._peers.worker.clients.values()
                if client._sock is not None
            }
        )
        return {
            "partition": partition,
            "hosts": [list(host) for host in p.info.hosts],
            "remote_peers": p.info.remote_peers,
            "host_arena": p.info.host_arena,
            "families": families,
            "digest": hashlib.sha256(weights.tobytes()).hexdigest(),
            "shm_device": os.stat("/dev/shm").st_dev if os.path.exists("/dev/shm") else None,
        }


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as file:
        param = pickle.load(file)
    print(json.dumps(run(param, int(sys.argv[2]), json.loads(sys.argv[3]))), flush=True)
