"""bench_torch_backend.py runs end to end on a tiny MLP and prints its table (no figures are
checked: speed belongs in the benchmark's own runs)."""

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
         "--hidden", "8", "--rounds", "2", "--steps", "2", "--warmup", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("machine: ") and "single-core copy bandwidth: " in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header == ["N", "MLP", "parameters", "ours ms", "gloo ms", "x gloo (range)"]
    row = [cell.strip() for cell in table[2].strip("|").split("|")]
    assert row[:3] == ["2", "3 x 8", "2,209"]  # 256*8+8, twice 8*8+8, then 8+1
    assert float(row[3]) > 0 and float(row[4]) > 0 and "(" in row[5]
