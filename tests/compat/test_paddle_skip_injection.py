"""Skip decisions against the real paddle.amp.GradScaler, with overflow anywhere in the gradients.

Parameters of two dtypes (float32, float64) in two param groups (weights with weight decay,
biases without); after backward, overflow is written at random elements of random parameters
(several per bad step; only nan, only -inf, only in the last tensor of the last group, mixed).
paddle's scaler drives paddle SGD; polyamp's paddle facade drives paddle SGD (paddle backend),
torch SGD (torch backend) and a group SGD over NumPy arrays (NumPy backend). All must skip
exactly the poisoned steps with paddle's scale and counters; paddle-on-paddle weights are
bitwise paddle's, the others finite. paddle's scaler is kept enabled on CPU as in
test_paddle_differential.py.
"""

from __future__ import annotations

import contextvars
import math
import types
import warnings

import numpy as np
import pytest
from polyamp.compat.paddle import GradScaler

import polyamp

paddle = pytest.importorskip("paddle")

SHAPES = [((5, 4), "float32"), ((5,), "float32"), ((3, 5), "float64"), ((3,), "float64"),
          ((2, 3), "float32"), ((2,), "float64")]
WEIGHTS = [0, 2, 4]
LAST = 5
STEPS = 14
LR, DECAY = 2.0**-4, 2.0**-6
VALUES = {"nan": [math.nan], "-inf": [-math.inf], "mixed": [math.nan, math.inf, -math.inf]}
SCENARIOS = [("nan", 11), ("-inf", 12), ("last", 13), ("mixed", 14), ("mixed", 15)]
PATH = contextvars.ContextVar("path", default="step")  # how the systems step: "step" or "minimize"
KWARGS = dict(init_loss_scaling=2.0**10, incr_every_n_steps=3, decr_every_n_nan_or_inf=2)


def plan(scenario: str, seed: int) -> dict[int, list[tuple[int, int, float]]]:
    """``{step: [(param, flat element, value), ...]}``: 1 to 4 poisoned elements per bad step."""
    rng = np.random.default_rng(seed)
    kind = "mixed" if scenario == "last" else scenario
    out = {}
    for step in sorted(rng.choice(np.arange(STEPS), size=6, replace=False).tolist()):
        out[step] = []
        for _ in range(int(rng.integers(1, 5))):
            param = LAST if scenario == "last" else int(rng.integers(len(SHAPES)))
            element = int(rng.integers(int(np.prod(SHAPES[param][0]))))
            out[step].append((param, element, float(rng.choice(VALUES[kind]))))
    return out


def dtypes(mixed: bool) -> list[str]:
    """The parameters' dtypes: float32 and float64, or all float32 (paddle's own scaler refuses
    float64 beside float32 in one call, and has no CPU kernel for float16/bfloat16)."""
    return [d if mixed else "float32" for _, d in SHAPES]


def initial(mixed: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.standard_normal(s).astype(d) for (s, _), d in zip(SHAPES, dtypes(mixed))]


def scaled_grads(step: int, scale: float, hits, mixed: bool) -> list[np.ndarray]:
    """The gradients backward of ``loss * scale`` gives at ``step``, poisoned as planned."""
    rng = np.random.default_rng(200 + step)
    grads = [(rng.standard_normal(s) * scale).astype(d) for (s, _), d in zip(SHAPES, dtypes(mixed))]
    for param, element, value in hits:
        grads[param].reshape(-1)[element] = value
    return grads


@pytest.fixture
def real(monkeypatch):
    """Real paddle.amp.GradScalers that stay enabled on this CPU-only machine."""
    place = types.SimpleNamespace(
        is_gpu_place=lambda: True, is_xpu_place=lambda: False, is_custom_place=lambda: False
    )
    monkeypatch.setattr(paddle.amp.grad_scaler, "_dygraph_tracer",
                        lambda: types.SimpleNamespace(_expected_place=place))
    monkeypatch.setattr(paddle.Tensor, "__float__", lambda self: float(self.reshape([-1])[0].item()))
    return paddle.amp.GradScaler


class PaddleSystem:
    """paddle parameters; paddle SGD over a weight-decay group and a bias group."""

    def __init__(self, scaler, mixed):
        self.scaler, self.mixed = scaler, mixed
        self.params = [paddle.create_parameter(list(a.shape), str(a.dtype),
                                               default_initializer=paddle.nn.initializer.Assign(a))
                       for a in initial(mixed)]
        groups = [  # paddle's own minimize() fails on param groups (it lists the dicts as parameters)
            {"params": [self.params[i] for i in WEIGHTS], "weight_decay": DECAY},
            {"params": [p for i, p in enumerate(self.params) if i not in WEIGHTS], "weight_decay": 0.0},
        ] if PATH.get() == "step" else self.params
        self.opt = paddle.optimizer.SGD(learning_rate=LR, parameters=groups)

    def loss_scale(self) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "amp_guard can only be enabled on CUDAPlace"
            with paddle.amp.auto_cast(dtype="float16"):
                self.scaled = self.scaler.scale(paddle.to_tensor(1.0, "float32"))  # minimize's loss
        return float(self.scaled.numpy().reshape(-1)[0])

    def backward(self, grads):
        for p, g in zip(self.params, grads, strict=True):  # d/dp sum(p * g) = g, exactly
            (p * paddle.to_tensor(g)).sum().backward()

    def weights(self):
        return [p.numpy() for p in self.params]

    def clear(self):
        self.opt.clear_grad()


class TorchSystem(PaddleSystem):
    """torch parameters and torch SGD (weight-decay split) under polyamp's paddle facade."""

    def __init__(self, scaler, mixed):
        self.torch = pytest.importorskip("torch")
        self.scaler, self.mixed = scaler, mixed
        self.params = [self.torch.nn.Parameter(self.torch.from_numpy(a)) for a in initial(mixed)]
        self.opt = self.torch.optim.SGD([
            {"params": [self.params[i] for i in WEIGHTS], "weight_decay": DECAY},
            {"params": [p for i, p in enumerate(self.params) if i not in WEIGHTS]},
        ], lr=LR)

    def loss_scale(self):
        return float(self.scaler.scale(self.torch.ones(())))

    def backward(self, grads):
        for p, g in zip(self.params, grads, strict=True):
            p.grad = self.torch.from_numpy(g)

    def weights(self):
        return [p.detach().numpy().copy() for p in self.params]

    def clear(self):
        self.opt.zero_grad()


class NumpySystem(TorchSystem):
    """polyamp.Parameter over NumPy; a group SGD with torch-style param_groups and no minimize."""

    class GroupSGD:
        def __init__(self, params):
            self.param_groups = [
                {"params": [params[i] for i in WEIGHTS], "weight_decay": DECAY},
                {"params": [p for i, p in enumerate(params) if i not in WEIGHTS], "weight_decay": 0.0},
            ]

        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data -= LR * (p.grad + group["weight_decay"] * p.data)

    def __init__(self, scaler, mixed):
        self.scaler, self.mixed = scaler, mixed
        self.params = [polyamp.Parameter(a) for a in initial(mixed)]
        self.opt = self.GroupSGD(self.params)

    def loss_scale(self):
        return float(self.scaler.scale(np.ones((), np.float32)))

    def backward(self, grads):
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g

    def weights(self):
        return [p.data.copy() for p in self.params]

    def clear(self):
        for p in self.params:
            p.grad = None


def run(system, poison_plan, path):
    """Every step's (skipped?, scale, counters) and the final weights."""
    trace = []
    for step in range(STEPS):
        system.backward(scaled_grads(step, system.loss_scale(), poison_plan.get(step, []), system.mixed))
        before = system.weights()
        if path == "minimize":
            system.scaler.minimize(system.opt, getattr(system, "scaled", None))
        else:
            system.scaler.step(system.opt)
            system.scaler.update()
        moved = any(not np.array_equal(a, b) for a, b in zip(before, system.weights()))
        state = system.scaler.state_dict()
        trace.append((moved, float(state.pop("scale")[0]), sorted(state.items())))
        system.clear()
    return trace, system.weights()


@pytest.mark.parametrize("path", ["minimize", "step"])
@pytest.mark.parametrize(("scenario", "seed"), SCENARIOS)
def test_skips_exactly_where_paddle_does(real, scenario, seed, path):
    """Decisions and state depend only on where the planned inf/nan are, so paddle's all-float32
    run is the reference for every system, float32 or mixed; weights bitwise where the kernels match."""
    poison_plan = plan(scenario, seed)
    PATH.set(path)
    ref_trace, ref_weights = run(PaddleSystem(real(**KWARGS), False), poison_plan, path)
    assert [moved for moved, *_ in ref_trace] == [s not in poison_plan for s in range(STEPS)]
    for cls in (PaddleSystem, TorchSystem, NumpySystem):
        for mixed in (False, True):
            trace, weights = run(cls(GradScaler(**KWARGS), mixed), poison_plan, path)
            where = f"{cls.__name__}, {'float32 and float64' if mixed else 'float32'}"
            assert trace == ref_trace, where
            assert all(np.isfinite(w).all() for w in weights), where
            if cls is PaddleSystem and not mixed:  # the same SGD kernels: bitwise
                for mine, theirs in zip(weights, ref_weights, strict=True):
                    np.testing.assert_array_equal(mine, theirs, strict=True)
