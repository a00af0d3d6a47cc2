"""LossScaler: the four verbs over every backend, checkpoints, and failure leaving state intact."""

from __future__ import annotations

import gzip
import json
import math
import os

import numpy as np
import pytest

import polyamp
from polyamp import LossScaleConfig, LossScaler, ScalerStateError, StateDictError


def _grads(make_array, values):
    return [make_array(np.asarray(v, dtype=np.float32)) for v in values]


def test_scale_unscale_step_update(backend_name, make_array, to_numpy):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2))
    loss = make_array(np.float32(1.5))
    assert float(to_numpy(scaler.scale(loss))) == 12.0
    assert scaler.backend.name == backend_name
    grads = _grads(make_array, [[8.0, 16.0], [4.0]])
    calls = []
    result = scaler.step(grads, lambda: calls.append(1))
    assert result and result.applied and not result.skipped and calls == [1]
    assert scaler.host_state() == (8.0, 0, 0)  # step does not update
    scaler.update()
    assert [to_numpy(g).tolist() for g in grads] == [[1.0, 2.0], [0.5]]
    assert float(to_numpy(result.scale_before)) == 8.0 and scaler.host_state() == (8.0, 1, 0)
    grads = _grads(make_array, [[8.0, 16.0]])
    scaler.step(grads, lambda: calls.append(2))
    scaler.update()
    assert scaler.get_scale() == 16.0 and scaler.host_state().growth_tracker == 0


def test_overflow_skips_and_backs_off(backend_name, make_array, to_numpy):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    scaler.scale(make_array(np.float32(1.0)))
    for bad in (np.inf, -np.inf, np.nan):
        calls: list[int] = []
        result = scaler.step(_grads(make_array, [[1.0], [2.0, bad]]), lambda c=calls: c.append(1))
        assert result.skipped and not result and calls == []
        scaler.update()
        assert scaler.get_scale() == float(to_numpy(result.scale_before)) / 2
    assert scaler.skipped_steps == 3 and scaler.steps == 3


def test_backoff_interval_absorbs_overflows(backend_name, make_array):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, backoff_interval=3))
    for expected in (8.0, 8.0, 4.0, 4.0):
        scaler.step(_grads(make_array, [[np.inf]]), lambda: None)
        scaler.update()
        assert scaler.get_scale() == expected


def test_update_without_check_is_an_error():
    scaler = LossScaler()
    with pytest.raises(ScalerStateError, match="no inf checks"):
        scaler.update()


def test_recorded_flags_accumulate(make_array, backend_name, to_numpy):
    scaler = LossScaler(LossScaleConfig(init_scale=4.0))
    grads = _grads(make_array, [[4.0]])
    flag = scaler.unscale_(grads)
    assert float(to_numpy(flag)) == 0.0 and scaler.has_pending_check
    scaler.record_found_inf(flag + 1)
    scaler.update()
    assert scaler.get_scale() == 2.0 and not scaler.has_pending_check


def test_dynamic_false_keeps_scale_but_skips(backend_name, make_array):
    scaler = LossScaler(LossScaleConfig(init_scale=4.0, growth_interval=1, dynamic=False))
    assert scaler.step(_grads(make_array, [[np.inf]]), lambda: None).skipped
    scaler.update()
    assert not scaler.step(_grads(make_array, [[1.0]]), lambda: None).skipped
    scaler.update()
    assert scaler.get_scale() == 4.0


def test_state_dict_round_trip_every_field(backend_name, make_array):
    config = LossScaleConfig(
        init_scale=32.0, growth_interval=3, backoff_interval=2, min_scale=1.0, max_scale=2.0**20
    )
    scaler = LossScaler(config)
    for g in ([1.0], [np.inf], [2.0], [2.0]):
        scaler.step(_grads(make_array, [g]), lambda: None)
        scaler.update()
    sd = scaler.state_dict()
    json.dumps(sd)  # JSON-safe
    other = LossScaler()
    other.load_state_dict(sd)
    assert other.state_dict() == sd and other.config == config
    assert sd["growth_tracker"] == 2 and sd["steps"] == 4 and sd["skipped_steps"] == 1


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda sd: sd.update(version=99), "version"),
        (lambda sd: sd.update(format="torch"), "format"),
        (lambda sd: sd.update(scale=-1.0), "scale"),
        (lambda sd: sd.update(scale=math.inf), "scale"),
        (lambda sd: sd.update(growth_tracker=-2), "growth_tracker"),
        (lambda sd: sd["config"].update(growth_factor=0.5), "growth_factor"),
        (lambda sd: sd.pop("backoff_tracker"), "backoff_tracker"),
    ],
)
def test_bad_state_dict_changes_nothing(mutate, message):
    scaler = LossScaler(LossScaleConfig(init_scale=16.0))
    scaler.step([np.ones(2, np.float32)], lambda: None)
    scaler.update()
    before = scaler.state_dict()
    bad = json.loads(json.dumps(before))
    mutate(bad)
    with pytest.raises(StateDictError, match=message):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before


def test_save_load_atomic_and_gzip(tmp_path):
    scaler = LossScaler(LossScaleConfig(init_scale=64.0, growth_interval=1))
    scaler.step([np.ones(3, np.float32)], lambda: None)
    scaler.update()
    for name in ("ckpt.json", "ckpt.json.gz"):
        path = tmp_path / name
        scaler.save(path)
        raw = path.read_bytes()
        assert (raw[:2] == b"\x1f\x8b") == name.endswith(".gz")
        loaded = LossScaler()
        loaded.load(path)
        assert loaded.state_dict() == scaler.state_dict()
    assert sorted(os.listdir(tmp_path)) == ["ckpt.json", "ckpt.json.gz"]  # no temp files left
    assert json.loads(gzip.decompress((tmp_path / "ckpt.json.gz").read_bytes()))["scale"] == 128.0


def test_failed_save_keeps_old_checkpoint(tmp_path):
    path = tmp_path / "ckpt.json"
    scaler = LossScaler()
    scaler.save(path)
    original = path.read_bytes()

    class Unserialisable(LossScaler):
        def state_dict(self):
            return {"x": object()}

    with pytest.raises(TypeError):
        Unserialisable().save(path)
    assert path.read_bytes() == original and os.listdir(tmp_path) == ["ckpt.json"]


def test_noop_scaler():
    scaler = polyamp.make_scaler(enabled=False)
    assert isinstance(scaler, polyamp.NoOpLossScaler)
    x = np.ones(2)
    assert scaler.scale(x) is x and scaler.get_scale() == 1.0
    calls = []
    assert not scaler.step([x], lambda: calls.append(1)).skipped and calls == [1]
    scaler.update()
    assert scaler.state_dict() == {}


def test_config_type_is_checked():
    with pytest.raises(TypeError, match="LossScaleConfig"):
        LossScaler({"init_scale": 2.0})  # type: ignore[arg-type]


def test_reconfigure_validates_first():
    scaler = LossScaler()
    with pytest.raises(polyamp.ConfigError):
        scaler.reconfigure(backoff_factor=2.0)
    assert scaler.config == LossScaleConfig()


def test_update_accepts_a_host_bool(backend_name, make_array):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=1))
    scaler.scale(make_array(np.float32(1.0)))
    scaler.update(found_inf=True)
    assert scaler.get_scale() == 4.0
    scaler.update(found_inf=False)
    assert scaler.get_scale() == 8.0 and not scaler.has_pending_check
    assert scaler.backend.name == backend_name


def test_host_bool_update_before_any_array_binds_no_backend():
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2))
    scaler.update(found_inf=False)
    scaler.update(found_inf=True)
    assert scaler.backend is None and scaler.state is None
    assert scaler.host_state() == (4.0, 0, 0)
    scaler.scale(np.float32(1.0))
    assert scaler.backend.name == "numpy" and scaler.get_scale() == 4.0
