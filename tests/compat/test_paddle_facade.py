"""polyamp.compat.paddle: paddle's API, defaults, errors, checkpoints and logging, over NumPy first."""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys

import numpy as np
import pytest
from polyamp.compat import paddle as pp
from polyamp.compat.paddle import AmpScaler, GradScaler, from_torch_state_dict, to_torch_state_dict

import polyamp
from polyamp import BackendNotFoundError, ConfigError, StateDictError
from polyamp.optim import SGD

PADDLE_KEYS = ["scale", "incr_ratio", "decr_ratio", "incr_every_n_steps", "decr_every_n_nan_or_inf",
               "incr_count", "decr_count", "use_dynamic_loss_scaling"]


def numpy_model(value=1.0):
    param = polyamp.Parameter(np.full(3, value, np.float32))
    return param, SGD([param], lr=0.5)


def iterate(scaler, param, opt, bad=False, verb="minimize"):
    """One NumPy iteration: gradient 1.0 per element (times the scale), inf when ``bad``."""
    scale = scaler.scale(np.float32(1.0))
    param.grad = np.full(3, np.inf if bad else 1.0, np.float32) * scale
    if verb == "minimize":
        return scaler.minimize(opt)
    scaler.step(opt)
    scaler.update()
    return None


# -- API and defaults ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["GradScaler", "AmpScaler"])
def test_signature_matches_paddles_plus_keyword_only_extras(name):
    paddle = pytest.importorskip("paddle")
    ours = inspect.signature(getattr(pp, name).__init__).parameters
    theirs = inspect.signature(getattr(paddle.amp, name).__init__).parameters
    positional = [(p.name, p.default) for p in ours.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == [(p.name, p.default) for p in theirs.values()]
    extras = {p.name: p.default for p in ours.values() if p.kind is p.KEYWORD_ONLY}
    assert extras == {"backend": None, "min_scale": None, "max_scale": None, "reducer": None,
                      "diagnose": False, "guard": None, "meter": None}


def test_defaults_of_both_classes():
    grad, amp = GradScaler(), AmpScaler()
    assert (grad.get_init_loss_scaling(), grad.get_incr_every_n_steps()) == (2.0**16, 2000)
    assert (amp.get_init_loss_scaling(), amp.get_incr_every_n_steps()) == (2.0**15, 1000)
    for scaler in (grad, amp):
        assert (scaler.get_incr_ratio(), scaler.get_decr_ratio()) == (2.0, 0.5)
        assert scaler.get_decr_every_n_nan_or_inf() == 1
        assert scaler.is_enable() and scaler.is_use_dynamic_loss_scaling()
        assert scaler.engine.config.product_dtype == "float32"
        assert scaler.engine.config.min_scale is None  # paddle's dygraph update does not clamp
    assert all(callable(getattr(grad, m)) for m in ("step", "update", "unscale_"))
    assert not any(hasattr(amp, m) for m in ("step", "update", "unscale_"))


def test_arguments_map_onto_the_engine_config():
    scaler = GradScaler(True, 1024, 3.0, 0.25, 5, 3, backend="numpy", min_scale=1.0, max_scale=2.0**20)
    config = scaler.engine.config
    assert (config.init_scale, config.growth_factor, config.backoff_factor) == (1024, 3.0, 0.25)
    assert (config.growth_interval, config.backoff_interval) == (5, 3)
    assert (config.min_scale, config.max_scale) == (1.0, 2.0**20)
    assert scaler.engine.backend.name == "numpy"


# -- errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"incr_ratio": 1.0}, r"^The incr_ratio must be > 1.0. Got incr_ratio=1.0.$"),
    ({"decr_ratio": 1.5}, r"^The decr_ratio must be < 1.0. Got decr_ratio=1.5.$"),
    ({"decr_ratio": 0.0}, r"decr_ratio must be in \(0, 1\), got decr_ratio=0.0"),
    ({"incr_every_n_steps": 0}, r"incr_every_n_steps must be an int >= 1, got incr_every_n_steps=0"),
    ({"decr_every_n_nan_or_inf": 1.5}, r"decr_every_n_nan_or_inf must be an int >= 1, got "),
    ({"init_loss_scaling": -1.0},
     r"init_loss_scaling must be a positive normal float32 value, .* got init_loss_scaling=-1.0"),
    ({"use_dynamic_loss_scaling": "yes"}, r"use_dynamic_loss_scaling must be True or False"),
    ({"min_scale": 4.0, "max_scale": 2.0}, r"min_scale must be <= max_scale"),
    ({"incr_ratio": "2"}, r"incr_ratio must be a real number, got incr_ratio='2'"),
])
def test_bad_arguments_name_parameter_and_value(kwargs, message):
    for enable in (True, False):
        with pytest.raises(pp.PaddleConfigError, match=message) as info:
            GradScaler(enable, **kwargs)
        assert isinstance(info.value, AssertionError) and isinstance(info.value, ConfigError)


def test_unknown_backend_is_reported_when_enabled_only():
    with pytest.raises(BackendNotFoundError, match="unknown polyamp backend 'nope'"):
        GradScaler(backend="nope")
    assert not GradScaler(enable=False, backend="nope").is_enable()


@pytest.mark.parametrize("setter, value, message", [
    ("set_incr_ratio", 1.0, r"^The new_incr_ratio must be > 1.0. Got new_incr_ratio=1.0.$"),
    ("set_decr_ratio", 1.0, r"^The new_decr_ratio must be < 1.0. Got new_decr_ratio=1.0.$"),
    ("set_decr_ratio", -0.5, r"new_decr_ratio must be in \(0, 1\), got new_decr_ratio=-0.5"),
    ("set_incr_every_n_steps", 0, r"must be an int >= 1, got new_incr_every_n_steps=0"),
    ("set_decr_every_n_nan_or_inf", "2", r"new_decr_every_n_nan_or_inf must be an int >= 1"),
    ("set_init_loss_scaling", float("nan"), r"new_init_loss_scaling must be a positive normal float32 value"),
    ("set_incr_ratio", None, r"new_incr_ratio must be a real number, got new_incr_ratio=None"),
])
def test_bad_setter_values_raise_and_change_nothing(setter, value, message):
    scaler = GradScaler()
    before = scaler.state_dict()
    with pytest.raises(pp.PaddleConfigError, match=message):
        getattr(scaler, setter)(value)
    after = scaler.state_dict()
    assert after.pop("scale") == before.pop("scale") and after == before


def test_scale_refuses_non_arrays():
    with pytest.raises(TypeError, match=r"The type of 'var' in AmpScaler.scale\(\) must be a Tensor"):
        GradScaler().scale(3.0)


def test_state_machine_errors_over_numpy():
    scaler, (param, opt) = GradScaler(), numpy_model()
    param.grad = np.ones(3, np.float32)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"^unscale_\(\) has already been called on this optimizer"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"^step\(\) has already been called since the last update"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"^unscale_\(\) is being called after step\(\).$"):
        scaler.unscale_(opt)
    scaler.update()
    scaler.unscale_(opt)  # a new iteration


# -- getters and setters ------------------------------------------------------------------
def test_setters_take_effect():
    scaler, (param, opt) = GradScaler(init_loss_scaling=8.0), numpy_model()
    scaler.set_incr_ratio(4.0)
    scaler.set_decr_ratio(0.25)
    scaler.set_incr_every_n_steps(1)
    scaler.set_decr_every_n_nan_or_inf(2)
    assert (scaler.get_incr_ratio(), scaler.get_decr_ratio()) == (4.0, 0.25)
    assert (scaler.get_incr_every_n_steps(), scaler.get_decr_every_n_nan_or_inf()) == (1, 2)
    iterate(scaler, param, opt)
    assert scaler.state_dict()["scale"][0] == 32.0
    iterate(scaler, param, opt, bad=True)
    iterate(scaler, param, opt, bad=True)
    assert scaler.state_dict()["scale"][0] == 8.0


def test_set_init_loss_scaling_restarts_the_scale_keeping_counters():
    scaler, (param, opt) = GradScaler(init_loss_scaling=8.0, incr_every_n_steps=3), numpy_model()
    iterate(scaler, param, opt)
    scaler.set_init_loss_scaling(100.0)
    state = scaler.state_dict()
    assert scaler.get_init_loss_scaling() == 100.0 and state["scale"][0] == 100.0
    assert state["incr_count"] == 1


# -- minimize, step, update ---------------------------------------------------------------
def test_minimize_returns_paddles_values():
    scaler, (param, opt) = GradScaler(init_loss_scaling=4.0), numpy_model()
    optimize_ops, params_grads = iterate(scaler, param, opt)
    assert optimize_ops == [] and params_grads[0][0] is param
    np.testing.assert_array_equal(params_grads[0][1], np.ones(3, np.float32))  # unscaled
    np.testing.assert_array_equal(param.data, np.full(3, 0.5, np.float32))
    assert iterate(scaler, param, opt, bad=True) == (None, None)
    np.testing.assert_array_equal(param.data, np.full(3, 0.5, np.float32))  # skipped
    assert scaler.skipped_steps == 1 and scaler.last_step_skipped is True


class MinimizingOptimizer:
    """An optimizer with paddle's minimize(loss, ...) but no found_inf protocol."""

    def __init__(self, param):
        self._parameter_list, self.calls = [param], []

    def minimize(self, loss, startup_program=None):
        self.calls.append((loss, startup_program))
        return ["op"], [(self._parameter_list[0], self._parameter_list[0].grad)]


def test_minimize_forwards_arguments_and_skips_on_overflow():
    scaler, (param, _) = GradScaler(init_loss_scaling=2.0), numpy_model()
    opt = MinimizingOptimizer(param)
    param.grad = np.full(3, 2.0, np.float32)
    assert scaler.minimize(opt, "loss", startup_program="prog")[0] == ["op"]
    assert opt.calls == [("loss", "prog")]
    np.testing.assert_array_equal(param.grad, np.ones(3, np.float32))
    param.grad = np.full(3, np.nan, np.float32)
    assert scaler.minimize(opt, "loss") == (None, None) and len(opt.calls) == 1


def test_torch_optimizer_through_minimize():
    torch = pytest.importorskip("torch")
    param = torch.nn.Parameter(torch.ones(3))
    opt, scaler = torch.optim.SGD([param], lr=0.5), GradScaler(init_loss_scaling=4.0)
    scaled = scaler.scale((param * 2).sum())
    scaled.backward()
    scaler.minimize(opt, scaled)  # the loss is not passed to torch's step(closure)
    assert scaler.engine.backend.name == "torch"
    assert torch.equal(param.detach(), torch.zeros(3))


def test_paddle_optimizer_decides_through_found_inf():
    paddle = pytest.importorskip("paddle")
    param = paddle.create_parameter([3], "float32", default_initializer=paddle.nn.initializer.Constant(1.0))
    opt, scaler = paddle.optimizer.AdamW(0.1, parameters=[param]), GradScaler(init_loss_scaling=4.0)
    scaled = scaler.scale((param * paddle.to_tensor([1.0, np.inf, 1.0])).sum())
    scaled.backward()
    optimize_ops, params_grads = scaler.minimize(opt, scaled)
    assert optimize_ops == [] and params_grads[0][0] is param  # paddle returns minimize's pair
    np.testing.assert_array_equal(param.numpy(), np.ones(3, np.float32))
    assert scaler.last_step_skipped and scaler.state_dict()["scale"][0] == 2.0


def test_update_without_a_step_counts_a_finite_step_and_repeats_the_last_flag():
    scaler, (param, opt) = GradScaler(init_loss_scaling=8.0, incr_every_n_steps=2), numpy_model()
    scaler.update()  # paddle: no step yet, so "no overflow"
    assert scaler.state_dict()["incr_count"] == 1
    iterate(scaler, param, opt, bad=True, verb="step")
    scaler.update()  # paddle keeps the last step's flag: a second backoff
    assert scaler.state_dict()["scale"][0] == 2.0


def test_fixed_scale_skips_overflow_and_keeps_counters():
    scaler, (param, opt) = GradScaler(init_loss_scaling=8.0, incr_every_n_steps=1,
                                      use_dynamic_loss_scaling=False), numpy_model()
    for bad in (True, False, False, True):
        iterate(scaler, param, opt, bad=bad, verb="step")
        assert scaler.last_step_skipped is bad
    state = scaler.state_dict()
    assert state["scale"][0] == 8.0 and (state["incr_count"], state["decr_count"]) == (0, 0)
    assert state["use_dynamic_loss_scaling"] is False and scaler.skipped_steps == 2


def test_step_scheduler_only_after_applied_steps():
    scaler, (param, opt) = GradScaler(), numpy_model()

    class Scheduler:
        steps = 0

        def step(self):
            self.steps += 1

    sched = Scheduler()
    iterate(scaler, param, opt, bad=True)
    assert not scaler.step_scheduler(sched)
    iterate(scaler, param, opt)
    assert scaler.step_scheduler(sched) and sched.steps == 1


# -- disabled -----------------------------------------------------------------------------
def test_disabled_scaler_passes_through():
    scaler, (param, opt) = GradScaler(enable=False, init_loss_scaling=8.0, incr_ratio=3.0), numpy_model()
    assert isinstance(scaler, GradScaler) and type(scaler) is not GradScaler
    loss = np.float32(2.0)
    assert scaler.scale(loss) is loss
    param.grad = np.full(3, np.inf, np.float32)
    assert scaler.unscale_(opt) is None and scaler.update() is None
    scaler.step(opt)  # never skipped, even on inf
    assert np.isinf(param.data).all()
    assert not scaler.is_enable() and not scaler.is_use_dynamic_loss_scaling()
    assert scaler.get_init_loss_scaling() == 1.0 and scaler.get_incr_ratio() == 3.0
    assert scaler.state_dict() == {} and scaler.load_state_dict({}) is None
    amp = AmpScaler(False)
    assert not amp.is_enable() and not hasattr(amp, "step") and isinstance(amp, AmpScaler)


# -- checkpoints --------------------------------------------------------------------------
def trained(**kwargs):
    scaler, (param, opt) = GradScaler(init_loss_scaling=2.0**10, **kwargs), numpy_model()
    for bad in (False, True, False, False, False, True):
        iterate(scaler, param, opt, bad=bad)
    return scaler


def test_state_dict_has_paddles_keys_and_round_trips():
    scaler = trained(incr_every_n_steps=5, decr_every_n_nan_or_inf=3)
    state = scaler.state_dict()
    assert list(state) == PADDLE_KEYS
    assert state["scale"].dtype == np.float32 and state["scale"].shape == (1,)
    assert (state["incr_count"], state["decr_count"]) == (0, 1)
    fresh = GradScaler()
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    assert again.pop("scale") == state.pop("scale") and again == state
    assert fresh.get_init_loss_scaling() == 2.0**10


def test_extras_round_trip_and_numpy_scalars_load():
    state = trained(min_scale=2.0, max_scale=2.0**12).state_dict()
    assert (state["min_scale"], state["max_scale"]) == (2.0, 2.0**12)
    state.update(incr_ratio=np.float32(2.0), incr_count=np.int64(1))  # as paddle.load may give
    fresh = GradScaler()
    fresh.load_state_dict(state)
    assert fresh.engine.config.min_scale == 2.0 and fresh.state_dict()["incr_count"] == 1


def test_bad_state_dicts_raise_and_change_nothing():
    scaler = GradScaler()
    with pytest.raises(RuntimeError, match="^The input state dict is empty, possibly because"):
        scaler.load_state_dict({})
    good = trained().state_dict()
    with pytest.raises(KeyError, match=r"lacks key\(s\) \['decr_count'\]") as info:
        scaler.load_state_dict({k: v for k, v in good.items() if k != "decr_count"})
    assert isinstance(info.value, StateDictError)
    for key, value in [("scale", np.array([-1.0], np.float32)), ("scale", np.zeros(2, np.float32)),
                       ("incr_ratio", 0.5), ("incr_count", -1), ("decr_every_n_nan_or_inf", 0)]:
        with pytest.raises(StateDictError, match=key if key != "decr_every_n_nan_or_inf" else key):
            scaler.load_state_dict({**good, key: value})
    assert scaler.state_dict()["scale"][0] == 2.0**16 and scaler.get_init_loss_scaling() == 2.0**16


def test_torch_checkpoints_load_into_the_paddle_facade_and_back():
    from polyamp.compat.torch import GradScaler as TorchFacade

    torch_facade = TorchFacade("cpu", init_scale=512.0, growth_interval=7, backoff_interval=3)
    torch_facade.scale(np.float32(1.0))
    torch_facade.unscale_(SGD([polyamp.Parameter(np.ones(1, np.float32), np.full(1, np.inf, np.float32))]))
    torch_facade.update()  # one absorbed overflow: _backoff_tracker=1
    source = torch_facade.state_dict()
    paddle_facade = GradScaler()
    paddle_facade.load_state_dict(source)  # torch's format is recognised and converted
    state = paddle_facade.state_dict()
    assert (state["scale"][0], state["incr_every_n_steps"]) == (512.0, 7)
    assert (state["decr_every_n_nan_or_inf"], state["decr_count"]) == (3, 1)
    assert to_torch_state_dict(state) == source == to_torch_state_dict(from_torch_state_dict(source))
    back = TorchFacade("cpu")
    back.load_state_dict(to_torch_state_dict(state))
    assert back.state_dict() == source


def test_real_torch_checkpoints_convert_both_ways():
    torch = pytest.importorskip("torch")
    real = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=9)
    real.scale(torch.ones(()))
    source = real.state_dict()
    paddle_state = from_torch_state_dict(source)
    assert list(paddle_state) == PADDLE_KEYS and paddle_state["incr_every_n_steps"] == 9
    assert paddle_state["decr_every_n_nan_or_inf"] == 1 and paddle_state["use_dynamic_loss_scaling"]
    restored = torch.amp.GradScaler("cpu")
    restored.load_state_dict(to_torch_state_dict(paddle_state))
    assert restored.state_dict() == source


def test_fixed_scale_has_no_torch_equivalent():
    state = GradScaler(use_dynamic_loss_scaling=False).state_dict()
    with pytest.raises(StateDictError, match="use_dynamic_loss_scaling=False has no torch equivalent"):
        to_torch_state_dict(state)
    assert from_torch_state_dict({}) == {} and to_torch_state_dict({}) == {}
    with pytest.raises(KeyError, match=r"lacks key\(s\) \['_growth_tracker'\]"):
        from_torch_state_dict({"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                               "growth_interval": 5})


# -- logging and imports ------------------------------------------------------------------
def test_scale_changes_are_logged_not_printed(caplog, capsys):
    """Overflows at INFO, growth at DEBUG: importing paddle turns INFO on, and growth is routine."""
    records = {}
    for level in (logging.INFO, logging.DEBUG):
        scaler = GradScaler(init_loss_scaling=8.0, incr_every_n_steps=2, decr_every_n_nan_or_inf=2)
        param, opt = numpy_model()
        caplog.clear()
        with caplog.at_level(level, logger="polyamp"):
            for bad in (True, True, False, False):
                iterate(scaler, param, opt, bad=bad)
        records[level] = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "polyamp"]
    overflows = [
        (logging.INFO, "Found inf or nan in gradients: loss scale kept at 8 (overflow 1 of "
                       "decr_every_n_nan_or_inf=2)"),
        (logging.INFO, "Found inf or nan in gradients: loss scale decreased 8 -> 4 (decr_ratio=0.5)"),
    ]
    assert records[logging.INFO] == overflows
    assert records[logging.DEBUG] == [
        *overflows, (logging.DEBUG, "loss scale increased 4 -> 8 after 2 finite steps (incr_every_n_steps)"),
    ]
    assert capsys.readouterr().out == ""


def test_importing_the_facade_imports_no_framework():
    code = (
        "import sys, numpy as np, polyamp\n"
        "assert not {'torch', 'cupy', 'paddle'} & set(sys.modules)\n"
        "import polyamp.compat.paddle as pp\n"
        "from polyamp.optim import SGD\n"
        "p = polyamp.Parameter(np.ones(2, np.float32)); s = pp.GradScaler()\n"
        "s.scale(np.float32(1.0)); p.grad = np.ones(2, np.float32); s.minimize(SGD([p]))\n"
        "print(sorted({'torch', 'cupy', 'paddle'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_paddle_tensors_after_arrayless_calls_still_choose_paddle():
    paddle = pytest.importorskip("paddle")
    param = paddle.create_parameter([2], "float32")
    opt, scaler = paddle.optimizer.SGD(0.1, parameters=[param]), GradScaler(init_loss_scaling=8.0)
    scaler.update()
    scaler.step(opt)  # no gradients yet: nothing to unscale, nothing skipped
    scaler.update()
    scaled = scaler.scale((param * 2.0).sum())
    assert scaler.engine.backend.name == "paddle" and isinstance(scaled, paddle.Tensor)
    assert scaler.state_dict()["incr_count"] == 2 and not scaler.last_step_skipped


# -- values beyond the device's integers (issue 15) --------------------------------------------
@pytest.mark.parametrize("name", ["incr_every_n_steps", "decr_every_n_nan_or_inf"])
def test_huge_intervals_are_refused_by_constructor_and_state_dict(name):
    with pytest.raises(ConfigError, match=rf"{name} must be an int below 2\*\*63"):
        GradScaler(**{name: 10**30})
    scaler = GradScaler()
    state = scaler.state_dict()
    with pytest.raises(StateDictError, match=rf"{name} must be an int below 2\*\*63"):
        scaler.load_state_dict({**state, name: 10**30})
    assert scaler.state_dict()[name] == state[name]


@pytest.mark.parametrize("lib", ["numpy", "torch", "paddle"])
def test_a_huge_incr_ratio_steps_on_every_backend(lib):
    """paddle multiplies in float32: an int 10**30 ratio overflows the product, and the scale stays
    (the torch backend raised OverflowError "int too big to convert" at the first step)."""
    module = pytest.importorskip(lib)
    scaler = GradScaler(init_loss_scaling=2.0**100, incr_ratio=10**30, incr_every_n_steps=1)
    if lib == "paddle":
        layer = module.nn.Linear(2, 2)
        opt = module.optimizer.SGD(parameters=layer.parameters())
        loss = layer(module.ones([1, 2])).sum()
        scaler.scale(loss).backward()
        args = (loss,)
    else:
        make = module.full if lib == "torch" else lambda shape, v: np.full(shape, v, np.float32)
        param = polyamp.Parameter(make((3,), 1.0))
        param.grad = make((3,), 2.0**100)
        opt, args = SGD([param], lr=0.5), ()
    scaler.minimize(opt, *args)
    assert float(scaler.state_dict()["scale"][0]) == 2.0**100 and scaler.skipped_steps == 0
