"""Every byte on a link between two hosts, captured: blocks in clear without encryption,
none with it, and the same sums either way.

Two simulated hosts (``sim_hosts``: network namespaces on a bridge, 192.0.2.1 and .2). On
h1 a capture process reads every frame that crosses h1's ``eth0``, both ways, from an
``AF_PACKET`` socket opened there (the only link between the hosts, so every byte the two
partitions exchange). One plain Python process per host syncs a vector through
``StaticRendezvous`` (no Spark): raw codec, gradients and weights of recognizable values,
one BSP step and a ``get_weights`` on either side of it. Then:

- without encryption the payloads' bytes are in the capture (so the capture works, and the
  check below could fail);
- with encryption no 64-byte window of any payload is (every such window, at every 64th
  byte of each vector, looked for at every byte offset of the capture), and the weights are
  still exactly the float32 sums computed here.

The capture socket reports the frames it dropped (``PACKET_STATISTICS``): none may be.
Root only (``sim_hosts`` skips, saying why, where namespaces cannot be made).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness.sim_hosts import simulated_hosts

from allreduce_param.engine import AllReduceParameter, NetworkSettings

pytestmark = pytest.mark.netns

SIZE = 65536  # 256 KiB a vector: a slice per partition of 128 KiB
PORT = 45123  # the namespaces are new: every port is free
WINDOW = 64
REPO = Path(__file__).resolve().parents[1]

CAPTURE = r"""
import select, socket, struct, sys
sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL: both ways
sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE (root): drop nothing while we write
sock.bind(("eth0", 0))
print("ready", flush=True)
frames = bytearray()
def drain():
    global frames
    while True:
        try:
            frames += sock.recv(1 << 18, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
while True:  # until the test closes our stdin
    ready, _, _ = select.select([sock, sys.stdin], [], [])
    if sock in ready:
        drain()
    if sys.stdin in ready and not sys.stdin.read():
        drain()
        break
packets, drops = struct.unpack("<II", sock.getsockopt(263, 6, 8))  # SOL_PACKET, PACKET_STATISTICS
open(sys.argv[1], "wb").write(frames)
print(f"captured {packets} {drops}", flush=True)
"""

PARTITION = r"""
import json, pickle, sys
import numpy as np
from allreduce_param.engine import StaticRendezvous
param_file, partition, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with open(param_file, "rb") as file:
    param, start, gradients = pickle.load(file)
addresses = [("192.0.2.1", port), ("192.0.2.2", port)]
with param.connect(StaticRendezvous(partition, addresses, timeout=60)) as p:
    p.init(start)
    first = p.get_weights().copy()
    p.put_gradients(gradients[partition], count=1.0)
    p.weight_partition[:] -= p.aggregate_gradient_partition()
    p.send_weight_partition()
    last = p.get_weights().copy()
    kinds = sorted({type(client._sock).__name__ for client in p._peers.worker.clients.values()})
np.save(out, np.stack([first, last]))
print(json.dumps({"kinds": kinds}), flush=True)
"""


def patterns() -> tuple[np.ndarray, list[np.ndarray]]:
    """Start weights and each partition's gradient: values that appear nowhere else."""
    start = (np.arange(SIZE, dtype=np.float32) * np.float32(0.001) + np.float32(7.0)).astype(
        np.float32
    )
    gradients = [
        (np.arange(SIZE, dtype=np.float32) * np.float32(0.25) + np.float32(1000 * (i + 1))).astype(
            np.float32
        )
        for i in range(2)
    ]
    return start, gradients


def windows_found(capture: bytes, payloads: list[np.ndarray]) -> int:
    """How many of the payloads' 64-byte windows (one at every 64th byte of each) the capture
    holds, at any offset."""
    wanted = set()
    for payload in payloads:
        raw = payload.tobytes()
        wanted.update(raw[i : i + WINDOW] for i in range(0, len(raw) - WINDOW + 1, WINDOW))
    found = set()
    for offset in range(len(capture) - WINDOW + 1):
        piece = capture[offset : offset + WINDOW]
        if piece in wanted:
            found.add(piece)
    return len(found)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(30)


def run_on_two_hosts(
    hosts, tmp_path: Path, encrypt: bool
) -> tuple[bytes, list[np.ndarray], list[dict], tuple]:
    """One capture on h1's eth0 around one sync of two partitions, one per host."""
    h1, h2 = hosts.hosts
    start, gradients = patterns()
    param = AllReduceParameter(
        2, SIZE, codec="raw", timeout=60, network=NetworkSettings(encrypt=encrypt)
    )
    param_file = tmp_path / f"param-{encrypt}.pickle"
    param_file.write_bytes(pickle.dumps((param, start, gradients)))
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    capture_file = tmp_path / f"capture-{encrypt}.bin"
    processes = []
    try:
        capture = subprocess.Popen(
            [*h1.prefix, sys.executable, "-c", CAPTURE, str(capture_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        processes.append(capture)
        assert capture.stdout.readline().strip() == "ready", "the capture did not start"
        partitions = [
            subprocess.Popen(
                [
                    *host.prefix,
                    sys.executable,
                    "-c",
                    PARTITION,
                    str(param_file),
                    str(i),
                    str(PORT),
                    str(tmp_path / f"weights-{encrypt}-{i}.npy"),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=environment,
                start_new_session=True,
            )
            for i, host in enumerate((h1, h2))
        ]
        processes += partitions
        reports = []
        for i, process in enumerate(partitions):
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, f"partition {i} failed:\n{err}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
        capture.stdin.close()  # every partition has ended: its bytes are in the capture's queue
        said = capture.stdout.readline().split()
        capture.wait(30)
        assert said[0] == "captured", said
        counts = int(said[1]), int(said[2])
        weights = [np.load(tmp_path / f"weights-{encrypt}-{i}.npy") for i in range(2)]
        return capture_file.read_bytes(), weights, reports, counts
    finally:
        for process in processes:
            stop(process)
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    stream.close()


@pytest.mark.slow
def test_encrypted_blocks_cross_a_link_with_no_plaintext_and_the_same_sums(tmp_path):
    start, gradients = patterns()
    mean = (gradients[0] + gradients[1]) / np.float32(2.0)
    expected = np.stack([start, start - mean])
    payloads = [start, *gradients, expected[1]]
    with simulated_hosts(2) as hosts:
        plain, plain_weights, plain_reports, plain_counts = run_on_two_hosts(
            hosts, tmp_path, encrypt=False
        )
        sealed, sealed_weights, sealed_reports, sealed_counts = run_on_two_hosts(
            hosts, tmp_path, encrypt=True
        )
    for weights in plain_weights + sealed_weights:
        assert np.array_equal(weights, expected)
    assert [report["kinds"] for report in plain_reports] == [["socket"]] * 2
    assert [report["kinds"] for report in sealed_reports] == [["SealedConnection"]] * 2
    assert plain_counts[1] == 0 and sealed_counts[1] == 0, "the capture dropped frames"
    # both runs moved at least the payloads: each partition's gradient chunk for the other, and
    # the other's slice of the weights twice (before and after the step): 3 x 128 KiB each way
    least = 2 * 3 * SIZE * 4 // 2
    assert len(plain) > least and len(sealed) > least
    total = len(payloads) * SIZE * 4 // WINDOW
    in_clear = windows_found(plain, payloads)
    assert in_clear > total // 4, (
        f"only {in_clear} of {total} windows in clear: does the capture see the link?"
    )
    assert windows_found(sealed, payloads) == 0
    print(
        f"\ncaptured {len(plain):,} bytes in clear ({in_clear} of {total} payload windows found), "
        f"{len(sealed):,} encrypted (none found)"
    )
