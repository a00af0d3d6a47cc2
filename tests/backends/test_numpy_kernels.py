"""The NumPy unscale-and-check kernels match torch's CPU kernel bit for bit, on every path."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KERNEL_FILE = Path(__file__).resolve().parents[2] / "backends" / "_numpy_kernels.py"


def _load_kernels():
    """``polyamp.backends._numpy_kernels``, or the source file by path while packaging is in flux."""
    try:
        from polyamp.backends import _numpy_kernels
    except ImportError:
        name = "_polyamp_numpy_kernels"  # the benchmark uses the same name (one numba cache)
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, KERNEL_FILE)
        _numpy_kernels = importlib.util.module_from_spec(spec)
        sys.modules[name] = _numpy_kernels
        spec.loader.exec_module(_numpy_kernels)
    return _numpy_kernels


K = _load_kernels()
KERNELS = ("compiled", "blocked", "naive")
NONFINITE = (np.inf, -np.inf, np.nan, -np.nan)
INVS = (0.5, 1.0, 2.0**-16, 1 / 3, 3.0, 65536.0, 0.0, 2.0**-30, 1e-45)


def _bf16():
    return pytest.importorskip("ml_dtypes").bfloat16


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Each path, forced through ``set_kernel`` (and reset afterwards)."""
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    K.set_kernel(request.param)
    yield request.param
    K.set_kernel(None)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 bytes, so small arrays cross many block boundaries."""
    monkeypatch.setattr(K, "BLOCK_BYTES", 64)


# ----------------------------------------------------------------------------- helpers
def _uint(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def _to_torch(a: np.ndarray):
    a = np.ascontiguousarray(a).copy()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _from_torch(t, dtype: np.dtype) -> np.ndarray:
    if dtype.name == "bfloat16":
        return t.view(torch.uint16).numpy().view(dtype)
    return t.numpy()


def torch_unscale(arrays: list[np.ndarray], inv: float) -> tuple[list[np.ndarray], float]:
    """torch's CPU ``_amp_foreach_non_finite_check_and_unscale_`` on copies of ``arrays``."""
    found = torch.zeros((), dtype=torch.float32)
    inv_t = torch.tensor(inv, dtype=torch.float32)
    out = []
    for a in arrays:  # one call per tensor: the flag ORs across calls just as across the list
        t = _to_torch(a)
        torch._amp_foreach_non_finite_check_and_unscale_([t], found, inv_t)
        out.append(_from_torch(t, a.dtype).reshape(a.shape))
    return out, float(found)


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Bit equality; for 16-bit types any NaN matches any NaN (torch's conversions pick payloads)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = _uint(got).ravel(), _uint(want).ravel()
    if got.dtype.itemsize == 2:
        gn = np.isnan(np.ascontiguousarray(got).astype(np.float32)).ravel()
        wn = np.isnan(np.ascontiguousarray(want).astype(np.float32)).ravel()
        np.testing.assert_array_equal(gn, wn)
        g, w = g[~gn], w[~wn]
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, f"{bad.size} values differ, first at {bad[:5]}: {g[bad[:5]]} vs {w[bad[:5]]}"


def check_against_torch(arrays: list[np.ndarray], inv: float, found0: float = 0.0) -> float:
    """Run polyamp on ``arrays`` in place and torch on copies; assert identical bits and flag."""
    want, want_flag = torch_unscale(arrays, inv)
    found = np.array(found0, np.float32)
    K.unscale_and_check_(arrays, np.array(inv, np.float32), found)
    for got, exp in zip(arrays, want):
        assert_same_bits(got, exp)
    assert float(found) == max(found0, want_flag)
    return float(found)


def random_f32(rng: np.random.Generator, n: int, spread: int = 40, scale: float = 2.0**16) -> np.ndarray:
    """Normal values times ``scale`` and random powers of two up to ``2**±spread``."""
    exps = rng.integers(-spread, spread + 1, n).astype(np.float32)
    with np.errstate(all="ignore"):  # spread 140 reaches subnormals and overflows on purpose
        values = rng.standard_normal(n).astype(np.float32) * np.exp2(exps) * np.float32(scale)
    return values.astype(np.float32)


# ----------------------------------------------------------------------------- against torch
@settings(max_examples=60 * settings.default.max_examples // 100, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    inv=st.one_of(st.sampled_from(INVS), st.floats(2.0**-100, 2.0**100, width=32)),
    n_bad=st.integers(0, 3),
    spread=st.sampled_from([4, 40, 140]),
)
def test_random_float32_matches_torch(seed, sizes, inv, n_bad, spread):
    rng = np.random.default_rng(seed)
    saved = K.BLOCK_BYTES
    try:
        for name in KERNELS:
            K.set_kernel(name)
            K.BLOCK_BYTES = int(rng.choice([16, 64, 1024, saved]))
            arrays = [random_f32(rng, n, spread) for n in sizes]
            for _ in range(n_bad):
                a = arrays[rng.integers(len(arrays))]
                if a.size:
                    a[rng.integers(a.size)] = rng.choice(NONFINITE)
            check_against_torch(arrays, inv)
    finally:
        K.BLOCK_BYTES = saved
        K.set_kernel(None)


def _positions(n_block: int, size: int) -> dict[str, tuple[int, int]]:
    """(gradient index, element index) of interesting places for an inf/nan."""
    return {
        "first": (0, 0),
        "last": (2, size - 1),
        "block_end": (0, n_block - 1),
        "block_start": (0, n_block),
        "second_block_end": (1, 2 * n_block - 1),
        "middle_of_second_grad": (1, size // 2),
    }


@pytest.mark.parametrize("where", list(_positions(1, 10)))
@pytest.mark.parametrize("bad", NONFINITE, ids=["inf", "-inf", "nan", "-nan"])
def test_nonfinite_positions_real_blocks(kernel, where, bad):
    n_block = K.BLOCK_BYTES // 4
    size = 2 * n_block + 123
    rng = np.random.default_rng(1)
    arrays = [random_f32(rng, size) for _ in range(3)]
    g, i = _positions(n_block, size)[where]
    arrays[g][i] = bad
    assert check_against_torch(arrays, 2.0**-16) == 1.0


@pytest.mark.parametrize("where", list(_positions(1, 10)))
def test_nonfinite_positions_small_blocks(kernel, small_blocks, where):
    n_block = K.BLOCK_BYTES // 4
    size = 3 * n_block + 5
    rng = np.random.default_rng(2)
    arrays = [random_f32(rng, size) for _ in range(3)]
    g, i = _positions(n_block, size)[where]
    arrays[g][i] = np.nan
    assert check_against_torch(arrays, 0.125) == 1.0


def test_finite_data_leaves_flag_clear(kernel):
    rng = np.random.default_rng(3)
    arrays = [random_f32(rng, n) for n in (0, 1, 1000, 300_001)]
    assert check_against_torch(arrays, 2.0**-16) == 0.0


def test_found_inf_is_never_cleared(kernel):
    arrays = [np.ones(1000, np.float32), np.ones((3, 4), np.float32)]
    assert check_against_torch(arrays, 0.5, found0=1.0) == 1.0


def test_large_finite_values_are_not_flagged(kernel):
    big = np.float32(np.finfo(np.float32).max)
    arrays = [np.full(300_000, big, np.float32), np.full(10, -big, np.float32)]
    assert check_against_torch(arrays, 1.0) == 0.0
    assert check_against_torch(arrays, 4.0) == 0.0  # the product overflows; the inputs were finite


# ----------------------------------------------------------------------------- shapes and layouts
SHAPES = {
    "empty": lambda a: a[:0],
    "empty_2d": lambda a: a[:0].reshape(0, 3) if a.size else a.reshape(0, 3),
    "zero_d": lambda a: a[:1].reshape(()),
    "one": lambda a: a[:1],
    "strided": lambda a: a[::3],
    "fortran": lambda a: a[:60].reshape(6, 10).T,
    "sliced_2d": lambda a: a[:120].reshape(10, 12)[2:9, 1:11],
    "reversed": lambda a: a[::-1],
    "byteswapped": lambda a: a[:50].astype(a.dtype.newbyteorder()),
}


@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_and_layouts(kernel, shape, bad):
    rng = np.random.default_rng(4)
    base = random_f32(rng, 600)
    if bad:
        base[[0, 299, 599]] = [np.inf, np.nan, -np.inf]
    grad = SHAPES[shape](base)
    view_bad = bool(grad.size and not np.isfinite(grad).all())
    want, _ = torch_unscale([np.ascontiguousarray(grad, dtype=np.float32)], 2.0**-8)
    found = np.zeros((), np.float32)
    K.unscale_and_check_([grad], np.array(2.0**-8, np.float32), found)
    assert_same_bits(np.ascontiguousarray(grad, dtype=np.float32), want[0])
    assert float(found) == float(view_bad)


def test_views_of_one_buffer_scale_only_their_elements(kernel):
    base = np.arange(12, dtype=np.float32)
    K.unscale_and_check_([base[::2]], np.array(0.5, np.float32), np.zeros((), np.float32))
    np.testing.assert_array_equal(base[1::2], np.arange(1, 12, 2, dtype=np.float32))


def test_empty_list_and_found_inf_shapes(kernel):
    found = np.zeros((1,), np.float32)
    K.unscale_and_check_([], np.array(0.5, np.float32), found)
    K.unscale_and_check_([np.array([np.nan], np.float32)], np.array([0.5], np.float32), found)
    assert found.tolist() == [1.0]


# ----------------------------------------------------------------------------- dtypes
def _dtype_data(dtype, rng: np.random.Generator) -> list[np.ndarray]:
    arrays = [random_f32(rng, n, 8, scale=1.0).astype(dtype) for n in (0, 1, 257, 70_000)]
    arrays[2][[0, 100, 256]] = [np.inf, -np.nan, -np.inf]
    return arrays


@pytest.mark.parametrize("inv", INVS)
@pytest.mark.parametrize("dtype", ["float16", "float64", "bfloat16"])
def test_other_dtypes_match_torch(kernel, dtype, inv):
    dt = np.dtype(_bf16() if dtype == "bfloat16" else dtype)
    rng = np.random.default_rng(5)
    assert check_against_torch(_dtype_data(dt, rng), inv) == 1.0
    finite = [random_f32(rng, n, 8, scale=1.0).astype(dt) for n in (3, 5000)]
    assert check_against_torch(finite, inv) == 0.0


@pytest.mark.parametrize("dtype", ["float16", "float64", "bfloat16"])
def test_other_dtypes_small_blocks(kernel, small_blocks, dtype):
    dt = np.dtype(_bf16() if dtype == "bfloat16" else dtype)
    for pos in range(0, 40, 3):
        a = np.full(40, 1.5, dt)
        a[pos] = -np.inf
        assert check_against_torch([np.ones(7, dt), a], 0.25) == 1.0


def test_float16_multiplies_in_float32_like_torch(kernel):
    # 2**-30 is 0 in float16: numpy's g *= inv.astype(float16) would zero the gradient
    a = np.array([1024.0, 65504.0, 3.0], np.float16)
    check_against_torch([a], 2.0**-30)
    assert a.astype(np.float32).tolist() == [2.0**-20, 2.0**-14, 0.0]


def test_mixed_dtypes_in_one_call(kernel):
    rng = np.random.default_rng(6)
    arrays = [random_f32(rng, 100, 8, 1.0).astype(dt) for dt in ("float16", "float32", "float64")]
    arrays[2][50] = np.nan
    assert check_against_torch(arrays, 0.5) == 1.0


@pytest.mark.parametrize("dtype", ["int32", "complex64", "float128"])
def test_unsupported_dtypes_raise(dtype):
    if not hasattr(np, dtype):
        pytest.skip(f"no {dtype} here")
    with pytest.raises(TypeError):
        K.unscale_and_check_([np.ones(3, dtype)], np.array(0.5, np.float32), np.zeros((), np.float32))


def test_read_only_gradient_raises(kernel):
    a = np.ones(10, np.float32)
    a.flags.writeable = False
    with pytest.raises(ValueError):
        K.unscale_and_check_([a], np.array(0.5, np.float32), np.zeros((), np.float32))
    found = np.zeros((), np.float32)
    K.unscale_and_check_([a], np.array(1.0, np.float32), found)  # nothing to write: fine
    assert float(found) == 0.0


# ----------------------------------------------------------------------------- inv_scale == 1
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_inv_scale_one_leaves_bits_untouched(kernel, dtype):
    dt = np.dtype(_bf16() if dtype == "bfloat16" else dtype)
    width = dt.itemsize * 8
    utype = np.dtype(f"u{dt.itemsize}")
    exp_mask = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000, "float64": 0x7FF0000000000000}[
        dtype
    ]
    special = [exp_mask | 1, exp_mask | 3 | 1 << (width - 1), 1 << (width - 1), 1, 7, exp_mask]
    bits = np.concatenate([np.array(special, utype), np.arange(1000, 2000, dtype=utype)])
    a = bits.view(dt).copy()  # signalling NaNs, -0.0, subnormals, inf, ordinary values
    found = np.zeros((), np.float32)
    K.unscale_and_check_([a], np.array(1.0, np.float32), found)
    np.testing.assert_array_equal(a.view(utype), bits)
    assert float(found) == 1.0
    if dtype in ("float32", "float64"):
        check_against_torch([bits.view(dt).copy()], 1.0)


# ----------------------------------------------------------------------------- all_finite
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
def test_all_finite(kernel, small_blocks, dtype):
    dt = np.dtype(_bf16() if dtype == "bfloat16" else dtype)
    ok = [np.ones(100, dt), np.zeros((0,), dt), np.ones((4, 5), dt)[:, ::2], np.arange(5)]
    assert K.all_finite(ok) is True
    assert K.all_finite([]) is True
    for pos in (0, 31, 99):
        for bad in NONFINITE:
            a = np.ones(100, dt)
            a[pos] = bad
            before = a.copy()
            assert K.all_finite([*ok, a]) is False
            np.testing.assert_array_equal(a.view(f"u{dt.itemsize}"), before.view(f"u{dt.itemsize}"))
    ro = np.array([1.0, np.inf], dt)
    ro.flags.writeable = False
    assert K.all_finite([ro]) is False


# ----------------------------------------------------------------------------- path selection
def test_env_var_and_set_kernel(monkeypatch):
    K.set_kernel(None)
    for name in KERNELS:
        monkeypatch.setenv(K.ENV_VAR, name)
        want = "blocked" if name == "compiled" and not K.compiled_available() else name
        assert K.active_kernel() == want
    monkeypatch.setenv(K.ENV_VAR, "naive")
    K.set_kernel("blocked")
    try:
        assert K.active_kernel() == "blocked"
    finally:
        K.set_kernel(None)
    monkeypatch.setenv(K.ENV_VAR, "fast")
    with pytest.raises(ValueError):
        K.unscale_and_check_([], np.array(0.5, np.float32), np.zeros((), np.float32))
    with pytest.raises(ValueError):
        K.set_kernel("fast")


def test_compiled_path_is_used_when_numba_imports():
    pytest.importorskip("numba")
    assert K.compiled_available(), K.compiled_error
    assert K.compiled_error is None


def test_compiled_failure_falls_back_to_blocked(monkeypatch):
    monkeypatch.setattr(K, "_compile_tried", False)
    monkeypatch.setattr(K, "_compiled", None)
    monkeypatch.setattr(K, "compiled_error", None)
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba -> ImportError
    K.set_kernel("compiled")
    try:
        assert K.compiled_available() is False
        assert "numba" in K.compiled_error
        assert K.active_kernel() == "blocked"
        assert check_against_torch([np.array([1.0, np.inf], np.float32)], 0.5) == 1.0
    finally:
        K.set_kernel(None)


def test_import_is_cheap_and_numba_is_lazy():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('_k', {str(KERNEL_FILE)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['_k'] = m\n"
        "spec.loader.exec_module(m)\n"
        "assert 'numba' not in sys.modules, 'numba imported eagerly'\n"
        "assert 'ml_dtypes' not in sys.modules and 'torch' not in sys.modules\n"
        "m.set_kernel('blocked')\n"
        "import numpy as np\n"
        "m.unscale_and_check_([np.ones(3, np.float32)], np.array(0.5, np.float32),"
        " np.zeros((), np.float32))\n"
        "assert 'numba' not in sys.modules, 'blocked path imported numba'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != K.ENV_VAR}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ----------------------------------------------------------------------------- float16 / bfloat16
HALF_INVS = (0.5, 1 / 3, 3.0, 2.0**-16, 2.0**-30, 1e-45, 65536.0, 2.0**100, 0.0, np.inf, 1.0000001)


def _half(dtype: str) -> np.dtype:
    return np.dtype(_bf16() if dtype == "bfloat16" else dtype)


def _at_offset(bits: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``bits`` starting ``offset`` values (2 bytes each) past a 64-byte boundary."""
    buf = np.zeros(bits.size + 64, np.uint16)
    start = (-buf.ctypes.data % 64) // 2 + offset
    out = buf[start : start + bits.size]
    out[...] = bits
    assert out.size == 0 or out.ctypes.data % 64 == 2 * offset
    return out


@pytest.fixture
def threads_reset():
    """``set_threads`` back to the default afterwards."""
    yield
    K.set_threads(None)


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("inv", HALF_INVS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_half_bit_pattern_matches_torch(kernel, dtype, inv, offset):
    # all 65536 values: subnormals, +-0, inf, NaN payloads (signalling too), values that overflow
    # to inf or round to subnormals or zero; offset 1 starts the gradient off a 4-byte boundary
    dt = _half(dtype)
    bits = _at_offset(np.arange(2**16, dtype=np.uint32).astype(np.uint16), offset)
    assert check_against_torch([bits.view(dt)], inv) == 1.0


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_odd_sizes_and_ends(kernel, dtype, offset):
    # the bfloat16 kernel works on pairs of values: a value before the first pair or after the last
    # one must be scaled and checked like the others
    dt = _half(dtype)
    rng = np.random.default_rng(7)
    for n in range(0, 12):
        values = random_f32(rng, n, 8, scale=1.0).astype(dt).view(np.uint16)
        assert check_against_torch([_at_offset(values, offset).view(dt)], 1 / 3) == 0.0
        for pos in range(n):
            bits = values.copy()
            bits[pos] = np.array(-np.inf, dt).view(np.uint16)
            assert check_against_torch([_at_offset(bits, offset).view(dt)], 1 / 3) == 1.0, (n, pos)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_strided_and_fortran_views(kernel, dtype):
    dt = _half(dtype)
    rng = np.random.default_rng(8)
    views = [SHAPES[name] for name in ("strided", "fortran", "sliced_2d", "reversed")]
    for make in [*views, lambda a: a[1:]]:
        base = random_f32(rng, 600, 8, scale=1.0).astype(dt)
        base[[5, 300]] = [np.nan, np.inf]
        grad = make(base)
        want, flag = torch_unscale([np.ascontiguousarray(grad)], 2.0**-8)
        found = np.zeros((), np.float32)
        K.unscale_and_check_([grad], np.array(2.0**-8, np.float32), found)
        assert_same_bits(np.ascontiguousarray(grad), want[0])
        assert float(found) == flag


def test_bfloat16_nan_inv_matches_torch(kernel):
    # a NaN inv_scale makes NaN products whose low bits the pairwise rounding could carry into
    # the sign: that case takes the blocked path, and every value comes out NaN as in torch
    dt = _half("bfloat16")
    a = random_f32(np.random.default_rng(9), 101, 8, 1.0).astype(dt)
    check_against_torch([a], float("nan"))
    assert np.isnan(a.astype(np.float32)).all()


@pytest.mark.parametrize("parts", [2, 3, 5])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_parallel_parts_match_torch(kernel, threads_reset, monkeypatch, dtype, parts):
    # a gradient of >= 2 * PARALLEL_BYTES is cut into parts run on threads; an inf in any part,
    # the first (run by the caller) or a later one (run by a worker), sets the flag
    monkeypatch.setattr(K, "PARALLEL_BYTES", 256)
    K.set_threads(parts)
    dt = _half(dtype) if dtype in ("float16", "bfloat16") else np.dtype(dtype)
    rng = np.random.default_rng(10)
    for n in (511, 1000, 4099):
        values = random_f32(rng, n, 12, scale=1.0).astype(dt)
        assert check_against_torch([values.copy(), values[1:].copy()], 1 / 3) == 0.0
        for pos in (0, n // 2, n - 1):
            bad = values.copy()
            bad[pos] = np.nan
            assert check_against_torch([values.copy(), bad], 1 / 3) == 1.0, (n, pos)
            assert K.all_finite([bad]) is False


def test_parallel_parts_use_worker_threads(threads_reset, monkeypatch):
    # the parts after the first run on the pool's threads, not on the caller's
    seen = []
    fast = K._fast_path

    def spy(x, kernel):
        fn = fast(x, kernel)

        def run(part, inv, scale):
            seen.append(threading.get_ident())
            return fn(part, inv, scale)

        return run

    monkeypatch.setattr(K, "_fast_path", spy)
    monkeypatch.setattr(K, "PARALLEL_BYTES", 1024)
    K.set_threads(3)
    found = np.zeros((), np.float32)
    K.unscale_and_check_([np.ones(3 * 256, np.float32)], np.array(0.5, np.float32), found)
    assert len(seen) == 3 and seen.count(threading.get_ident()) == 1  # 3 parts, 2 on the pool
    K.set_threads(1)
    seen.clear()
    K.unscale_and_check_([np.ones(3 * 256, np.float32)], np.array(0.5, np.float32), found)
    assert seen == [threading.get_ident()]


def test_threads_setting_and_env(threads_reset, monkeypatch):
    monkeypatch.delenv(K.THREADS_ENV_VAR, raising=False)
    K.set_threads(None)
    assert K.threads() >= 1
    monkeypatch.setenv(K.THREADS_ENV_VAR, "3")
    assert K.threads() == 3
    K.set_threads(2)
    assert K.threads() == 2
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="set_threads"):
            K.set_threads(bad)
    K.set_threads(None)
    for text in ("0", "two", "-2"):
        monkeypatch.setenv(K.THREADS_ENV_VAR, text)
        with pytest.raises(ValueError, match=K.THREADS_ENV_VAR):
            K.unscale_and_check_([np.ones(3, np.float32)], np.array(0.5, np.float32), np.zeros(()))


def test_parallel_parts_after_fork():
    # a forked child must not wait on the parent's pool threads, which do not exist in it
    code = (
        "import os, sys, numpy as np\n"
        "from polyamp.backends import _numpy_kernels as K\n"
        "K.PARALLEL_BYTES = 1024; K.set_threads(2)\n"
        "f = np.zeros((), np.float32)\n"
        "K.unscale_and_check_([np.ones(4096, np.float32)], np.array(0.5, np.float32), f)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    g = np.ones(4096, np.float32); g[-1] = np.inf\n"
        "    K.unscale_and_check_([g], np.array(0.5, np.float32), f)\n"
        "    os._exit(0 if float(f) == 1.0 and g[0] == 0.5 else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n"
    )
    if not hasattr(os, "fork"):
        pytest.skip("no os.fork on this platform")
    env = {k: v for k, v in os.environ.items() if k not in (K.ENV_VAR, K.THREADS_ENV_VAR)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_compiled_kernels_cover_half_types():
    # float16 and bfloat16 get compiled kernels (float16 where LLVM converts half in hardware)
    pytest.importorskip("numba")
    assert K.compiled_available(), K.compiled_error
    assert {"float32", "float64", "bfloat16"} <= set(K._compiled)
    assert ("float16" in K._compiled) == K._native_half()


def test_float16_without_hardware_conversion_takes_blocked(monkeypatch):
    # where LLVM cannot convert half in hardware the float16 kernel is not built (building it would
    # abort the process); float16 then takes the blocked path, with the same results
    pytest.importorskip("numba")
    monkeypatch.setattr(K, "_compile_tried", False)
    monkeypatch.setattr(K, "_compiled", None)
    monkeypatch.setattr(K, "compiled_error", None)
    monkeypatch.setattr(K, "_native_half", lambda: False)
    K.set_kernel("compiled")
    try:
        assert K.compiled_available()
        assert "float16" not in K._compiled and "bfloat16" in K._compiled
        bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
        assert check_against_torch([bits.view(np.float16)], 1 / 3) == 1.0
    finally:
        K.set_kernel(None)


def test_the_generic_array_api_backend_scales_float16_through_float32():
    """The generic backend (any array-API library without a plugin of its own) scales a float16 loss
    by 65536 through float32, as the NumPy backend does: a float16 scale would be inf."""
    import polyamp

    generic = polyamp.get_backend("array_api")
    scale = np.asarray(65536.0, dtype=np.float32)
    half = generic.scale_array(np.asarray(2.0**-4, dtype=np.float16), scale)
    assert half.dtype == np.float16 and float(half) == 4096.0
    assert float(generic.scale_array(np.asarray(3.0), scale)) == 196608.0
    with pytest.raises(TypeError, match="floating-point"):
        generic.scale_array(np.asarray(3, dtype=np.int32), scale)
