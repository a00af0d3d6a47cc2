"""The ``polyamp`` command in a subprocess: ``info``, ``demo`` (short run, writes the PNG),
the error for a backend that cannot run, and what ``import polyamp`` pulls in."""

from __future__ import annotations

import os
import re
import shlex
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
    assert "pip install 'polyamp[cupy]'" in out.stderr and "one available here: numpy" in out.stderr


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
    """``polyamp info | head -1``: the reader is gone before polyamp writes; no error, status 0."""
    proc = subprocess.Popen([sys.executable, "-m", "polyamp", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # closed before the child writes (it is still importing)
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 0
    assert stderr == ""


def test_a_reader_that_leaves_after_one_line_loses_no_plot(tmp_path):
    """``polyamp demo | head -1``: training goes on, the plot is written, the status is 0."""
    pytest.importorskip("matplotlib")
    png, errors = tmp_path / "demo.png", tmp_path / "stderr.txt"
    with errors.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "polyamp", "demo", *SHORT, "--output", str(png)],
                                stdout=subprocess.PIPE, stderr=err, text=True)
        first = proc.stdout.readline()
        proc.stdout.close()  # as head -1 does: the table and the plot's line have no reader
        status = proc.wait(timeout=300)
    assert first.startswith("polyamp demo: MLP")
    assert status == 0, errors.read_text()
    assert errors.read_text() == ""
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_shows_the_defaults_of_steps_seed_and_batch(capsys):
    from polyamp.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--steps STEPS", 300), ("--seed SEED", 0), ("--batch BATCH", 4096)):
        assert re.search(rf"{flag} [^-]*\(default: {default}\)", text), flag
    # mpirun as root (containers, CI) needs to be told: the help says how
    assert "--allow-run-as-root" in text and "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in text


def test_an_unavailable_backend_names_only_its_own_install_line():
    """Without torch, cupy and paddle: asking for torch names torch's extra, not every backend's."""
    code = (
        "import sys\n"
        "for m in ('torch', 'cupy', 'paddle'): sys.modules[m] = None\n"
        "import polyamp\n"
        "try: polyamp.LossScaler(backend='torch')\n"
        "except polyamp.BackendUnavailableError as exc: print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    message = out.stdout.strip()
    assert message.startswith("backend 'torch' (asked for by backend=) is unavailable: torch is not ")
    assert message.count("pip install") == 1 and "pip install 'polyamp[torch]'" in message
    assert "torch's CPU build first, from https://download.pytorch.org/whl/cpu" in message
    assert "available here (numpy, array_api)" in message and len(message) < 400, message


def test_demo_without_torch_says_to_install_the_cpu_build_first():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from polyamp.cli import main\n"
        "sys.exit(main(['demo', '--backend', 'torch', '--steps', '2']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    message = " ".join(out.stderr.split())
    assert "pip install 'polyamp[torch]' (on a machine without an NVIDIA GPU, install torch's CPU " \
           "build first, from https://download.pytorch.org/whl/cpu)" in message, message


def test_every_install_hint_has_one_style():
    """``pip install 'polyamp[extra]'`` wherever the code tells users to install an optional part."""
    import ast

    root = Path(__file__).resolve().parents[1]
    others = []
    for folder in ("polyamp", "backends", "compat"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    for target in re.findall(r"pip install (\S+)", node.value):
                        if not target.startswith(("'polyamp[", "-e")):  # -e .: polyamp itself is missing
                            others.append(f"{path.name}: {target}")
    # the one exception: cupy >= 14 for bfloat16, which the cupy extra (>= 13) does not promise
    assert others == ["cupy.py: 'cupy-cuda12x>=14'"]


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


@pytest.mark.parametrize("args", [("info",), ("inspect", "x.json"), ("demo", "--no-plot"), ("--version",),
                                  ("--help",)])
def test_every_command_with_stdout_closed_says_so(args):
    """``polyamp info >&-``: a one-line error on stderr naming the fix, not an AttributeError."""
    command = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "polyamp", *args)) + " >&-"
    out = subprocess.run(command, shell=True, stderr=subprocess.PIPE, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "standard output is closed" in out.stderr and "Fix:" in out.stderr
    assert "Traceback" not in out.stderr


def test_demo_refuses_a_name_too_long_and_a_device_before_training(tmp_path):
    long_name = "a" * 300 + ".png"
    cases = {str(tmp_path / long_name): "over this file system's limit",
             "a" * 252: "over this file system's limit",  # 256 bytes once .png is appended
             os.devnull: "is a device, pipe or socket"}
    if os.path.exists("/dev/full"):
        cases["/dev/full"] = "is a device, pipe or socket"
    for output, says in cases.items():
        out = _run("demo", *SHORT, "--output", output, cwd=tmp_path)
        assert out.returncode == 2 and out.stdout == "", (output, out.stderr)
        assert says in out.stderr and "Fix:" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not list(tmp_path.iterdir())  # nothing written, no probe left behind


def test_info_says_which_numpy_kernel_runs():
    """The compiled (numba) kernel when it imports; else the blocked loop, why, and the extra."""
    pytest.importorskip("numba")
    assert "numpy kernel: compiled (numba " in _run("info").stdout
    naive = _run("info", env={"POLYAMP_NUMPY_KERNEL": "naive"}).stdout
    assert "numpy kernel: naive (POLYAMP_NUMPY_KERNEL=naive" in naive
    code = "import sys\nsys.modules['numba'] = None\nfrom polyamp.cli import main\nsys.exit(main(['info']))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("numpy kernel:")]
    assert line.startswith("numpy kernel: blocked, not the compiled one (ModuleNotFoundError")
    assert line.endswith("Fix: pip install 'polyamp[compiled]'")


def test_info_help_has_a_description(capsys):
    from polyamp.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["info", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "which NumPy kernel runs" in text and "POLYAMP_BACKEND" in text


def test_inspect_help_says_torch_save_files_are_read_safely(capsys):
    from polyamp.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["inspect", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "torch.save" in text and "torch.load(weights_only=True)" in text and "refused" not in text
