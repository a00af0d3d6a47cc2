"""Skip decisions against the real torch.amp.GradScaler, with overflow anywhere in the gradients.

Each scenario trains parameters of two dtypes (float32 and float64), split into two param
groups as a weight-decay split does (weights decay, biases do not), with overflow written at
random elements of random parameters after backward: several per bad step, only nan, only
-inf, only in the last tensor of the last group, or mixed. The real torch scaler drives torch
tensors; polyamp's torch facade drives torch tensors and, through its NumPy and array-API
backends, NumPy arrays holding the same values. Every run must skip exactly the poisoned steps,
keep the same scale trajectory, and end with bitwise-equal, finite weights.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyamp.compat.torch import GradScaler  # noqa: E402

import polyamp  # noqa: E402

SHAPES = [((6, 5), "float32"), ((6,), "float32"), ((4, 6), "float64"), ((4,), "float64"),
          ((3, 4), "float32"), ((3,), "float64")]
WEIGHTS = [0, 2, 4]  # the weight-decay group; biases (1, 3, 5) form the second, last, group
LAST = 5  # the last tensor of the last group
STEPS = 14
LR, DECAY = 2.0**-4, 2.0**-6
VALUES = {"nan": [math.nan], "-inf": [-math.inf], "mixed": [math.nan, math.inf, -math.inf]}


def plan(scenario: str, seed: int) -> dict[int, list[tuple[int, int, float]]]:
    """``{step: [(param, flat element, value), ...]}``: 1 to 4 poisoned elements per bad step."""
    rng = np.random.default_rng(seed)
    kind = "mixed" if scenario == "last" else scenario
    bad_steps = sorted(rng.choice(np.arange(1, STEPS), size=5, replace=False).tolist())
    out = {}
    for step in bad_steps:
        hits = []
        for _ in range(int(rng.integers(1, 5))):
            param = LAST if scenario == "last" else int(rng.integers(len(SHAPES)))
            size = int(np.prod(SHAPES[param][0]))
            hits.append((param, int(rng.integers(size)), float(rng.choice(VALUES[kind]))))
        out[step] = hits
    return out


def true_grads(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal(shape).astype(dtype) for shape, dtype in SHAPES]


def initial() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(shape).astype(dtype) for shape, dtype in SHAPES]


class GroupSGD:
    """SGD with a weight-decay group and a bias group over anything with ``.data``/``.grad``:
    the same float operations on torch tensors and on NumPy arrays (lr and decay are powers
    of two), so both are bitwise comparable. Counts the steps it applied."""

    def __init__(self, params):
        self.param_groups = [
            {"params": [params[i] for i in WEIGHTS], "lr": LR, "weight_decay": DECAY},
            {"params": [p for i, p in enumerate(params) if i not in WEIGHTS], "lr": LR, "weight_decay": 0.0},
        ]
        self.applied = []

    def step(self):
        self.applied.append(True)
        for group in self.param_groups:
            for p in group["params"]:
                p.data -= group["lr"] * (p.grad + group["weight_decay"] * p.data)


class CountingTorchSGD(torch.optim.SGD):
    """torch's own SGD (foreach) over the two groups; counts the steps it applied."""

    def __init__(self, params):
        super().__init__([
            {"params": [params[i] for i in WEIGHTS], "weight_decay": DECAY},
            {"params": [p for i, p in enumerate(params) if i not in WEIGHTS], "weight_decay": 0.0},
        ], lr=LR)
        self.applied = []

    def step(self, closure=None):
        self.applied.append(True)
        return super().step(closure)


def train(scaler, params, opt, to_array, poison_plan):
    """Drive one scaler; returns the per-step (applied?, scale after update) and final weights."""
    trace = []
    for step in range(STEPS):
        scale = float(scaler.scale(to_array(np.ones((), np.float32))))  # the loss scale, as torch applies it
        grads = [(g.astype(np.float64) * scale).astype(g.dtype) for g in true_grads(step)]  # backward
        for param, element, value in poison_plan.get(step, []):
            grads[param].reshape(-1)[element] = value
        for p, grad in zip(params, grads, strict=True):
            p.grad = to_array(grad)
        before = len(opt.applied)
        scaler.step(opt)
        scaler.update()
        trace.append((len(opt.applied) > before, scaler.get_scale()))
    weights = [p.detach().numpy().copy() if isinstance(p, torch.Tensor) else np.array(p.data) for p in params]
    return trace, weights


def torch_params():
    return [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in initial()]


def numpy_params(to_array):
    return [polyamp.Parameter(to_array(a.copy())) for a in initial()]


SCENARIOS = [("nan", 1), ("-inf", 2), ("last", 3), ("mixed", 4), ("mixed", 5)]
KWARGS = dict(init_scale=2.0**10, growth_interval=3)


def _check(trace, weights, ref_trace, ref_weights, poison_plan):
    assert [applied for applied, _ in trace] == [applied for applied, _ in ref_trace]
    assert [applied for applied, _ in ref_trace] == [s not in poison_plan for s in range(STEPS)]
    assert trace == ref_trace
    for mine, theirs in zip(weights, ref_weights, strict=True):
        np.testing.assert_array_equal(mine, theirs, strict=True)
        assert np.isfinite(mine).all()


@pytest.mark.parametrize("optimizer", ["torch-sgd", "group-sgd"])
@pytest.mark.parametrize(("scenario", "seed"), SCENARIOS)
def test_torch_tensors_skip_exactly_where_torch_does(scenario, seed, optimizer):
    poison_plan = plan(scenario, seed)
    opt_cls = CountingTorchSGD if optimizer == "torch-sgd" else GroupSGD
    runs = []
    for cls in (torch.amp.GradScaler, GradScaler):
        params = torch_params()
        runs.append(train(cls("cpu", **KWARGS), params, opt_cls(params), torch.from_numpy, poison_plan))
    (ref_trace, ref_weights), (trace, weights) = runs
    _check(trace, weights, ref_trace, ref_weights, poison_plan)


def _available(name):
    return any(i.name == name and i.available for i in polyamp.available_backends())


@pytest.mark.parametrize("backend", [
    "array_api",
    pytest.param("numpy", marks=pytest.mark.skipif(not _available("numpy"), reason="no numpy backend")),
])
@pytest.mark.parametrize(("scenario", "seed"), SCENARIOS)
def test_numpy_arrays_skip_exactly_where_torch_does(scenario, seed, backend):
    poison_plan = plan(scenario, seed)
    params = torch_params()
    reference = train(torch.amp.GradScaler("cpu", **KWARGS), params, GroupSGD(params), torch.from_numpy,
                      poison_plan)
    to_array = np.asarray
    if backend == "array_api":
        xps = pytest.importorskip("array_api_strict")
        to_array = xps.asarray
    params = numpy_params(to_array)
    trace, weights = train(GradScaler("cpu", backend=backend, **KWARGS), params, GroupSGD(params), to_array,
                           poison_plan)
    _check(trace, weights, *reference, poison_plan)


def test_the_plans_cover_what_they_claim():
    """The scenarios poison several elements, of several parameters, of both groups and dtypes."""
    hits = [hit for scenario, seed in SCENARIOS for hits in plan(scenario, seed).values() for hit in hits]
    assert {param for param, _, _ in hits} == set(range(len(SHAPES)))
    assert {element for _, element, _ in hits} - {0}
    assert all(param == LAST for hits in plan("last", 3).values() for param, _, _ in hits)
    assert all(math.isnan(v) for hits in plan("nan", 1).values() for _, _, v in hits)
    assert all(v == -math.inf for hits in plan("-inf", 2).values() for _, _, v in hits)
    assert max(len(hits) for hits in plan("mixed", 4).values()) > 1


def test_dtype_cache_across_libraries():
    """The torch facade over array-api-strict arrays, then over NumPy arrays, in one process: no warning."""
    import warnings

    xps = pytest.importorskip("array_api_strict")
    for to_array, backend in ((xps.asarray, "array_api"), (np.asarray, "array_api")):
        param = polyamp.Parameter(to_array(np.zeros(3, np.float32)))
        scaler = GradScaler("cpu", backend=backend)
        scaler.scale(to_array(np.ones((), np.float32)))
        param.grad = to_array(np.ones(3, np.float32))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scaler.step(GroupSGD([param] * len(SHAPES)))
