"""docs/coming-from-torch.md: its loop runs as written, and the scaler in it is polyamp's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "coming-from-torch.md"


def test_the_drop_in_loop_runs_and_trains(capsys):
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert blocks
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), namespace)
    import polyamp

    assert type(namespace["scaler"]) is polyamp.GradScaler
    assert namespace["loss"].item() < 1e-2
    assert namespace["scaler"].get_scale() == 2.0**13  # grew at steps 20, 40 and 60
    assert "skipped 0" in capsys.readouterr().out
