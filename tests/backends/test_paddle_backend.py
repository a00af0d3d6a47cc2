"""The paddle backend plugin: each kernel against NumPy and against polyamp.policy.next_host_state."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polyamp
from polyamp import HostState, LossScaleConfig, LossScaleState, next_host_state

paddle = pytest.importorskip("paddle")


@pytest.fixture(scope="module")
def backend():
    return polyamp.get_backend("paddle")


def _t(values, dtype="float32"):
    return paddle.to_tensor(np.asarray(values, dtype=np.float32)).astype(dtype)


def test_plugin_is_found_without_importing_paddle():
    code = (
        "import sys, numpy as np, polyamp\n"
        "from polyamp.backends import paddle as plugin\n"
        "info = {i.name: i for i in polyamp.available_backends()}['paddle']\n"
        "assert info.available and info.version, info\n"
        "assert not plugin.owns_array(np.zeros(2))\n"
        "print('paddle' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_owns_paddle_tensors_only(backend):
    torch = pytest.importorskip("torch")
    assert backend.owns_array(paddle.zeros([2]))
    assert not backend.owns_array(np.zeros(2)) and not backend.owns_array(torch.zeros(2))
    for other in ("numpy", "torch", "array_api"):
        assert not polyamp.get_backend(other).owns_array(paddle.zeros([2])), other
    assert polyamp.LossScaler().bind(paddle.zeros([1])).name == "paddle"


def test_full_makes_0d_arrays_of_the_dtype(backend):
    scale = backend.full(1024.0, "float32", paddle.zeros([3]))
    tracker = backend.full(3, "int32", scale)
    assert list(scale.shape) == [] and scale.dtype == paddle.float32 and scale.item() == 1024.0
    assert tracker.dtype == paddle.int32 and backend.to_host(tracker) == 3
    assert backend.full(0.0, "float32", None).place == paddle.zeros([1]).place


def test_float32_unscale_is_bitwise_numpys(backend):
    rng = np.random.default_rng(0)
    numpy_backend = polyamp.get_backend("numpy")
    for scale_value in (2.0**16, 3.0, 1234.567, 2.0**-3):
        values = [rng.standard_normal(s).astype(np.float32) * 1e3 for s in ((5, 4), (7,))]
        ours = [paddle.to_tensor(v) for v in values]
        theirs = [v.copy() for v in values]
        found = backend.full(0.0, "float32", ours[0])
        backend.unscale_and_check(ours, backend.full(scale_value, "float32", found), found)
        np_found = numpy_backend.full(0.0, "float32", None)
        numpy_backend.unscale_and_check(theirs, np.asarray(np.float32(scale_value)), np_found)
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(a.numpy(), b)
        assert not backend.read_flag(found) and not numpy_backend.read_flag(np_found)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_overflow_sets_the_flag_in_every_dtype(backend, bad, dtype):
    grads = [_t([1.0, 2.0], dtype), _t([3.0, bad], dtype)]
    found = backend.full(0.0, "float32", grads[0])
    backend.unscale_and_check(grads, backend.full(4.0, "float32", found), found)
    assert backend.read_flag(found) and backend.to_host(found) == 1.0


def test_flag_is_never_cleared(backend):
    found = backend.full(1.0, "float32", None)
    backend.unscale_and_check([_t([8.0])], backend.full(2.0, "float32", found), found)
    assert backend.read_flag(found)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_other_dtypes_unscale_in_float32_in_place(backend, dtype):
    grad = _t([8.0, 24.0, 1.0], dtype)
    found = backend.full(0.0, "float32", grad)
    backend.unscale_and_check([grad], backend.full(8.0, "float32", found), found)
    assert str(grad.dtype).endswith(dtype)
    np.testing.assert_array_equal(grad.astype("float32").numpy(), [1.0, 3.0, 0.125])
    assert not backend.read_flag(found)


def test_unscales_a_parameters_real_gradient_in_place(backend):
    param = paddle.create_parameter([3], "float32")
    (param * _t([4.0, 8.0, 12.0])).sum().backward()
    found = backend.full(0.0, "float32", param)
    backend.unscale_and_check([param._grad_ivar()], backend.full(4.0, "float32", found), found)
    np.testing.assert_array_equal(param.grad.numpy(), [1.0, 2.0, 3.0])


def test_scale_array_keeps_dtype_and_autograd(backend):
    scale = backend.full(1024.0, "float32", None)
    param = paddle.create_parameter([2], "float32")
    scaled = backend.scale_array((param * _t([1.0, 3.0])).sum(), scale)
    scaled.backward()
    np.testing.assert_array_equal(param.grad.numpy(), [1024.0, 3072.0])
    half = backend.scale_array(_t([60.0], "float16"), scale)  # 61440 fits float16
    assert half.dtype == paddle.float16 and half.astype("float32").item() == 61440.0
    with pytest.raises(TypeError, match="floating-point tensor, got dtype=int32"):
        backend.scale_array(paddle.to_tensor([1], dtype="int32"), scale)


def test_all_finite_cast_and_flags(backend):
    assert bool(backend.all_finite([_t([1.0]), _t([2.0, 3.0])]))
    assert not bool(backend.all_finite([_t([1.0]), _t([np.nan])]))
    assert bool(backend.all_finite([]))
    assert backend.cast(_t([1.5]), "bfloat16").dtype == paddle.bfloat16
    assert backend.cast(_t([1.5]), "float16").dtype == paddle.float16
    with pytest.raises(ValueError, match="or 'bfloat16', got dtype='int8'"):
        backend.cast(_t([1.5]), "int8")


@st.composite
def paddle_configs(draw):
    return LossScaleConfig(
        init_scale=draw(st.sampled_from([2.0**16, 3.0, 7.0, 12345.678, 2.0**-3])),
        growth_factor=draw(st.sampled_from([2.0, 1.1, 3.0])),
        backoff_factor=draw(st.sampled_from([0.5, 0.1, 0.3, 0.7])),
        growth_interval=draw(st.integers(1, 4)),
        backoff_interval=draw(st.integers(1, 3)),
        min_scale=draw(st.sampled_from([None, 1.0])),
        dynamic=draw(st.booleans()),
        product_dtype=draw(st.sampled_from(["float32", "float64"])),
    )


@settings(max_examples=60 * settings.default.max_examples // 100, deadline=None)
@given(config=paddle_configs(), overflows=st.lists(st.booleans(), min_size=1, max_size=25))
def test_update_matches_next_host_state(backend, config, overflows):
    like = paddle.zeros([])
    state = LossScaleState(*(backend.full(v, d, like) for v, d in
                             [(config.init_scale, "float32"), (0, "int32"), (0, "int32")]))
    host = HostState(float(np.float32(config.init_scale)))
    for found in overflows:
        state = backend.update_scale(state, backend.full(float(found), "float32", like), config)
        host = next_host_state(host, found, config)
        assert tuple(backend.to_host(a) for a in state) == tuple(host)
        assert [str(a.dtype) for a in state] == ["paddle.float32", "paddle.int32", "paddle.int32"]
        assert all(list(a.shape) == [] for a in state)


@pytest.mark.parametrize("start, ratio", [(7.0, 0.3), (12345.678, 1.1)])
def test_float32_product_is_paddles_own_multiply(backend, start, ratio):
    """paddle's dygraph _update computes ``scale * ratio`` on a float32 tensor: the same bits."""
    grow = ratio > 1
    config = LossScaleConfig(
        init_scale=start, product_dtype="float32", growth_interval=1,
        growth_factor=ratio if grow else 2.0, backoff_factor=0.5 if grow else ratio,
    )
    state = LossScaleState(backend.full(start, "float32", None), *(backend.full(0, "int32", None),) * 2)
    state = backend.update_scale(state, backend.full(0.0 if grow else 1.0, "float32", None), config)
    paddles = (paddle.to_tensor(np.array([start], np.float32)) * ratio).numpy()[0]
    assert np.float32(backend.to_host(state.scale)) == paddles
    assert np.float32(np.float64(np.float32(start)) * ratio) != paddles  # float64 would differ
