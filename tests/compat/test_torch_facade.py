"""The facade's API and errors, checked against the real torch.amp.GradScaler where torch has them.

Each ``same_error`` case runs one script with torch's scaler and with polyamp's: both must
raise the same exception type, and polyamp's message must start with torch's.
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")

from polyamp.compat.torch import GradScaler  # noqa: E402

import polyamp  # noqa: E402

SCALERS = [torch.amp.GradScaler, GradScaler]


def setup(cls, **kwargs):
    """A scaler, a small seeded model and its SGD optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return cls("cpu", **kwargs), model, torch.optim.SGD(model.parameters(), lr=0.1)


def backward(scaler, model, overflow=False):
    x = torch.ones(1, 3, dtype=next(model.parameters()).dtype)
    loss = model(x).sum() * (math.inf if overflow else 1.0)
    scaler.scale(loss).backward()


def raised(script, cls):
    with pytest.raises(Exception) as info:
        script(cls)
    return info.value


def same_error(script, kind):
    """Both scalers raise ``kind``; polyamp's message starts with torch's (it may add the fix)."""
    theirs, ours = (raised(script, cls) for cls in SCALERS)
    assert isinstance(theirs, kind) and isinstance(ours, kind), (theirs, ours)
    assert str(ours).startswith(str(theirs)), (str(theirs), str(ours))
    return ours


# -- construction ------------------------------------------------------------------------
def test_signature_and_defaults_are_torchs():
    ours = inspect.signature(GradScaler.__init__).parameters
    theirs = inspect.signature(torch.amp.GradScaler.__init__).parameters
    assert [(n, p.default) for n, p in theirs.items()] == [
        (n, p.default) for n, p in list(ours.items())[: len(theirs)]
    ]
    assert polyamp.GradScaler is GradScaler


@pytest.mark.parametrize("kwargs", [{"growth_factor": 1.0}, {"backoff_factor": 1.0}])
def test_bad_factors_raise_torchs_assertion(kwargs):
    error = same_error(lambda cls: cls("cpu", **kwargs), AssertionError)
    name, value = next(iter(kwargs.items()))
    assert f"{name}={value!r}" in str(error)


@pytest.mark.parametrize(
    "kwargs", [{"growth_interval": 0}, {"init_scale": -1.0}, {"backoff_factor": 0.0},
               {"growth_interval": 2.5}, {"min_scale": 4.0, "max_scale": 2.0}],
)
def test_values_torch_accepts_silently_are_refused_with_the_field_named(kwargs):
    if "min_scale" not in kwargs:
        torch.amp.GradScaler("cpu", **kwargs)  # accepted by torch
    with pytest.raises(AssertionError) as info:
        GradScaler("cpu", **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, polyamp.ConfigError)
    assert next(iter(kwargs)) in str(info.value) and "Fix:" in str(info.value)


def test_numpy_scalars_are_accepted_as_factors():
    np = pytest.importorskip("numpy")
    scaler = GradScaler("cpu", init_scale=np.float32(8), growth_factor=np.float64(2))
    assert scaler.get_scale() == 8.0 and scaler.get_growth_factor() == 2.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_cuda_without_cuda_warns_and_disables_like_torch():
    messages = []
    for cls in SCALERS:
        with pytest.warns(UserWarning, match="CUDA is not available.  Disabling.") as caught:
            scaler = cls()
        assert scaler.is_enabled() is False
        x = torch.ones(2)
        assert scaler.scale(x) is x and scaler.state_dict() == {}
        messages.append(str(caught[0].message))
        assert caught[0].filename == __file__  # points at the user's line, as torch's does
    assert messages[1].startswith(messages[0]) and "backend='numpy'" in messages[1]


_ENABLED = """
import sys, warnings
warnings.simplefilter("ignore")
{first}
scaler = polyamp.GradScaler({args})
print(scaler.is_enabled(), sys.modules.get("torch") is not None)
"""


@pytest.mark.parametrize("first", ["import torch, polyamp", "import polyamp"],
                         ids=["torch-imported-first", "torch-not-imported"])
def test_default_device_is_enabled_as_torch_decides_whatever_the_import_order(first):
    out = subprocess.run([sys.executable, "-c", _ENABLED.format(first=first, args="")],
                         capture_output=True, text=True, check=True).stdout.split()
    torch_decides = torch.cuda.amp.common.amp_definitely_not_available() is False
    assert out == [str(torch_decides), "True"]


@pytest.mark.parametrize("args, env", [("backend='numpy'", {}), ("", {"POLYAMP_BACKEND": "numpy"}),
                                       ("'cpu'", {})], ids=["backend=", "env", "cpu"])
def test_no_torch_test_when_the_arrays_are_not_torchs(args, env):
    code = _ENABLED.format(first="import polyamp", args=args)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout.split()
    assert out == ["True", "False"]  # enabled, and torch was not imported to decide it


def test_without_torch_installed_the_default_device_stays_enabled():
    first = "sys.modules['torch'] = None  # as if torch were not installed\nimport polyamp"
    code = _ENABLED.format(first=first, args="")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "False"]


def test_disabled_scaler_passes_everything_through():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for cls in SCALERS:
        scaler = cls("cpu", enabled=False)
        x = torch.ones(2)
        assert scaler.scale(x) is x and scaler.unscale_(opt) is None
        assert scaler.step(opt, closure=lambda: 7.0) == 7.0  # closures allowed when disabled
        assert scaler.update() is None and scaler.get_scale() == 1.0
        assert scaler.state_dict() == {} and scaler.load_state_dict({}) is None
        assert scaler.is_enabled() is False and scaler._get_growth_tracker() == 0
    disabled = GradScaler("cpu", enabled=False)
    assert isinstance(disabled, GradScaler) and disabled.skipped_steps == 0
    assert disabled.last_step_skipped is None
    assert disabled.get_growth_factor() == 2.0  # torch's disabled scaler: AttributeError
    with pytest.raises(AttributeError):
        torch.amp.GradScaler("cpu", enabled=False).get_growth_factor()


def test_setters_torch_takes_silently_are_refused():
    theirs, ours = torch.amp.GradScaler("cpu"), GradScaler("cpu")
    theirs.set_growth_interval(0)
    with pytest.raises(polyamp.ConfigError, match="growth_interval=0"):
        ours.set_growth_interval(0)


# -- scale() -----------------------------------------------------------------------------
def test_scale_of_a_tensor_is_torchs_and_creates_the_state_lazily():
    ours, theirs = GradScaler("cpu", init_scale=3.3), torch.amp.GradScaler("cpu", init_scale=3.3)
    assert ours._scale is None and ours.get_scale() == theirs.get_scale() == 3.3
    x = torch.tensor([1.0, -2.5, 1e30])
    assert torch.equal(ours.scale(x), theirs.scale(x))
    assert ours._scale.dtype == torch.float32 and ours._growth_tracker.dtype == torch.int32
    assert ours.get_scale() == theirs.get_scale() == float(torch.tensor(3.3))


def test_scale_keeps_list_and_tuple_structure_and_maps_other_iterables():
    x, y = torch.ones(2), torch.full((3,), 2.0)
    for cls in SCALERS:
        scaler = cls("cpu", init_scale=4.0)
        out = scaler.scale([x, (y, [x])])
        assert type(out) is list and type(out[1]) is tuple and type(out[1][1]) is list
        assert torch.equal(out[1][0], y * 4) and torch.equal(out[1][1][0], x * 4)
        lazy = scaler.scale(t for t in (x, y))
        assert isinstance(lazy, map) and torch.equal(list(lazy)[1], y * 4)


@pytest.mark.parametrize("bad", [3.0, [1.0], (torch.ones(1), None)], ids=repr)
def test_scale_of_non_tensors_raises_torchs_value_error(bad):
    same_error(lambda cls: cls("cpu").scale(bad), ValueError)


# -- the READY / UNSCALED / STEPPED state machine ---------------------------------------
@pytest.mark.parametrize("verb", ["unscale_", "step", "update"])
def test_verbs_before_scale_raise_torchs_assertion(verb):
    def script(cls):
        scaler, _, opt = setup(cls)
        getattr(scaler, verb)(*([] if verb == "update" else [opt]))

    same_error(script, AssertionError)


def _scaled(cls, **kwargs):
    scaler, model, opt = setup(cls, **kwargs)
    backward(scaler, model)
    return scaler, model, opt


def test_unscale_twice_and_after_step_raise_runtime_error():
    def twice(cls):
        scaler, _, opt = _scaled(cls)
        scaler.unscale_(opt)
        scaler.unscale_(opt)

    def after_step(cls):
        scaler, _, opt = _scaled(cls)
        scaler.step(opt)
        scaler.unscale_(opt)

    same_error(twice, RuntimeError)
    same_error(after_step, RuntimeError)


def test_step_twice_and_closures_raise_runtime_error():
    def twice(cls):
        scaler, _, opt = _scaled(cls)
        scaler.step(opt)
        scaler.step(opt)

    same_error(twice, RuntimeError)
    same_error(lambda cls: setup(cls)[0].step(setup(cls)[2], closure=lambda: 0.0), RuntimeError)


def test_update_without_a_step_raises_torchs_assertion():
    same_error(lambda cls: _scaled(cls)[0].update(), AssertionError)


def test_optimizer_without_gradients_raises_in_step_and_update():
    def step_no_grads(cls):
        scaler, model, opt = _scaled(cls)
        opt.zero_grad(set_to_none=True)
        scaler.step(opt)

    def update_no_grads(cls):
        scaler, model, opt = _scaled(cls)
        opt.zero_grad(set_to_none=True)
        scaler.unscale_(opt)
        scaler.update()

    same_error(step_no_grads, AssertionError)
    same_error(update_no_grads, AssertionError)


def test_fp16_gradients_are_refused_before_anything_is_unscaled():
    def script(cls):
        scaler, model, opt = setup(cls)
        model.half()
        backward(scaler, model)
        script.grads = [p.grad.clone() for p in model.parameters()]
        try:
            scaler.unscale_(opt)
        finally:
            assert all(torch.equal(g, p.grad) for g, p in zip(script.grads, model.parameters(),
                                                              strict=True))

    same_error(script, ValueError)


def test_a_new_iteration_starts_after_update():
    scaler, model, opt = _scaled(GradScaler)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    scaler.update()
    backward(scaler, model)
    scaler.unscale_(opt)  # no "already been called" error
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)


def test_importing_the_facade_imports_no_torch():
    code = "import sys, polyamp, polyamp.compat.torch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_warnings_on_the_happy_path():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler, model, opt = _scaled(GradScaler)
        scaler.step(opt)
        scaler.update()
    assert scaler.last_step_skipped is False


class CountingScaler(GradScaler):
    """A user subclass, as frameworks write them: overrides call super()."""

    def step(self, optimizer, *args, **kwargs):
        self.count = getattr(self, "count", 0) + 1
        return super().step(optimizer, *args, **kwargs)


@pytest.mark.parametrize("enabled", [True, False])
def test_user_subclasses_keep_their_overrides_enabled_or_not(enabled):
    import pickle

    scaler, model, opt = setup(CountingScaler, enabled=enabled)
    backward(scaler, model)
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert isinstance(scaler, CountingScaler) and scaler.is_enabled() is enabled
    assert scaler.count == 1 and not torch.equal(model.weight, before)
    again = pickle.loads(pickle.dumps(scaler))
    assert isinstance(again, CountingScaler) and again.is_enabled() is enabled
    assert again.count == 1 and again.get_scale() == scaler.get_scale()
