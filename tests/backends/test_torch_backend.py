"""The torch backend's kernels against NumPy references and polyamp's pure rule.

unscale-and-check must multiply by float32(1 / float64(scale)) in each gradient's dtype and
flag any inf/nan; update_scale must reproduce polyamp.policy.next_host_state exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

from polyamp.backends import torch as torch_backend  # noqa: E402

import polyamp  # noqa: E402
from polyamp import HostState, LossScaleConfig, LossScaleState, next_host_state  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SPECIAL = [math.inf, -math.inf, math.nan]


@pytest.fixture(scope="module")
def backend():
    return polyamp.get_backend("torch")


def reference_unscale(values: np.ndarray, dtype: str, scale: float) -> np.ndarray:
    """NumPy: values times float32(1/float64(scale)), computed as torch's CPU kernel does."""
    inv = np.float32(1.0 / np.float64(np.float32(scale)))
    if dtype == "float64":
        return values.astype(np.float64) * np.float64(inv)
    product = values.astype(np.float32) * inv  # bfloat16: float32 math, rounded once
    return product.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else product


def to_torch(values: np.ndarray, dtype: str):
    return torch.from_numpy(values.astype(np.float64)).to(DTYPES[dtype])


def to_numpy(tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.float().numpy().astype(ml_dtypes.bfloat16)
    return tensor.numpy()


finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)
element = st.one_of(finite, finite, finite, st.sampled_from(SPECIAL))
grad_spec = st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(element, min_size=1, max_size=7))
scales = st.one_of(
    st.sampled_from([1.0, 2.0**16, 2.0**-10, 3.0, 1000.0 * 0.3**3]),
    st.floats(1e-6, 1e30, allow_nan=False, allow_infinity=False),
)


@settings(max_examples=150 * settings.default.max_examples // 100, deadline=None)
@given(
    specs=st.lists(grad_spec, min_size=1, max_size=6),
    scale=scales,
    start=st.sampled_from([0.0, 1.0]),
)
def test_unscale_and_check_matches_the_numpy_reference(backend, specs, scale, start):
    arrays = [np.asarray(v, dtype=np.float64) for _, v in specs]
    grads = [to_torch(a, d) for a, (d, _) in zip(arrays, specs, strict=True)]
    inputs = [to_numpy(g).astype(np.float64) for g in grads]  # after rounding to the dtype
    found = torch.full((), start)
    backend.unscale_and_check(grads, torch.tensor(scale, dtype=torch.float32), found)
    for grad, values, (dtype, _) in zip(grads, inputs, specs, strict=True):
        expected = reference_unscale(values, dtype, scale)
        assert grad.dtype == DTYPES[dtype]
        got = to_numpy(grad)
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got.astype(np.float64), expected.astype(np.float64))
    overflow = any(not np.isfinite(v).all() for v in inputs)
    assert found.item() == (1.0 if overflow or start else 0.0)


def test_flag_set_by_any_one_group_and_never_cleared(backend):
    grads = [torch.ones(3), torch.ones(2, dtype=torch.float64), torch.ones(4, dtype=torch.bfloat16)]
    grads[2][1] = math.inf
    found = torch.zeros(())
    backend.unscale_and_check(grads, torch.tensor(4.0), found)
    assert found.item() == 1.0 and torch.equal(grads[0], torch.full((3,), 0.25))
    assert torch.equal(grads[1], torch.full((2,), 0.25, dtype=torch.float64))
    backend.unscale_and_check([torch.ones(3)], torch.tensor(4.0), found)
    assert found.item() == 1.0


def test_groups_are_formed_per_device_and_dtype():
    a, b, c, d = torch.ones(1), torch.ones(1, dtype=torch.float64), torch.ones(2), torch.ones(3)
    groups = {g[0].dtype: g for _, g in torch_backend.group_by_device_and_dtype([a, b, c, d])}
    assert set(groups) == {torch.float32, torch.float64}
    assert [id(t) for t in groups[torch.float32]] == [id(a), id(c), id(d)]
    assert len(groups[torch.float64]) == 1 and groups[torch.float64][0] is b


def test_sparse_gradients_have_their_values_unscaled(backend):
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 2, 2]]), torch.tensor([2.0, 4.0, math.nan]), (4,), check_invariants=True
    )
    dense = torch.full((2,), 8.0)
    found = torch.zeros(())
    backend.unscale_and_check([sparse, dense], torch.tensor(2.0), found)
    assert sparse._values()[:2].tolist() == [1.0, 2.0] and dense.tolist() == [4.0, 4.0]
    assert found.item() == 1.0


def test_no_gradients_is_a_no_op(backend):
    found = torch.zeros(())
    backend.unscale_and_check([], torch.tensor(2.0), found)
    assert found.item() == 0.0


def test_grads_that_require_grad_are_unscaled_without_autograd(backend):
    grad = torch.full((2,), 6.0, requires_grad=True).clone()
    backend.unscale_and_check([grad], torch.tensor(3.0), torch.zeros(()))
    assert grad.tolist() == [2.0, 2.0] and torch.is_grad_enabled()


@st.composite
def configs(draw):
    lo = draw(st.one_of(st.none(), st.sampled_from([1.0, 2.0**-3, 100.0])))
    hi = draw(st.one_of(st.none(), st.sampled_from([2.0**18, 1e6, 3e38])))
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    return LossScaleConfig(
        init_scale=draw(st.sampled_from([2.0**16, 1.0, 3.0, 2.0**126, 1000.0])),
        growth_factor=draw(st.sampled_from([2.0, 1.5, 3.0, 1.0001])),
        backoff_factor=draw(st.sampled_from([0.5, 0.25, 0.3, 0.999])),
        growth_interval=draw(st.integers(1, 5)),
        backoff_interval=draw(st.integers(1, 4)),
        min_scale=lo,
        max_scale=hi,
        dynamic=draw(st.booleans()),
        product_dtype=draw(st.sampled_from(["float64", "float64", "float32"])),
    )


@settings(max_examples=200 * settings.default.max_examples // 100, deadline=None)
@given(config=configs(), flags=st.lists(st.sampled_from([0.0, 0.0, 1.0, 2.0]), max_size=25))
def test_update_scale_equals_next_host_state(backend, config, flags):
    host = HostState(float(np.float32(config.init_scale)), 0, 0)
    state = LossScaleState(
        torch.tensor(host.scale), torch.tensor(0, dtype=torch.int32),
        torch.tensor(0, dtype=torch.int32),
    )
    for flag in flags:
        host = next_host_state(host, bool(flag), config)
        state = backend.update_scale(state, torch.tensor(flag), config)
        got = HostState(*(t.item() for t in state))
        assert got == host, (config, flags)
    assert state.scale.dtype == torch.float32 and state.growth_tracker.dtype == torch.int32


def test_torchs_fused_update_is_used_exactly_for_torchs_rule():
    assert torch_backend._torch_rule(LossScaleConfig())
    for change in ({"backoff_interval": 2}, {"min_scale": 1.0}, {"max_scale": 1e6},
                   {"dynamic": False}, {"product_dtype": "float32"}):
        assert not torch_backend._torch_rule(LossScaleConfig(**change)), change


@pytest.fixture
def reads_of(host_reads):
    """``reads_of(fn)``: how many times ``fn()`` reads a tensor's value on the host (tests/conftest.py)."""

    def reads(fn):
        with host_reads() as counter:
            fn()
        return counter.count

    return reads


@pytest.mark.parametrize("config", [LossScaleConfig(), LossScaleConfig(backoff_interval=3)])
def test_kernels_do_not_read_the_device(backend, config, reads_of):
    state = LossScaleState(torch.tensor(8.0), torch.tensor(0, dtype=torch.int32),
                           torch.tensor(0, dtype=torch.int32))
    grads, found = [torch.ones(3), torch.ones(2, dtype=torch.float64)], torch.zeros(())
    assert reads_of(lambda: backend.unscale_and_check(grads, state.scale, found)) == 0
    assert reads_of(lambda: backend.update_scale(state, found, config)) == 0
    assert reads_of(lambda: backend.all_finite(grads)) == 0
    assert reads_of(lambda: backend.read_flag(found)) == 1


def test_small_kernels(backend):
    like = torch.zeros((), dtype=torch.float64)
    made = backend.full(3, "int32", like)
    assert made.dtype == torch.int32 and made.shape == () and made.item() == 3
    x = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert backend.scale_array(x, torch.tensor(4.0)).dtype == torch.bfloat16
    assert backend.all_finite([torch.ones(2), torch.ones(1)]).item() is True
    assert backend.all_finite([torch.ones(2), torch.tensor([math.nan])]).item() is False
    assert backend.all_finite([]).item() is True
    assert backend.cast(torch.tensor([1.0 / 3]), "bfloat16").dtype == torch.bfloat16
    assert backend.read_flag(torch.tensor(2.0)) is True and backend.to_host(torch.tensor(5)) == 5
    assert backend.owns_array(torch.ones(1)) and not backend.owns_array(np.ones(1))


def test_cast_to_an_unknown_dtype_names_it(backend):
    with pytest.raises(ValueError, match="dtype='int8'"):
        backend.cast(torch.ones(1), "int8")


@settings(max_examples=300 * settings.default.max_examples // 100, deadline=None)
@given(scale=st.floats(2.0**-149, 3.4028234663852886e38, allow_infinity=False, width=32))
def test_inverse_scale_is_float32_of_the_float64_reciprocal(scale):
    got = torch_backend.inverse_scale(torch.tensor(scale, dtype=torch.float32))
    with np.errstate(over="ignore"):  # 1/scale past float32's max is inf on both sides
        expected = np.float32(1.0 / np.float64(np.float32(scale)))
    assert got.dtype == torch.float32
    assert got.numpy().view(np.int32) == expected.view(np.int32)


@settings(max_examples=150 * settings.default.max_examples // 100, deadline=None)
@given(
    init=st.one_of(st.floats(1e-30, 3e38), st.sampled_from([2.0**-126, 3 * 2.0**-126, 2.0**16])),
    factors=st.sampled_from([(2.0, 0.5), (1.5, 0.3), (3.0, 0.7), (1.0001, 0.999), (10.0, 0.1)]),
    interval=st.integers(1, 4),
    bounds=st.sampled_from([{}, {"min_scale": 2.0**-126}, {"max_scale": float(np.finfo(np.float32).max)},
                            {"min_scale": 2.0**-126, "max_scale": float(np.finfo(np.float32).max)}]),
    flags=st.lists(st.sampled_from([0.0, 1.0, math.nan, math.inf]), max_size=25),
)
def test_update_scale_agrees_with_torchs_own_update(backend, torch_amp_update, init, factors, interval,
                                                    bounds, flags):
    """Both of the backend's update paths against ``torch._amp_update_scale_`` called directly:
    torch's fused one, and the rule as tensor ops, which a floor or ceiling equal to polyamp's own
    selects (the same rule, so the same bits)."""
    config = LossScaleConfig(init_scale=init, growth_factor=factors[0], backoff_factor=factors[1],
                             growth_interval=interval, **bounds)
    assert torch_backend._torch_rule(config) == (not bounds)
    state = LossScaleState(torch.tensor(np.float32(init)), torch.tensor(0, dtype=torch.int32),
                           torch.tensor(0, dtype=torch.int32))
    want = HostState(float(np.float32(init)), 0, 0)
    for found in flags:
        want = torch_amp_update(want, found, config)
        state = backend.update_scale(state, torch.tensor(found, dtype=torch.float32), config)
        got = HostState(state.scale.item(), state.growth_tracker.item(), state.backoff_tracker.item())
        assert np.float32(got.scale).view(np.uint32) == np.float32(want.scale).view(np.uint32), found
        assert got[1:] == want[1:]


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "strided", "inf"])
def test_unscale_and_squares_leaves_gradients_as_the_unscale_does(backend, kind):
    """The StepGuard's fused hook: float32 CPU gradients go through the NumPy backend's one-pass
    kernel on their memory (when numba is there), the rest through torch's two passes; either way
    the gradients end bitwise as unscale_and_check leaves them, the flag is the same, and the sum
    of squares is that of the unscaled values (float64 adds of float32 squares: far below 1e-6)."""
    rng = np.random.default_rng(3)
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    base = [torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 1024).to(dtype) for n in (5, 3000)]
    if kind == "strided":
        base = [torch.from_numpy(rng.standard_normal((40, 30)).astype(np.float32)).t()]
    if kind == "inf":
        base[1][7] = float("inf")
    fused, plain = [g.clone() for g in base], [g.clone() for g in base]
    if kind == "strided":
        fused, plain = [g.t().clone().t() for g in base], [g.t().clone().t() for g in base]
    scale = torch.tensor(1024.0)
    flag_fused, flag_plain = torch.zeros(()), torch.zeros(())
    total = backend.unscale_and_squares(fused, scale, flag_fused)
    backend.unscale_and_check(plain, scale, flag_plain)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert float(flag_fused) == float(flag_plain) == (1.0 if kind == "inf" else 0.0)
    want = math.fsum(float(v) ** 2 for g in plain for v in g.double().reshape(-1))
    assert total.dtype == torch.float64
    if kind == "inf":
        assert math.isinf(float(total))
    else:
        assert float(total) == pytest.approx(want, rel=1e-6)
