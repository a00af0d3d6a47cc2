"""Two identical models trained side by side, one with torch.amp.GradScaler, one with polyamp's.

Shared by the CPU differential tests and the CUDA ones (loaded by path from both conftests):
each scenario is an ``iteration(side, step, batch)`` function run on both sides with the
same data; :func:`assert_same` then demands bitwise-equal parameters, gradients, optimizer
state and identical per-step traces (scale, growth tracker, what ``step`` returned).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from polyamp.compat.torch import GradScaler as PolyampGradScaler

INF = math.inf


@dataclass
class Side:
    """One training run: a scaler, its model(s) and optimizer(s), and what each step did."""

    name: str
    scaler: Any
    models: list[torch.nn.Module]
    optimizers: list[Any]
    trace: list[tuple[Any, ...]] = field(default_factory=list)
    notes: list[Any] = field(default_factory=list)

    @property
    def model(self) -> torch.nn.Module:
        return self.models[0]

    @property
    def optimizer(self) -> Any:
        return self.optimizers[0]


def mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A small two-layer network (deterministic once the seed is set)."""
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    ).to(dtype)


def make_sides(
    device: str,
    n_models: int = 1,
    model_fn: Callable[[], torch.nn.Module] = mlp,
    opt_fn: Callable[[torch.nn.Module], Any] = lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    **scaler_kwargs: Any,
) -> list[Side]:
    """A torch side and a polyamp side with identical models, optimizers and scaler settings."""
    torch.manual_seed(0)
    models = [model_fn().to(device) for _ in range(n_models)]
    sides = []
    for name, cls in (("torch", torch.amp.GradScaler), ("polyamp", PolyampGradScaler)):
        copies = [copy.deepcopy(m) for m in models]
        opts = [opt_fn(m) for m in copies]
        sides.append(Side(name, cls(device, **scaler_kwargs), copies, opts))
    return sides


def batch(step: int, device: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """The same inputs and targets for both sides at ``step``."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(5, 8, generator=gen, dtype=dtype)
    y = torch.randn(5, 4, generator=gen, dtype=dtype)
    return x.to(device), y.to(device)


def loss_of(model: torch.nn.Module, data: tuple[Any, Any], overflow: bool = False) -> Any:
    """Mean squared error; times inf when ``overflow`` so every gradient overflows."""
    x, y = data
    loss = ((model(x) - y) ** 2).mean()
    return loss * INF if overflow else loss


def poison(model: torch.nn.Module, value: float = INF) -> None:
    """Write ``value`` into one gradient element of the model's first parameter."""
    with torch.no_grad():
        next(model.parameters()).grad.view(-1)[0] = value


def record(side: Side, returned: Any = None) -> None:
    """Append the scaler's state after update() (and what step returned) to the trace."""
    scaler = side.scaler
    side.trace.append((scaler.get_scale(), scaler._get_growth_tracker(), returned))


def run(sides: list[Side], steps: int, iteration: Callable[[Side, int, Any], Any],
        start: int = 0) -> None:
    """Drive every side through ``steps`` iterations with the same batches."""
    for step in range(start, start + steps):
        for side in sides:
            data = batch(step, side_device(side), next(side.model.parameters()).dtype)
            iteration(side, step, data)


def side_device(side: Side) -> str:
    return str(next(side.model.parameters()).device)


def _tensors_of_state(optimizer: Any) -> list[Any]:
    out = []
    for param_state in optimizer.state.values():
        for key in sorted(param_state):
            out.append(param_state[key])
    return out


def equal(a: Any, b: Any) -> bool:
    """torch.equal, except that NaN equals NaN (gradients of an overflow step hold NaNs)."""
    if a.is_sparse:
        a, b = a.to_dense(), b.to_dense()
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    )


def assert_same(sides: list[Side]) -> None:
    """Bitwise-equal parameters, gradients and optimizer state; identical traces."""
    left, right = sides
    assert left.trace == right.trace, f"traces differ:\n{left.trace}\n{right.trace}"
    for m1, m2 in zip(left.models, right.models, strict=True):
        for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters(), strict=True):
            assert torch.equal(p1, p2), f"parameter {name} differs"
            if p1.grad is None or p2.grad is None:
                assert p1.grad is None and p2.grad is None, f"grad of {name}: one side is None"
            else:
                assert equal(p1.grad, p2.grad), f"gradient of {name} differs"
    for o1, o2 in zip(left.optimizers, right.optimizers, strict=True):
        s1, s2 = _tensors_of_state(o1), _tensors_of_state(o2)
        assert len(s1) == len(s2)
        for a, b in zip(s1, s2, strict=True):
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            assert same, "optimizer state differs"
    assert left.scaler.state_dict() == right.scaler.state_dict()
