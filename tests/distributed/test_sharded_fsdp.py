"""FSDP2 (``fully_shard``) training with polyamp's ShardedGradScaler, against torch's own.

torch 2.13 runs ``fully_shard`` on CPU over gloo (a "cpu" device mesh), so this runs on any
machine: 2 ranks (and 3, whose shards are uneven), a tiny model sharded per layer, full precision
and FP16 mixed precision.
Both scalers see the same run; the local parameter shards must stay bitwise equal. At one
step rank 1's loss overflows through unit 0 of the first layer only, whose weights live in
rank 0's shard: after the reduce-scatter only rank 0 sees inf, and both ranks must skip.
Collectives issued inside the scalers' calls are counted: torch's DTensor unscale all-reduces
the flag (MAX, a functional collective) and torch's scaler adds its SUM; polyamp unscales the
local shards and issues its one SUM.
"""

from __future__ import annotations

import math

import pytest

STEPS = 6
OVERFLOW = (1, 2)  # (rank, step): that rank's loss is inf at that step, through unit 0 of layer 0


def sharded_model(torch, mesh, mp_policy, device):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same full model on every rank before sharding
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    return fully_shard(model, mesh=mesh, mp_policy=mp_policy)


class Counter:
    """Counts calls of ``dist.all_reduce`` and of the functional all_reduce DTensor uses."""

    def __init__(self):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        self.count = 0
        for module in (dist, funcol):
            module.all_reduce = self.wrap(module.all_reduce)

    def wrap(self, call):
        def counted(*args, **kwargs):
            self.count += 1
            return call(*args, **kwargs)

        return counted


def train(torch, rank, scaler, model, device, clip, counter):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hidden = []
    model[0].register_forward_hook(lambda module, args, output: hidden.append(output))
    trace = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(4, 8, generator=gen).to(device), torch.randn(4, 4, generator=gen).to(device)
        hidden.clear()
        loss = ((model(x).float() - y) ** 2).mean()
        if (rank, step) == OVERFLOW:
            loss = loss + hidden[0][:, 0].float().sum() * math.inf
        scaler.scale(loss).backward()
        calls = 0
        if clip:
            before = counter.count
            scaler.unscale_(optimizer)
            calls += counter.count - before
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # its own all-reduce, not counted
        before = counter.count
        scaler.step(optimizer)
        calls += counter.count - before
        flag = sum(float(v.item()) for v in scaler._found_inf_per_device(optimizer).values())
        scaler.update()
        trace.append((flag > 0, scaler.get_scale(), calls))
    shards = [p.to_local().detach().clone() for p in model.parameters()]
    return trace, shards, [type(p.grad).__name__ for p in model.parameters() if p.grad is not None]


def fsdp_side_by_side(rank: int, size: int, device_type: str, precision: str, clip: bool,
                      own_group: bool = False) -> dict:
    """``own_group``: polyamp's process_group is this rank alone, which does not span the mesh."""
    import torch
    import torch.distributed as dist
    from polyamp.compat.torch import ShardedGradScaler
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    device = torch.device(device_type)
    mesh = init_device_mesh(device_type, (size,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
              if precision == "fp16" else MixedPrecisionPolicy())
    groups = [dist.new_group([r]) for r in range(size)]  # every rank builds every group
    out, counter = {}, Counter()
    for name, cls in (("torch", TorchSharded), ("polyamp", ShardedGradScaler)):
        group = groups[rank] if own_group and name == "polyamp" else None
        scaler = cls(device_type, init_scale=2.0**10, growth_interval=2, process_group=group)
        model = sharded_model(torch, mesh, policy, device)
        out[name] = train(torch, rank, scaler, model, device, clip, counter)
    (t_trace, t_shards, _), (p_trace, p_shards, grad_types) = out["torch"], out["polyamp"]
    return {"torch": t_trace, "polyamp": p_trace, "grad_types": grad_types,
            "same_shards": all(torch.equal(a, b) for a, b in zip(t_shards, p_shards, strict=True)),
            "shard_sizes": [s.numel() for s in p_shards]}


def check(results, polyamp_calls=1):
    for out in results:
        assert out["same_shards"]
        assert [s[:2] for s in out["torch"]] == [s[:2] for s in out["polyamp"]]  # skips, scales
        assert set(out["grad_types"]) == {"DTensor"}  # the scaler unscaled sharded DTensor gradients
        assert [s[0] for s in out["polyamp"]] == [s == OVERFLOW[1] for s in range(STEPS)]  # all skip
        assert [s[2] for s in out["torch"]] == [2] * STEPS  # DTensor's MAX and the scaler's SUM
        assert [s[2] for s in out["polyamp"]] == [polyamp_calls] * STEPS
    assert all(out["polyamp"] == results[0]["polyamp"] for out in results)
    assert sum(sum(out["shard_sizes"]) for out in results) >= 8 * 16 + 16 + 16 * 4 + 4


@pytest.mark.parametrize(("precision", "clip"), [("fp32", False), ("fp16", True)])
def test_fully_shard_on_cpu_gloo(run_gloo, precision, clip):
    fully_shard = pytest.importorskip("torch.distributed.fsdp").__dict__.get("fully_shard")
    if fully_shard is None:
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    check(run_gloo(fsdp_side_by_side, 2, "cpu", precision, clip, pg_timeout=30.0).results())


def test_uneven_fully_shard_on_3_ranks(run_gloo):
    pytest.importorskip("torch.distributed.fsdp")
    # 16 rows shard as 6, 6, 4 and 4 rows as 2, 2, 0: the last rank holds an empty shard
    results = run_gloo(fsdp_side_by_side, 3, "cpu", "fp32", False, pg_timeout=30.0).results()
    check(results)
    assert results[2]["shard_sizes"] != results[0]["shard_sizes"] and 0 in results[2]["shard_sizes"]


def test_a_group_that_does_not_span_the_mesh_keeps_dtensors_agreement(run_gloo):
    pytest.importorskip("torch.distributed.fsdp")
    # polyamp's SUM runs over this rank alone; DTensor's own MAX over the mesh still agrees
    check(run_gloo(fsdp_side_by_side, 2, "cpu", "fp32", False, True, pg_timeout=30.0).results(),
          polyamp_calls=2)

