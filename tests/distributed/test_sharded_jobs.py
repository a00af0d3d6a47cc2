"""ShardedGradScaler against torch's own with shards as sharded jobs have them, on 2 and 3 gloo ranks.

One job per world size runs every case (one process group, torch imported once). Each rank trains
twice side by side, under torch's ``ShardedGradScaler`` and under polyamp's:

- ``uneven``: other shapes and counts of parameters per rank, a float16 parameter on the last rank
  only, and rank 1 with no gradient at all at one step (it ran no backward), overflows elsewhere;
- ``sub_groups``: the scalers on sub-groups ({0, 1} and {2} on 3 ranks, {0} and {1} on 2), each
  with uneven shards: an overflow on rank 1 skips its group's step only;
- ``fsdp2``: an FSDP2 ``fully_shard`` model whose layers split unevenly over the ranks
  (7 and 3 rows over 2 or 3 ranks).

Per step both sides must make the same skip decision with the same scale and growth tracker, every
rank of a group alike, and the parameters must end bitwise equal.
"""

from __future__ import annotations

import math

import pytest

SIZES = [2, 3]
STEPS = 7
EMPTY = (1, 3)  # (rank, step): that rank computes no gradient at that step
OVERFLOW = {"uneven": {1: 0, 5: -1}, "sub_groups": {2: 1, 4: 0}, "fsdp2": {1: 1, 4: 0}}  # step -> rank


def groups_of(size: int) -> list[list[int]]:
    return [[0, 1], [2]] if size == 3 else [[0], [1]]


def uneven_params(torch, rank, size):
    """Rank-dependent shapes and counts; the last rank also holds a float16 parameter."""
    torch.manual_seed(rank)
    shapes = [[(6,)], [(2, 3), (4,), (1,)], [(3, 3)]][rank]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    if rank == size - 1:
        params.append(torch.nn.Parameter((torch.randn(4) * 3).to(torch.float16)))
    return params


def uneven_step(torch, rank, scaler, params, opt, step, bad):
    opt.zero_grad(set_to_none=True)
    if (rank, step) != EMPTY:
        gen = torch.Generator().manual_seed(100 * rank + step)
        loss = sum(((p.float() - torch.randn(p.shape, generator=gen)) ** 2).sum() for p in params)
        scaler.scale(loss * (math.inf if bad else 1.0)).backward()
    scaler.step(opt)


def fsdp2_model(torch, mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same full model on every rank before sharding
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def run_case(rank: int, size: int, name: str, group, mesh) -> dict:
    import torch
    from polyamp.compat.torch import ShardedGradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    kwargs = dict(init_scale=2.0**12, growth_interval=2)
    sides = {}
    for kind, make in (("torch", TorchSharded), ("polyamp", ShardedGradScaler)):
        scaler = make("cpu", process_group=group, **kwargs)
        if name == "fsdp2":
            model = fsdp2_model(torch, mesh)
            params = list(model.parameters())
        else:
            model, params = None, uneven_params(torch, rank, size)
        sides[kind] = (scaler, model, params, torch.optim.SGD(params, lr=0.05, momentum=0.9))
    traces = {kind: [] for kind in sides}
    for step in range(STEPS):
        bad = OVERFLOW[name].get(step, None) in (rank, rank - size)
        for kind, (scaler, model, params, opt) in sides.items():
            if model is None:
                uneven_step(torch, rank, scaler, params, opt, step, bad)
            else:
                opt.zero_grad(set_to_none=True)
                x = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * rank + step))
                scaler.scale((model(x) ** 2).mean() * (math.inf if bad else 1.0)).backward()
                scaler.step(opt)
            flag = sum(float(v.item()) for v in scaler._found_inf_per_device(opt).values())
            scaler.update()
            traces[kind].append((flag > 0, scaler.get_scale(), scaler._get_growth_tracker()))
    t_params, p_params = sides["torch"][2], sides["polyamp"][2]
    return {
        "traces": traces,
        "same_params": all(torch.equal(local(a), local(b)) for a, b in zip(t_params, p_params, strict=True)),
        "moved": any(not torch.equal(local(a), local(b)) for a, b in
                     zip(t_params, (uneven_params(torch, rank, size) if name != "fsdp2" else
                                    fsdp2_model(torch, mesh).parameters()), strict=True)),
        "shapes": [tuple(local(p).shape) for p in p_params],
        "dtypes": sorted({str(p.dtype) for p in p_params}),
    }


def every_case(rank: int, size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    subs = [dist.new_group(members) for members in groups_of(size)]  # every rank makes every group
    mine = next(g for g, members in zip(subs, groups_of(size), strict=True) if rank in members)
    mesh = init_device_mesh("cpu", (size,))
    return {"uneven": run_case(rank, size, "uneven", None, None),
            "sub_groups": run_case(rank, size, "sub_groups", mine, None),
            "fsdp2": run_case(rank, size, "fsdp2", None, mesh)}


@pytest.fixture(scope="module")
def jobs():
    return {}


@pytest.fixture(params=SIZES, ids=[f"{n}-ranks" for n in SIZES])
def ranks(request, run_gloo, jobs):
    size = request.param
    if size not in jobs:
        jobs[size] = run_gloo(every_case, size, pg_timeout=30.0)
    return jobs[size].results()


def check(ranks, name, groups) -> list[list[bool]]:
    """torch and polyamp alike per rank and step, bitwise parameters; each group's ranks alike.
    Returns each rank's skip decisions."""
    for rank, results in enumerate(ranks):
        out = results[name]
        assert out["traces"]["torch"] == out["traces"]["polyamp"], (name, rank)
        assert out["same_params"] and out["moved"], (name, rank)
    for members in groups:
        assert all(ranks[r][name]["traces"]["polyamp"] == ranks[members[0]][name]["traces"]["polyamp"]
                   for r in members), (name, members)
    return [[t[0] for t in r[name]["traces"]["polyamp"]] for r in ranks]


def test_uneven_shards_a_float16_shard_and_a_rank_without_gradients(ranks):
    size = len(ranks)
    skipped = check(ranks, "uneven", [list(range(size))])[0]
    assert skipped[1] and skipped[5] and not skipped[EMPTY[1]], skipped
    assert [r["uneven"]["dtypes"] for r in ranks][-1] == ["torch.float16", "torch.float32"]
    assert len({len(r["uneven"]["shapes"]) for r in ranks}) == size  # other counts on every rank


def test_sub_groups_skip_alone(ranks):
    size = len(ranks)
    skipped = check(ranks, "sub_groups", groups_of(size))
    assert skipped[1][2] and skipped[0][4]
    if size == 3:  # {0, 1} skipped at 2 with rank 1; {2} did not
        assert skipped[0][2] and not skipped[2][2] and not skipped[2][4]
    else:  # {0} and {1} each alone
        assert not skipped[0][2] and not skipped[1][4]


def test_fsdp2_with_uneven_splits(ranks):
    size = len(ranks)
    skipped = check(ranks, "fsdp2", [list(range(size))])[0]
    assert skipped[1] and skipped[4] and not all(skipped)
    rows = [r["fsdp2"]["shapes"][0][0] for r in ranks]  # the first weight's rows on each rank
    assert sum(rows) == 7 and len(set(rows)) > 1, rows  # split unevenly
