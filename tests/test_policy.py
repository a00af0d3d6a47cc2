"""The loss-scale rule: every implementation against a plain-Python model of DESIGN.md's rule."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polyamp
from polyamp import HostState, LossScaleConfig, LossScaleState, next_host_state, next_state

TINY = np.float32(np.finfo(np.float32).tiny)  # float32's smallest normal, 2**-126


@np.errstate(over="ignore", under="ignore")  # growth past float32's max is part of the rule
def model_run(config: LossScaleConfig, overflows: list[bool]) -> list[tuple[float, int, int]]:
    """DESIGN.md's pseudo-code, written out independently with float32 rounding.

    The floor: a backoff never leaves the scale below min_scale, or below float32's smallest
    normal when min_scale is None (torch's rule would go on to subnormals and 0).
    """
    scale, growth, backoff = np.float32(config.init_scale), 0, 0
    wide = np.float64 if config.products == "float64" else np.float32
    floor = TINY if config.min_scale is None else np.float32(config.min_scale)
    out = []
    for found in overflows:
        if config.dynamic and found:
            growth = 0
            backoff += 1
            if backoff == config.backoff_interval:
                scale = np.float32(wide(scale) * wide(config.backoff_factor))
                if scale < floor:
                    scale = floor
                backoff = 0
        elif config.dynamic:
            backoff = 0
            growth += 1
            if growth == config.growth_interval:
                new = np.float32(wide(scale) * wide(config.growth_factor))
                if np.isfinite(new):
                    if config.max_scale is not None and new > np.float32(config.max_scale):
                        new = np.float32(config.max_scale)
                    scale = new
                growth = 0
        out.append((float(scale), growth, backoff))
    return out


@st.composite
def configs(draw):
    lo = draw(st.one_of(st.none(), st.sampled_from([1.0, 2.0**-3, 128.0, float(TINY), 1e-37])))
    hi = draw(st.one_of(st.none(), st.sampled_from([2.0**18, 2.0**20, 3e38])))
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    near_floor = [float(TINY), 3.0 * float(TINY), 2.0**-120, 1.5e-38, 1e-35]
    return LossScaleConfig(
        init_scale=draw(st.sampled_from([2.0**16, 1.0, 3.0, 2.0**120, 1e-3, *near_floor])),
        growth_factor=draw(st.sampled_from([2.0, 1.5, 3.0, 1.0001])),
        backoff_factor=draw(st.sampled_from([0.5, 0.25, 0.7, 0.999, 0.1])),
        growth_interval=draw(st.integers(1, 5)),
        backoff_interval=draw(st.integers(1, 4)),
        min_scale=lo,
        max_scale=hi,
        dynamic=draw(st.booleans()),
        product_dtype=draw(st.sampled_from(["float64", "float32"])),
    )


short_seqs = st.lists(st.booleans(), min_size=1, max_size=60)
# Long overflow runs: from 2**16 (or 2**120) the default rule reaches 2**-126 in ~140 (~250)
# backoffs; the tail checks that growth restarts from the floor.
long_runs = st.builds(
    lambda n, tail: [True] * n + tail, st.integers(150, 400), st.lists(st.booleans(), max_size=12)
)
overflow_seqs = st.one_of(short_seqs, long_runs)


@settings(max_examples=300 * settings.default.max_examples // 100, deadline=None)
@given(config=configs(), overflows=overflow_seqs)
def test_host_rule_matches_model(config, overflows):
    state = HostState(float(np.float32(config.init_scale)))
    got = []
    for found in overflows:
        state = next_host_state(state, found, config)
        got.append(tuple(state))
    assert got == model_run(config, overflows)


@settings(max_examples=100 * settings.default.max_examples // 100, deadline=None)
@given(config=configs(), overflows=overflow_seqs)
def test_array_rule_matches_model_numpy_and_strict(config, overflows):
    import array_api_compat.numpy as xnp
    import array_api_strict as xps

    for xp in (xnp, xps):
        state = LossScaleState(
            xp.asarray(config.init_scale, dtype=xp.float32),
            xp.asarray(0, dtype=xp.int32),
            xp.asarray(0, dtype=xp.int32),
        )
        got = []
        for found in overflows:
            state = next_state(state, xp.asarray(float(found), dtype=xp.float32), config, xp)
            got.append((float(state.scale), int(state.growth_tracker), int(state.backoff_tracker)))
            assert state.scale.dtype == xp.float32 and state.growth_tracker.dtype == xp.int32
        assert got == model_run(config, overflows)


def _kernel_runs(config, overflows):
    """Per available backend: (name, the states its update kernel leaves after each flag, as host
    numbers), from the config's initial state on that library's device."""
    for info in polyamp.available_backends():
        if not info.available:
            continue
        backend = polyamp.get_backend(info.name)
        like = _like(info.name)
        with _float64(info.name):
            state = LossScaleState(backend.full(config.init_scale, "float32", like),
                                   backend.full(0, "int32", like), backend.full(0, "int32", like))
            got = []
            for found in overflows:
                state = backend.update_scale(state, backend.full(float(found), "float32", like), config)
                got.append(tuple(backend.to_host(a) for a in state))
        yield info.name, got


@settings(max_examples=40 * settings.default.max_examples // 100, deadline=None)
@given(config=configs(), overflows=overflow_seqs)
def test_every_backend_kernel_matches_model(config, overflows):
    for name, got in _kernel_runs(config, overflows):
        assert got == model_run(config, overflows), name


def _with_rule(config, rule, consecutive):
    """``config`` under ``rule`` (its own product precision; consecutive_hysteresis for deepspeed)."""
    if rule == "torch":
        return config
    return config.replace(rule=rule, product_dtype=None,
                          consecutive_hysteresis=consecutive and rule == "deepspeed")


every_rule = st.builds(_with_rule, configs(), st.sampled_from(["torch", "paddle", "megatron", "deepspeed"]),
                       st.booleans())


@settings(max_examples=40 * settings.default.max_examples // 100, deadline=None)
@given(config=every_rule, overflows=overflow_seqs)
def test_every_backend_kernel_matches_the_readable_rule_for_every_rule(config, overflows):
    """Every backend's update kernel against next_host_state, for each LossScaleConfig.rule (the
    engines themselves: tests/backends/test_engine_rules.py)."""
    want, state = [], HostState(float(np.float32(config.init_scale)))
    for found in overflows:
        state = next_host_state(state, found, config)
        want.append(tuple(state))
    for name, got in _kernel_runs(config, overflows):
        assert got == want, (name, config)


def _float64(name):
    """Where the library has float64 for the rule's products: JAX only with x64 on (without it the
    products are float32, within one ulp per step: tests/functional/test_exactness.py)."""
    if name == "jax":
        import jax

        return jax.enable_x64(True)
    return contextlib.nullcontext()


def _like(name):
    if name == "torch":
        import torch

        return torch.zeros(())
    if name == "array_api":
        import array_api_strict

        return array_api_strict.zeros(())
    if name == "cupy":
        import cupy

        return cupy.zeros(())
    if name == "paddle":
        import paddle

        return paddle.zeros([])
    return np.zeros((), np.float32)


@pytest.mark.parametrize("found_value", [1.0, 2.0, 3.0])
def test_found_inf_counts_as_overflow_when_summed(found_value):
    config = LossScaleConfig(init_scale=8.0)
    backend = polyamp.get_backend("numpy")
    state = LossScaleState(*(backend.full(v, d, None) for v, d in
                             [(8.0, "float32"), (0, "int32"), (0, "int32")]))
    state = backend.update_scale(state, backend.full(found_value, "float32", None), config)
    assert backend.to_host(state.scale) == 4.0


FLOOR_CONFIGS = [
    LossScaleConfig(),  # torch's rule: torch's fused kernel on the torch backend
    LossScaleConfig(product_dtype="float32", growth_interval=3),  # paddle's product
    LossScaleConfig(backoff_interval=2, backoff_factor=0.1, init_scale=2.0**120),
    LossScaleConfig(init_scale=1e-30, backoff_factor=0.7, growth_factor=1.0001, growth_interval=1),
]


@pytest.mark.parametrize("config", FLOOR_CONFIGS, ids=["torch", "paddle", "hysteresis", "slow"])
def test_long_overflow_runs_stop_at_the_floor_in_every_backend(config):
    # torch's rule reaches 0 after ~150 overflows from 2**16 and the next finite step writes
    # NaN into the weights; here the scale stops at 2**-126, then grows from there.
    overflows = [True] * 320 * config.backoff_interval + [False] * config.growth_interval * 2
    want = model_run(config, overflows)
    assert want[-1 - config.growth_interval * 2][0] == float(TINY) == polyamp.config.SCALE_FLOOR
    assert want[-1][0] > want[-1 - config.growth_interval][0] > float(TINY)  # grew, twice
    for name, got in _kernel_runs(config, overflows):
        assert got == want, name
        assert min(g[0] for g in got) == polyamp.config.SCALE_FLOOR, name


def test_scale_floor_is_min_scale_when_set_else_float32_smallest_normal():
    from polyamp.policy import scale_floor

    assert scale_floor(LossScaleConfig()) == 2.0**-126
    assert scale_floor(LossScaleConfig(min_scale=2.0**-126)) == 2.0**-126
    assert scale_floor(LossScaleConfig(min_scale=1.0)) == 1.0
    assert scale_floor(LossScaleConfig(min_scale=0.1)) == float(np.float32(0.1))  # as float32


@pytest.mark.parametrize("product_dtype", ["float64", "float32"])
def test_host_rule_backoff_below_the_floor_lands_on_it(product_dtype):
    config = LossScaleConfig(product_dtype=product_dtype, init_scale=3.0 * 2.0**-126)
    state = next_host_state(HostState(3.0 * 2.0**-126), True, config)
    assert state.scale == 1.5 * 2.0**-126  # normal: kept as the product
    assert next_host_state(HostState(1.5 * 2.0**-126), True, config).scale == 2.0**-126
    assert next_host_state(HostState(2.0**-126), True, config).scale == 2.0**-126


@pytest.mark.parametrize("rule", ["torch", "paddle", "megatron", "deepspeed"])
def test_a_state_past_the_configs_limits_backs_off_and_grows_instead_of_sticking(rule):
    """A state made under longer intervals and updated under shorter ones (polyamp.functional takes
    any state): with ``==`` its trackers passed the limit and never met it again, so overflows never
    backed the scale off (every step skipped for ever) and it never grew."""
    from polyamp import functional as F

    config = LossScaleConfig(rule=rule, backoff_interval=2, growth_interval=5)
    past = LossScaleState(np.asarray(np.float32(1024.0)), np.asarray(np.int32(0)), np.asarray(np.int32(3)))
    overflow, finite = np.ones((), np.float32), np.zeros((), np.float32)
    backed = F.update(past, overflow, config)
    host = next_host_state(HostState(1024.0, 0, 3), True, config)
    assert float(backed.scale) == host.scale == 512.0
    assert int(backed.backoff_tracker) == host.backoff_tracker  # the device and the host agree
    again = F.update(backed, overflow, config)  # megatron/deepspeed: spent, backs off again
    spent = polyamp.policy.rule_params(config).keeps_count
    assert float(again.scale) == next_host_state(host, True, config).scale == (256.0 if spent else 512.0)
    delay = polyamp.policy.rule_params(config).growth_delay
    long_past = LossScaleState(past.scale, np.asarray(np.int32(9)), np.asarray(np.int32(0)))
    grown = F.update(long_past, finite, config)
    assert float(grown.scale) == 2048.0 and int(grown.growth_tracker) == delay
    assert next_host_state(HostState(1024.0, 9, 0), False, config) == HostState(2048.0, delay, 0)


@pytest.mark.parametrize("backend", ["numpy", "torch", "paddle"])
def test_an_interval_past_int32_is_never_reached_on_any_backend(backend):
    """torch compared the int32 trackers with the interval wrapped to int32: growth_interval=2**32 + 3
    grew the scale after 3 steps (and ``>=`` with 2**63 - 1 after every step)."""
    lib = pytest.importorskip(backend)
    makers = {"torch": lambda: lib.ones(2), "paddle": lambda: lib.ones([2])}
    make = makers.get(backend, lambda: np.ones(2, "f4"))
    for interval in (2**31, 2**32 + 3, 2**63 - 1):
        for rule in ("torch", "megatron", "deepspeed"):
            config = LossScaleConfig(growth_interval=interval, backoff_interval=2, rule=rule)
            scaler = polyamp.LossScaler(config, backend=backend)
            for _ in range(6):
                scaler.step([make()], lambda: None)
                scaler.update()
            assert scaler.get_scale() == 2.0**16, (backend, interval, rule)
            scaler.step([make() * np.inf], lambda: None)
            scaler.update()
            scaler.step([make() * np.inf], lambda: None)
            scaler.update()  # backoff_interval=2 is still reached: the second overflow backs off
            assert scaler.get_scale() == 2.0**15, (backend, interval, rule)


@st.composite
def rule_configs(draw):
    """A config of any rule (consecutive_hysteresis only with deepspeed), short intervals."""
    rule = draw(st.sampled_from(["torch", "paddle", "megatron", "deepspeed"]))
    extra = {"consecutive_hysteresis": draw(st.booleans())} if rule == "deepspeed" else {}
    return LossScaleConfig(rule=rule, init_scale=1024.0, growth_interval=draw(st.integers(1, 5)),
                           backoff_interval=draw(st.integers(1, 4)), **extra)


@settings(max_examples=300 * settings.default.max_examples // 100, deadline=None)
@given(config=rule_configs(), growth=st.integers(0, 40), backoff=st.integers(0, 40),
       overflows=st.lists(st.booleans(), min_size=1, max_size=30))
def test_a_fitted_state_moves_the_scale_as_the_unfitted_one(config, growth, backoff, overflows):
    """fit_to_config (the engine's reconfigure: issue 32) cuts only the trackers past the limits,
    and from the cut state the rule moves the scale exactly as from the uncut one; the trackers are
    equal from the step that resets them. The array rule agrees with the host rule on both."""
    import array_api_compat.numpy as xnp

    from polyamp.policy import fit_to_config, tracker_limits

    raw = HostState(1024.0, growth, backoff)
    fitted = fit_to_config(raw, config)
    most_growth, most_backoff = tracker_limits(config)
    assert fitted == HostState(1024.0, min(growth, most_growth), min(backoff, most_backoff))
    assert fit_to_config(fitted, config) == fitted
    a, b = raw, fitted
    arrays = LossScaleState(*(np.asarray(v, dtype) for v, dtype in zip(raw, ("f4", "i4", "i4"))))
    for found in overflows:
        a, b = next_host_state(a, found, config), next_host_state(b, found, config)
        arrays = next_state(arrays, np.asarray(float(found), np.float32), config, xnp)
        assert a.scale == b.scale
        assert (float(arrays.scale), int(arrays.growth_tracker), int(arrays.backoff_tracker)) == a
    assert a.growth_tracker == b.growth_tracker  # the first step resets the growth tracker
    if found or polyamp.policy.rule_params(config).finite_refills:  # the backoff tracker too
        assert a == b


def test_a_shortened_growth_interval_grows_at_the_next_clean_step():
    """Issue 32: 7 clean steps under growth_interval=10, then growth_interval=3: the 7 steps
    already meet the new interval, so the next clean step grows (with or without the fit)."""
    from polyamp.policy import fit_to_config

    before = LossScaleConfig(init_scale=1024.0, growth_interval=10)
    state = HostState(1024.0)
    for _ in range(7):
        state = next_host_state(state, False, before)
    after = before.replace(growth_interval=3)
    assert state == HostState(1024.0, 7, 0) and fit_to_config(state, after) == HostState(1024.0, 2, 0)
    for start in (state, fit_to_config(state, after)):
        scales = []
        for _ in range(4):
            start = next_host_state(start, False, after)
            scales.append(start.scale)
        assert scales == [2048.0, 2048.0, 2048.0, 4096.0]
