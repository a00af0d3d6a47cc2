"""Gradient utilities against a plain NumPy reference on every backend; the contiguous buffer."""

from __future__ import annotations

import math

import numpy as np
import pytest

import polyamp
from polyamp import GradBuffer, LossScaleConfig, LossScaler, ScaledGradientsError
from polyamp.grads import clip_grad_norm_, global_norm

RNG = np.random.default_rng(0)
SHAPES = [(3, 4), (5,), (), (2, 1, 3)]


@pytest.fixture
def make_array(make_array):
    """The backend fixture's array maker, for libraries array-api-compat supports (others skip)."""
    import array_api_compat

    sample = make_array(np.zeros(1, np.float32))
    if not array_api_compat.is_array_api_obj(sample):
        pytest.skip(f"{type(sample).__module__} arrays are not array-API arrays: polyamp.grads refuses them")
    return make_array


def _values(shapes=SHAPES, scale=1.0):
    return [np.asarray(RNG.standard_normal(s) * scale, dtype=np.float32) for s in shapes]


def _reference_norm(arrays):
    return math.sqrt(sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in arrays))


def test_global_norm_matches_numpy(make_array, to_numpy):
    values = _values()
    norm = global_norm([make_array(v) for v in values])
    assert float(to_numpy(norm)) == pytest.approx(_reference_norm(values), rel=1e-6)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_matches_numpy_reference(make_array, to_numpy, max_norm):
    values = _values(scale=3.0)
    grads = [make_array(v) for v in values]
    before = clip_grad_norm_(grads, max_norm)
    total = _reference_norm(values)
    assert float(to_numpy(before)) == pytest.approx(total, rel=1e-6)
    coef = min(1.0, max_norm / (total + 1e-6))
    for g, v in zip(grads, values):
        np.testing.assert_allclose(to_numpy(g), v * coef, rtol=1e-6)
    assert _reference_norm([to_numpy(g) for g in grads]) == pytest.approx(min(total, max_norm), rel=1e-5)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_clip_leaves_nonfinite_gradients_untouched(make_array, to_numpy, bad):
    values = _values()
    values[1][2] = bad
    grads = [make_array(v) for v in values]
    norm = float(to_numpy(clip_grad_norm_(grads, 0.1)))
    assert math.isnan(norm) if np.isnan(bad) else norm == math.inf
    for g, v in zip(grads, values):
        np.testing.assert_array_equal(to_numpy(g), v)


def test_float16_gradients_are_accumulated_wide():
    grads = [np.full(70000, 200.0, dtype=np.float16)]  # the float16 sum of squares overflows
    assert float(global_norm(grads)) == pytest.approx(200.0 * math.sqrt(70000), rel=1e-6)


# -- huge finite gradients: the norm must stay finite, clipping must clip ------------------------
def _hypot(arrays):
    """The exact-as-float64 L2 norm (math.hypot scales internally, so it cannot overflow)."""
    return math.hypot(*np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays]).tolist())


# float32 squares are exact in float64 and ~30 of them sum with relative error <= 30 * 2**-53
NORM_RTOL = 1e-12


@pytest.mark.parametrize("big", [3e19, 3e38])  # squares past float32's max; the norm itself too
def test_huge_finite_gradients_have_a_finite_norm_and_are_clipped(make_array, to_numpy, big):
    values = _values()
    values[0][1, 2] = big
    values[3][0, 0, 1] = -big
    grads = [make_array(v) for v in values]
    expected = _hypot(values)
    assert float(to_numpy(global_norm(grads))) == pytest.approx(expected, rel=NORM_RTOL)
    before = clip_grad_norm_(grads, 1.0)
    assert float(to_numpy(before)) == pytest.approx(expected, rel=NORM_RTOL)
    coef = 1.0 / (expected + 1e-6)  # rounded to float32 once, the product once: 2 * 2**-24
    for g, v in zip(grads, values):
        np.testing.assert_allclose(to_numpy(g), v * coef, rtol=2.5e-7, atol=0)
    assert _hypot([to_numpy(g) for g in grads]) == pytest.approx(1.0, rel=1e-6)


def test_float64_gradients_past_the_square_range_are_rescaled(make_array, to_numpy):
    huge = [np.array([3e200, -4e200, 1.0]), np.array([[1e199]])]
    assert float(to_numpy(global_norm([make_array(v) for v in huge]))) == pytest.approx(
        _hypot(huge), rel=NORM_RTOL)
    tiny = [np.full(10, 3e-320), np.zeros(3)]  # subnormal: their squares underflow to 0
    assert float(to_numpy(global_norm([make_array(v) for v in tiny]))) == pytest.approx(
        _hypot(tiny), rel=1e-3)  # 3e-320 holds ~14 significant bits
    for bad, expected in ((np.inf, math.inf), (-np.inf, math.inf), (np.nan, math.nan)):
        norm = float(to_numpy(global_norm([make_array(np.array([1e300, bad, 2.0]))])))
        assert norm == expected or (math.isnan(expected) and math.isnan(norm))


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_huge_bfloat16_gradients_have_a_finite_norm(library):
    values = np.array([1e30, -2e30, 3.0], np.float32)
    if library == "numpy":
        grads = [values.astype(pytest.importorskip("ml_dtypes").bfloat16)]
    else:
        grads = [pytest.importorskip("torch").tensor(values).bfloat16()]
    exact = _hypot([np.asarray(grads[0].tolist() if library == "torch" else grads[0], np.float64)])
    assert float(global_norm(grads)) == pytest.approx(exact, rel=NORM_RTOL)


def test_chunked_sum_matches_one_pass(monkeypatch, make_array, to_numpy):
    import polyamp.grads as grads_module

    values = _values(shapes=[(40,), (7, 3), (0,), (1,)], scale=5.0)
    values[1][2, 2] = 1e25
    expected = _hypot(values)
    for chunk in (1, 7, 21, 40, 2**20):
        monkeypatch.setattr(grads_module, "_CHUNK", chunk)
        norm = global_norm([make_array(v) for v in values])
        assert float(to_numpy(norm)) == pytest.approx(expected, rel=NORM_RTOL), chunk


def test_torch_clip_zeroes_huge_gradients_where_polyamp_clips():
    """torch.nn.utils.clip_grad_norm_ computes the norm in float32: inf, so it multiplies the
    gradients by max_norm / inf = 0 and the step runs with zero gradients (docs/training.md)."""
    torch = pytest.importorskip("torch")
    values = torch.tensor([3e19, 1.0, -2.0])
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = values.clone()
    assert torch.nn.utils.clip_grad_norm_([param], 1.0).item() == math.inf
    assert not param.grad.any()
    ours = values.clone()
    assert clip_grad_norm_([ours], 1.0).item() == pytest.approx(3e19, rel=1e-6)
    assert ours[0].item() == pytest.approx(1.0, rel=1e-6) and ours[1].item() != 0


def test_still_scaled_gradients_are_refused():
    scaler = LossScaler(LossScaleConfig(init_scale=1024.0))
    grads = [np.ones(3, np.float32) * 1024]
    scaler.scale(np.float32(1.0))
    with pytest.raises(ScaledGradientsError, match=r"unscale_\(grads\)"):
        clip_grad_norm_(grads, 1.0, scaler=scaler)
    with pytest.raises(ScaledGradientsError):
        global_norm(grads, scaler=scaler)
    scaler.unscale_(grads)
    assert float(global_norm(grads, scaler=scaler)) == pytest.approx(math.sqrt(3))
    scaler.update()
    with pytest.raises(ScaledGradientsError):  # the next iteration's gradients are scaled again
        global_norm(grads, scaler=scaler)
    assert float(global_norm(grads, scaler=polyamp.NoOpLossScaler())) == pytest.approx(math.sqrt(3))


def test_torch_facade_tracks_unscaling():
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = polyamp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(p.sum()).backward()
    with pytest.raises(ScaledGradientsError):
        clip_grad_norm_([p.grad], 1.0, scaler=scaler)
    scaler.unscale_(opt)
    assert float(clip_grad_norm_([p.grad], 1.0, scaler=scaler)) == pytest.approx(math.sqrt(3))


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, "1", True])
def test_bad_max_norm_is_named(bad):
    with pytest.raises(polyamp.ConfigError, match="max_norm"):
        clip_grad_norm_([np.ones(2, np.float32)], bad)


def test_empty_and_mixed_gradients_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(polyamp.ConfigError, match="no gradients"):
        global_norm([None])
    with pytest.raises(TypeError, match="one array-API library"):
        global_norm([np.ones(2, np.float32), torch.ones(2)])
    with pytest.raises(TypeError, match=r"\['builtins.list'\]"):
        clip_grad_norm_([[1.0, 2.0]], 1.0)


# -- the contiguous buffer -----------------------------------------------------------------
def test_buffer_views_share_memory_with_flat(make_array, to_numpy):
    buffer = GradBuffer(SHAPES, like=make_array(np.zeros(1, np.float32)))
    assert [tuple(v.shape) for v in buffer.views] == SHAPES
    assert buffer.flat.shape == (sum(math.prod(s) for s in SHAPES),)
    buffer.flat[...] = 1.0  # writes through the flat array show in every view ...
    assert all(bool(np.all(to_numpy(v) == 1.0)) for v in buffer.views)
    buffer.views[1][...] = 7.0  # ... and writes into a view show in the flat array
    flat = to_numpy(buffer.flat)
    assert flat[12:17].tolist() == [7.0] * 5 and flat[:12].tolist() == [1.0] * 12


def test_buffer_one_call_operations(make_array, to_numpy):
    buffer = GradBuffer(SHAPES, like=make_array(np.zeros(1, np.float32)))
    values = _values(scale=2.0)
    for view, v in zip(buffer.views, values):
        view[...] = make_array(v)
    flat_id = id(buffer.flat)
    assert float(to_numpy(buffer.norm())) == pytest.approx(_reference_norm(values), rel=1e-6)
    buffer.scale_(0.5)
    np.testing.assert_allclose(to_numpy(buffer.views[0]), values[0] * 0.5, rtol=1e-6)
    before = float(to_numpy(buffer.clip_(1.0)))
    assert before == pytest.approx(_reference_norm(values) / 2, rel=1e-6)
    assert float(to_numpy(buffer.norm())) == pytest.approx(1.0, rel=1e-5)
    buffer.zero_()
    assert id(buffer.flat) == flat_id and not np.any(to_numpy(buffer.flat))
    assert not np.any(to_numpy(buffer.views[3]))


def test_flat_array_is_one_gradient_for_the_scaler(make_array, to_numpy):
    buffer = GradBuffer(SHAPES, like=make_array(np.zeros(1, np.float32)))
    buffer.flat[...] = 4.0
    buffer.mark_scaled()
    with pytest.raises(ScaledGradientsError, match="buffer.unscale_"):
        buffer.clip_(1.0)
    scaler = LossScaler(LossScaleConfig(init_scale=4.0))
    found = buffer.unscale_(scaler)
    assert float(to_numpy(found)) == 0.0 and not buffer.scaled
    assert bool(np.all(to_numpy(buffer.views[2]) == 1.0))


def test_attach_makes_parameter_grads_views():
    params = [polyamp.Parameter(np.ones(s, np.float32)) for s in SHAPES]
    params[1].grad = np.full(5, 3.0, np.float32)
    buffer = GradBuffer.attach(params)
    assert all(np.shares_memory(p.grad, buffer.flat) for p in params)
    assert params[1].grad.tolist() == [3.0] * 5 and float(buffer.flat[:12].sum()) == 0.0
    params[0].grad = None  # e.g. optimizer.zero_grad(set_to_none=True)
    buffer.reattach()
    assert params[0].grad is buffer.views[0]


def test_attach_torch_parameters_receive_autograd():
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(3, 2)
    buffer = GradBuffer.attach(list(model.parameters()))
    model(torch.ones(4, 3)).sum().backward()  # autograd accumulates into the views
    assert float(buffer.flat.abs().sum()) > 0
    assert model.weight.grad.data_ptr() == buffer.flat.data_ptr()
    torch.testing.assert_close(model.bias.grad, torch.full((2,), 4.0))


def test_buffer_rejects_bad_shapes_and_mixed_dtypes():
    with pytest.raises(polyamp.ConfigError, match="shape"):
        GradBuffer([(2, -1)])
    with pytest.raises(polyamp.ConfigError, match="shapes=\\[\\]"):
        GradBuffer([])
    params = [polyamp.Parameter(np.ones(2, np.float32)), polyamp.Parameter(np.ones(2, np.float16))]
    with pytest.raises(polyamp.ConfigError, match="one floating dtype"):
        GradBuffer.attach(params)


def test_float16_and_bfloat16_buffers():
    pytest.importorskip("ml_dtypes")
    for dtype in ("float16", "bfloat16"):
        buffer = GradBuffer([(2,), (3,)], dtype)
        assert buffer.dtype == dtype and buffer.flat.dtype.name == dtype
        buffer.flat[...] = 3.0
        assert float(buffer.norm()) == pytest.approx(math.sqrt(45))


# -- bad inputs (issue 15): each named, nothing written ---------------------------------------
@pytest.mark.parametrize("fn", [global_norm, lambda g: clip_grad_norm_(g, 1.0)], ids=["global_norm", "clip"])
def test_complex_gradients_are_refused_not_truncated(fn):
    grad = np.array([3 + 4j], np.complex64)
    with pytest.raises(polyamp.ForeignArrayError, match=r"not floating-point.*complex64.*view_as_real"):
        fn([grad])  # the norm used to be 3.0: the imaginary part was dropped
    assert grad.tolist() == [3 + 4j]


def test_complex_torch_gradients_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(polyamp.ForeignArrayError, match="torch.complex64"):
        global_norm([torch.tensor([3 + 4j])])


@pytest.mark.parametrize("dtype", ["int32", "int64", "bool"])
def test_clip_refuses_integer_gradients_and_writes_nothing(dtype):
    grad = np.array([30, 40], dtype)
    message = rf"clip_grad_norm_ got a gradient that is not floating.*{dtype}"
    with pytest.raises(polyamp.ForeignArrayError, match=message):
        clip_grad_norm_([grad], 1.0)  # used to return 50 and write [0, 0]
    assert grad.tolist() == np.array([30, 40], dtype).tolist()


def test_clip_refuses_read_only_gradients_before_writing_any():
    first, frozen = np.full(3, 100.0, np.float32), np.full(3, 100.0, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"read-only array.*flags\.writeable is False.*np\.array\(g\)"):
        clip_grad_norm_([first, frozen], 1.0)
    assert first.tolist() == [100.0] * 3  # not half-clipped
    assert float(global_norm([frozen])) == pytest.approx(math.sqrt(3e4))  # reading it is fine


@pytest.mark.parametrize("fn", [global_norm, lambda g: clip_grad_norm_(g, 1.0)], ids=["global_norm", "clip"])
def test_none_gradients_are_named(fn):
    with pytest.raises(TypeError, match=r"needs grads to be a list of gradient arrays, got grads=None\. Fix"):
        fn(None)


def test_buffer_and_attach_name_none_and_non_parameters():
    with pytest.raises(polyamp.ConfigError, match=r"GradBuffer needs shapes.*got shapes=None"):
        GradBuffer(None)
    with pytest.raises(TypeError, match=r"attach needs params to be a list of parameters, got params=None"):
        GradBuffer.attach(None)
    with pytest.raises(TypeError, match=r"params\[0\] of type builtins\.memoryview.*polyamp\.Parameter"):
        GradBuffer.attach([memoryview(np.ones(3, np.float32))])
    with pytest.raises(TypeError, match=r"params\[1\] of type numpy\.ndarray"):
        GradBuffer.attach([polyamp.Parameter(np.ones(2, np.float32)), np.ones(2, np.float32)])
