"""docs/coming-from-paddle.md: its polyamp loops run and train on CPU."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "coming-from-paddle.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_paddle_loop_on_cpu_trains(capsys):
    pytest.importorskip("paddle")
    page = blocks()
    last = next(i for i, b in enumerate(page) if "from polyamp.compat.paddle import GradScaler" in b
                and "paddle.nn.Linear" in b)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paddle: "amp_guard ... makes no effect" on CPU
        for code in page[: last + 1]:  # the data block and paddle's own loop come first
            exec(compile(code, str(PAGE), "exec"), namespace)
    assert float(namespace["loss"]) < 1e-2
    assert namespace["scaler"].is_enable() and "loss" in capsys.readouterr().out


def test_numpy_loop_converges():
    code = next(b for b in blocks() if "polyamp.optim" in b)
    namespace: dict = {}
    exec(compile(code, str(PAGE), "exec"), namespace)
    w, target = namespace["w"], namespace["target"]
    assert abs(w.data - target).max() < 1e-4


def test_the_page_says_what_a_step_on_unscaled_gradients_does():
    """Issue 32 item 15: the facade follows paddle there (divides and applies); the page says so and
    names the differential test that holds it against paddle."""
    text = " ".join(PAGE.read_text().split())
    assert "on gradients that `scale()` never scaled" in text and "as paddle does" in text
    test = "test_a_step_on_unscaled_gradients_matches_paddle"
    assert test in text
    tests = PAGE.parents[1] / "tests" / "compat" / "test_paddle_differential.py"
    assert f"def {test}(" in tests.read_text()
