"""The ``polyamp`` command in a subprocess: ``info``, ``demo`` (short run, writes the PNG),
the error for a backend that cannot run, and what ``import polyamp`` pulls in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import polyamp
from polyamp.demo import backends

SCRIPT = Path(sys.executable).with_name("polyamp")
SHORT = ["--steps", "30", "--batch", "512", "--no-progress"]


def _run(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "POLYAMP_BACKEND"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "polyamp", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=300)


def test_info_lists_backends_versions_and_env():
    out = _run("info")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"polyamp {polyamp.__version__}"
    assert lines[1].startswith("POLYAMP_BACKEND: (unset")
    for info in polyamp.available_backends():
        row = next(line for line in lines if line.split()[:1] == [info.name])
        assert ("yes" if info.available else "no") in row.split()
        assert (info.version or "-") in row


@pytest.mark.parametrize(("value", "says"), [
    ("numpy", "numpy (in effect for scalers built without backend=)"),
    ("nosuch", "nosuch (unknown backend: scalers built without backend= will raise)"),
])
def test_info_shows_the_backend_in_effect(value, says):
    out = _run("info", env={"POLYAMP_BACKEND": value})
    assert out.returncode == 0 and out.stdout.splitlines()[1] == f"POLYAMP_BACKEND: {says}"


def test_demo_short_run_prints_table_and_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "demo.png"
    out = _run("demo", *SHORT, "--output", str(png), "--seed", "1")
    assert out.returncode == 0, out.stderr
    rows = {line.split("  ")[0].strip(): line for line in out.stdout.splitlines()}
    assert {"float32", "float16, no loss scaling", "float16 + polyamp"} <= set(rows)
    assert "float16 + polyamp: matches float32" in out.stdout
    assert "float16, no loss scaling: does NOT match float32" in out.stdout
    assert f"plot written to {png}" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_console_script_runs_the_demo_with_plain_progress(tmp_path):
    if not SCRIPT.exists():
        pytest.skip(f"no console script next to {sys.executable}")
    out = subprocess.run([str(SCRIPT), "demo", "--steps", "10", "--batch", "256", "--no-plot",
                          "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "bfloat16 + polyamp" in out.stdout and "plot written" not in out.stdout
    assert "step 10/10" in out.stderr or "10/10" in out.stderr  # progress went to stderr


def test_demo_refuses_an_unavailable_backend():
    if backends._why_unavailable("cupy") is None:
        pytest.skip("cupy can run here")
    out = _run("demo", "--backend", "cupy", *SHORT)
    assert out.returncode == 2 and out.stdout == ""
    assert "demo backend 'cupy' is not available here" in out.stderr
    assert backends._why_unavailable("cupy") in out.stderr
    assert "Available demo backends: numpy" in out.stderr


def test_demo_refuses_unknown_backend_and_bad_settings():
    out = _run("demo", "--backend", "jax", *SHORT)
    assert out.returncode == 2 and "unknown demo backend 'jax'" in out.stderr
    out = _run("demo", "--batch", "100", "--global-batch", "10", "--no-progress")
    assert out.returncode == 2 and "global_batch must be >= batch" in out.stderr


def test_import_polyamp_imports_nothing_heavy():
    code = ("import sys, polyamp, polyamp.demo, polyamp.cli\n"
            "heavy = {'torch', 'cupy', 'matplotlib', 'tqdm'} & set(sys.modules)\n"
            "print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
