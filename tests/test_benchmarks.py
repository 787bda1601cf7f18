"""The benchmark jobs run end to end on tiny sizes and print their tables (no figures are
checked here: speed belongs in the benchmarks' own runs, never in a test)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_job(*args: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "jobs" / args[0]), *args[1:]], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def rows(table: str, name: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("|") and name in line]


def test_bench_allreduce_prints_a_row_per_codec_and_loop():
    out = run_job("bench_allreduce.py", "--master", "local[2]", "--sizes", "10000", "--codecs", "raw,int8",
                  "--loops", "readme,tuned", "--rounds", "1", "--steps", "2", "--warmup", "1", "--no-baselines")
    engine = rows(out, "allreduce-param")
    assert [row[1] for row in engine] == ["allreduce-param raw, readme loop", "allreduce-param raw, tuned loop",
                                          "allreduce-param int8, readme loop", "allreduce-param int8, tuned loop"]
    assert all(row[0] == "10K" and float(row[2]) > 0 for row in engine)


def test_bench_allreduce_compares_tcp_with_and_without_encryption():
    out = run_job("bench_allreduce.py", "--master", "local[2]", "--sizes", "10000", "--codecs", "raw",
                  "--transports", "tcp,tcp-encrypted", "--rounds", "2", "--steps", "2", "--warmup", "1",
                  "--no-baselines")
    assert [row[1] for row in rows(out, "allreduce-param")] == ["allreduce-param raw (tcp)",
                                                                "allreduce-param raw (tcp-encrypted)"]
    [row] = rows(out.split("encryption in transit")[1], "10K")
    plain, sealed, ratio = float(row[2]), float(row[3]), row[5]
    assert plain > 0 and sealed > 0 and re.fullmatch(r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)", ratio)


def test_bench_growth_prints_a_row_per_size():
    out = run_job("bench_growth.py", "--tables", "sizes", "--master", "local[2]", "--sizes", "10K,20K",
                  "--rounds", "1", "--steps", "2", "--warmup", "1", "--no-gloo")
    assert "memory copy:" in out
    assert [row[0] for row in rows(out, "allreduce-param raw")] == ["10K", "20K"]


def test_bench_allreduce_refuses_an_unknown_codec():
    done = subprocess.run([sys.executable, str(REPO / "jobs" / "bench_allreduce.py"), "--codecs", "zip"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown codec ['zip']" in done.stderr


def test_bench_overlap_prints_a_row_per_model_and_codec():
    out = run_job("bench_overlap.py", "--master", "local[2]", "--models", "mlp", "--layers", "8,16,16,3",
                  "--codecs", "raw,lz4", "--rows", "600", "--batch", "64", "--rounds", "1")
    table = rows(out, "| host")
    assert [(row[1], row[3]) for row in table] == [("mlp", "raw"), ("mlp", "lz4")]
    for row in table:  # both step times measured, and their ratio printed from them (one round: its
        off, on = (float(cell.split()[0]) for cell in row[5:7])  # ratio), each rounded to 0.1 ms
        ratio = float(row[9].split()[0])
        assert off > 0 and on > 0 and (on - 0.05) / (off + 0.05) - 0.005 <= ratio <= (on + 0.05) / (off - 0.05) + 0.005
