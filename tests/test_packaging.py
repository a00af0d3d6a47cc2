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


# -- extras give ranges, CI pins ------------------------------------------------------------------
def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _constraints() -> dict[str, str]:
    """Package name (normalised) -> the exact version .ci/constraints.txt pins."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def test_extras_give_ranges_so_a_users_torch_is_kept():
    project = _pyproject()["project"]
    for extra, requirements in project["optional-dependencies"].items():
        for requirement in requirements:
            assert "==" not in requirement and "===" not in requirement, (extra, requirement)
    assert "ml_dtypes>=0.4" in project["optional-dependencies"]["demo"]  # for --dtype bfloat16


def test_ci_pins_every_requirement_through_the_constraints_file():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = _pyproject()["project"]
    pins = _constraints()
    assert pins["torch"] == "2.13.0"
    wanted = project["dependencies"] + [r for reqs in project["optional-dependencies"].values() for r in reqs]
    for requirement in map(Requirement, wanted):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} has no pin in .ci/constraints.txt"
        assert requirement.specifier.contains(pins[name]), (str(requirement), pins[name])
    ci = (ROOT / ".ci" / "run").read_text()
    installs = [line for line in ci.splitlines() if line.startswith("python -m pip install")]
    # One deliberate exception, after the suite: the newest pluggy the dependency range allows.
    newest = 'python -m pip install -q -U "$pluggy_req"'
    assert installs and all("-c .ci/constraints.txt" in line or line == newest for line in installs), installs


def test_ci_reruns_the_plugin_tests_with_the_newest_pluggy():
    """The constraints pin one pluggy; CI also runs the plugin tests with the newest (issue 15)."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    upgrade = lines.index('python -m pip install -q -U "$pluggy_req"')
    assert lines.index("python -m pytest -n auto") < upgrade  # the whole suite first, with the pinned one
    rerun = " ".join(lines[upgrade + 1:])
    assert "python -m pytest" in rerun and "tests/test_hookspecs.py" in rerun
    assert 'startswith("pluggy")' in lines[upgrade - 1] and "pluggy_req=" in lines[upgrade - 1]


def _warn_from(module: str, category: type[Warning]) -> None:
    """Issue a warning whose frame belongs to ``module``, as code in that module would."""
    namespace = {"__name__": module, "warnings": __import__("warnings"), "category": category}
    exec("def emit():\n    warnings.warn('probe', category)\n", namespace)
    namespace["emit"]()


def test_warnings_raised_in_polyamp_or_by_pluggy_fail_the_suite():
    """pyproject's filterwarnings (issue 15): a warning polyamp's own code raises, and a pluggy
    deprecation (1.7 warned about our hookspecs), is an error; others stay warnings."""
    filters = _pyproject()["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert "error:::polyamp" in filters and "error::DeprecationWarning:pluggy" in filters
    with pytest.raises(RuntimeWarning, match="probe"):
        _warn_from("polyamp.engine", RuntimeWarning)
    with pytest.raises(DeprecationWarning, match="probe"):
        _warn_from("pluggy._hooks", DeprecationWarning)
    with pytest.warns(RuntimeWarning, match="probe"):
        _warn_from("numpy.somewhere", RuntimeWarning)
