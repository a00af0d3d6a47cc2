"""The wheel builds, installs into a fresh virtual environment, imports, and finds its backends."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_and_imports_in_fresh_venv(tmp_path):
    pytest.importorskip("build")
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = dist.glob("polyamp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "polyamp/backends/numpy.py" in names and "polyamp/compat/torch.py" in names
    assert not any(n.startswith(("backends/", "compat/", "tests/")) for n in names)

    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    python = env / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], check=True)
    code = (
        "import sys, numpy as np, polyamp\n"
        "names = [i.name for i in polyamp.available_backends() if i.available]\n"
        "assert 'numpy' in names and 'array_api' in names, names\n"
        "assert 'torch' not in sys.modules\n"
        "s = polyamp.GradScaler('cpu', init_scale=4.0)\n"
        "print(names, float(s.scale(np.float32(2.0))))\n"
    )
    out = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.strip().endswith("8.0")
