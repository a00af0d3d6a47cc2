"""benchmarks/unscale.py runs for every dtype, with a threaded floor over the same bytes (a smoke test)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "unscale.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("_polyamp_bench_unscale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_benchmark_runs_each_dtype(bench, capsys, dtype):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    bench.main(["--dtype", dtype, "--reps", "2", "--size", "8K", "--count", "2", "--threads", "2"])
    out = capsys.readouterr().out
    assert out.startswith(f"2 x 8192 {dtype} ") and "2 threads" in out
    assert "floor / compiled" in out or "compiled available: False" in out
    for name in ("blocked", "naive", "floor"):
        assert any(line.split()[0] == name for line in out.splitlines() if line.strip())


def test_benchmark_data_stays_exact_under_half_and_double(bench):
    # the benchmark alternates x0.5 and x2: its data must come back bit for bit in every dtype
    for dtype in ("float16", "bfloat16", "float32"):
        if dtype == "bfloat16":
            pytest.importorskip("ml_dtypes")
        (a,) = bench.make_data(4096, 1, bench.resolve_dtype(dtype))
        b = (a.astype(np.float32) * np.float32(0.5)).astype(a.dtype)
        b = (b.astype(np.float32) * np.float32(2.0)).astype(a.dtype)
        assert np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{a.itemsize}"))
        assert np.isfinite(a.astype(np.float32)).all()


def test_benchmark_threaded_floor_multiplies_every_part(bench):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        floor = bench.threaded_floor(pool, 3)
        buffers = [np.ones(1001, np.float32), np.ones(7, np.float32)]
        floor(buffers, np.array(0.5, np.float32))
    assert all((b == 0.5).all() for b in buffers)


def test_benchmark_refuses_zero_threads(bench):
    with pytest.raises(SystemExit):
        bench.main(["--threads", "0"])
