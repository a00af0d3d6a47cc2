"""Issue 32 item 7: an interval shortened mid-run moves the scale the same way on every backend.

Each scenario runs steps under one config, changes it (shorter intervals: the trackers may now be
past the limits), and runs more steps. The reference is ``polyamp.policy.next_host_state`` (it
compares ``>=``). Each backend's update kernel runs the same flags twice: on the state as it
stands (every kernel comparing ``>=``), and on the state ``fit_to_config`` cut to the new limits,
as the engine's reconfigure leaves it (torch's fused ``_amp_update_scale_`` compares ``==`` and
needs that). The cupy kernel runs on the host (nvcc), as in test_cupy_kernels_host.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import polyamp
from polyamp import LossScaleConfig, LossScaleState
from polyamp.policy import HostState, fit_to_config, next_host_state, tracker_limits

F, T = False, True

#: name -> (config before, flags before, the change, flags after)
SCENARIOS = {
    "issue-32": (dict(init_scale=1024.0, growth_interval=10), [F] * 7, dict(growth_interval=3), [F] * 4),
    "torch-then-overflow": (dict(init_scale=1024.0, growth_interval=10), [F] * 9,
                            dict(growth_interval=2), [F, F, F, T, F, F, F]),
    "torch-min-scale": (dict(init_scale=1024.0, growth_interval=10, min_scale=1.0), [F] * 7,
                        dict(growth_interval=3), [F, F, F, F, T, F]),
    "paddle-backoff": (dict(rule="paddle", init_scale=1024.0, growth_interval=10, backoff_interval=4),
                       [F, F, T, T, T], dict(backoff_interval=2, growth_interval=1), [T, F, T, T, F]),
    "megatron": (dict(rule="megatron", init_scale=1024.0, growth_interval=10, backoff_interval=4),
                 [T, T, T, F, F, F, F, F], dict(backoff_interval=2, growth_interval=4), [F, T, F, F, T, T]),
    "megatron-backoff-only": (dict(rule="megatron", init_scale=1024.0, backoff_interval=4),
                              [T, T, T], dict(backoff_interval=2), [F, F, T, T, F]),
    "deepspeed": (dict(rule="deepspeed", init_scale=1024.0, growth_interval=10, backoff_interval=3),
                  [T, T, F, F, F, F, F, F, F, F], dict(growth_interval=3, backoff_interval=1),
                  [F, F, T, F, F, F, F]),
    "deepspeed-consecutive": (dict(rule="deepspeed", init_scale=1024.0, growth_interval=10,
                                   backoff_interval=3, consecutive_hysteresis=True),
                              [F] * 8 + [T, T], dict(growth_interval=2, backoff_interval=2), [T, F, F, F, T]),
}


Reference = tuple[LossScaleConfig, list[HostState], LossScaleConfig, HostState, list[HostState]]


def reference(name: str) -> Reference:
    """The pure rule over a scenario: (before, its states, after, the state at the change, after's states)."""
    kwargs, flags, change, flags_after = SCENARIOS[name]
    before = LossScaleConfig(**kwargs)
    after = before.replace(**change)
    state, first = HostState(float(before.init_scale)), []
    for found in flags:
        state = next_host_state(state, found, before)
        first.append(state)
    second, at_change = [], state
    for found in flags_after:
        state = next_host_state(state, found, after)
        second.append(state)
    return before, first, after, at_change, second


def test_the_scenarios_leave_a_tracker_past_the_new_limits():
    """Each scenario tests something: at the change a tracker is past the new config's limits."""
    for name in SCENARIOS:
        _, _, after, at_change, _ = reference(name)
        assert fit_to_config(at_change, after) != at_change, name


#: A 0-d float32 value: what the state's device is taken from (``make_array`` makes it the backend's).
ZERO = np.zeros((), np.float32)


def _fused_torch(backend_name: str, config: LossScaleConfig) -> bool:
    from polyamp.backends.torch import _torch_rule

    return backend_name == "torch" and _torch_rule(config)


def kernel_run(backend_name: str, name: str, fit: bool, like) -> tuple[list[HostState], list[HostState]]:
    """The backend's update_scale over a scenario, read back after every step; ``fit``: the
    trackers are cut at the change and new tracker arrays made, as the engine's reconfigure does."""
    kwargs, flags, change, flags_after = SCENARIOS[name]
    before = LossScaleConfig(**kwargs)
    after = before.replace(**change)
    backend = polyamp.get_backend(backend_name)
    state = LossScaleState(backend.full(before.init_scale, "float32", like),
                           backend.full(0, "int32", like), backend.full(0, "int32", like))
    yes, no = backend.full(1.0, "float32", like), backend.full(0.0, "float32", like)
    runs: list[list[HostState]] = []
    for config, run_flags in ((before, flags), (after, flags_after)):
        if config is after and fit:
            host = fit_to_config(HostState(*(backend.to_host(a) for a in state)), after)
            state = state._replace(growth_tracker=backend.full(host.growth_tracker, "int32", like),
                                   backoff_tracker=backend.full(host.backoff_tracker, "int32", like))
        got = []
        for found in run_flags:
            state = backend.update_scale(state, yes if found else no, config)
            got.append(HostState(*(backend.to_host(a) for a in state)))
        runs.append(got)
    return runs[0], runs[1]


def _same_scales(got: list[HostState], want: list[HostState]) -> bool:
    return [s.scale for s in got] == [s.scale for s in want]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_backend_kernel_is_the_rule_after_a_shortened_interval(backend_name, make_array, name):
    """Fitted at the change, every kernel (torch's fused one too) follows the rule step by step,
    and its scales are the rule's from the unfitted state. Unfitted, every kernel that compares
    ``>=`` (all but torch's fused op) is the rule too."""
    before, first, after, at_change, second = reference(name)
    fitted_state = fit_to_config(at_change, after)
    fitted_want, state = [], fitted_state
    for found in SCENARIOS[name][3]:
        state = next_host_state(state, found, after)
        fitted_want.append(state)
    got_first, got_second = kernel_run(backend_name, name, fit=True, like=make_array(ZERO))
    assert got_first == first, f"{backend_name} {name}: before the change"
    assert got_second == fitted_want, f"{backend_name} {name}: fitted"
    assert _same_scales(got_second, second), f"{backend_name} {name}: fitted scales"
    if not _fused_torch(backend_name, after):
        as_is = kernel_run(backend_name, name, fit=False, like=make_array(ZERO))[1]
        assert as_is == second, f"{backend_name} {name}: as is"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("fit", [True, False], ids=["fitted", "as-is"])
def test_cupy_kernel_is_the_rule_after_a_shortened_interval_emulated(cupy_host_update, name, fit):
    """The cupy update kernel's CUDA body (built for the CPU by nvcc) compares ``>=`` too."""
    before, first, after, at_change, second = reference(name)
    state, got = HostState(float(before.init_scale)), []
    for found in SCENARIOS[name][1]:
        state = cupy_host_update(state, 1.0 if found else 0.0, before)
        got.append(state)
    assert got == first
    state = fit_to_config(state, after) if fit else state
    want, ref = [], state
    for found in SCENARIOS[name][3]:
        state = cupy_host_update(state, 1.0 if found else 0.0, after)
        ref = next_host_state(ref, found, after)
        want.append(ref)
        assert state == ref, (name, fit, len(want))
    assert _same_scales(want, second)


def _engine_run(scaler: polyamp.LossScaler, flags: list[bool]) -> list[HostState]:
    got = []
    for found in flags:
        scaler.update(found)
        got.append(scaler.host_state())
    return got


@pytest.mark.parametrize("name", ["issue-32", "torch-min-scale", "megatron"])
def test_the_engine_after_reconfigure_is_the_rule_and_its_checkpoint_loads(backend_name, make_array, name):
    """LossScaler(..., growth_interval=10), 7 clean steps, reconfigure(growth_interval=3), 4 clean
    steps (issue 32): the scales are the rule's on every backend; state_dict() then loads and
    resumes on the same trajectory."""
    before, first, after, _, second = reference(name)
    kwargs, flags, change, flags_after = SCENARIOS[name]
    scaler = polyamp.LossScaler(LossScaleConfig(**kwargs))
    scaler.bind(make_array(ZERO))
    assert [s.scale for s in _engine_run(scaler, flags)] == [s.scale for s in first]
    scaler.reconfigure(**change)
    got = _engine_run(scaler, flags_after)
    assert [s.scale for s in got] == [s.scale for s in second], backend_name
    most_growth, most_backoff = tracker_limits(after)
    assert all(s.growth_tracker <= most_growth and s.backoff_tracker <= most_backoff for s in got)
    resumed = polyamp.LossScaler()
    resumed.load_state_dict(scaler.state_dict())
    resumed.bind(make_array(ZERO))
    tail = [F, F, F, T, F]
    assert _engine_run(resumed, tail) == _engine_run(scaler, tail)


@pytest.mark.parametrize("name", ["issue-32", "megatron-backoff-only"])
def test_a_checkpoint_taken_right_after_reconfigure_loads_and_follows_the_rule(make_array, name):
    """state_dict() between the change and the next step, trackers still past the new limits: it is
    written fitted, so load_state_dict() takes it (it refuses trackers past the limits), and the
    loaded scaler moves the scale as the rule does from the state at the change."""
    _, _, after, at_change, second = reference(name)
    kwargs, flags, change, flags_after = SCENARIOS[name]
    scaler = polyamp.LossScaler(LossScaleConfig(**kwargs))
    scaler.bind(make_array(ZERO))
    _engine_run(scaler, flags)
    scaler.reconfigure(**change)
    sd = scaler.state_dict()
    assert (sd["growth_tracker"], sd["backoff_tracker"]) == fit_to_config(at_change, after)[1:]
    resumed = polyamp.LossScaler()
    resumed.load_state_dict(sd)
    resumed.bind(make_array(ZERO))
    assert [s.scale for s in _engine_run(resumed, flags_after)] == [s.scale for s in second]
