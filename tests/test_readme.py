"""Every python block of README.md runs as written, and the test command is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _run_block(code: str) -> dict:
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, str(README), "exec"), namespace)
    return namespace


def _block(marker: str) -> str:
    (code,) = [b for b in BLOCKS if marker in b]
    return code


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_every_python_block_runs_as_written(code, capsys):
    if re.search(r"^import paddle", code, re.M):
        pytest.importorskip("paddle")
    _run_block(code)


def test_readme_numpy_loop_trains(capsys):
    namespace = _run_block(_block("import numpy as np"))
    assert namespace["loss"] < 1e-3
    assert namespace["scaler"].skipped_steps >= 1  # the scale calibrated itself
    assert "loss" in capsys.readouterr().out


def test_readme_paddle_loop_trains_on_cpu(capsys):
    pytest.importorskip("paddle")
    code = _block("import paddle")
    assert "scaled.backward()" in code and "scaler.minimize(optimizer, scaled)" in code
    namespace = _run_block(code)
    assert float(namespace["loss"]) < 1e-4
    assert namespace["scaler"].skipped_steps == 0
    assert capsys.readouterr().out.startswith("loss ")


def test_every_python_block_is_tested_for_what_it_shows():
    assert len(BLOCKS) == 2  # a new block needs its own test above


def test_readme_test_command_is_what_ci_runs():
    """The test command README shows (after ``&&``) is a line of .ci/run, after the same install."""
    ci = (README.parent / ".ci" / "run").read_text()
    (shown,) = re.findall(r'^pip install -e "\.\[test\]" && (.+)$', README.read_text(), re.M)
    assert shown == "python -m pytest -n auto"  # on every core (pytest-xdist)
    assert 'pip install -q -c .ci/constraints.txt -e ".[test]"' in ci and f"\n{shown}\n" in ci
    assert ci.index('-e ".[test]"') < ci.index(f"\n{shown}\n")


def test_readme_puts_the_cpu_build_of_torch_first():
    """A literal reader without a GPU meets the CPU line before any ``.[test]`` install."""
    text = README.read_text()
    cpu = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert text.index(cpu) < text.index('pip install -e ".[test]"')
    # every ``.[test]`` install README shows is in a block that starts with the CPU line
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        if '".[test]"' in block:
            assert block.startswith(cpu), block


def test_readme_says_what_the_test_extra_brings():
    text = " ".join(README.read_text().split())
    for name in ("paddlepaddle", "numba", "Open MPI", "matplotlib", "1.8 GB"):
        assert name in text, name


def test_readme_says_how_to_keep_a_cpu_install_small():
    """The CPU build of torch first, then the test command: the extras' torch range keeps it."""
    from packaging.requirements import Requirement

    text = README.read_text()
    cpu = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    test = 'pip install -e ".[test]" && python -m pytest -n auto'
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if cpu in b]
    assert block.index(cpu) < block.index(test)
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    for extra in ("test", "torch"):
        (torch_req,) = [Requirement(r) for r in project["optional-dependencies"][extra]
                        if Requirement(r).name == "torch"]
        # any torch 2.x build, CPU ones (2.13.0+cpu) included, satisfies it: pip keeps it
        assert torch_req.specifier.contains("2.13.0+cpu") and not torch_req.url, torch_req
        assert all(s.operator == ">=" for s in torch_req.specifier), torch_req


def test_readme_says_how_ci_pins_versions():
    text = " ".join(README.read_text().split())
    assert "pins `torch==2.13.0`" not in text
    assert "The extras give version ranges" in text and ".ci/constraints.txt" in text
