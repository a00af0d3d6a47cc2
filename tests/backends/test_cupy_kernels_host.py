"""The cupy backend's CUDA kernel bodies run on the CPU (compiled by nvcc, no GPU needed).

``cupy_host_harness.cu`` runs every (block, thread) of a launch through the same
``__host__ __device__`` functions the ``__global__`` kernels call, over chunk tables built by
the backend's own Python code. Results are held bitwise against torch's CPU
``_amp_foreach_non_finite_check_and_unscale_`` and the policy's ``next_host_state``.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polyamp.backends import _cupy_kernels as kern
from polyamp.backends._cupy_launch import dtype_kind, group_by_kind

from polyamp import LossScaleConfig
from polyamp.config import SCALE_CEILING, SCALE_FLOOR
from polyamp.policy import HostState, next_host_state

ml_dtypes = pytest.importorskip("ml_dtypes")
torch = pytest.importorskip("torch")

KIND_CODE = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3}
DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
          "bfloat16": ml_dtypes.bfloat16}
BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
P, I64 = ctypes.c_void_p, ctypes.c_longlong


@pytest.fixture(scope="module")
def lib(cupy_host_lib):
    """The host harness built as a shared library (skips when nvcc is absent)."""
    return cupy_host_lib


def host_unscale(lib, arrays, scale, found, *, check_only=False, chunk=64, threads=8,
                 max_blocks=5):
    """Launch as the backend does (grouped per dtype, one table each), emulated on the host."""
    scale_arr = np.asarray(scale, dtype=np.float32)
    entries = [(dtype_kind(a.dtype), a.ctypes.data, a.size) for a in arrays]
    for kind, (ptrs, sizes) in group_by_kind(entries).items():
        table, n_chunks = kern.build_table(ptrs, sizes, chunk)
        if n_chunks:
            rc = lib.polyamp_host_unscale(
                KIND_CODE[kind], table.ctypes.data, len(ptrs), n_chunks, chunk,
                scale_arr.ctypes.data, found.ctypes.data, int(check_only),
                min(n_chunks, max_blocks), threads,
            )
            assert rc == 0


def torch_unscale(arrays, scale):
    """torch's CPU kernel on copies: (results as numpy arrays, found flag)."""
    tensors = []
    for a in arrays:
        if a.dtype == ml_dtypes.bfloat16:
            tensors.append(torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16))
        else:
            tensors.append(torch.from_numpy(a.copy()))
    found = torch.zeros(())
    inv = torch.tensor(np.float32(1.0 / np.float64(np.float32(scale))))
    groups = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    for group in groups.values():
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
    out = [t.view(torch.int16).numpy().view(a.dtype) if a.dtype == ml_dtypes.bfloat16
           else t.numpy() for t, a in zip(tensors, arrays, strict=True)]
    return out, float(found)


def assert_same_bits(got, want):
    """Bitwise equal, except that any nan equals any nan (payloads differ between libraries)."""
    bits = BITS[got.dtype.itemsize]
    nan_got = np.isnan(got.astype(np.float64))
    nan_want = np.isnan(want.astype(np.float64))
    np.testing.assert_array_equal(nan_got, nan_want)
    np.testing.assert_array_equal(got.view(bits)[~nan_got], want.view(bits)[~nan_want])


def wide_values(rng, dtype, n):
    """Values over a dtype's whole range: subnormals, signed zeros, big values, some inf/nan."""
    if n == 0:
        return np.zeros(0, dtype)
    lo, hi = {np.float16: (-9, 4.9), np.float64: (-320, 308)}.get(dtype, (-46, 38.6))
    values = rng.standard_normal(n) * 10.0 ** rng.uniform(lo, hi, n)
    values[rng.integers(0, n, 3)] = [0.0, -0.0, np.inf][: min(3, n)]
    if n > 8:
        values[rng.integers(0, n)] = np.nan
    with np.errstate(over="ignore"):
        return values.astype(dtype)


def aligned_or_not(rng, dtype, n, misaligned):
    """An n-element array whose address is 16-byte aligned, or deliberately not."""
    itemsize = np.dtype(dtype).itemsize
    buf = np.zeros(n + 16, dtype=dtype)
    offset = (-buf.ctypes.data % 16) // itemsize
    offset += 1 if misaligned and itemsize < 16 else 0
    return buf[offset: offset + n]


@pytest.mark.parametrize("kind", list(DTYPES))
@pytest.mark.parametrize("scale", [65536.0, 3.0, 1.0, 2.0**-20, 1e-30, 3e38])
def test_unscale_matches_torch_bitwise(lib, kind, scale):
    rng = np.random.default_rng(abs(hash((kind, scale))) % 2**32)
    dtype = DTYPES[kind]
    arrays = []
    for i, n in enumerate([0, 1, 5, 63, 64, 65, 300, 1000]):
        a = aligned_or_not(rng, dtype, n, misaligned=i % 2 == 1)
        a[...] = wide_values(rng, dtype, n)
        arrays.append(a)
    want, want_found = torch_unscale(arrays, scale)
    found = np.zeros((), np.float32)
    host_unscale(lib, arrays, scale, found)
    for got, ref in zip(arrays, want, strict=True):
        assert_same_bits(got, ref)
    assert float(found) == want_found == 1.0


@pytest.mark.parametrize("kind", list(DTYPES))
@pytest.mark.parametrize("chunk,threads,max_blocks", [(64, 4, 3), (64, 32, 100), (8, 1, 1),
                                                      (16384, 256, 4)])
def test_every_element_is_unscaled_exactly_once(lib, kind, chunk, threads, max_blocks):
    dtype = DTYPES[kind]
    rng = np.random.default_rng(7)
    sizes = [0, 1, 7, 8, 63, 64, 65, 129, 257, 3 * chunk + 5]
    arrays = []
    for i, n in enumerate(sizes):
        a = aligned_or_not(rng, dtype, n, misaligned=i % 3 == 2)
        a[...] = rng.integers(-64, 64, n).astype(dtype) * 4
        arrays.append(a)
    before = [a.astype(np.float64) for a in arrays]
    found = np.zeros((), np.float32)
    host_unscale(lib, arrays, 4.0, found, chunk=chunk, threads=threads, max_blocks=max_blocks)
    for a, b in zip(arrays, before, strict=True):
        np.testing.assert_array_equal(a.astype(np.float64), b / 4)  # not twice, not skipped
    assert float(found) == 0.0


def _positions(n, chunk):
    """First, last, around chunk boundaries and around the vector/tail boundary."""
    return sorted({p for p in (0, 1, chunk - 1, chunk, chunk + 1, n - 8, n - 2, n - 1)
                   if 0 <= p < n})


@pytest.mark.parametrize("kind", list(DTYPES))
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_nonfinite_anywhere_sets_the_flag(lib, kind, bad):
    dtype, chunk = DTYPES[kind], 64
    for misaligned in (False, True):
        n = 3 * chunk + 3
        for pos in _positions(n, chunk):
            rng = np.random.default_rng(pos)
            others = [np.ones(5, dtype) for _ in range(3)]
            a = aligned_or_not(rng, dtype, n, misaligned)
            a[...] = 2
            a[pos] = bad
            found = np.zeros((), np.float32)
            host_unscale(lib, [others[0], a, *others[1:]], 2.0, found, chunk=chunk)
            assert float(found) == 1.0, (misaligned, pos)
            assert np.isnan(a[pos]) if np.isnan(bad) else a[pos] == bad
            assert (np.delete(a, pos) == 1).all() and all((o == 0.5).all() for o in others)


@pytest.mark.parametrize("kind", list(DTYPES))
def test_flag_is_never_cleared_and_check_only_writes_nothing(lib, kind):
    dtype = DTYPES[kind]
    a = np.full(100, 3, dtype=dtype)
    found = np.ones((), np.float32)
    host_unscale(lib, [a], 2.0, found)
    assert float(found) == 1.0 and (a == 1.5).all()
    a[50] = np.nan
    snapshot = a.copy()
    found[...] = 0
    host_unscale(lib, [a], 2.0, found, check_only=True)
    assert float(found) == 1.0
    np.testing.assert_array_equal(a.view(BITS[a.itemsize]), snapshot.view(BITS[a.itemsize]))


@pytest.mark.parametrize("kind", ["float32", "float64"])
def test_inv_scale_one_leaves_float_bits_untouched(lib, kind):
    bits = BITS[np.dtype(DTYPES[kind]).itemsize]
    payloads = np.array([0x7FC00001, 0xFFC12345], np.uint32) if kind == "float32" else \
        np.array([0x7FF8000000000001, 0xFFF0000000000ABC], np.uint64)
    a = np.concatenate([np.arange(6, dtype=DTYPES[kind]), payloads.view(DTYPES[kind])])
    snapshot = a.view(bits).copy()
    found = np.zeros((), np.float32)
    host_unscale(lib, [a], 1.0, found)
    np.testing.assert_array_equal(a.view(bits), snapshot)
    assert float(found) == 1.0


configs = st.builds(
    LossScaleConfig,
    init_scale=st.one_of(st.floats(1e-30, 3e38), st.floats(SCALE_FLOOR, 1e-36),
                         st.sampled_from([SCALE_FLOOR, 3 * SCALE_FLOOR])),
    growth_factor=st.sampled_from([2.0, 1.5, 3.0, 1.0001, 1.1, 10.0]),
    backoff_factor=st.sampled_from([0.5, 0.3, 0.7, 0.999, 0.1]),
    growth_interval=st.integers(1, 4),
    backoff_interval=st.integers(1, 3),
    min_scale=st.one_of(st.none(), st.floats(1e-3, 10.0), st.sampled_from([SCALE_FLOOR, 1e-37])),
    max_scale=st.one_of(st.none(), st.floats(1e4, SCALE_CEILING)),
    product_dtype=st.sampled_from(["float64", "float32"]),
).filter(lambda c: c.min_scale is None or c.max_scale is None or c.min_scale <= c.max_scale)

# Short mixed runs, and long overflow runs that reach the floor (2**-126) and then grow again.
update_flags = st.one_of(
    st.lists(st.sampled_from([0.0, 1.0, 2.0, np.nan]), max_size=30),
    st.builds(lambda n, tail: [1.0] * n + tail, st.integers(100, 300),
              st.lists(st.sampled_from([0.0, 1.0]), max_size=10)),
)


def _with_rule(config, rule, consecutive):
    """``config`` under ``rule`` (its own product precision; consecutive_hysteresis for deepspeed)."""
    if rule == "torch":
        return config
    return config.replace(rule=rule, product_dtype=None,
                          consecutive_hysteresis=consecutive and rule == "deepspeed")


configs_every_rule = st.builds(_with_rule, configs,
                               st.sampled_from(["torch", "paddle", "megatron", "deepspeed"]),
                               st.booleans())


@settings(max_examples=300 * settings.default.max_examples // 100, deadline=None)
@given(config=configs_every_rule, flags=update_flags)
def test_update_kernel_agrees_with_the_policy(cupy_host_update, config, flags):
    state = HostState(float(np.float32(config.init_scale)), 0, 0)
    for found in flags:
        want = next_host_state(state, bool(found != 0), config)
        got = cupy_host_update(state, found, config)
        assert np.float32(got.scale).view(np.uint32) == np.float32(want.scale).view(np.uint32)
        assert got[1:] == want[1:]
        state = want


def test_kernel_floor_constant_is_polyamps():
    # _cupy_kernels repeats SCALE_FLOOR so the nvcc tool can load it without polyamp.
    assert kern.SCALE_FLOOR == SCALE_FLOOR == float(np.finfo(np.float32).tiny)


@pytest.mark.parametrize("product_dtype", ["float64", "float32"])
@pytest.mark.parametrize("start", [SCALE_FLOOR, 1.5 * SCALE_FLOOR, 2.0**-125, 2.0**16])
def test_update_kernel_stops_at_the_floor(cupy_host_update, product_dtype, start):
    """Backoffs from any scale end exactly on 2**-126 (bitwise), never on a subnormal or 0."""
    config = LossScaleConfig(init_scale=start, product_dtype=product_dtype)
    state = HostState(start, 0, 0)
    for _ in range(200):
        state = cupy_host_update(state, 1.0, config)
        assert state.scale >= SCALE_FLOOR
    assert np.float32(state.scale).view(np.uint32) == np.float32(SCALE_FLOOR).view(np.uint32)
    grown = cupy_host_update(state._replace(growth_tracker=config.growth_interval - 1), 0.0, config)
    assert grown.scale == 2 * SCALE_FLOOR


def test_update_kernel_floor_is_min_scale_when_set(cupy_host_update):
    config = LossScaleConfig(init_scale=1.0, min_scale=0.3)
    state = HostState(1.0, 0, 0)
    for _ in range(5):
        state = cupy_host_update(state, 1.0, config)
    assert state.scale == float(np.float32(0.3))


torch_rule_configs = st.builds(
    LossScaleConfig,
    init_scale=st.one_of(st.floats(1e-30, 3e38), st.sampled_from([SCALE_FLOOR, 3 * SCALE_FLOOR, 2.0**16])),
    growth_factor=st.sampled_from([2.0, 1.5, 3.0, 1.0001, 1.1, 10.0]),
    backoff_factor=st.sampled_from([0.5, 0.3, 0.7, 0.999, 0.1]),
    growth_interval=st.integers(1, 4),
    min_scale=st.sampled_from([None, SCALE_FLOOR]),  # the floor: the same rule either way
    max_scale=st.sampled_from([None, SCALE_CEILING]),  # float32's max: the same rule either way
)


@settings(max_examples=200 * settings.default.max_examples // 100, deadline=None)
@given(config=torch_rule_configs, flags=update_flags)
def test_update_kernel_agrees_with_torchs_own_update(cupy_host_update, torch_amp_update, config, flags):
    """The kernel against ``torch._amp_update_scale_`` itself, not only the policy's reference."""
    state = HostState(float(np.float32(config.init_scale)), 0, 0)
    for found in flags:
        want = torch_amp_update(state, found, config)
        got = cupy_host_update(state, found, config)
        assert np.float32(got.scale).view(np.uint32) == np.float32(want.scale).view(np.uint32), found
        assert got[1:] == want[1:]
        state = want
