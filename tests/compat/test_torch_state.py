"""The facade's state: update(new_scale), getters, setters, checkpoints, pickling; against torch."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyamp.compat.torch import GradScaler  # noqa: E402

import polyamp  # noqa: E402
from polyamp.config import short_repr  # noqa: E402

SCALERS = [torch.amp.GradScaler, GradScaler]


def trained(cls, steps=5, overflow_at=(1,), **kwargs):
    """A scaler after ``steps`` iterations of a small model (overflows at ``overflow_at``)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = cls("cpu", **{"init_scale": 2.0**10, "growth_interval": 2, **kwargs})
    for step in range(steps):
        opt.zero_grad()
        loss = model(torch.ones(1, 3)).sum() * (math.inf if step in overflow_at else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return scaler, model, opt


def _scaled(cls, **kwargs):
    """A scaler whose state exists (after one scale() and backward)."""
    scaler, model, opt = trained(cls, 0, **kwargs)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    return scaler, model, opt


def same_error(script, kind):
    """Both scalers raise ``kind``; polyamp's message starts with torch's."""
    errors = []
    for cls in SCALERS:
        with pytest.raises(kind) as info:
            script(cls)
        errors.append(str(info.value))
    assert errors[1].startswith(errors[0]), errors


# -- update(new_scale) -------------------------------------------------------------------
@pytest.mark.parametrize(
    "new_scale", [3.3, torch.tensor(5.5, dtype=torch.float64), torch.tensor(1.0)], ids=repr
)
def test_update_with_a_new_scale_matches_torch(new_scale):
    results = []
    for cls in SCALERS:
        scaler, _, _ = _scaled(cls)
        scaler.update(new_scale)
        results.append((scaler.get_scale(), scaler._get_growth_tracker()))
    assert results[0] == results[1]
    assert results[1][0] == float(torch.tensor(float(new_scale)))


def test_update_with_a_tensor_copies_it():
    scaler, _, _ = _scaled(GradScaler)
    new = torch.tensor(8.0)
    scaler.update(new)
    new.fill_(1.0)
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize(
    "new_scale",
    [
        torch.tensor(2.0, device="meta"),
        torch.tensor([2.0, 3.0]),
        torch.tensor(2.0, requires_grad=True),
    ],
    ids=["other-device", "two-elements", "requires-grad"],
)
def test_update_with_a_bad_tensor_raises_torchs_assertion(new_scale):
    same_error(lambda cls: _scaled(cls)[0].update(new_scale), AssertionError)


def test_update_with_an_int_is_accepted_and_a_string_refused():
    scaler, _, _ = _scaled(GradScaler)
    scaler.update(1024)
    assert scaler.get_scale() == 1024.0
    with pytest.raises(AttributeError):  # 'int' object has no attribute 'device'
        _scaled(torch.amp.GradScaler)[0].update(1024)
    with pytest.raises(TypeError, match="new_scale='big'"):
        scaler.update("big")


# -- getters and setters ----------------------------------------------------------------
def test_getters_and_setters_match_torch():
    pairs = [cls("cpu", growth_interval=7) for cls in SCALERS]
    for scaler in pairs:
        scaler.set_growth_factor(3.0)
        scaler.set_backoff_factor(0.25)
        scaler.set_growth_interval(5)
    for getter in ("get_growth_factor", "get_backoff_factor", "get_growth_interval",
                   "get_scale", "_get_growth_tracker", "is_enabled"):
        assert getattr(pairs[0], getter)() == getattr(pairs[1], getter)(), getter


def test_setters_validate_and_name_the_value():
    scaler = GradScaler("cpu")
    with pytest.raises(ValueError, match=r"growth_factor.*0\.5"):
        scaler.set_growth_factor(0.5)
    with pytest.raises(ValueError, match="growth_interval"):
        scaler.set_growth_interval(0)
    assert scaler.get_growth_factor() == 2.0 and scaler.get_growth_interval() == 2000


@pytest.mark.parametrize("steps", [0, 1, 2, 5])
def test_state_dict_is_torchs(steps):
    theirs, ours = (trained(cls, steps)[0] for cls in SCALERS)
    assert ours.state_dict() == theirs.state_dict()
    assert list(ours.state_dict()) == list(theirs.state_dict())


def test_state_dicts_load_into_each_other():
    source_t, source_p = trained(torch.amp.GradScaler, 5)[0], trained(GradScaler, 4)[0]
    into_p, into_t = GradScaler("cpu"), torch.amp.GradScaler("cpu")
    into_p.load_state_dict(source_t.state_dict())
    into_t.load_state_dict(source_p.state_dict())
    assert into_p.state_dict() == source_t.state_dict()
    assert into_t.state_dict() == source_p.state_dict()
    x = torch.ones(1)
    assert torch.equal(into_p.scale(x), source_t.scale(x))
    assert into_p._get_growth_tracker() == source_t._get_growth_tracker() == 1


def test_load_after_the_state_exists_overwrites_it():
    scaler = trained(GradScaler, 3)[0]
    scaler.load_state_dict({"scale": 8.0, "growth_factor": 3.0, "backoff_factor": 0.125,
                            "growth_interval": 9, "_growth_tracker": 4})
    assert scaler.get_scale() == 8.0 and scaler._get_growth_tracker() == 4
    assert scaler.get_growth_factor() == 3.0 and scaler.get_growth_interval() == 9


def test_polyamp_extras_round_trip_and_torch_ignores_them():
    scaler = trained(GradScaler, 3, overflow_at=(2,), backoff_interval=2, max_scale=2.0**20)[0]
    state = scaler.state_dict()
    assert state["backoff_interval"] == 2 and state["_backoff_tracker"] == 1
    assert state["max_scale"] == 2.0**20
    again = GradScaler("cpu")
    again.load_state_dict(state)
    assert again.state_dict() == state
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(state)
    assert theirs.get_scale() == state["scale"]


def test_engine_format_loads_too():
    scaler = trained(GradScaler, 3)[0]
    again = GradScaler("cpu")
    again.load_state_dict(scaler.engine.state_dict())
    assert again.state_dict() == scaler.state_dict()


def test_empty_state_dict_raises_torchs_runtime_error():
    messages = []
    for cls in SCALERS:
        with pytest.raises(RuntimeError) as info:
            cls("cpu").load_state_dict({})
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_missing_key_is_a_key_error_and_changes_nothing():
    scaler = trained(GradScaler, 3)[0]
    before = scaler.state_dict()
    bad = dict(before)
    del bad["_growth_tracker"]
    with pytest.raises(KeyError) as info:
        scaler.load_state_dict(bad)
    assert isinstance(info.value, polyamp.StateDictError) and "_growth_tracker" in str(info.value)
    with pytest.raises(KeyError):
        torch.amp.GradScaler("cpu").load_state_dict(bad)
    assert scaler.state_dict() == before


BAD_VALUES = [
    ("growth_factor", "2"), ("growth_factor", math.inf), ("growth_factor", math.nan),
    ("growth_factor", 10**400), ("growth_factor", 0.5), ("growth_factor", True),
    ("backoff_factor", math.nan), ("backoff_factor", -math.inf), ("backoff_factor", 1.0),
    ("scale", math.inf), ("scale", math.nan), ("scale", 1e300), ("scale", 10**400),
    ("scale", 1e-46), ("scale", -1.0), ("scale", "big"), ("scale", None),
    ("growth_interval", math.inf), ("growth_interval", 10**30), ("growth_interval", 2.5),
    ("growth_interval", "many"), ("growth_interval", 0),
    ("_growth_tracker", math.inf), ("_growth_tracker", math.nan), ("_growth_tracker", 10**30),
    ("_growth_tracker", 2**31), ("_growth_tracker", 9), ("_growth_tracker", -2),
    ("_growth_tracker", 1.5), ("_growth_tracker", "3"),
    ("backoff_interval", 10**30), ("backoff_interval", 0), ("_backoff_tracker", 1),
    ("min_scale", "x"), ("max_scale", math.inf), ("max_scale", 1e39),
]


@pytest.mark.parametrize("key, value", BAD_VALUES, ids=lambda v: short_repr(v, 16))
def test_invalid_values_are_refused_naming_the_key_as_written_and_nothing_changes(key, value):
    scaler, model, opt = trained(GradScaler, 3)
    before, scale_tensor = scaler.state_dict(), scaler._scale.clone()
    with pytest.raises(polyamp.StateDictError) as info:  # torch loads all but None; see docs
        scaler.load_state_dict({**before, "growth_interval": 9, key: value})
    message = str(info.value)
    assert f"{key}={short_repr(value)}" in message, message  # the user's key and value
    assert "Fix: load a state dict written by GradScaler.state_dict()" in message
    if key.startswith("_"):
        assert f" {key.lstrip('_')}" not in message and "config" not in message, message
    assert scaler.state_dict() == before and torch.equal(scaler._scale, scale_tensor)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()  # and it trains on as before
    scaler.step(opt)
    scaler.update()
    grown = before["_growth_tracker"] + 1 == before["growth_interval"]
    assert scaler.get_scale() == before["scale"] * (2 if grown else 1)


def test_values_torch_writes_or_takes_still_load():
    scaler = GradScaler("cpu")
    scaler.load_state_dict({"scale": torch.tensor(8.0), "growth_factor": np.float32(4),
                            "backoff_factor": np.float64(0.25), "growth_interval": 7.0,
                            "_growth_tracker": torch.tensor(6, dtype=torch.int32)})
    assert scaler.state_dict() == {"scale": 8.0, "growth_factor": 4.0, "backoff_factor": 0.25,
                                   "growth_interval": 7, "_growth_tracker": 6}


@pytest.mark.parametrize("interval", [2**31, 2**62, 2**63 - 1])
def test_a_never_reached_interval_round_trips(interval):
    scaler = trained(GradScaler, 3, growth_interval=interval)[0]
    again = GradScaler("cpu")
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == scaler.state_dict()
    assert again.get_growth_interval() == interval


def test_an_interval_past_int64_is_refused_where_torch_fails_at_the_first_update():
    with pytest.raises(ValueError, match="Overflow"):  # torch: a raw error, after the step
        trained(torch.amp.GradScaler, 1, growth_interval=10**30)
    with pytest.raises(AssertionError, match=r"growth_interval must be an int below 2\*\*63"):
        GradScaler("cpu", growth_interval=10**30)
    scaler = GradScaler("cpu")
    with pytest.raises(polyamp.ConfigError, match="growth_interval=10000"):
        scaler.set_growth_interval(10**30)
    with pytest.raises(polyamp.StateDictError) as info:  # the config's message, then the load's fix
        scaler.load_state_dict({**scaler.state_dict(), "growth_interval": 10**30})
    assert "growth_interval=10000" in str(info.value) and ".." not in str(info.value)
    assert scaler.get_growth_interval() == 2000


def test_a_state_dict_that_is_not_a_dict_is_named():
    with pytest.raises(polyamp.StateDictError, match=r"must be a dict.*\(list\)"):
        GradScaler("cpu").load_state_dict([("scale", 2.0)])


# -- pickling ----------------------------------------------------------------------------
def _mid_iteration(cls, stop):
    scaler, model, opt = trained(cls, 2)
    loss = model(torch.ones(1, 3)).sum()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    if stop == "stepped":
        scaler.step(opt)
    return scaler


@pytest.mark.parametrize("stop", ["unscaled", "stepped"])
def test_pickling_mid_iteration_raises_torchs_assertion(stop):
    messages = []
    for cls in SCALERS:
        with pytest.raises(AssertionError) as info:
            pickle.dumps(_mid_iteration(cls, stop))
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_pickling_after_a_refused_fp16_unscale_raises_like_torch():
    for cls in SCALERS:
        scaler, model, opt = trained(cls, 1, overflow_at=())
        scaler.scale(model.half()(torch.ones(1, 3, dtype=torch.half)).sum()).backward()
        with pytest.raises(ValueError):
            scaler.unscale_(opt)
        with pytest.raises(AssertionError, match="may only be pickled"):
            pickle.dumps(scaler)


@pytest.mark.parametrize("steps", [0, 4])
def test_pickle_round_trip_keeps_state_and_counters(steps):
    scaler = trained(GradScaler, steps, overflow_at=(1, 2))[0]
    for again in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert type(again) is GradScaler and again.is_enabled()
        assert again.state_dict() == scaler.state_dict()
        assert again.skipped_steps == scaler.skipped_steps == (2 if steps else 0)
        theirs = pickle.loads(pickle.dumps(trained(torch.amp.GradScaler, steps, (1, 2))[0]))
        assert again.state_dict() == theirs.state_dict()


def test_pickled_scaler_recreates_its_state_lazily_on_the_tensors_device():
    scaler = trained(GradScaler, 3)[0]
    again = pickle.loads(pickle.dumps(scaler))
    assert again._scale is None  # as torch: re-created by the next scale()
    assert again.get_scale() == scaler.get_scale() == 2.0**9
    assert torch.equal(again.scale(torch.ones(1)), torch.tensor([2.0**9]))
    assert again._scale.device.type == "cpu" and again._scale.dtype == torch.float32


def test_disabled_scaler_pickles_as_disabled():
    for cls in SCALERS:
        again = pickle.loads(pickle.dumps(cls("cpu", enabled=False)))
        assert again.is_enabled() is False


def _one_step(scaler):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("key, value, later", [
    ("growth_factor", "2", TypeError), ("scale", 1e300, RuntimeError),
    ("_growth_tracker", 10**30, OverflowError),
])
def test_torch_loads_what_polyamp_refuses_and_fails_later(key, value, later):
    """What docs/coming-from-torch.md says of torch: the bad value loads, the next step fails."""
    good = trained(torch.amp.GradScaler, 3)[0].state_dict()
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict({**good, key: value})  # no error from torch
    with pytest.raises(later):
        _one_step(theirs)
    with pytest.raises(polyamp.StateDictError):
        GradScaler("cpu").load_state_dict({**good, key: value})


def test_torch_loads_a_tracker_at_its_interval_and_never_grows_again():
    good = trained(torch.amp.GradScaler, 3)[0].state_dict()
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict({**good, "_growth_tracker": good["growth_interval"]})
    for _ in range(2 * good["growth_interval"]):
        _one_step(theirs)
    assert theirs.get_scale() == good["scale"]  # stuck: the tracker passed the interval
    with pytest.raises(polyamp.StateDictError, match="_growth_tracker=2"):
        GradScaler("cpu").load_state_dict({**good, "_growth_tracker": good["growth_interval"]})


@pytest.mark.parametrize("rule", ["megatron", "deepspeed"])
def test_a_rule_beyond_torchs_survives_the_facades_own_state_dict(rule):
    """Issue 32 item 6: a Megatron or DeepSpeed engine state loaded into the facade runs that rule,
    and the facade's own state_dict() keeps it, so a resume runs the same rule (it resumed torch's)."""
    torch = pytest.importorskip("torch")
    import polyamp
    from polyamp import LossScaleConfig, LossScaler

    engine = LossScaler(LossScaleConfig(rule=rule, init_scale=256.0, growth_interval=2, backoff_interval=2))

    def run(scaler, flags):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([p], lr=0.0)
        scales = []
        for bad in flags:
            scaler.scale(torch.ones(()))
            p.grad = torch.full((2,), float("inf") if bad else 1.0)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales

    first = polyamp.GradScaler("cpu")
    first.load_state_dict(engine.state_dict())
    run(first, [False])
    saved = first.state_dict()
    assert saved["rule"] == rule
    resumed = polyamp.GradScaler("cpu")
    resumed.load_state_dict(saved)
    assert resumed.engine.config.rule == rule
    assert run(resumed, [False, True, True, False]) == run(first, [False, True, True, False])
    plain = polyamp.GradScaler("cpu").state_dict()
    assert not set(plain) - {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
