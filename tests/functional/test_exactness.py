"""Item 3 of issue 24: polyamp.functional against polyamp.LossScaler on NumPy, step by step:
the state after each update, the unscaled gradients and the scaled losses of every dtype.

Hypothesis draws configs (both rules through ``backoff_interval`` and ``product_dtype``, bounds,
``dynamic=False``) and overflow sequences. With power-of-two factors and scales the scale, the
trackers and the unscaled gradients are bitwise equal on every library, JAX without x64 included
(a power-of-two reciprocal and power-of-two products are exact in float32). With other factors:
bitwise where the library has float64 (JAX under ``enable_x64``); without it each update and the
reciprocal are formed in float32, one rounding instead of two, so from the engine's state a new
scale is within 1 float32 ulp and an unscaled float32 gradient within 2 (1 ulp of the reciprocal,
then the product's rounding); float16/bfloat16 gradients, rounded once more, within 1 ulp of theirs.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polyamp
from polyamp import functional as F
from polyamp._dtypes import numpy_bfloat16

# float16 gradients divided by a small scale overflow to inf, as in the engine (whose kernels are quiet)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

POW2 = st.sampled_from([2.0**k for k in range(-8, 25)])


@st.composite
def configs(draw, power_of_two: bool) -> polyamp.LossScaleConfig:
    if power_of_two:
        growth, backoff = draw(st.sampled_from([2.0, 4.0])), draw(st.sampled_from([0.5, 0.25]))
        init = draw(POW2)
        bounds = st.one_of(st.none(), POW2)
    else:
        growth = draw(st.floats(1.01, 8.0))
        backoff = draw(st.floats(0.05, 0.95))
        init = draw(st.floats(1.0, 1e6))
        bounds = st.one_of(st.none(), st.floats(1e-3, 1e7))
    low, high = draw(bounds), draw(bounds)
    if low is not None and high is not None and low > high:
        low, high = high, low
    return polyamp.LossScaleConfig(
        init_scale=init, growth_factor=growth, backoff_factor=backoff,
        growth_interval=draw(st.integers(1, 4)), backoff_interval=draw(st.integers(1, 3)),
        min_scale=low, max_scale=high, dynamic=draw(st.booleans()),
        product_dtype=draw(st.sampled_from(["float64", "float32"])),
    )


OVERFLOWS = st.lists(st.booleans(), min_size=1, max_size=24)
SETTINGS = settings(max_examples=25 * settings.default.max_examples // 100, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _numpy_dtype(name: str):
    return numpy_bfloat16() if name == "bfloat16" else np.dtype(name)


def _gradients(dtypes: tuple[str, ...], overflows: list[bool], seed: int) -> list[list[np.ndarray]]:
    """Per step one gradient of each dtype (values the dtype holds), an inf/nan in one where it overflows."""
    rng = np.random.default_rng(seed)
    steps = []
    for i, bad in enumerate(overflows):
        grads = [(rng.standard_normal(5) * 1e3).astype(_numpy_dtype(d)) for d in dtypes]
        if bad:
            grads[i % len(grads)][i % 5] = (np.inf, -np.inf, np.nan)[i % 3]
        steps.append(grads)
    return steps


def _engine(config: polyamp.LossScaleConfig, steps: list[list[np.ndarray]]):
    """The NumPy engine's state after each step and the gradients it unscaled (in place)."""
    scaler = polyamp.LossScaler(config, backend="numpy")
    states, unscaled = [], []
    for grads in steps:
        losses = [scaler.scale(g[1:2].copy()).astype(np.float64) for g in grads]  # one loss per dtype
        grads = [g.copy() for g in grads]
        scaler.step(grads, lambda: None)
        scaler.update()
        state = scaler.state
        states.append((float(state.scale), int(state.growth_tracker), int(state.backoff_tracker)))
        unscaled.append([g.astype(np.float64) for g in grads] + losses)
    return states, unscaled


def _functional(library, config, steps):
    state = F.init(config, like=library.make(steps[0][0]))
    states, unscaled = [], []
    for grads in steps:
        losses = [library.back(x) for x in F.scale(state, [library.make(g[1:2]) for g in grads])]
        tree = {"layer": [library.make(g) for g in grads]}
        new, found_inf = F.unscale(state, tree)
        state = F.update(state, found_inf, config)
        states.append((float(state.scale), int(state.growth_tracker), int(state.backoff_tracker)))
        unscaled.append([library.back(g) for g in new["layer"]] + losses)
        assert [str(g.dtype) for g in new["layer"]] == [str(g.dtype) for g in tree["layer"]]
    return states, unscaled


def _assert_equal(ours, theirs):
    (states, grads), (ref_states, ref_grads) = ours, theirs
    assert states == ref_states
    for step, (mine, ref) in enumerate(zip(grads, ref_grads)):
        assert len(mine) == len(ref)
        for a, b in zip(mine, ref):
            assert np.array_equal(a, b, equal_nan=True), (step, a, b)


@SETTINGS
@given(config=configs(power_of_two=True), overflows=OVERFLOWS, seed=st.integers(0, 2**16))
def test_power_of_two_factors_are_bitwise_the_engine(library, config, overflows, seed):
    steps = _gradients(library.dtypes, overflows, seed)
    _assert_equal(_functional(library, config, steps), _engine(config, steps))


@SETTINGS
@given(config=configs(power_of_two=False), overflows=OVERFLOWS, seed=st.integers(0, 2**16))
def test_other_factors_are_bitwise_the_engine_with_float64(library, config, overflows, seed):
    dtypes = tuple(dict.fromkeys(library.dtypes + ("float64",)))
    steps = _gradients(dtypes, overflows, seed)
    with library.wide():
        ours = _functional(library, config, steps)
    _assert_equal(ours, _engine(config, steps))


@SETTINGS
@given(config=configs(power_of_two=False), overflows=OVERFLOWS, seed=st.integers(0, 2**16))
def test_jax_without_x64_is_within_one_ulp_of_the_engine(ulp, config, overflows, seed):
    """From each of the engine's states: the next scale within 1 float32 ulp, the unscaled
    gradients within 2 float32 ulps (float32) or 1 ulp of their dtype (float16, bfloat16)."""
    jax = pytest.importorskip("jax", reason="jax is not installed (pip install 'polyamp[jax]')")
    import jax.numpy as jnp

    assert not jax.config.jax_enable_x64
    dtypes = ("float32", "float16", "bfloat16")
    steps = _gradients(dtypes, overflows, seed)
    ref_states, ref_grads = _engine(config, steps)
    before = [(float(np.float32(config.init_scale)), 0, 0)] + ref_states[:-1]
    for (scale, growth, backoff), grads, ref_state, ref in zip(before, steps, ref_states, ref_grads):
        state = polyamp.LossScaleState(jnp.float32(scale), jnp.int32(growth), jnp.int32(backoff))
        new, found_inf = F.unscale(state, [jnp.asarray(g) for g in grads])
        after = F.update(state, found_inf, config)
        assert (int(after.growth_tracker), int(after.backoff_tracker)) == ref_state[1:]
        assert abs(float(after.scale) - ref_state[0]) <= ulp(np.float64(ref_state[0]), "float32")
        for name, mine, theirs in zip(dtypes, new, ref):
            mine = np.asarray(mine.astype(jnp.float32)).astype(np.float64)
            finite = np.isfinite(theirs)
            assert np.array_equal(np.isfinite(mine), finite)
            bound = ulp(theirs[finite], name) * (2 if name == "float32" else 1)
            assert np.all(np.abs(mine[finite] - theirs[finite]) <= bound), (name, mine, theirs)
