"""polyamp.compat.paddle under hostile input: checked flags and checkpoints, odd optimizers, copies.

Each test drives the real facade over NumPy (and torch or paddle where installed).
"""

from __future__ import annotations

import ast
import copy
import pickle
from pathlib import Path

import numpy as np
import pytest
from polyamp.compat import paddle as pp
from polyamp.compat.paddle import AmpScaler, GradScaler, from_torch_state_dict, to_torch_state_dict

import polyamp
from polyamp import StateDictError
from polyamp.optim import SGD

COMPAT = Path(pp.__file__).resolve().parent


def numpy_model(value=1.0):
    param = polyamp.Parameter(np.full(3, value, np.float32))
    return param, SGD([param], lr=0.5)


def backward(scaler, param, bad=False):
    """The scaled gradient of ``sum(param)``; inf in every element when ``bad``."""
    scale = scaler.scale(np.float32(1.0))
    param.grad = np.full(3, np.inf if bad else 1.0, np.float32) * scale


def trained(cls=GradScaler, **kwargs):
    scaler, (param, opt) = cls(init_loss_scaling=2.0**10, incr_every_n_steps=3, **kwargs), numpy_model()
    for bad in (False, True, False, False, False, True, False):
        backward(scaler, param, bad)
        scaler.minimize(opt)
    return scaler


def same_state(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return np.array_equal(sa.pop("scale"), sb.pop("scale")) and sa == sb


# -- use_dynamic_loss_scaling only as a bool ----------------------------------------------
@pytest.mark.parametrize("value", ["False", "True", 0, 1, None])
def test_use_dynamic_loss_scaling_must_be_a_bool(value):
    with pytest.raises(pp.PaddleConfigError, match=f"use_dynamic_loss_scaling must be True or False, "
                                                   f"got use_dynamic_loss_scaling={value!r}"):
        GradScaler(use_dynamic_loss_scaling=value)
    scaler = trained()
    before = scaler.state_dict()
    with pytest.raises(StateDictError, match=r"state_dict\['use_dynamic_loss_scaling'\] must be True or "
                                             rf"False, got {value!r}.*Fix: store a bool"):
        scaler.load_state_dict({**before, "use_dynamic_loss_scaling": value})
    assert same_state(scaler, trained()) and scaler.is_use_dynamic_loss_scaling()
    with pytest.raises(StateDictError, match="use_dynamic_loss_scaling"):
        to_torch_state_dict({**before, "use_dynamic_loss_scaling": value})


def test_numpy_bools_are_bools():
    scaler = GradScaler(use_dynamic_loss_scaling=np.bool_(False))
    assert scaler.is_use_dynamic_loss_scaling() is False
    state = trained().state_dict()
    scaler.load_state_dict({**state, "use_dynamic_loss_scaling": np.bool_(True)})
    assert scaler.is_use_dynamic_loss_scaling() is True


# -- checkpoints: clear errors, state unchanged -------------------------------------------
BAD_VALUES = [
    ("scale", "big", r"state_dict\['scale'\] is invalid: scale must be a real number, got scale='big'"),
    ("scale", None, r"scale must be a real number, got scale=None"),
    ("scale", np.array([1024.0, 2048.0], np.float32), r"state_dict\['scale'\] must hold one number, got "
                                                      r"array\(\[1024., 2048.\].* \(2 elements\)\. Fix: "),
    ("scale", np.zeros(0, np.float32), r"must hold one number, .*\(0 elements\)"),
    ("scale", np.array(["big"]), r"must hold one number"),
    ("scale", 1e300, r"scale must be a positive normal float32 value.*got scale=1e\+300"),
    ("scale", np.array([1e-40]), r"positive normal float32 value.*got scale=1e-40"),
    ("scale", np.array([np.inf], np.float32), r"got scale=inf"),
    ("scale", 10**400, r"got scale=1000000000000000000000000000\.\.\.\(401 chars\)"),
    ("incr_count", 10**30, r"state_dict\['incr_count'\] must be an int >= 0 and below "
                           r"incr_every_n_steps=3, got incr_count=1000000000000000000000000000000; .*"
                           r"Fix: set it to 0"),
    ("decr_count", 10**30, r"state_dict\['decr_count'\] must be an int >= 0 and below "
                           r"decr_every_n_nan_or_inf=1, got decr_count=10+;"),
    ("incr_count", 3, r"below incr_every_n_steps=3, got incr_count=3;"),
    ("decr_count", 1, r"below decr_every_n_nan_or_inf=1, got decr_count=1;"),
    ("incr_count", -1, r"got incr_count=-1;"),
    ("incr_count", 1.0, r"got incr_count=1\.0;"),
    ("decr_count", True, r"got decr_count=True;"),
    ("incr_ratio", "2", r"incr_ratio must be a real number, got incr_ratio='2'"),
]


@pytest.mark.parametrize("key, value, message", BAD_VALUES)
def test_bad_checkpoint_values_name_key_value_and_fix(key, value, message):
    scaler, reference = trained(), trained()
    good = scaler.state_dict()
    with pytest.raises(StateDictError, match=message):
        scaler.load_state_dict({**good, key: value})
    assert same_state(scaler, reference)
    assert scaler.get_init_loss_scaling() == reference.get_init_loss_scaling()
    with pytest.raises(StateDictError, match=message):  # the converter checks the same way
        to_torch_state_dict({**good, key: value})


def test_counts_also_stay_below_two_to_the_31():
    """The device trackers are int32: a count must fit even where the interval is larger."""
    scaler = GradScaler(incr_every_n_steps=2**40)
    state = scaler.state_dict()
    scaler.load_state_dict({**state, "incr_count": 2**31 - 1})
    assert scaler.state_dict()["incr_count"] == 2**31 - 1
    with pytest.raises(StateDictError, match=r"below 2\*\*31, got incr_count=2147483648;"):
        scaler.load_state_dict({**state, "incr_count": 2**31})


@pytest.mark.parametrize("key, value, message", [
    ("_growth_tracker", 10**30, r"state_dict\['_growth_tracker'\] must be an int >= 0 and below "
                                r"growth_interval=3, got _growth_tracker=10+;"),
    ("_backoff_tracker", 7, r"state_dict\['_backoff_tracker'\] .* below backoff_interval=1, got "
                            r"_backoff_tracker=7;"),
    ("growth_factor", "2", r"growth_factor must be a real number, got growth_factor='2'"),
    ("backoff_factor", float("inf"), r"backoff_factor must be in \(0, 1\), got backoff_factor=inf"),
    ("scale", "big", r"state_dict\['scale'\] is invalid: scale must be a real number"),
])
def test_torch_format_errors_name_the_torch_keys(key, value, message):
    scaler, reference = trained(), trained()
    torch_state = to_torch_state_dict(scaler.state_dict())
    with pytest.raises(StateDictError, match=message):
        scaler.load_state_dict({**torch_state, key: value})
    assert same_state(scaler, reference)


@pytest.mark.parametrize("scale", [
    np.array([1024.0], np.float32), np.array([[1024.0]]), np.float32(1024.0), np.array(1024.0), 1024.0, 1024,
])
def test_any_one_element_scale_loads(scale):
    scaler = GradScaler()
    scaler.load_state_dict({**trained().state_dict(), "scale": scale})
    assert scaler.state_dict()["scale"][0] == 1024.0 and scaler.get_init_loss_scaling() == 1024.0


def test_framework_tensor_scales_load():
    torch = pytest.importorskip("torch")
    scaler = GradScaler()
    scaler.load_state_dict({**trained().state_dict(), "scale": torch.tensor([512.0])})
    assert scaler.state_dict()["scale"][0] == 512.0
    with pytest.raises(StateDictError, match=r"\(2 elements\)"):
        scaler.load_state_dict({**trained().state_dict(), "scale": torch.ones(2)})
    paddle = pytest.importorskip("paddle")
    scaler.load_state_dict({**trained().state_dict(), "scale": paddle.to_tensor([256.0])})
    assert scaler.state_dict()["scale"][0] == 256.0


def test_paddles_own_checkpoint_round_trips_unchanged():
    state = trained(decr_every_n_nan_or_inf=2).state_dict()
    fresh = GradScaler()
    fresh.load_state_dict(state)
    assert same_state(fresh, trained(decr_every_n_nan_or_inf=2))
    assert from_torch_state_dict(to_torch_state_dict(state)).keys() == state.keys()


# -- minimize returns what the optimizer's minimize returned ------------------------------
class Minimizer:
    """An optimizer whose minimize returns ``result`` rather than paddle's pair."""

    def __init__(self, param, result):
        self._parameter_list, self.result, self.calls = [param], result, 0

    def minimize(self, loss=None):
        self.calls += 1
        self._parameter_list[0].data -= self._parameter_list[0].grad
        return self.result


@pytest.mark.parametrize("result", [None, "done", ("ops", "pairs", "extra"), ["a"]])
@pytest.mark.parametrize("enable", [True, False])
def test_minimize_returns_the_optimizers_result_as_it_is(result, enable):
    scaler, (param, _) = GradScaler(enable, init_loss_scaling=4.0), numpy_model()
    opt = Minimizer(param, result)
    backward(scaler, param)
    assert scaler.minimize(opt, "loss") is result
    assert opt.calls == 1 and np.array_equal(param.data, np.zeros(3, np.float32))
    if enable:  # a skipped step still returns paddle's (None, None), and the optimizer is not called
        backward(scaler, param, bad=True)
        assert scaler.minimize(opt, "loss") == (None, None) and opt.calls == 1


# -- copies -------------------------------------------------------------------------------
COPIERS = {"pickle": lambda s: pickle.loads(pickle.dumps(s)), "deepcopy": copy.deepcopy}


def drive(scaler, param, opt, pattern):
    for bad in pattern:
        backward(scaler, param, bad)
        if isinstance(scaler, GradScaler):
            scaler.step(opt)
            scaler.update()
        else:
            scaler.minimize(opt)


@pytest.mark.parametrize("how", COPIERS)
@pytest.mark.parametrize("cls", [GradScaler, AmpScaler])
@pytest.mark.parametrize("steps", [0, 5])
def test_copies_keep_state_and_are_independent(how, cls, steps):
    scaler = cls(init_loss_scaling=2.0**10, incr_every_n_steps=2, decr_every_n_nan_or_inf=2,
                 max_scale=2.0**20)
    param, opt = numpy_model()
    drive(scaler, param, opt, [False, True, False, False, True][:steps])
    twin = COPIERS[how](scaler)
    assert type(twin) is type(scaler) and twin is not scaler and twin.engine is not scaler.engine
    assert same_state(twin, scaler) and twin.engine.config == scaler.engine.config
    for name in ("skipped_steps", "last_step_skipped", "get_init_loss_scaling", "is_enable"):
        value = getattr(scaler, name)
        assert getattr(twin, name) == value if not callable(value) else getattr(twin, name)() == value()
    twin_param, twin_opt = numpy_model()
    twin_param.data[...] = param.data
    drive(twin, twin_param, twin_opt, [True, True])  # the copy moves, the original does not
    assert not same_state(twin, scaler)
    drive(scaler, param, opt, [True, True])  # the same steps bring the original to the same state
    assert same_state(twin, scaler) and np.array_equal(twin_param.data, param.data)
    assert twin.skipped_steps == scaler.skipped_steps


@pytest.mark.parametrize("how", COPIERS)
@pytest.mark.parametrize("bad", [False, True])
def test_copies_mid_iteration_keep_the_pending_flag(how, bad):
    """After unscale_ the copy still knows whether the gradients overflowed (read on the host)."""
    scaler, (param, opt) = GradScaler(init_loss_scaling=8.0), numpy_model()
    backward(scaler, param, bad)
    scaler.unscale_(opt)
    twin = COPIERS[how](scaler)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        twin.unscale_(opt)  # the same optimizer: the stage was copied
    for s in (scaler, twin):
        s.step(opt)
        s.update()
    assert twin.last_step_skipped is scaler.last_step_skipped is bad
    assert same_state(twin, scaler)


@pytest.mark.parametrize("how", COPIERS)
def test_copies_over_torch_and_paddle_continue_on_their_backend(how):
    torch = pytest.importorskip("torch")
    param = torch.nn.Parameter(torch.ones(3))
    opt, scaler = torch.optim.SGD([param], lr=0.5), GradScaler(init_loss_scaling=4.0)
    scaler.scale((param * 2).sum()).backward()
    scaler.minimize(opt)
    twin = COPIERS[how](scaler)
    assert twin.engine.backend.name == "torch" and same_state(twin, scaler)
    opt.zero_grad()
    twin.scale((param * 2).sum()).backward()
    twin.minimize(opt)
    assert torch.equal(param.detach(), torch.full((3,), -1.0))
    assert twin.engine.state.scale.device == param.device
    paddle = pytest.importorskip("paddle")
    weight = paddle.create_parameter([2], "float32")
    popt, pscaler = paddle.optimizer.SGD(0.1, parameters=[weight]), GradScaler(init_loss_scaling=8.0)
    pscaler.scale((weight * paddle.to_tensor([1.0, np.inf])).sum()).backward()
    pscaler.unscale_(popt)  # an overflow pending; paddle's optimizer reads the copy's host flag
    ptwin = COPIERS[how](pscaler)
    before = weight.numpy().copy()
    ptwin.step(popt)
    ptwin.update()
    assert ptwin.last_step_skipped and np.array_equal(weight.numpy(), before)
    assert ptwin.state_dict()["scale"][0] == 4.0 and pscaler.state_dict()["scale"][0] == 8.0


class MyScaler(GradScaler):
    """A user's subclass with an attribute of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.note = "mine"


@pytest.mark.parametrize("how", COPIERS)
@pytest.mark.parametrize("cls", [GradScaler, AmpScaler, MyScaler])
def test_disabled_scalers_and_subclasses_copy_and_stay_as_they_were(how, cls):
    off = cls(enable=False, incr_ratio=3.0)
    assert isinstance(off, cls) and not off.is_enable() and off.state_dict() == {}
    twin = COPIERS[how](off)
    assert type(twin) is type(off) and not twin.is_enable() and twin.get_incr_ratio() == 3.0
    param, opt = numpy_model()
    param.grad = np.full(3, np.inf, np.float32)
    twin.minimize(opt)  # disabled: never skipped
    assert np.isinf(param.data).all()
    on = COPIERS[how](cls(init_loss_scaling=16.0))
    assert type(on) is cls and on.is_enable() and on.state_dict()["scale"][0] == 16.0
    if cls is MyScaler:
        assert twin.note == on.note == "mine"


def test_a_subclass_with_enable_false_is_disabled():
    """Before, ``_DISABLED.get(cls, cls)`` gave a user's subclass its enabled type back."""
    off = MyScaler(enable=False)
    param, opt = numpy_model()
    param.grad = np.full(3, np.inf, np.float32)
    off.step(opt)
    assert not off.is_enable() and isinstance(off, MyScaler) and np.isinf(param.data).all()
    assert type(MyScaler(enable=False)) is type(off)  # made once


# -- the import graph ---------------------------------------------------------------------
def _compat_imports(module: Path) -> set[str]:
    """The compat modules ``module`` imports anywhere in its body (top level or in functions)."""
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                names.add(node.module)
            elif node.module and node.module.startswith("polyamp.compat."):
                names.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            names.update(a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("polyamp.compat."))
    return {n for n in names if (COMPAT / f"{n}.py").exists()}


def test_no_paddle_facade_module_imports_itself_back():
    graph = {p.stem: _compat_imports(p) for p in COMPAT.glob("*.py")}
    for start in [n for n in graph if n == "paddle" or n.startswith("_paddle_")]:
        seen, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            assert name != start, f"compat/{start}.py is part of an import cycle"
            if name not in seen:
                seen.add(name)
                todo.extend(graph.get(name, ()))
