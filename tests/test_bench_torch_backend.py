"""bench_torch_backend.py runs end to end on a tiny MLP and a tiny CNN and prints its table
(no figures are checked: speed belongs in the benchmark's own runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_torch_backend_prints_ours_against_gloo():
    done = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "bench_torch_backend.py"), "--processes", "2",
         "--hidden", "8", "--cnn", "2,4", "--rounds", "2", "--steps", "1", "--warmup", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("machine: ") and "single-core copy bandwidth: " in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header == ["N", "hosts", "model", "parameters", "sync floor ms", "ours ms",
                      "gloo ms", "x gloo (range)", "ours CPU ms", "gloo CPU ms"]  # fmt: skip
    assert "torch threads in each rank: 1 intra-op, " in out
    mlp, cnn = ([cell.strip() for cell in line.strip("|").split("|")] for line in table[2:])
    assert mlp[:4] == ["2", "1", "MLP 3 x 8", "2,209"]  # 256*8+8, twice 8*8+8, then 8+1
    # 2*9+2, 4*2*9+4, 4*12*12*128+128, 128*10+10
    assert cnn[:4] == ["2", "1", "CNN 2,4 ch", "75,242"]
    for row in (mlp, cnn):
        assert all(float(row[i]) > 0 for i in (4, 5, 6, 8, 9)) and "(" in row[7]
