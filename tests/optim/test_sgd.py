"""polyamp.optim.SGD against torch.optim.SGD, across array libraries, and its Optimizer API."""

from __future__ import annotations

import re

import numpy as np
import pytest

from polyamp.optim import SGD
from polyamp.optim.optimizer import fma
from polyamp.parameter import Parameter

SHAPES = [(64, 33), (7,), ()]
STEPS = 20

# torch's CPU kernels compute ``a + alpha * b`` as one FMA; polyamp's ``fma`` reproduces that
# single rounding for float32 (via float64), so SGD is compared for exact, bitwise equality.

CONFIGS = [
    {"lr": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.1, "momentum": 0.9, "nesterov": True},
    {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1},
    {"lr": 0.05, "momentum": 0.5, "dampening": 0.3, "weight_decay": 0.01, "maximize": True},
    {"lr": 0.02, "momentum": 0.99, "nesterov": True, "weight_decay": 1e-3, "maximize": True},
    {"lr": 0.1, "weight_decay": 0.5},
]


def make_data(seed: int, steps: int = STEPS) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """Float32 initial values for SHAPES and ``steps`` random gradients for each."""
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(steps)]
    return init, grads


def run_polyamp(init, grads, xp=np, **kwargs) -> tuple[list[Parameter], SGD]:
    """Train Parameters of namespace ``xp`` with polyamp's SGD on the given gradients."""
    params = [Parameter(xp.asarray(np.array(x))) for x in init]
    opt = SGD(params, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = xp.asarray(np.array(g))
        opt.step()
    return params, opt


@pytest.mark.parametrize(
    "kwargs", CONFIGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items())
)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_torch_sgd(kwargs, seed):
    torch = pytest.importorskip("torch")
    init, grads = make_data(seed)
    params, opt = run_polyamp(init, grads, **kwargs)
    tparams = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in init]
    topt = torch.optim.SGD(tparams, foreach=False, **kwargs)
    for step_grads in grads:
        for t, g in zip(tparams, step_grads, strict=True):
            t.grad = torch.from_numpy(g.copy())
        topt.step()
    for p, t in zip(params, tparams, strict=True):
        assert p.data.dtype == np.float32
        np.testing.assert_array_equal(p.data, t.detach().numpy())  # exact
        if kwargs.get("momentum", 0):
            buf = topt.state[t]["momentum_buffer"].numpy()
            np.testing.assert_array_equal(opt.state[p]["momentum_buffer"], buf)


def test_array_api_strict_equals_numpy():
    xps = pytest.importorskip("array_api_strict")
    init, grads = make_data(2)
    kwargs = {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    ref, _ = run_polyamp(init, grads, **kwargs)
    got, _ = run_polyamp(init, grads, xp=xps, **kwargs)
    for r, g in zip(ref, got, strict=True):
        assert type(g.data).__module__.startswith("array_api_strict")
        np.testing.assert_array_equal(np.asarray(g.data), r.data)  # exact: same float32 ops


def test_torch_tensors_as_data():
    torch = pytest.importorskip("torch")
    init, grads = make_data(3)
    ref, _ = run_polyamp(init, grads, lr=0.1, momentum=0.9)
    got, _ = run_polyamp(init, grads, xp=torch, lr=0.1, momentum=0.9)
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_array_equal(g.data.numpy(), r.data)


def test_torch_leaf_tensor_requiring_grad_is_updated_in_place():
    torch = pytest.importorskip("torch")
    leaf = torch.ones(3, requires_grad=True)
    p = Parameter(leaf, torch.full((3,), 2.0))
    opt = SGD([p], lr=0.25, momentum=0.9, weight_decay=0.5)
    opt.step()
    assert p.data is leaf and leaf.requires_grad
    assert leaf.detach().tolist() == [0.375, 0.375, 0.375]
    assert opt.state[p]["momentum_buffer"].grad_fn is None  # no autograd graph kept in state


def test_update_is_in_place_and_skips_params_without_grad():
    data = np.ones(3, dtype=np.float32)
    p, frozen = Parameter(data), Parameter(np.ones(2, dtype=np.float32))
    opt = SGD([p, frozen], lr=0.5)
    p.grad = np.full(3, 2.0, dtype=np.float32)
    assert opt.step(lambda: 7.0) == 7.0
    assert p.data is data
    np.testing.assert_array_equal(data, np.zeros(3, dtype=np.float32))
    np.testing.assert_array_equal(frozen.data, np.ones(2, dtype=np.float32))
    assert opt.state_dict()["state"] == {}  # no momentum: no state, as in torch


def test_zero_grad():
    p, q = Parameter(np.ones(3, np.float32)), Parameter(np.ones(2, np.float32))
    opt = SGD([p, q])
    grad = np.ones(3, np.float32)
    p.grad = grad
    opt.zero_grad(set_to_none=False)
    assert p.grad is grad and not grad.any() and q.grad is None
    opt.zero_grad()
    assert p.grad is None and q.grad is None


def test_param_groups_with_different_lr():
    a, b = Parameter(np.ones(2, np.float32)), Parameter(np.ones(2, np.float32))
    opt = SGD([{"params": [a]}, {"params": b, "lr": 0.25}], lr=0.5, momentum=0.0)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.25]
    assert opt.param_groups[1]["params"] == [b] and opt.param_groups[1]["momentum"] == 0.0
    a.grad = b.grad = np.ones(2, np.float32)
    opt.step()
    np.testing.assert_array_equal(a.data, [0.5, 0.5])
    np.testing.assert_array_equal(b.data, [0.75, 0.75])
    c = Parameter(np.ones(2, np.float32))
    opt.add_param_group({"params": [c], "lr": 1.0})
    c.grad = np.ones(2, np.float32)
    opt.step()
    np.testing.assert_array_equal(c.data, [0.0, 0.0])


def test_state_dict_round_trip():
    kwargs = {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}
    init, grads = make_data(4)
    ref, _ = run_polyamp(init, grads, **kwargs)
    params, opt = run_polyamp(init, grads[:10], **kwargs)
    saved = opt.state_dict()
    assert sorted(saved["state"]) == [0, 1, 2]
    assert saved["param_groups"][0]["params"] == [0, 1, 2]
    assert saved["param_groups"][0]["lr"] == 0.05
    fresh = [Parameter(np.array(p.data)) for p in params]
    opt2 = SGD(fresh, lr=1.0)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == 0.05 and opt2.param_groups[0]["params"] == fresh
    for step_grads in grads[10:]:
        for p, g in zip(fresh, step_grads, strict=True):
            p.grad = g.copy()
        opt2.step()
    for r, f in zip(ref, fresh, strict=True):
        np.testing.assert_array_equal(f.data, r.data)  # exact: same ops, same state


def test_load_state_dict_rejects_mismatched_groups():
    opt = SGD([Parameter(np.ones(2, np.float32))], momentum=0.9)
    other = SGD([Parameter(np.ones(2, np.float32)), Parameter(np.ones(1, np.float32))])
    with pytest.raises(ValueError, match="group 0 has 2 params"):
        opt.load_state_dict(other.state_dict())
    two_groups = SGD([{"params": [Parameter(np.ones(1))]}, {"params": [Parameter(np.ones(1))]}])
    with pytest.raises(ValueError, match="2 parameter groups"):
        opt.load_state_dict(two_groups.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "Invalid learning rate: lr=-1.0; expected lr >= 0"),
        ({"lr": float("nan")}, "Invalid learning rate: lr=nan"),
        ({"momentum": -0.5}, "Invalid momentum value: momentum=-0.5; expected momentum >= 0"),
        ({"weight_decay": -1e-4}, "weight_decay=-0.0001; expected weight_decay >= 0"),
        ({"nesterov": True}, "Nesterov momentum requires a momentum and zero dampening"),
        ({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "dampening=0.1"),
    ],
)
def test_invalid_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SGD([Parameter(np.ones(2, np.float32))], **kwargs)


def test_invalid_group_hyperparameter():
    opt = SGD([Parameter(np.ones(2, np.float32))])
    with pytest.raises(ValueError, match="lr=-0.1"):
        opt.add_param_group({"params": [Parameter(np.ones(2, np.float32))], "lr": -0.1})


def test_invalid_params():
    p = Parameter(np.ones(2, np.float32))
    with pytest.raises(ValueError, match="empty parameter list"):
        SGD([])
    with pytest.raises(TypeError, match="pass a list"):
        SGD(p)
    with pytest.raises(TypeError, match="ordered"):
        SGD({p})
    with pytest.raises(TypeError, match=r"numpy\.ndarray; wrap it: Parameter\(array\)"):
        SGD([np.ones(2)])
    with pytest.raises(ValueError, match="more than once"):
        SGD([p, p])
    opt = SGD([p])
    with pytest.raises(ValueError, match="more than once"):
        opt.add_param_group({"params": [p]})


@pytest.mark.parametrize("alpha", [0.37, -1e-3, 1.0, 3.0])
def test_fma_equals_torch_add_with_alpha(alpha):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    a, b = (rng.standard_normal(10_001).astype(np.float32) for _ in range(2))
    expected = torch.from_numpy(a).add(torch.from_numpy(b), alpha=alpha).numpy()
    result = fma(a, b, alpha)
    assert result.dtype == np.float32
    np.testing.assert_array_equal(result, expected)


def test_fma_other_dtypes_round_twice():
    a, b = np.array([1.0, 2.0]), np.array([0.5, 0.25])
    np.testing.assert_array_equal(fma(a, b, 3.0), a + b * 3.0)
    assert fma(a.astype(np.float16), b.astype(np.float16), 3.0).dtype == np.float16
