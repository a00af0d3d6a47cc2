"""The cupy backend on a CUDA device: bitwise against NumPy and torch, edge cases, the facade.

Every test carries the ``gpu`` mark; where cupy cannot run the module skips with the
backend's own reason (e.g. "cupy 14.x is installed but no CUDA device is available: ...").
"""

from __future__ import annotations

import numpy as np
import pytest
from polyamp.backends import _cupy_launch
from polyamp.backends import cupy as cupy_backend
from polyamp.backends._cupy_kernels import CHUNK

import polyamp
from polyamp import LossScaleConfig, LossScaler
from polyamp.policy import HostState, LossScaleState, next_host_state

pytestmark = pytest.mark.gpu
_INFO = cupy_backend.backend_info()
if not _INFO["available"]:
    pytest.skip(f"cupy backend unavailable: {_INFO['reason']}", allow_module_level=True)

import cupy  # noqa: E402
import cupyx  # noqa: E402

KINDS = ["float32", "float64", "float16", "bfloat16"]
BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
SCALES = [65536.0, 3.0, 1.0, 2.0**-20, 1e-30]


@pytest.fixture(scope="module")
def backend():
    return polyamp.get_backend("cupy")


def host_dtype(kind):
    """The NumPy dtype for ``kind``; bfloat16 skips where this cupy cannot hold it."""
    if kind == "bfloat16":
        try:
            return np.dtype(cupy_backend.bfloat16_dtype())
        except TypeError as exc:
            pytest.skip(str(exc))
    return np.dtype(kind)


def wide_values(rng, dtype, n):
    """Values over the dtype's range (subnormals, zeros, big ones), all finite unless added."""
    if n == 0:
        return np.zeros(0, dtype)
    hi = {2: 4.5, 8: 300}.get(dtype.itemsize, 37.0) if dtype.name != "bfloat16" else 37.0
    values = rng.standard_normal(n) * 10.0 ** rng.uniform(-hi, hi, n)
    with np.errstate(over="ignore"):
        return values.astype(dtype)


def reference_unscale(host, scale):
    """torch's kernel in NumPy: widen, times float32(1/float64(scale)) unless 1, round back."""
    inv = np.float32(1.0 / np.float64(np.float32(scale)))
    found = not np.isfinite(host.astype(np.float64)).all()
    if inv == 1:
        return host.copy(), found
    wide = np.float64 if host.dtype == np.float64 else np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        return (host.astype(wide) * wide(inv)).astype(host.dtype), found


def assert_same_bits(got, want):
    """Bitwise equal, except that any nan equals any nan."""
    bits = BITS[got.dtype.itemsize]
    nan_got, nan_want = np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
    np.testing.assert_array_equal(nan_got, nan_want)
    np.testing.assert_array_equal(got.view(bits)[~nan_got], want.view(bits)[~nan_want])


def misaligned(host):
    """A cupy view of ``host`` that starts one element past a 16-byte boundary."""
    padded = cupy.asarray(np.concatenate([np.zeros(1, host.dtype), host]))
    return padded[1:]


def run(backend, grads, scale, found=0.0):
    like = grads[0]
    scale_arr, flag = backend.full(scale, "float32", like), backend.full(found, "float32", like)
    backend.unscale_and_check(grads, scale_arr, flag)
    return float(flag.get())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale", SCALES)
def test_unscale_equals_numpy(backend, kind, scale):
    dtype = host_dtype(kind)
    rng = np.random.default_rng(1)
    hosts = [wide_values(rng, dtype, n) for n in (0, 1, 5, 1000, CHUNK - 1, CHUNK + 3, 3 * CHUNK)]
    hosts[3][17] = np.inf
    grads = [cupy.asarray(h) for h in hosts[:-1]] + [misaligned(hosts[-1])]
    found = run(backend, grads, scale)
    for grad, host in zip(grads, hosts, strict=True):
        want, _ = reference_unscale(host, scale)
        assert_same_bits(grad.get(), want)
    assert found == 1.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_nonfinite_first_last_and_on_boundaries(backend, kind, bad):
    dtype = host_dtype(kind)
    n = 3 * CHUNK + 13
    for pos in (0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, n - 9, n - 2, n - 1):
        for shift in (False, True):
            host = np.full(n, 4, dtype)
            host[pos] = bad
            grad = misaligned(host) if shift else cupy.asarray(host)
            clean = cupy.full(7, 4, dtype)
            assert run(backend, [clean, grad], 2.0) == 1.0, (pos, shift)
            got = grad.get()
            assert np.isnan(got[pos]) if np.isnan(bad) else got[pos] == bad
            assert (np.delete(got, pos) == 2).all() and (clean.get() == 2).all()
    assert run(backend, [cupy.full(n, 4, dtype)], 2.0) == 0.0
    assert run(backend, [cupy.full(n, 4, dtype)], 2.0, found=1.0) == 1.0  # never cleared


def test_empty_and_one_element_gradients(backend):
    empty = cupy.zeros(0, cupy.float32)
    assert run(backend, [empty, cupy.zeros(0, cupy.float16)], 2.0) == 0.0
    one = cupy.full(1, 8.0, cupy.float32)
    assert run(backend, [empty, one, empty], 2.0) == 0.0 and float(one.get()[0]) == 4.0
    bad = cupy.full(1, np.inf, cupy.float16)
    assert run(backend, [one, bad], 2.0) == 1.0 and float(one.get()[0]) == 2.0


def test_a_thousand_small_tensors_in_one_launch_per_dtype(backend):
    rng = np.random.default_rng(3)
    hosts = [rng.standard_normal(int(rng.integers(1, 5000))).astype(
        np.float32 if i % 2 else np.float16) for i in range(1000)]
    hosts[777][-1] = np.inf
    grads = [cupy.asarray(h) for h in hosts]
    assert run(backend, grads, 1024.0) == 1.0
    for grad, host in zip(grads, hosts, strict=True):
        assert_same_bits(grad.get(), reference_unscale(host, 1024.0)[0])
    plan = _cupy_launch._by_identity.get(tuple(map(id, grads)))
    assert sorted(launch.kind for launch in plan.launches) == ["float16", "float32"]
    assert run(backend, grads, 1.0) == 1.0  # the cached plan, again


def test_strided_gradients_are_unscaled_in_place(backend):
    base, other = cupy.arange(48, dtype=cupy.float32).reshape(6, 8), cupy.ones((3, 8))
    before = base.get()
    strided, transposed = base[:, ::2], other.T  # a copy-and-back path, an F-order direct one
    assert run(backend, [strided, transposed], 2.0) == 0.0
    want = before.copy()
    want[:, ::2] /= 2
    np.testing.assert_array_equal(base.get(), want)  # odd columns untouched
    np.testing.assert_array_equal(other.get(), np.full((3, 8), 0.5))


def test_all_finite_reads_without_writing(backend):
    good, bad = cupy.ones(100, cupy.float16), cupy.ones(CHUNK + 1, cupy.float32)
    bad[CHUNK] = cupy.nan
    snapshot = bad.get().view(np.uint32).copy()
    result = backend.all_finite([good, bad])
    assert result.shape == () and result.dtype == cupy.bool_ and not bool(result)
    assert bool(backend.all_finite([good])) and bool(backend.all_finite([]))
    np.testing.assert_array_equal(bad.get().view(np.uint32), snapshot)


CONFIGS = [
    LossScaleConfig(growth_interval=3),
    LossScaleConfig(growth_interval=2, backoff_interval=3, min_scale=1.0, max_scale=2.0**20),
    LossScaleConfig(init_scale=3e38, growth_interval=1),
    LossScaleConfig(growth_factor=1.1, backoff_factor=0.3, growth_interval=2,
                    product_dtype="float32"),
    LossScaleConfig(growth_interval=1, dynamic=False),
]


@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
def test_scale_update_agrees_with_the_policy(backend, config):
    like = cupy.zeros(1, cupy.float32)
    state = LossScaleState(backend.full(config.init_scale, "float32", like),
                           backend.full(0, "int32", like), backend.full(0, "int32", like))
    host = HostState(float(np.float32(config.init_scale)), 0, 0)
    flags = np.random.default_rng(5).choice([0.0, 0.0, 0.0, 1.0, np.nan], size=60)
    for flag in flags:
        state = backend.update_scale(state, backend.full(flag, "float32", like), config)
        host = next_host_state(host, bool(flag != 0), config)
        got = (float(state.scale.get()), int(state.growth_tracker.get()),
               int(state.backoff_tracker.get()))
        assert got == tuple(host)


def test_steady_state_iteration_never_syncs(backend):
    grads = [cupy.ones(1000, cupy.float32), cupy.ones(3, cupy.float16)]
    like = grads[0]
    state = LossScaleState(backend.full(2.0, "float32", like), backend.full(0, "int32", like),
                           backend.full(0, "int32", like))
    found = backend.full(0.0, "float32", like)
    backend.unscale_and_check(grads, state.scale, found)  # compiles and caches the plan
    backend.update_scale(state, found, LossScaleConfig())
    with cupyx.allow_synchronize(False):
        backend.unscale_and_check(grads, state.scale, found)
        backend.update_scale(state, found, LossScaleConfig(backoff_interval=2))
        backend.all_finite(grads)
        with pytest.raises(cupyx.DeviceSynchronized):  # the detector works: read_flag syncs
            backend.read_flag(found)


def test_engine_step_skips_and_backs_off(backend):
    scaler = LossScaler(LossScaleConfig(init_scale=1024.0, growth_interval=2), backend="cupy")
    applied = []
    for bad in (False, True, False, False):
        grad = cupy.full(10, 1024.0, cupy.float32)
        if bad:
            grad[3] = cupy.inf
        result = scaler.step([grad], lambda: applied.append(True))
        scaler.update()
        assert result.skipped is bad and bool(result) is not bad
    assert len(applied) == 3 and scaler.get_scale() == 1024.0  # 1024 -> 512 -> 1024


@pytest.mark.parametrize("target", ["float16", "float32", "bfloat16"])
def test_cast_and_scale_round_like_numpy(backend, target):
    dtype = host_dtype(target)
    host = wide_values(np.random.default_rng(9), np.dtype(np.float32), 5000)
    got = backend.cast(cupy.asarray(host), target)
    assert_same_bits(got.get(), host.astype(dtype))
    scaled = backend.scale_array(got, backend.full(3.0, "float32", got))
    with np.errstate(over="ignore"):
        want = (host.astype(dtype).astype(np.float32) * np.float32(3.0)).astype(dtype)
    assert scaled.dtype == got.dtype
    assert_same_bits(scaled.get(), want)


def test_gradients_on_two_devices_are_refused(backend):
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two CUDA devices")
    with cupy.cuda.Device(1):
        other = cupy.ones(3, cupy.float32)
    with pytest.raises(ValueError, match="one CUDA device per scaler"):
        run(backend, [cupy.ones(3, cupy.float32), other], 2.0)
