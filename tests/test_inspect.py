"""``polyamp inspect PATH``: polyamp checkpoints (.gz too), torch- and paddle-facade state dicts
saved as JSON, ``--json``; exit 2 with one line for anything else, never executing the file."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from polyamp import LossScaleConfig, LossScaler, _inspect
from polyamp.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyamp", "inspect", *args], capture_output=True,
                          text=True, timeout=120)


def trained_scaler() -> LossScaler:
    scaler = LossScaler(LossScaleConfig(init_scale=1024.0, growth_interval=10, backoff_interval=3))
    for bad in (False, True, False):
        scaler.step([np.array([np.inf if bad else 1.0], np.float32)], lambda: None)
        scaler.update()
    return scaler


@pytest.mark.parametrize("name", ["ckpt.json", "ckpt.json.gz"])
def test_polyamp_checkpoint_text_and_json(tmp_path, name, capsys):
    path = tmp_path / name
    scaler = trained_scaler()
    scaler.save(path)
    host = scaler.host_state()
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "format:   polyamp.LossScaler version 1" in text
    assert f"scale:    {host.scale:g}" in text
    assert f"trackers: growth {host.growth_tracker}, backoff {host.backoff_tracker}" in text
    assert "counters: 3 steps, 1 skipped" in text and "backoff_interval=3" in text
    assert main(["inspect", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps"] == 3 and data["skipped_steps"] == 1 and data["scale"] == host.scale
    assert data["config"]["growth_interval"] == 10


def test_torch_facade_state_dict_as_json(tmp_path, capsys):
    from polyamp.compat.torch import GradScaler

    path = tmp_path / "torch.json"
    scaler = GradScaler("cpu", init_scale=256.0, growth_interval=7, backend="numpy")
    path.write_text(json.dumps(scaler.state_dict()))
    assert main(["inspect", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "torch GradScaler state_dict (JSON)" and data["scale"] == 256.0
    assert data["config"]["growth_interval"] == 7 and data["steps"] is None


def test_paddle_facade_state_dict_as_json(tmp_path, capsys):
    from polyamp.compat.paddle import GradScaler

    state = GradScaler(init_loss_scaling=512.0, decr_every_n_nan_or_inf=2, backend="numpy").state_dict()
    state["scale"] = state["scale"].tolist()  # paddle's 1-element array, as JSON
    path = tmp_path / "paddle.json"
    path.write_text(json.dumps(state))
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "paddle GradScaler state_dict (JSON)" in text and "scale:    512" in text
    assert "backoff_interval=2" in text and "not saved in this format" in text


class Boom:
    """Unpickling it writes ``marker``: the file exists only if a pickle's code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "x"))


@pytest.mark.parametrize(("content", "words"), [
    (None, "No such file"),
    ("dir", "is a directory"),
    (b"\x00\x01garbage", "not valid JSON"),
    (json.dumps([1, 2]).encode(), "holds JSON list"),
    (json.dumps({"a": 1}).encode(), "not a checkpoint polyamp can load"),
    (json.dumps({"format": "polyamp.LossScaler", "version": 1, "config": {}, "scale": -1.0,
                 "growth_tracker": 0, "backoff_tracker": 0}).encode(), "scale"),
    (json.dumps({"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 0,
                 "_growth_tracker": 0}).encode(), "growth_interval"),
    ("pickle", "torch.load(weights_only=True)"),  # read as a torch.save file, never fully unpickled
])
def test_anything_else_exits_2_with_one_line(tmp_path, content, words):
    path, marker = tmp_path / "x", tmp_path / "executed"  # this test's own: no run leaves it for another
    if content == "dir":
        path.mkdir()
    elif content == "pickle":
        path.write_bytes(pickle.dumps(Boom(marker)))
    elif content is not None:
        path.write_bytes(content)
    out = _run(str(path))
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("polyamp inspect: error: ") and words in lines[0]
    assert not marker.exists()  # nothing in the file ran


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_device_is_refused_before_it_is_opened(tmp_path, kind):
    path = tmp_path / "pipe"
    if kind == "fifo":
        os.mkfifo(path)  # no writer: opening it for reading would block for ever
    else:
        path = Path(os.devnull)
    out = subprocess.run([sys.executable, "-m", "polyamp", "inspect", str(path)], capture_output=True,
                         text=True, timeout=20)
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("polyamp inspect: error: ") and repr(str(path)) in line
    assert ("a FIFO (named pipe)" if kind == "fifo" else "a device") in line and "not a regular file" in line


def test_a_nul_in_the_path_is_a_clean_error(capsys):
    assert main(["inspect", "a\0b.json"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert captured.out == "" and line.startswith("polyamp inspect: error: ")
    assert repr("a\0b.json") in line and "NUL" in line and "Fix:" in line


def test_the_docs_say_torch_save_files_are_read_safely():
    page = (Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md").read_text()
    section = " ".join(page.split("## Inspecting a checkpoint", 1)[1].split("\n## ", 1)[0].split())
    assert "torch.load(weights_only=True)" in section and "a pickle, is refused" not in section
    assert f"{_inspect.MAX_DEPTH} levels" in section and f"{_inspect.MAX_ITEMS:,} items" in section


def test_a_json_torch_state_says_which_fields_it_does_not_hold(tmp_path, capsys):
    from polyamp.compat.torch import GradScaler

    path = tmp_path / "torch.json"
    path.write_text(json.dumps(GradScaler("cpu", init_scale=256.0, backend="numpy").state_dict()))
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "init_scale=" not in text and "trackers: growth 0, backoff not saved in this format" in text
    (unsaved,) = [line for line in text.splitlines() if "not saved in this format:" in line]
    assert "init_scale" in unsaved and "rule" in unsaved and "growth_interval" not in unsaved
