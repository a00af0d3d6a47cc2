"""The engine as people first type it: config fields as keywords, Python numbers scaled to floats."""

from __future__ import annotations

import numpy as np
import pytest

import polyamp
from polyamp import LossScaleConfig, LossScaler, NoOpLossScaler, make_scaler


def test_config_fields_as_keywords_build_the_config():
    scaler = LossScaler(init_scale=1024, growth_interval=100, backend="numpy")
    assert scaler.config == LossScaleConfig(init_scale=1024, growth_interval=100)
    assert scaler.get_scale() == 1024.0
    assert make_scaler(init_scale=8).config.init_scale == 8
    assert make_scaler(enabled=False, init_scale=8).config == LossScaleConfig(init_scale=8)


def test_keywords_follow_the_same_rule_as_the_config():
    scaler = LossScaler(init_scale=4.0, growth_interval=1, growth_factor=4.0)
    grads = [np.ones(3, np.float32)]
    scaler.step(grads, lambda: None)
    scaler.update()
    assert scaler.get_scale() == 16.0


def test_a_config_and_fields_together_are_refused():
    with pytest.raises(TypeError, match=r"both config= and the config field\(s\) init_scale, dynamic"):
        LossScaler(LossScaleConfig(), init_scale=1024, dynamic=False)
    with pytest.raises(TypeError, match="both config="):
        NoOpLossScaler(LossScaleConfig(), init_scale=1024)


def test_an_unknown_keyword_is_named_with_the_valid_ones():
    with pytest.raises(TypeError) as info:
        LossScaler(init_scal=1024)
    message = str(info.value)
    assert "'init_scal'" in message
    assert "init_scale, growth_factor, backoff_factor, growth_interval" in message


def test_a_bad_field_value_names_the_field():
    with pytest.raises(polyamp.ConfigError, match="growth_interval=0"):
        LossScaler(growth_interval=0)


@pytest.mark.parametrize("backend", [None, "numpy"])
def test_a_python_number_scales_to_a_python_float(backend):
    scaler = LossScaler(init_scale=1024, backend=backend)
    out = scaler.scale(2.0)
    assert type(out) is float and out == 2048.0
    assert type(scaler.scale(3)) is float and scaler.scale(3) == 3072.0
    nested = scaler.scale([1.5, (2.0,)])
    assert nested == [1536.0, (2048.0,)] and type(nested[0]) is float


def test_numpy_values_keep_their_numpy_type():
    scaler = LossScaler(init_scale=1024)
    assert type(scaler.scale(np.float32(2.0))) is np.float32
    out = scaler.scale(np.ones(2, np.float16))
    assert isinstance(out, np.ndarray) and out.dtype == np.float16
