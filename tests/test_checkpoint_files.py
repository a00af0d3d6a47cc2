"""Checkpoint files written by earlier commits load with today's code (tests/data/checkpoints).

Each ``<commit>-expected.json`` was written by tools/write_checkpoint_fixtures.py with that
commit's polyamp, beside the files: what that commit's own API said after training (scale,
trackers, counters, config, StepGuard histories, the facades' state dicts). Today's
``LossScaler.load``, the facades' ``load_state_dict`` and ``polyamp inspect`` must read the same.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

import polyamp
from polyamp.cli import main as cli_main

DATA = Path(__file__).parent / "data" / "checkpoints"
SIDECARS = sorted(DATA.glob("*-expected.json"))
CASES = [(name, entry, sidecar.name) for sidecar in SIDECARS
         for name, entry in sorted(json.loads(sidecar.read_text())["files"].items())]
FIXTURE_FILES = {p.name for p in DATA.iterdir()} - {"README.md"} - {p.name for p in SIDECARS}


def _cases(*kinds: str) -> list[Any]:
    return [pytest.param(name, entry, id=name) for name, entry, _ in CASES
            if entry["kind"].split(" in ")[0] in kinds]


def _plain(value: Any) -> Any:
    """A state dict as JSON values (arrays, tensors and NumPy scalars as lists and numbers)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.tolist() if hasattr(value, "tolist") else value


def _guard(entry: dict[str, Any]) -> dict[str, Any]:
    return {"guard": polyamp.StepGuard(**entry["guard_config"])} if "guard" in entry else {}


def _engine_values(entry: dict[str, Any]) -> dict[str, Any]:
    """Scale, trackers and counters the writing commit reported, in the engine's names; a torch
    state dict holds ``_backoff_tracker`` only where it is not 0 (None: not in the file)."""
    kind = entry["kind"]
    if kind.startswith("LossScaler"):
        return {k: entry[k] for k in ("scale", "growth_tracker", "backoff_tracker", "steps", "skipped_steps")}
    backoff = (entry["state_dict"].get("_backoff_tracker") if kind.startswith("torch")
               else entry["backoff_tracker"])
    return {"scale": entry["scale"], "growth_tracker": entry["growth_tracker"], "backoff_tracker": backoff,
            "steps": None, "skipped_steps": None}


def _config_values(entry: dict[str, Any]) -> dict[str, Any]:
    """The config fields the file holds, as the writing commit reported them."""
    if entry["kind"].startswith("LossScaler"):
        return entry["config"]
    sd = entry["state_dict"]
    if entry["kind"].startswith("torch"):
        held = {"growth_factor": entry["growth_factor"], "backoff_factor": entry["backoff_factor"],
                "growth_interval": entry["growth_interval"]}
    else:
        held = {"growth_factor": entry["incr_ratio"], "backoff_factor": entry["decr_ratio"],
                "growth_interval": entry["incr_every_n_steps"],
                "backoff_interval": entry["decr_every_n_nan_or_inf"],
                "dynamic": entry["use_dynamic_loss_scaling"]}
    return held | {k: sd[k] for k in ("backoff_interval", "min_scale", "max_scale") if k in sd}


def _torch_load(path: Path) -> Any:
    torch = pytest.importorskip("torch")
    return torch.load(path, map_location="cpu", weights_only=True)


# -- the folder ---------------------------------------------------------------------------
def test_every_file_has_its_recorded_values_and_the_folder_stays_small():
    listed = [name for name, _, _ in CASES]
    assert SIDECARS, f"no *-expected.json in {DATA}"
    assert len(listed) == len(set(listed))
    assert set(listed) == FIXTURE_FILES  # no file untested, no entry without its file
    for name, _, sidecar in CASES:
        assert name.split("-")[0] == sidecar.split("-")[0]  # each commit's sidecar lists its own files
    readme = (DATA / "README.md").read_text()
    for sidecar in SIDECARS:
        assert json.loads(sidecar.read_text())["meta"]["commit"][:7] in readme
    assert sum(p.stat().st_size for p in DATA.iterdir()) < 200 * 1024


# -- LossScaler ---------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "entry"), _cases("LossScaler.save", "LossScaler.state_dict"))
def test_loss_scaler_loads_the_file(name, entry):
    scaler = polyamp.LossScaler(**_guard(entry))
    if entry["kind"] == "LossScaler.save":
        scaler.load(DATA / name)
    else:
        scaler.load_state_dict(_torch_load(DATA / name)["scaler"])
    host = scaler.host_state()
    got = {"scale": host.scale, "growth_tracker": host.growth_tracker,
           "backoff_tracker": host.backoff_tracker, "steps": scaler.steps,
           "skipped_steps": scaler.skipped_steps}
    assert got == _engine_values(entry)
    config, defaults = scaler.config.to_dict(), polyamp.LossScaleConfig().to_dict()
    assert {k: config[k] for k in entry["config"]} == entry["config"]
    for field in set(config) - set(entry["config"]):  # fields added since: their defaults
        assert config[field] == defaults[field], field
    if "guard" in entry:
        assert scaler.guard_history.to_dict() == entry["guard"]


@pytest.mark.parametrize(("name", "entry"),
                         [p for p in _cases("LossScaler.save") if "guard" not in p.values[1]])
def test_a_file_without_guard_histories_gives_a_guarded_scaler_empty_ones(name, entry):
    scaler = polyamp.LossScaler(guard=polyamp.StepGuard(loss_zscore=3.0, window=4, min_history=2))
    scaler.load(DATA / name)
    assert scaler.guard_history == polyamp.GuardHistory()
    assert scaler.host_state().scale == entry["scale"]


# -- the torch facade -----------------------------------------------------------------------
@pytest.mark.parametrize(("name", "entry"), _cases("torch GradScaler.state_dict"))
def test_torch_facade_loads_the_file(name, entry):
    from polyamp.compat.torch import GradScaler

    path = DATA / name
    state = json.loads(path.read_text()) if name.endswith(".json") else _torch_load(path)
    scaler = GradScaler("cpu", **_guard(entry))
    scaler.load_state_dict(state)
    got = {"scale": scaler.get_scale(), "growth_tracker": scaler._get_growth_tracker(),
           "growth_factor": scaler.get_growth_factor(), "backoff_factor": scaler.get_backoff_factor(),
           "growth_interval": scaler.get_growth_interval()}
    assert got == {k: entry[k] for k in got}
    assert _plain(scaler.state_dict()) == entry["state_dict"]  # the same keys and values, histories too


# -- the paddle facade ----------------------------------------------------------------------
@pytest.mark.parametrize(("name", "entry"), [p for p in _cases("paddle GradScaler.state_dict")
                                             if not p.values[0].endswith(".json")])
def test_paddle_facade_loads_the_file(name, entry):
    from polyamp.compat.paddle import GradScaler

    path = DATA / name
    if name.endswith(".pdparams"):
        paddle = pytest.importorskip("paddle")
        state = paddle.load(str(path))  # scale as a paddle Tensor
    else:
        with open(path, "rb") as f:
            state = pickle.load(f)  # a file this repository wrote: scale as a NumPy array
    scaler = GradScaler(**_guard(entry))
    scaler.load_state_dict(state)
    got = {"incr_ratio": scaler.get_incr_ratio(), "decr_ratio": scaler.get_decr_ratio(),
           "incr_every_n_steps": scaler.get_incr_every_n_steps(),
           "decr_every_n_nan_or_inf": scaler.get_decr_every_n_nan_or_inf(),
           "use_dynamic_loss_scaling": scaler.is_use_dynamic_loss_scaling()}
    assert got == {k: entry[k] for k in got}
    saved = _plain(scaler.state_dict())
    assert saved == entry["state_dict"]  # scale, counts, extras and histories
    assert (saved["scale"], saved["incr_count"], saved["decr_count"]) == (
        [entry["scale"]], entry["growth_tracker"], entry["backoff_tracker"])


# -- polyamp inspect ------------------------------------------------------------------------
def _inspect(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any, str]:
    capsys.readouterr()
    status = cli_main(["inspect", "--json", str(path)])
    out, err = capsys.readouterr()
    return status, json.loads(out) if status == 0 else None, err


@pytest.mark.parametrize(("name", "entry"), [pytest.param(n, e, id=n) for n, e, _ in CASES])
def test_inspect_shows_the_recorded_values(name, entry, capsys):
    path = DATA / name
    if name.endswith(".pt"):
        pytest.importorskip("torch")
    status, found, err = _inspect(path, capsys)
    if name.endswith((".pkl", ".pdparams")):
        # inspect promises JSON and torch.save files only: a raw pickle is refused in one line
        # naming the file (never unpickled fully), or read through torch's restricted unpickler
        if status != 0:
            assert status == 2 and err.count("\n") == 1 and repr(str(path)) in err, err
            return
    assert status == 0, err
    if isinstance(found, list):
        assert len(found) == 1
        found = found[0]
        assert found["where"] == entry.get("where", "checkpoint")
    expected = _engine_values(entry)
    if expected["backoff_tracker"] is None:  # not in the file: loaded as 0, or shown as not saved
        assert found["backoff_tracker"] in (0, None)
        del expected["backoff_tracker"]
    assert {k: found[k] for k in expected} == expected
    config = _config_values(entry)
    assert {k: found["config"][k] for k in config} == config


def test_the_recorded_configs_name_only_fields_that_exist_today():
    known = {f.name for f in dataclasses.fields(polyamp.LossScaleConfig)}
    for _, entry, _ in CASES:
        assert set(_config_values(entry)) <= known
