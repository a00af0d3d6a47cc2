"""README's NumPy training loop runs and trains."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_numpy_loop_trains(capsys):
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[:1]
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["loss"] < 1e-3
    assert namespace["scaler"].skipped_steps >= 1  # the scale calibrated itself
    assert "loss" in capsys.readouterr().out


def test_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && python -m pytest' in README.read_text()
    assert 'pip install -q -e ".[test]"' in ci and "\npython -m pytest\n" in ci
