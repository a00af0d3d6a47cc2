"""The ``polyamp`` command in a subprocess: ``info``, ``demo`` (short run, writes the PNG),
the error for a backend that cannot run, and what ``import polyamp`` pulls in."""

from __future__ import annotations

import os
import re
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
    # whether 30 steps land within the tolerance varies with the CPU's BLAS; tests/demo check that
    assert re.search(r"^float16 \+ polyamp: (matches|does NOT match) float32", out.stdout, re.M)
    assert "float16, no loss scaling: does NOT match float32" in out.stdout
    assert f"plot written to {png}\n" in out.stdout
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
            "heavy = {'torch', 'cupy', 'matplotlib', 'tqdm', 'mpi4py', 'paddle', 'polyamp.distributed'}"
            " & set(sys.modules)\n"
            "print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- the command as a new user meets it ---------------------------------------------------------
def test_a_closed_pipe_ends_the_command_quietly():
    """``polyamp info | head -1``: the reader is gone before polyamp writes."""
    proc = subprocess.Popen([sys.executable, "-m", "polyamp", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # closed before the child writes (it is still importing)
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert stderr == ""


def test_help_is_plain_text(capsys):
    from polyamp.cli import build_parser

    for argv in (["--help"], ["info", "--help"], ["demo", "--help"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        text = capsys.readouterr().out
        assert "usage: polyamp" in text
        assert not re.search(r"``|:(class|func|meth|mod|attr|data):`|\*\*[A-Za-z]", text), text


@pytest.mark.parametrize(("env", "flags", "runs_on"), [
    ("torch", [], "torch"),  # the demo follows POLYAMP_BACKEND ...
    ("torch", ["--backend", "numpy"], "numpy"),  # ... unless --backend says otherwise
])
def test_demo_runs_where_polyamp_backend_points(env, flags, runs_on):
    pytest.importorskip("torch")
    out = _run("demo", *SHORT, "--no-plot", *flags, env={"POLYAMP_BACKEND": env})
    assert out.returncode == 0, out.stderr
    assert f"Adam, {runs_on};" in out.stdout.splitlines()[0]
    assert "float16, no loss scaling: does NOT match float32" in out.stdout


@pytest.mark.parametrize(("env", "says"), [
    ("bogus", "unknown polyamp backend 'bogus' (asked for by POLYAMP_BACKEND=bogus). Installed backends:"),
    ("paddle", "POLYAMP_BACKEND=paddle names a backend the demo cannot train with"),
])
def test_demo_refuses_a_bad_polyamp_backend_before_training(env, says):
    if env == "paddle" and not any(i.name == "paddle" for i in polyamp.available_backends()):
        pytest.skip("no paddle backend installed")
    out = _run("demo", *SHORT, env={"POLYAMP_BACKEND": env})
    assert out.returncode == 2 and out.stdout == ""  # nothing trained, nothing printed
    assert out.stderr.startswith("polyamp demo: error: ") and says in out.stderr
    assert "Traceback" not in out.stderr


def test_demo_checks_the_output_path_before_training(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "taken.png").mkdir()
    cases = {
        str(tmp_path / "missing" / "plot.png"): "the folder",
        str(tmp_path / "plot.txt"): "matplotlib cannot write .txt files",
        str(tmp_path): "is a folder",
        str(tmp_path / "taken"): "is a folder",  # taken.png, where the plot would go
    }
    for output, says in cases.items():
        out = _run("demo", *SHORT, "--output", output)
        assert out.returncode == 2 and out.stdout == "", (output, out.stderr)
        assert f"--output {output!r}" in out.stderr and says in out.stderr and "Fix:" in out.stderr


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write anywhere")
def test_demo_refuses_an_unwritable_folder(tmp_path):
    pytest.importorskip("matplotlib")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    out = _run("demo", *SHORT, "--output", str(locked / "plot.png"))
    assert out.returncode == 2 and out.stdout == "" and "not writable" in out.stderr


def test_demo_prints_the_path_really_written(tmp_path):
    pytest.importorskip("matplotlib")
    out = _run("demo", "--steps", "2", "--batch", "64", "--no-progress", "--output", "plot", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    written = tmp_path / "plot.png"  # no suffix: matplotlib's png, and the path says so
    assert f"plot written to {written}\n" in out.stdout and written.read_bytes()[:4] == b"\x89PNG"
    out = _run("demo", "--steps", "2", "--batch", "64", "--no-progress", "--output", "p.SVG", cwd=tmp_path)
    assert out.returncode == 0 and f"plot written to {tmp_path / 'p.SVG'}\n" in out.stdout
    assert b"<svg" in (tmp_path / "p.SVG").read_bytes()[:500]


def test_demo_without_ml_dtypes_refuses_bfloat16_before_training(monkeypatch, capsys):
    from polyamp.cli import build_parser
    from polyamp.demo import command

    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    args = build_parser().parse_args(["demo", "--dtype", "bfloat16", "--steps", "2", "--no-plot"])
    assert command.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--dtype bfloat16 cannot run on the demo backend 'numpy'" in captured.err
    assert "ml_dtypes" in captured.err


def test_demo_refuses_a_negative_seed_without_a_traceback():
    out = _run("demo", "--seed", "-1", *SHORT)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert "polyamp demo: error: seed must be an int >= 0" in out.stderr and "seed=-1" in out.stderr
