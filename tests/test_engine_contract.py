"""LossScaler's loop (`stepped = scaler.step(grads, step_fn); scaler.update()`) and its input checks.

Each misuse raises a clear error and leaves the scaler (and the gradients) as they were.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest

import polyamp
from polyamp import (
    ConfigError,
    ForeignArrayError,
    LossScaleConfig,
    LossScaler,
    NoOpLossScaler,
    ScalerStateError,
    StateDictError,
    StepResult,
)


def _matrix(rows):
    with warnings.catch_warnings():  # np.matrix warns that it is discouraged; that is the point here
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        return np.matrix(rows, np.float32)


def _snapshot(scaler):
    return scaler.host_state(), scaler.steps, scaler.skipped_steps, scaler.has_pending_check


# -- the loop -------------------------------------------------------------------------------
def test_the_rust_loop_runs_as_written(backend_name, make_array):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2))
    applied = []
    for i, bad in enumerate([False, False, True, False]):
        grads = [make_array(np.array([8.0, np.inf if bad else 1.0], np.float32))]
        stepped = scaler.step(grads, lambda i=i: applied.append(i))
        assert bool(stepped) is (not bad) and stepped.skipped is bad and stepped.applied is (not bad)
        scaler.update()
    assert applied == [0, 1, 3] and scaler.steps == 4 and scaler.skipped_steps == 1
    assert scaler.host_state() == (8.0, 1, 0)  # 8 -> 16 (grown) -> 8 (backed off), 1 clean step


def test_step_does_not_update_the_scale():
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    result = scaler.step([np.array([np.inf], np.float32)], lambda: None)
    assert scaler.get_scale() == 8.0 and float(result.scale_before) == 8.0
    scaler.update()
    assert scaler.get_scale() == 4.0 and float(result.scale_before) == 8.0  # a copy, not a view


def test_second_step_before_update_raises_and_changes_nothing():
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    grads = [np.full(2, 8.0, np.float32)]
    scaler.step(grads, lambda: None)
    before, calls = _snapshot(scaler), []
    with pytest.raises(ScalerStateError, match=r"call update\(\) after step\(\)"):
        scaler.step(grads, lambda: calls.append(1))
    assert _snapshot(scaler) == before and calls == [] and grads[0].tolist() == [1.0, 1.0]
    scaler.update()
    scaler.step(grads, lambda: calls.append(1))  # the next iteration works
    assert calls == [1]


def test_step_result_is_truthy_exactly_when_applied_and_has_no_scale_after():
    assert StepResult(False, 1.0) and not StepResult(True, 1.0)
    with pytest.raises(AttributeError, match=r"update\(\) after step\(\)"):
        StepResult(False, 1.0).scale_after  # noqa: B018


def test_unscale_twice_raises_and_divides_once(backend_name, make_array, to_numpy):
    scaler = LossScaler(LossScaleConfig(init_scale=4.0))
    grads = [make_array(np.array([8.0], np.float32))]
    scaler.unscale_(grads)
    before = _snapshot(scaler)
    with pytest.raises(ScalerStateError, match=r"remove the second scaler\.unscale_"):
        scaler.unscale_(grads)
    assert to_numpy(grads[0]).tolist() == [2.0] and _snapshot(scaler) == before
    assert scaler.step(grads, lambda: None)  # step does not unscale again
    assert to_numpy(grads[0]).tolist() == [2.0]
    scaler.update()
    scaler.unscale_(grads)  # a new iteration may unscale again
    assert to_numpy(grads[0]).tolist() == [0.5]


def test_unscale_after_step_raises():
    scaler = LossScaler()
    scaler.step([np.ones(1, np.float32)], lambda: None)
    with pytest.raises(ScalerStateError, match=r"after step\(\).*update\(\)"):
        scaler.unscale_([np.ones(1, np.float32)])


def test_step_unscales_even_after_an_extra_recorded_flag():
    scaler = LossScaler(LossScaleConfig(init_scale=4.0))
    scaler.record_found_inf(np.zeros((), np.float32))  # e.g. a finite-norm check, before step
    grads = [np.full(1, 8.0, np.float32)]
    assert scaler.step(grads, lambda: None) and grads[0].tolist() == [2.0]


def test_noop_scaler_keeps_the_same_loop():
    scaler = NoOpLossScaler()
    calls = []
    for _ in range(2):
        scaler.unscale_([np.ones(1)])
        assert scaler.step([np.ones(1)], lambda: calls.append(1))
        scaler.update()
    assert calls == [1, 1] and scaler.steps == 2
    scaler.step([np.ones(1)], lambda: None)
    with pytest.raises(ScalerStateError, match=r"update\(\) after step\(\)"):
        scaler.step([np.ones(1)], lambda: None)
    scaler.update()
    scaler.unscale_([np.ones(1)])
    with pytest.raises(ScalerStateError, match="second unscale_"):
        scaler.unscale_([np.ones(1)])


# -- logging ----------------------------------------------------------------------------------
def test_backoff_and_absorbed_overflow_log_at_info_growth_at_debug(caplog):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=1, backoff_interval=2))
    bad, good = [np.array([np.inf], np.float32)], [np.array([1.0], np.float32)]
    with caplog.at_level(logging.DEBUG, logger="polyamp"):
        for grads in (bad, bad, good):
            scaler.step([g.copy() for g in grads], lambda: None)
            scaler.update()
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "polyamp"]
    assert records == [
        (logging.INFO, "overflow in gradients: step skipped, loss scale kept at 8 "
                       "(absorbed by backoff_interval=2)"),
        (logging.INFO, "overflow in gradients: step skipped, loss scale backed off 8 -> 4"),
        (logging.DEBUG, "loss scale grew 4 -> 8"),
    ]


# -- scales entering ------------------------------------------------------------------------
BAD_SCALES = [float("nan"), -1.0, 0.0, float("inf"), 1e300, 10**400, 1e-46, True, "2"]


@pytest.mark.parametrize("value", BAD_SCALES, ids=repr)
@pytest.mark.parametrize("bound", [False, True])
def test_set_scale_refuses_non_normal_float32(value, bound):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    if bound:
        scaler.scale(np.float32(1.0))
    before = _snapshot(scaler)
    with pytest.raises(ConfigError, match="value"):
        scaler.set_scale(value)
    assert _snapshot(scaler) == before


def test_set_scale_takes_a_one_element_array_and_checks_it(backend_name, make_array):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    scaler.scale(make_array(np.float32(1.0)))
    scaler.set_scale(make_array(np.array([32.0], np.float32)))
    assert scaler.get_scale() == 32.0
    for bad in (np.array([np.nan], np.float32), np.array([0.0], np.float32), np.ones(2, np.float32)):
        with pytest.raises(ConfigError, match="value"):
            scaler.set_scale(make_array(bad))
    assert scaler.get_scale() == 32.0


@pytest.mark.parametrize("scale", [1e300, 10**400, 1e-46])
def test_load_state_dict_refuses_scales_out_of_float32(scale):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    sd = scaler.state_dict()
    sd["scale"] = scale
    with pytest.raises(StateDictError, match=r"state_dict\['scale'\]"):
        scaler.load_state_dict(sd)
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize("flag", ["yes", 1, 0.0, None.__class__, [True]], ids=repr)
def test_update_refuses_a_flag_that_is_not_a_bool_or_an_array(flag):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    scaler.unscale_([np.ones(1, np.float32)])
    before = _snapshot(scaler)
    with pytest.raises(TypeError, match="found_inf"):
        scaler.update(found_inf=flag)
    assert _snapshot(scaler) == before


def test_update_refuses_a_flag_of_another_library():
    torch = pytest.importorskip("torch")
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    scaler.unscale_([np.ones(1, np.float32)])
    with pytest.raises(ForeignArrayError, match="found_inf"):
        scaler.update(found_inf=torch.ones(()))
    assert scaler.get_scale() == 8.0 and scaler.has_pending_check


def test_update_takes_numpy_bools_and_flag_arrays():
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    scaler.update(found_inf=np.True_)
    assert scaler.get_scale() == 4.0 and scaler.backend is None
    scaler.update(found_inf=np.ones((), np.float32))  # a flag array binds the numpy backend
    assert scaler.get_scale() == 2.0 and scaler.backend.name == "numpy"


@pytest.mark.parametrize("outputs, where", [(None, "outputs=None"), ([np.ones(1), None], r"outputs\[1\]"),
                                            ((np.ones(1), [None]), r"outputs\[1\]\[0\]")])
def test_scale_refuses_none(outputs, where):
    scaler = LossScaler()
    with pytest.raises(TypeError, match=where):
        scaler.scale(outputs)
    assert scaler.backend is None and scaler.state is None


# -- trackers in state dicts ----------------------------------------------------------------
@pytest.mark.parametrize(
    "config, key, value",
    [
        ({"growth_interval": 5}, "growth_tracker", 5),
        ({"growth_interval": 5}, "growth_tracker", 6),
        ({"backoff_interval": 3}, "backoff_tracker", 3),
        ({"growth_interval": 2**40}, "growth_tracker", 2**31),
        ({"backoff_interval": 2**40}, "backoff_tracker", 2**31),
        ({}, "steps", 2**63),
        ({}, "skipped_steps", 10**30),
    ],
)
def test_trackers_at_or_above_their_limit_are_refused(config, key, value):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    sd = LossScaler(LossScaleConfig(**config)).state_dict()
    sd[key] = value
    before = scaler.state_dict()
    with pytest.raises(StateDictError, match=key):
        scaler.load_state_dict(sd)
    assert scaler.state_dict() == before


def test_trackers_just_below_their_limit_load():
    sd = LossScaler(LossScaleConfig(growth_interval=2**40, backoff_interval=4)).state_dict()
    sd.update(growth_tracker=2**31 - 1, backoff_tracker=3)
    scaler = LossScaler()
    scaler.load_state_dict(sd)
    scaler.scale(np.float32(1.0))  # the device state holds them as int32
    assert scaler.host_state() == (2.0**16, 2**31 - 1, 3)


# -- gradients that cannot change in place --------------------------------------------------
@pytest.mark.parametrize(
    "bad, message",
    [
        (_matrix([[8.0, 8.0]]), r"grads\[2\] is a numpy\.matrix.*np\.asarray\(m\)"),
        (np.float32(8.0), r"grads\[2\] is a scalar \(numpy\.float32.*0-d array"),
        (8.0, r"grads\[2\] is a scalar \(builtins\.float"),
    ],
    ids=["matrix", "numpy-scalar", "float"],
)
@pytest.mark.parametrize("call", ["unscale_", "step"])
def test_gradients_that_cannot_change_in_place_are_refused_first(bad, message, call):
    scaler = LossScaler(LossScaleConfig(init_scale=4.0))
    good = np.full(2, 8.0, np.float32)
    args = ([good, None, bad],) + ((lambda: None,) if call == "step" else ())
    with pytest.raises(TypeError, match=message):
        getattr(scaler, call)(*args)
    assert scaler.backend is None and scaler.state is None and not scaler.has_pending_check
    assert good.tolist() == [8.0, 8.0]


def test_zero_d_arrays_are_fine_and_a_bare_array_is_refused():
    scaler = LossScaler(LossScaleConfig(init_scale=4.0))
    with pytest.raises(TypeError, match=r"list of gradient arrays.*\[grad\]"):
        scaler.unscale_(np.ones(3, np.float32))
    grad = np.array(8.0, np.float32)
    scaler.unscale_([grad])
    assert float(grad) == 2.0


def test_numpy_backend_refuses_a_matrix_too():
    backend = polyamp.get_backend("numpy")
    found = np.zeros((), np.float32)
    with pytest.raises(TypeError, match="numpy.matrix"):
        backend.unscale_and_check([_matrix([[1.0]])], np.ones((), np.float32), found)
