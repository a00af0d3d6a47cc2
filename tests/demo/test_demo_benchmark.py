"""benchmarks/demo.py runs a fresh ``polyamp demo`` and reads its table's times (a smoke test; the
time per run is printed, never asserted: ``pytest -s`` shows it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "demo.py"


def test_benchmark_reads_the_three_runs_times():
    out = subprocess.run([sys.executable, str(SCRIPT), "--runs", "1", "--steps", "3", "--variants",
                          "default,blas-all-cores"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["default"],
                                                                                   ["blas-all-cores"])]
    assert [r[0] for r in rows] == ["default", "blas-all-cores"]
    for row in rows:  # variant, load, three runs' times, wall, CPU
        assert len(row) == 7 and all(cell.endswith("s") for cell in row[2:]), row
    assert "median wall, default:" in out.stdout


def test_benchmark_refuses_an_unknown_variant():
    out = subprocess.run([sys.executable, str(SCRIPT), "--variants", "fast"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--variants: unknown ['fast']" in out.stderr
