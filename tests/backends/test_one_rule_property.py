"""One rule on every backend, after any change of config: a property test (hypothesis).

Random configs (every rule; scales near both ends of float32), random overflow sequences, and,
mid-run, random reconfigurations (the engine's ``reconfigure``, the torch facade's
``set_growth_interval``, the paddle facade's ``set_incr_every_n_steps`` and
``set_decr_every_n_nan_or_inf``) and checkpoint round trips. Every backend follows the pure rule
(:func:`polyamp.policy.next_host_state`; a reconfigure fits the trackers to the new limits as the
engine does): the engine on numpy, torch, array-API and paddle arrays; the CuPy update kernel's CUDA
body built for the host (as test_cupy_kernels_host.py runs it); JAX through
:mod:`polyamp.functional` (no reconfigure there: a new config passed to ``update``, the trackers
fitted to it by hand as the engine fits them; its scales are compared); the torch and paddle
facades where the rule is theirs.

A few examples by default (CI time); ``-m slow`` runs many more.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polyamp
from polyamp import LossScaleConfig
from polyamp.policy import HostState, fit_to_config, next_host_state

F32_MAX = float(np.finfo(np.float32).max)
SCALES = st.one_of(
    st.sampled_from([2.0**-126, 2.0**-125, 2.0**-100, 2.0**100, 2.0**126, 2.0**127, F32_MAX]),
    st.integers(-126, 127).map(lambda k: 2.0**k),
)


@st.composite
def runs(draw):
    """(config, ops): ops are ("step", found), ("change", growth_interval, backoff_interval) or
    ("checkpoint",)."""
    rule = draw(st.sampled_from(["torch", "paddle", "megatron", "deepspeed"]))
    backoff = 1 if rule == "torch" else draw(st.integers(1, 4))
    config = LossScaleConfig(rule=rule, init_scale=draw(SCALES),
                             growth_factor=draw(st.sampled_from([2.0, 4.0])),
                             backoff_factor=draw(st.sampled_from([0.5, 0.125])),
                             growth_interval=draw(st.integers(1, 6)), backoff_interval=backoff)
    op = st.one_of(
        st.tuples(st.just("step"), st.booleans()),
        st.tuples(st.just("change"), st.integers(1, 6), st.just(1) if rule == "torch" else st.integers(1, 4)),
        st.tuples(st.just("checkpoint")),
    )
    steps = st.tuples(st.just("step"), st.booleans())
    return config, draw(st.lists(st.one_of(steps, steps, op), min_size=1, max_size=24))


def reference(config: LossScaleConfig, ops) -> list[HostState]:
    state, out = HostState(float(np.float32(config.init_scale))), []
    for op in ops:
        if op[0] == "step":
            state = next_host_state(state, op[1], config)
            out.append(state)
        elif op[0] == "change":
            config = config.replace(growth_interval=op[1], backoff_interval=op[2])
            state = fit_to_config(state, config)
    return out


def _makers() -> dict:
    infos = {i.name: i for i in polyamp.available_backends()}
    makers = {"numpy": lambda a: np.array(a, copy=True)}
    if getattr(infos.get("torch"), "available", False):
        import torch
        makers["torch"] = lambda a: torch.from_numpy(np.array(a, copy=True))
    if getattr(infos.get("array_api"), "available", False):
        import array_api_strict as xps
        makers["array_api"] = lambda a: xps.asarray(np.array(a, copy=True))
    if getattr(infos.get("paddle"), "available", False):
        import paddle
        makers["paddle"] = lambda a: paddle.to_tensor(np.array(a, copy=True))
    return makers


def engine_run(config: LossScaleConfig, ops, make) -> list[HostState]:
    zero = np.zeros((), np.float32)
    scaler = polyamp.LossScaler(config)
    scaler.bind(make(zero))
    out = []
    for op in ops:
        if op[0] == "step":
            scaler.update(op[1])
            out.append(scaler.host_state())
        elif op[0] == "change":
            scaler.reconfigure(growth_interval=op[1], backoff_interval=op[2])
        else:
            resumed = polyamp.LossScaler()
            resumed.load_state_dict(scaler.state_dict())
            resumed.bind(make(zero))
            scaler = resumed
    return out


def cupy_run(config: LossScaleConfig, ops, update) -> list[HostState]:
    state, out = HostState(float(np.float32(config.init_scale))), []
    for op in ops:
        if op[0] == "step":
            state = update(state, 1.0 if op[1] else 0.0, config)
            out.append(state)
        elif op[0] == "change":
            config = config.replace(growth_interval=op[1], backoff_interval=op[2])
            state = fit_to_config(state, config)
    return out


def jax_run(config: LossScaleConfig, ops) -> list[float]:
    jnp = pytest.importorskip("jax.numpy")
    from polyamp import functional as F
    from polyamp.policy import LossScaleState

    state, out = F.init(config, like=jnp.zeros((), jnp.float32)), []
    for op in ops:
        if op[0] == "step":
            state = F.update(state, jnp.asarray(1.0 if op[1] else 0.0, jnp.float32), config)
            out.append(float(state.scale))
        else:  # a checkpoint, or a new config: the state's values as host numbers (fitted to a new
            # config's limits by hand, as the engine's reconfigure does: the functional core has none)
            host = HostState(*[np.asarray(a).item() for a in state])
            if op[0] == "change":
                config = config.replace(growth_interval=op[1], backoff_interval=op[2])
                host = fit_to_config(host, config)
            state = LossScaleState(jnp.asarray(host.scale, jnp.float32),
                                   jnp.asarray(host.growth_tracker, jnp.int32),
                                   jnp.asarray(host.backoff_tracker, jnp.int32))
    return out


def torch_facade_run(config: LossScaleConfig, ops) -> list[HostState]:
    torch = pytest.importorskip("torch")
    from polyamp.compat.torch import GradScaler

    def make():
        return GradScaler("cpu", init_scale=config.init_scale, growth_factor=config.growth_factor,
                          backoff_factor=config.backoff_factor, growth_interval=config.growth_interval)

    param = torch.nn.Parameter(torch.zeros(2))
    opt, scaler, out = torch.optim.SGD([param], lr=0.0), make(), []
    for op in ops:
        if op[0] == "step":
            scaler.scale(torch.ones(()))
            param.grad = torch.full((2,), float("inf") if op[1] else 1.0)
            scaler.step(opt)
            scaler.update()
            out.append(HostState(scaler.get_scale(), scaler._get_growth_tracker(), 0))
        elif op[0] == "change":
            scaler.set_growth_interval(op[1])
        else:
            resumed = make()
            resumed.load_state_dict(scaler.state_dict())
            scaler = resumed
    return out


def paddle_facade_run(config: LossScaleConfig, ops) -> list[float]:
    from polyamp.compat.paddle import GradScaler

    from polyamp.optim import SGD

    def make():
        return GradScaler(init_loss_scaling=config.init_scale, incr_ratio=config.growth_factor,
                          decr_ratio=config.backoff_factor, incr_every_n_steps=config.growth_interval,
                          decr_every_n_nan_or_inf=config.backoff_interval, backend="numpy")

    param = polyamp.Parameter(np.zeros(2, np.float32))
    opt, scaler, out = SGD([param], lr=0.0), make(), []
    for op in ops:
        if op[0] == "step":
            scaler.scale(np.float32(1.0))
            param.grad = np.full(2, np.inf if op[1] else 1.0, np.float32)
            scaler.step(opt)
            scaler.update()
            out.append(float(np.asarray(scaler.state_dict()["scale"]).reshape(-1)[0]))
        elif op[0] == "change":
            scaler.set_incr_every_n_steps(op[1])
            scaler.set_decr_every_n_nan_or_inf(op[2])
        else:
            resumed = make()
            resumed.load_state_dict(scaler.state_dict())
            scaler = resumed
    return out


def check(config: LossScaleConfig, ops, cupy_update) -> None:
    want = reference(config, ops)
    scales = [s.scale for s in want]
    for name, make in _makers().items():
        assert engine_run(config, ops, make) == want, name
    if cupy_update is not None:
        assert cupy_run(config, ops, cupy_update) == want, "cupy kernel (emulated)"
    assert jax_run(config, ops) == scales, "jax (polyamp.functional)"
    if config.rule == "torch":
        assert torch_facade_run(config, ops) == want, "torch facade"
    if config.rule == "paddle":
        assert paddle_facade_run(config, ops) == scales, "paddle facade"


@pytest.fixture(scope="module")
def cupy_update(request):
    """The cupy update kernel built for the host, or None (with the reason printed) without nvcc."""
    try:
        return request.getfixturevalue("cupy_host_update")
    except pytest.skip.Exception as why:
        print(f"the cupy kernel is left out: {why}")
        return None


SETTINGS = dict(deadline=None, derandomize=False, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


@settings(max_examples=12, **SETTINGS)
@given(run=runs())
def test_every_backend_follows_the_rule_through_changes_and_checkpoints(cupy_update, run):
    check(*run, cupy_update)


@pytest.mark.slow
@settings(max_examples=300, **SETTINGS)
@given(run=runs())
def test_every_backend_follows_the_rule_through_changes_and_checkpoints_many(cupy_update, run):
    check(*run, cupy_update)
