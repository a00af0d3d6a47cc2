"""LossScaleConfig validation and serialisation."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from polyamp import ConfigError, LossScaleConfig


@pytest.mark.parametrize(
    "field, value",
    [
        ("init_scale", 0.0), ("init_scale", -1.0), ("init_scale", math.inf), ("init_scale", "1"),
        ("growth_factor", 1.0), ("growth_factor", 0.5), ("growth_factor", math.inf),
        ("backoff_factor", 1.0), ("backoff_factor", 0.0), ("backoff_factor", 1.5),
        ("growth_interval", 0), ("growth_interval", 1.5), ("growth_interval", True),
        ("backoff_interval", 0), ("backoff_interval", "2"),
        ("min_scale", 0.0), ("max_scale", math.nan), ("dynamic", 1),
        ("product_dtype", "float16"),
    ],
)
def test_invalid_values_name_field_and_value(field, value):
    with pytest.raises(ConfigError) as info:
        LossScaleConfig(**{field: value})
    assert field in str(info.value) and repr(value) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_min_above_max_is_refused():
    with pytest.raises(ConfigError, match="min_scale must be <= max_scale"):
        LossScaleConfig(min_scale=4.0, max_scale=2.0)


def test_frozen_and_replace_validates():
    config = LossScaleConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.init_scale = 1.0  # type: ignore[misc]
    with pytest.raises(ConfigError):
        config.replace(growth_factor=0.9)
    assert config.replace(growth_interval=5).growth_interval == 5


def test_round_trip_covers_every_field():
    config = LossScaleConfig(
        init_scale=3.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7,
        backoff_interval=3, min_scale=1.0, max_scale=1024.0, dynamic=False, product_dtype="float64",
        rule="deepspeed", consecutive_hysteresis=True, raise_error_at_min_scale=True,
    )
    data = config.to_dict()
    assert set(data) == {f.name for f in dataclasses.fields(LossScaleConfig)}
    assert LossScaleConfig.from_dict(data) == config
    for f in dataclasses.fields(LossScaleConfig):  # every field is non-default above
        assert getattr(config, f.name) != f.default, f.name


def test_from_dict_refuses_unknown_keys():
    with pytest.raises(ConfigError, match="unknown LossScaleConfig field"):
        LossScaleConfig.from_dict({"init_scale": 2.0, "bogus": 1})


@pytest.mark.parametrize("field", ["init_scale", "min_scale", "max_scale"])
@pytest.mark.parametrize("value", [1e39, 1e-46, 1e-40, 10**400, float("nan"), float("inf"), 0.0, -1.0])
def test_scales_must_be_positive_normal_float32(field, value):
    with pytest.raises(ConfigError, match=f"{field} must be a positive normal float32 value"):
        LossScaleConfig(**{field: value})


def test_scale_range_ends_are_accepted():
    assert LossScaleConfig(init_scale=2.0**-126).init_scale == 2.0**-126
    assert LossScaleConfig(init_scale=float(np.finfo(np.float32).max)).init_scale > 3e38


# -- limits the device arithmetic sets (issue 15) ---------------------------------------------
@pytest.mark.parametrize("field", ["growth_interval", "backoff_interval"])
@pytest.mark.parametrize("value", [2**63, 10**30])
def test_intervals_beyond_int64_are_refused_with_the_fix(field, value):
    message = rf"{field} must be an int below 2\*\*63 .*Fix: pass e\.g\. {field}=2\*\*31"
    with pytest.raises(ConfigError, match=message):
        LossScaleConfig(**{field: value})


@pytest.mark.parametrize("backend", ["torch", "paddle", "numpy"])
def test_the_largest_interval_and_an_int_factor_run_on_each_device(backend):
    """2**63 - 1 compares as int64 everywhere; an int factor of 10**30 multiplies a float32 scale
    (torch refused to convert it: "int too big to convert") and overflows to inf, so the scale stays."""
    from polyamp import LossScaler

    lib = pytest.importorskip(backend)
    makers = {"torch": lambda: lib.ones(2), "paddle": lambda: lib.ones([2])}
    make = makers.get(backend, lambda: np.ones(2, "f4"))
    for kwargs in ({"growth_interval": 2**63 - 1, "backoff_interval": 2**63 - 1},
                   {"growth_factor": 10**30, "growth_interval": 1, "product_dtype": "float32"},
                   {"growth_factor": 10**30, "growth_interval": 1, "backoff_interval": 2}):
        scaler = LossScaler(LossScaleConfig(init_scale=2.0**100, **kwargs))
        scaler.step([make()], lambda: None)
        scaler.update()
        assert scaler.get_scale() == 2.0**100, kwargs  # 2**100 * 1e30 is past float32: kept


NUMPY_FIELDS = {  # every numeric field, as a NumPy scalar and as a 0-d array
    "init_scale": np.float32(1024), "growth_factor": np.float64(4), "backoff_factor": np.float32(0.25),
    "growth_interval": np.int64(3), "backoff_interval": np.int32(2), "min_scale": np.float16(1),
    "max_scale": np.float32(2.0**20),
}


@pytest.mark.parametrize("as_array", [False, True], ids=["scalar", "0-d array"])
def test_numpy_numbers_are_stored_as_python_numbers(as_array):
    given = {k: np.asarray(v) if as_array else v for k, v in NUMPY_FIELDS.items()}
    config = LossScaleConfig(**given)
    for name, value in config.to_dict().items():
        if name in given:
            kind = int if name.endswith("_interval") else float
            assert type(value) is kind and value == float(given[name]), (name, value)
    assert json.loads(json.dumps(config.to_dict())) == config.to_dict()
    assert LossScaleConfig().replace(init_scale=np.float32(8)).init_scale.__class__ is float


def test_numpy_numbers_that_are_not_numbers_of_the_field_are_still_refused():
    with pytest.raises(ConfigError, match="growth_interval must be an int"):
        LossScaleConfig(growth_interval=np.float64(3.0))
    with pytest.raises(ConfigError, match="init_scale must be a real number"):
        LossScaleConfig(init_scale=np.bool_(True))


def test_a_numpy_init_scale_saves_agrees_and_dumps(tmp_path):
    """LossScaler(init_scale=np.float32(1024)): save(), a reducer's first step and the facades'
    state_dict() through json all work (they raised 'not JSON serializable')."""
    from polyamp import LossScaler
    from polyamp.distributed import Reducer

    class OneRank(Reducer):  # a group of one process: the plugin contract, summing over itself
        def __init__(self):
            super().__init__("one", 0, 1, None)

        def _prepare(self, array):
            return array

        def _allreduce(self, buffer, op):
            pass

        def _barrier(self):
            pass

    scaler = LossScaler(init_scale=np.float32(1024))
    scaler.save(tmp_path / "scaler.json")
    loaded = LossScaler()
    loaded.load(tmp_path / "scaler.json")
    assert loaded.get_scale() == 1024.0 and type(loaded.config.init_scale) is float
    agreed = LossScaler(init_scale=np.float32(1024), reducer=OneRank())
    grads = [np.ones(3, np.float32)]
    assert agreed.step(grads, lambda: None)
    agreed.update()
    torch_facade = pytest.importorskip("polyamp.compat.torch")
    json.dumps(torch_facade.GradScaler("cpu", init_scale=np.float32(1024), growth_factor=np.float32(2),
                                       growth_interval=np.int64(5), backend="numpy").state_dict())
    paddle_facade = pytest.importorskip("polyamp.compat.paddle")
    paddle_state = paddle_facade.GradScaler(
        init_loss_scaling=np.float32(1024), incr_ratio=np.float32(2), decr_ratio=np.float32(0.5),
        incr_every_n_steps=np.int64(5), backend="numpy").state_dict()
    json.dumps({k: v for k, v in paddle_state.items() if k != "scale"})  # paddle's scale is an array


@pytest.mark.parametrize(("field", "value"), [
    ("init_scale", 0), ("init_scale", "x"), ("growth_factor", 1), ("growth_factor", "2"),
    ("backoff_factor", 1), ("backoff_factor", None), ("growth_interval", 0), ("growth_interval", 2**64),
    ("backoff_interval", 1.0), ("min_scale", 0.0), ("max_scale", float("inf")), ("dynamic", 1),
    ("product_dtype", "float16"), ("rule", "apex"), ("consecutive_hysteresis", 1),
    ("raise_error_at_min_scale", "yes"),
])
def test_each_fields_error_names_the_field_the_value_and_the_fix(field, value):
    """Most of the config's messages named the field and value but said no fix (review of issue 23)."""
    with pytest.raises(ConfigError) as caught:
        LossScaleConfig(**{field: value})
    message = str(caught.value)
    assert f"{field}={value!r}" in message and "Fix: " in message
    pairs = (({"min_scale": 4.0, "max_scale": 2.0}, "min_scale=4.0"),
             ({"rule": "megatron", "consecutive_hysteresis": True}, "consecutive_hysteresis=True"))
    for pair, named in pairs:
        with pytest.raises(ConfigError, match=f"{named}.*Fix: "):
            LossScaleConfig(**pair)
    with pytest.raises(ConfigError, match=r"\['rulez'\].*Fix: "):
        LossScaleConfig.from_dict({"rulez": 1})
