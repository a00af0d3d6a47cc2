"""Where torch's ShardedGradScaler misbehaves and polyamp's does not (gloo, 2 ranks, CPU).

Each scenario trains the same per-rank model twice, under torch's scaler and under polyamp's,
and returns per step the flags each optimizer saw, the scale, and whether the parameters are
finite. The docs section on ShardedGradScaler states only what these tests show.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

STEPS = 6


def mlp(torch):
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def make_scaler(kind, **kwargs):
    from polyamp.compat.torch import ShardedGradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    return (TorchSharded if kind == "torch" else ShardedGradScaler)("cpu", **kwargs)


def run(torch, rank, kind, scaler_kwargs, loss_factor, opt="sgd", unscale=False, steps=STEPS):
    """Train; ``loss_factor(rank, step)`` multiplies the loss (inf: overflow, 0: zero gradients)."""
    torch.manual_seed(rank)
    model = mlp(torch)
    optimizer = (torch.optim.Adam(model.parameters(), lr=1e-3, fused=True) if opt == "fused-adam"
                 else torch.optim.SGD(model.parameters(), lr=0.05, fused=opt == "fused-sgd"))
    scaler = make_scaler(kind, **scaler_kwargs)
    trace = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
        loss = ((model(x) - y) ** 2).mean() * loss_factor(rank, step)
        scaler.scale(loss).backward()
        if unscale:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        flag = sum(float(v.item()) for v in scaler._found_inf_per_device(optimizer).values())
        scaler.update()
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        trace.append((flag, scaler.get_scale(), finite))
    return trace


def both(torch, rank, *args, **kwargs):
    return {kind: run(torch, rank, kind, *args, **kwargs) for kind in ("torch", "polyamp")}


def both_or_error(torch, rank, *args, **kwargs):
    """As ``both``, with what a side raised (every rank raises at the same point) in place of a trace."""
    out = {}
    for kind in ("torch", "polyamp"):
        try:
            out[kind] = run(torch, rank, kind, *args, **kwargs)
        except RuntimeError as exc:
            out[kind] = f"{type(exc).__name__}: {exc}"
    return out


def scenarios(rank: int, size: int) -> dict:
    import torch

    inf = math.inf
    return {
        # a fused optimizer takes found_inf itself; without unscale_ torch's never all-reduces it
        "fused_one_rank": both(torch, rank, {}, lambda r, s: inf if (r, s) == (1, 1) else 1.0,
                               opt="fused-adam"),
        # after unscale_ torch's flag is the SUM over ranks (2.0); fused kernels skip only on 1.0
        "fused_all_ranks": both(torch, rank, {}, lambda r, s: inf if s == 1 else 1.0,
                                opt="fused-sgd", unscale=True),
        # torch's flag after unscale_ has shape (1,), which fused Adam's step counts refuse
        "fused_adam_unscale": both_or_error(torch, rank, {}, lambda r, s: 1.0, opt="fused-adam",
                                            unscale=True),
        # repeated overflows: torch's scale reaches 0.0; the next finite gradients (0 * 1/0) are NaN
        # after its unscale, which checks them before multiplying, so NaN reaches the weights
        "to_zero": both(torch, rank, dict(backoff_factor=2.0**-16, growth_interval=1),
                        lambda r, s: inf if s < 12 else 1.0, steps=16),
        # growth past float32's max: torch's scale becomes inf and every later step is skipped
        "to_inf": both(torch, rank, dict(init_scale=2.0**127, growth_interval=1),
                       lambda r, s: 0.0 if s == 0 else 1e-3, steps=8),
        # a backoff factor that is not a power of two: torch's CPU path multiplies in float32
        "backoff_0.3": both(torch, rank, dict(backoff_factor=0.3), lambda r, s: inf),
    }


@pytest.fixture(scope="module")
def job():
    return {}


@pytest.fixture
def ranks(run_gloo, job):
    if "ranks" not in job:
        job["ranks"] = run_gloo(scenarios, 2, pg_timeout=30.0).results()
    return job["ranks"]


def test_fused_optimizer_without_unscale_agrees_where_torch_diverges(ranks):
    torch0, torch1 = (r["fused_one_rank"]["torch"] for r in ranks)
    poly0, poly1 = (r["fused_one_rank"]["polyamp"] for r in ranks)
    assert (torch0[1][0], torch1[1][0]) == (0.0, 1.0)  # torch: rank 0 steps, rank 1 skips
    assert [s[1] for s in torch0] != [s[1] for s in torch1]  # and the scales part ways
    assert poly0[1][0] == poly1[1][0] == 1.0  # polyamp: both ranks skip
    assert poly0 == [(f, s, True) for f, s, _ in poly1]  # identical flags and scales


def test_fused_optimizer_never_applies_an_overflowed_step(ranks):
    for results in ranks:
        torch_trace, poly_trace = results["fused_all_ranks"]["torch"], results["fused_all_ranks"]["polyamp"]
        assert torch_trace[1][0] == 2.0 and not torch_trace[1][2]  # NaN reached torch's weights
        assert poly_trace[1][0] == 1.0 and all(s[2] for s in poly_trace)  # polyamp's flag is 0/1: skipped


def test_fused_adam_after_unscale_works(ranks):
    for results in ranks:
        out = results["fused_adam_unscale"]
        assert "doesn't match the broadcast shape [1]" in out["torch"]  # torch's raises
        assert all(s[0] == 0.0 and s[2] for s in out["polyamp"])


def test_scale_stops_at_the_floor_instead_of_zero(ranks):
    for results in ranks:
        torch_trace, poly_trace = results["to_zero"]["torch"], results["to_zero"]["polyamp"]
        assert [s[1] for s in torch_trace[10:]] == [0.0] * 6  # stuck at 0
        assert torch_trace[12][0] == 0.0 and not torch_trace[12][2]  # "clean" step: NaN weights
        assert all(s[2] for s in poly_trace)
        assert min(s[1] for s in poly_trace) == 2.0**-126
        assert [s[0] for s in poly_trace[12:]] == [0.0] * 4  # finite losses step again
        assert [s[1] for s in poly_trace[12:]] == [2.0**-125, 2.0**-124, 2.0**-123, 2.0**-122]


def test_scale_does_not_grow_to_inf(ranks):
    for results in ranks:
        torch_trace, poly_trace = results["to_inf"]["torch"], results["to_inf"]["polyamp"]
        assert torch_trace[0][1] == math.inf and all(s[0] > 0 for s in torch_trace[1:])
        assert poly_trace[0][1] == 2.0**127 and all(math.isfinite(s[1]) for s in poly_trace)
        assert poly_trace[-1][0] == 0.0  # stepping again


def test_backoff_by_a_non_power_of_two_rounds_as_torch_gradscaler(ranks):
    scale32 = scale64 = np.float32(2.0**16)
    want_torch, want_polyamp = [], []
    for _ in range(STEPS):
        scale32 = np.float32(scale32 * np.float32(0.3))  # torch's ShardedGradScaler on CPU
        scale64 = np.float32(np.float64(scale64) * 0.3)  # torch's GradScaler kernel, and polyamp
        want_torch.append(float(scale32))
        want_polyamp.append(float(scale64))
    assert want_torch != want_polyamp
    for results in ranks:
        assert [s[1] for s in results["backoff_0.3"]["torch"]] == want_torch
        assert [s[1] for s in results["backoff_0.3"]["polyamp"]] == want_polyamp
