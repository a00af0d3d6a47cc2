"""polyamp.optim.Adam / AdamW against torch.optim.Adam / AdamW, across array libraries."""

from __future__ import annotations

import re

import numpy as np
import pytest

from polyamp.optim import Adam, AdamW
from polyamp.optim.adam import _lerp
from polyamp.parameter import Parameter

SHAPES = [(64, 33), (7,), ()]
STEPS = 20

# polyamp reproduces torch's fused multiply-adds (add with alpha, lerp, addcmul) exactly for
# float32, but torch's CPU sqrt (MKL) is not correctly rounded (~0.6% of elements are 1 ulp
# off), so Adam differs from torch by float32 rounding in a few elements, not bitwise.
# Tolerance: rtol=1e-6 (~8 float32 ulps) plus atol=1e-7 for entries that cancel to ~0 (data
# is O(1); worst atol needed over 10 seeds: 3e-8).
RTOL, ATOL = 1e-6, 1e-7

CONFIGS = [
    {},
    {"lr": 0.01},
    {"lr": 0.01, "amsgrad": True},
    {"lr": 0.01, "weight_decay": 0.1},
    {"lr": 0.01, "weight_decay": 0.1, "maximize": True, "amsgrad": True},
    {"lr": 0.003, "betas": (0.3, 0.9), "eps": 0.1},  # lerp weight >= 0.5: torch's 2nd branch
    {"lr": 0.05, "betas": (0.0, 0.5), "maximize": True},
]
CLASSES = ["Adam", "AdamW"]


def assert_close(actual, desired) -> None:
    """Equal to float32 rounding: see RTOL and ATOL."""
    np.testing.assert_allclose(np.asarray(actual), desired, rtol=RTOL, atol=ATOL)


def make_data(seed: int, steps: int = STEPS) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """Float32 initial values for SHAPES and ``steps`` random gradients for each."""
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(steps)]
    return init, grads


def run_polyamp(cls, init, grads, xp=np, **kwargs):
    """Train Parameters of namespace ``xp`` with ``cls`` on the given gradients."""
    params = [Parameter(xp.asarray(np.array(x))) for x in init]
    opt = cls(params, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = xp.asarray(np.array(g))
        opt.step()
    return params, opt


def run_torch(torch, name, init, grads, groups=None, **kwargs):
    """Train torch Parameters with torch.optim.<name> (foreach=False) on the given gradients."""
    tparams = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in init]
    spec = tparams if groups is None else [{**g, "params": [tparams[i]]} for i, g in groups]
    topt = getattr(torch.optim, name)(spec, foreach=False, **kwargs)
    for step_grads in grads:
        for t, g in zip(tparams, step_grads, strict=True):
            t.grad = torch.from_numpy(g.copy())
        topt.step()
    return tparams, topt


@pytest.mark.parametrize(
    "kwargs", CONFIGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items())
)
@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_torch(name, kwargs, seed):
    torch = pytest.importorskip("torch")
    init, grads = make_data(seed)
    params, opt = run_polyamp({"Adam": Adam, "AdamW": AdamW}[name], init, grads, **kwargs)
    tparams, topt = run_torch(torch, name, init, grads, **kwargs)
    for p, t in zip(params, tparams, strict=True):
        assert p.data.dtype == np.float32
        assert_close(p.data, t.detach().numpy())
        state, tstate = opt.state[p], topt.state[t]
        assert state["step"] == tstate["step"].item() == STEPS
        keys = ["exp_avg", "exp_avg_sq"] + ["max_exp_avg_sq"] * kwargs.get("amsgrad", False)
        assert sorted(state) == sorted(tstate)
        # Moments see only the gradients (no L2 term from the param): these match bitwise.
        exact = name == "AdamW" or not kwargs.get("weight_decay")
        for key in keys:
            check = np.testing.assert_array_equal if exact else assert_close
            check(state[key], tstate[key].numpy())


def test_param_groups_match_torch():
    torch = pytest.importorskip("torch")
    init, grads = make_data(5)
    groups = [(0, {"lr": 0.1}), (1, {"weight_decay": 0.5, "amsgrad": True}), (2, {})]
    params = [Parameter(np.array(x)) for x in init]
    opt = AdamW([{**g, "params": [params[i]]} for i, g in groups], lr=0.01)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.copy()
        opt.step()
    tparams, _ = run_torch(torch, "AdamW", init, grads, groups=groups, lr=0.01)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01, 0.01]
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-2, 0.5, 1e-2]
    for p, t in zip(params, tparams, strict=True):
        assert_close(p.data, t.detach().numpy())


@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_array_api_strict_equals_numpy(cls):
    xps = pytest.importorskip("array_api_strict")
    init, grads = make_data(2)
    kwargs = {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}
    ref, _ = run_polyamp(cls, init, grads, **kwargs)
    got, opt = run_polyamp(cls, init, grads, xp=xps, **kwargs)
    for r, g in zip(ref, got, strict=True):
        assert type(opt.state[g]["exp_avg"]).__module__.startswith("array_api_strict")
        np.testing.assert_array_equal(np.asarray(g.data), r.data)  # exact: same float32 ops


def test_state_dict_round_trip():
    kwargs = {"lr": 0.01, "amsgrad": True, "weight_decay": 0.01}
    init, grads = make_data(4)
    ref, _ = run_polyamp(AdamW, init, grads, **kwargs)
    params, opt = run_polyamp(AdamW, init, grads[:10], **kwargs)
    saved = opt.state_dict()
    assert saved["state"][0]["step"] == 10.0
    assert sorted(saved["state"][0]) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]
    assert saved["param_groups"][0]["params"] == [0, 1, 2]
    assert saved["param_groups"][0]["decoupled_weight_decay"] is True
    for step_grads in grads[10:]:  # the original keeps training: the saved dict must not move
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g
        opt.step()
    fresh = [Parameter(np.array(p.data)) for p in run_polyamp(AdamW, init, grads[:10], **kwargs)[0]]
    opt2 = AdamW(fresh)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["amsgrad"] is True and opt2.param_groups[0]["lr"] == 0.01
    for step_grads in grads[10:]:
        for p, g in zip(fresh, step_grads, strict=True):
            p.grad = g
        opt2.step()
    for r, f, p in zip(ref, fresh, params, strict=True):
        np.testing.assert_array_equal(f.data, r.data)  # exact: same ops, same state
        np.testing.assert_array_equal(p.data, r.data)


def test_loads_torch_state_dict():
    torch = pytest.importorskip("torch")
    init, grads = make_data(6)
    tparams, topt = run_torch(torch, "Adam", init, grads[:10], lr=0.01)
    params = [Parameter(t.detach().numpy().copy()) for t in tparams]
    opt = Adam(params)
    opt.load_state_dict(topt.state_dict())
    assert isinstance(opt.state[params[0]]["exp_avg"], np.ndarray)
    assert opt.state[params[0]]["step"] == 10.0 and opt.param_groups[0]["lr"] == 0.01
    for step_grads in grads[10:]:
        for p, t, g in zip(params, tparams, step_grads, strict=True):
            p.grad, t.grad = g, torch.from_numpy(g.copy())
        opt.step()
        topt.step()
    for p, t in zip(params, tparams, strict=True):
        assert_close(p.data, t.detach().numpy())


def test_adamw_defaults():
    opt = AdamW([Parameter(np.ones(2, np.float32))])
    group = opt.param_groups[0]
    assert group["weight_decay"] == 1e-2 and group["decoupled_weight_decay"] is True
    assert Adam([Parameter(np.ones(2))]).param_groups[0]["decoupled_weight_decay"] is False


@pytest.mark.parametrize("cls", [Adam, AdamW])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "Invalid learning rate: lr=-1.0; expected lr >= 0"),
        ({"eps": -1e-8}, "Invalid epsilon value: eps=-1e-08; expected eps >= 0"),
        ({"betas": (1.0, 0.999)}, "at index 0: betas[0]=1.0; expected 0 <= betas[0] < 1"),
        ({"betas": (0.9, -0.1)}, "at index 1: betas[1]=-0.1; expected 0 <= betas[1] < 1"),
        ({"betas": (0.9,)}, "Invalid betas: betas=(0.9,); expected a pair"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1; expected weight_decay >= 0"),
    ],
)
def test_invalid_hyperparameters(cls, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cls([Parameter(np.ones(2, np.float32))], **kwargs)


@pytest.mark.parametrize("dtype", [np.complex64, np.int32])
def test_rejects_non_real_floating_params(dtype):
    p = Parameter(np.ones(2, dtype=dtype), np.ones(2, dtype=dtype))
    with pytest.raises(TypeError, match="needs real floating-point parameters"):
        Adam([p]).step()


@pytest.mark.parametrize("weight", [0.0, 0.1, 0.4999999, 0.5, 0.7, 1.0])
def test_lerp_equals_torch_lerp(weight):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    start, end = (rng.standard_normal(10_001).astype(np.float32) for _ in range(2))
    expected = torch.from_numpy(start.copy()).lerp_(torch.from_numpy(end), weight).numpy()
    np.testing.assert_array_equal(_lerp(start, end, weight), expected)
