"""bench_torch_backend.py runs end to end on a tiny MLP and a tiny CNN and prints its table
(no figures are checked: speed belongs in the benchmark's own runs).

The job's ``main`` runs in this process, as test_benchmarks runs the other jobs: it spawns
its ranks from here, instead of first starting a Python that imports torch (seconds of a
2-core machine's CPU) only to spawn them; the ranks are the same spawned processes.
"""

from __future__ import annotations

import contextlib
import io

import bench_torch_backend
import pytest

pytest.importorskip("torch")


@pytest.mark.slow
def test_bench_torch_backend_prints_ours_against_gloo():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = bench_torch_backend.main(
            ["--processes", "2", "--hidden", "8", "--cnn", "2,4", "--rounds", "2", "--steps", "1",
             "--warmup", "1"]
        )  # fmt: skip
    out = printed.getvalue()
    assert status == 0, out[-3000:]
    assert out.startswith("machine: ") and "single-core copy bandwidth: " in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header == ["N", "hosts", "model", "parameters", "sync floor ms", "ours ms",
                      "gloo ms", "x gloo (range)", "ours CPU ms", "gloo CPU ms", "ours asleep ms",
                      "gloo asleep ms"]  # fmt: skip
    assert "torch threads in each rank: 1 intra-op, " in out
    mlp, cnn = ([cell.strip() for cell in line.strip("|").split("|")] for line in table[2:])
    assert mlp[:4] == ["2", "1", "MLP 3 x 8", "2,209"]  # 256*8+8, twice 8*8+8, then 8+1
    # 2*9+2, 4*2*9+4, 4*12*12*128+128, 128*10+10
    assert cnn[:4] == ["2", "1", "CNN 2,4 ch", "75,242"]
    for row in (mlp, cnn):
        assert all(float(row[i]) > 0 for i in (4, 5, 6, 8, 9)) and "(" in row[7]
        assert float(row[10]) >= 0 and float(row[11]) >= 0  # asleep: none at all is possible
