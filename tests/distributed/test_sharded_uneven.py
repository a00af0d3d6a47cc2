"""Uneven shards: polyamp's ShardedGradScaler against torch's own on 3 gloo ranks (CPU).

The ranks' optimizers hold different parameters: (a) rank 0 three, one of them float16, the
others two float32 of other shapes; (b) a ZeRO-style partition of one model, each rank's optimizer
owning other parameters (other counts, shapes and param groups); (c) two FSDP2 meshes under the
scaler's one group, as pipeline stages (DTensors of other global shapes). Each rank trains twice
side by side, under torch's ``ShardedGradScaler`` and under polyamp's; one rank overflows at some
steps. Per step both must make the same skip decisions with the same scale and growth tracker, and the
parameters must end bitwise equal. Then ranks that are really misaligned still raise
``RankMismatchError`` on every rank before any applies the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

SIZE = 3


@dataclass(frozen=True)
class Case:
    steps: int
    scaler: dict
    overflow: dict = field(default_factory=dict)  # step -> the rank whose gradient holds an inf


CASES = {
    # rank 0's float16 parameter also overflows by itself at the larger scales (its gradient is cast)
    "uneven_dtypes": Case(10, dict(init_scale=2.0**13, growth_interval=2), {4: 2}),
    "zero_partition": Case(9, dict(init_scale=2.0**10, growth_interval=2), {2: 1, 6: 0}),
    "pipeline_stages": Case(6, dict(init_scale=2.0**10, growth_interval=2), {1: 0, 3: 2}),
}


# -- what runs on every rank ---------------------------------------------------------------
def make_scalers(kwargs, group=None):
    from polyamp.compat.torch import ShardedGradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    return {"torch": TorchSharded("cpu", **kwargs), "polyamp": ShardedGradScaler("cpu", process_group=group,
                                                                                **kwargs)}


def uneven_params(torch, rank):
    """Rank 0: two float32 parameters and a float16 one; the others two float32 of other shapes."""
    torch.manual_seed(rank)
    shapes = [(4,), (3, 2)] if rank == 0 else [(5 + rank,), (2, rank)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    if rank == 0:
        params.append(torch.nn.Parameter(torch.randn(5).to(torch.float16) * 4))
    return params


class Run:
    """One side of a case on this rank: its parameters, optimizer, and how one step trains."""

    def __init__(self, params, opt, step, after=lambda: None):
        self.params, self.opt, self.step, self.after = params, opt, step, after

    def local(self):
        """The parameters as this rank holds them (a DTensor's local shard)."""
        return [local(p) for p in self.params]


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def uneven_run(torch, rank, scaler):
    params = uneven_params(torch, rank)
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)

    def step(step, bad):
        gen = torch.Generator().manual_seed(100 * rank + step)
        loss = sum(((p.float() - torch.randn(p.shape, generator=gen)) ** 2).sum() for p in params)
        scaler.scale(loss * (math.inf if bad else 1.0)).backward()
        scaler.step(opt)

    return Run(params, opt, step)


def zero_model(torch):
    torch.manual_seed(0)  # the same full model on every rank
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4),
                               torch.nn.ReLU(), torch.nn.Linear(4, 3))


def zero_owners(params, size):
    """Each parameter's owner: the largest first, to the least loaded rank (ZeRO's balance)."""
    owners, load = {}, [0] * size
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        owners[i] = load.index(min(load))
        load[owners[i]] += params[i].numel()
    return owners


def zero_run(torch, rank, size, scaler):
    """SGD over this rank's parameters of one model: weights (decayed) and biases, empty groups left
    out. A step: backward on this rank's data, each gradient summed onto its owner, the owners
    step, then every parameter is sent from its owner to every rank."""
    import torch.distributed as dist

    model = zero_model(torch)
    params = list(model.parameters())
    owners = zero_owners(params, size)
    mine = [p for i, p in enumerate(params) if owners[i] == rank]
    groups = [{"params": [p for p in mine if p.dim() > 1], "weight_decay": 1e-2},
              {"params": [p for p in mine if p.dim() == 1]}]
    opt = torch.optim.SGD([g for g in groups if g["params"]], lr=0.05, momentum=0.9)

    def step(step, bad):
        model.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 3, generator=gen)
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        for i, p in enumerate(params):
            dist.reduce(p.grad, dst=owners[i])
        if bad:
            mine[0].grad.view(-1)[0] = math.inf
        scaler.step(opt)

    def after():
        for i, p in enumerate(params):
            dist.broadcast(p.data, src=owners[i])

    return Run(params, opt, step, after)


def stages_run(torch, rank, size, scaler, meshes):
    """Two FSDP2 meshes under one scaler group, as pipeline stages: ranks 0 and 1 shard one layer,
    the last rank holds another (DTensors of other global shapes)."""
    from torch.distributed.fsdp import fully_shard

    stage = 0 if rank < size - 1 else 1
    torch.manual_seed(stage)
    layer = fully_shard(torch.nn.Linear(8, 16) if stage == 0 else torch.nn.Linear(16, 4), mesh=meshes[stage])
    opt = torch.optim.SGD(layer.parameters(), lr=0.05, momentum=0.9)

    def step(step, bad):
        gen = torch.Generator().manual_seed(100 * rank + step)
        loss = (layer(torch.randn(4, layer.in_features, generator=gen)) ** 2).mean()
        scaler.scale(loss * (math.inf if bad else 1.0)).backward()
        scaler.step(opt)

    return Run(list(layer.parameters()), opt, step)


def side_by_side(rank: int, size: int, name: str, meshes) -> dict:
    import torch
    import torch.distributed as dist

    case = CASES[name]
    calls = {"n": 0}
    all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        calls["n"] += 1
        return all_reduce(*args, **kwargs)

    runs = {}
    for kind, scaler in make_scalers(case.scaler).items():
        if name == "uneven_dtypes":
            runs[kind] = (scaler, uneven_run(torch, rank, scaler))
        elif name == "zero_partition":
            runs[kind] = (scaler, zero_run(torch, rank, size, scaler))
        else:
            runs[kind] = (scaler, stages_run(torch, rank, size, scaler, meshes))
    traces = {kind: [] for kind in runs}
    dist.all_reduce = counted
    try:
        for step in range(case.steps):
            bad = case.overflow.get(step) == rank
            for kind, (scaler, run) in runs.items():
                run.opt.zero_grad(set_to_none=True)
                before = calls["n"]
                run.step(step, bad)
                step_calls = calls["n"] - before
                flag = sum(float(v.item()) for v in scaler._found_inf_per_device(run.opt).values())
                scaler.update()
                run.after()
                traces[kind].append((flag, scaler.get_scale(), scaler._get_growth_tracker(), step_calls))
    finally:
        dist.all_reduce = all_reduce
    (_, t), (_, p) = runs["torch"], runs["polyamp"]
    buffer = "momentum_buffer"
    momentum = [torch.equal(local(t.opt.state[a][buffer]), local(p.opt.state[b][buffer]))
                for ga, gb in zip(t.opt.param_groups, p.opt.param_groups, strict=True)
                for a, b in zip(ga["params"], gb["params"], strict=True) if a in t.opt.state]
    return {
        "traces": traces,
        "same_params": all(torch.equal(a, b) for a, b in zip(t.local(), p.local(), strict=True)),
        "same_momentum": bool(momentum) and all(momentum),
        "values": torch.cat([v.float().flatten() for v in p.local()]).tolist(),
        "group_sizes": [len(g["params"]) for g in p.opt.param_groups],
        "dtypes": sorted({str(v.dtype) for g in p.opt.param_groups for v in g["params"]}),
        "shapes": [tuple(v.shape) for v in p.params],
    }


def every_case(rank: int, size: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    meshes = [DeviceMesh("cpu", list(range(size - 1))), DeviceMesh("cpu", [size - 1])]  # on every rank
    return {name: side_by_side(rank, size, name, meshes) for name in CASES}


# -- the checks ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jobs():
    return {}


@pytest.fixture
def ranks(run_gloo, jobs):
    """Every rank's results of every case (one job of 3 ranks)."""
    if "uneven" not in jobs:
        jobs["uneven"] = run_gloo(every_case, SIZE, pg_timeout=30.0)
    return jobs["uneven"].results()


def check_case(ranks, name) -> list[bool]:
    """torch and polyamp decide alike per rank and step; every rank alike; one collective per step."""
    case = CASES[name]
    for rank, results in enumerate(ranks):
        out = results[name]
        t_trace, p_trace = out["traces"]["torch"], out["traces"]["polyamp"]
        for step, (t, p) in enumerate(zip(t_trace, p_trace, strict=True)):
            assert (t[0] > 0, *t[1:3]) == (p[0] > 0, *p[1:3]), (name, rank, step, t, p)
            assert p[0] in (0.0, 1.0) and t[3] == p[3] == 1, (name, rank, step, t, p)
        assert out["same_params"] and out["same_momentum"], (name, rank)
        assert p_trace == ranks[0][name]["traces"]["polyamp"], (name, rank)  # every rank skips together
    skipped = [p[0] > 0 for p in ranks[0][name]["traces"]["polyamp"]]
    assert all(skipped[step] for step in case.overflow), (name, skipped)
    assert not all(skipped), (name, skipped)
    return skipped


def test_uneven_parameters_and_dtypes_train_like_torch(ranks):
    skipped = check_case(ranks, "uneven_dtypes")
    assert [r["uneven_dtypes"]["group_sizes"] for r in ranks] == [[3], [2], [2]]
    assert [r["uneven_dtypes"]["dtypes"] for r in ranks] == [["torch.float16", "torch.float32"],
                                                             ["torch.float32"], ["torch.float32"]]
    # rank 0's float16 gradient overflowed by itself too: skips beyond the injected one
    assert sum(skipped) > len(CASES["uneven_dtypes"].overflow), skipped
    scales = [s[1] for s in ranks[0]["uneven_dtypes"]["traces"]["polyamp"]]
    assert min(scales) < scales[0], scales  # backed off
    assert any(b > a for a, b in zip(scales, scales[1:])), scales  # and grew again


def test_zero_partition_trains_like_torch(ranks):
    check_case(ranks, "zero_partition")
    sizes = [r["zero_partition"]["group_sizes"] for r in ranks]
    assert len({tuple(s) for s in sizes}) > 1, sizes  # each rank owns other parameters
    assert ranks[0]["zero_partition"]["values"] == ranks[1]["zero_partition"]["values"] \
        == ranks[2]["zero_partition"]["values"]  # one model again after the owners' broadcasts


def test_pipeline_stages_on_meshes_of_their_own_train_like_torch(ranks):
    pytest.importorskip("torch.distributed.fsdp")
    check_case(ranks, "pipeline_stages")
    # the stages' DTensors differ in global shape, so those shapes do not name the flag
    assert ranks[0]["pipeline_stages"]["shapes"] == ranks[1]["pipeline_stages"]["shapes"] \
        != ranks[2]["pipeline_stages"]["shapes"]


# -- misaligned ranks still raise on every rank ------------------------------------------------
def _outcome(fn) -> dict:
    try:
        return {"value": fn(), "type": None, "message": ""}
    except Exception as exc:  # the job reports it per rank
        return {"value": None, "type": type(exc).__name__, "message": str(exc)}


def train_misaligned(torch, rank, scaler, plan, steps=3) -> dict:
    """``plan(it)``: the optimizers and their parameters this rank steps in iteration ``it``."""
    applied: list[tuple[int, int]] = []

    def train() -> None:
        for it in range(steps):
            order = plan(it)
            loss = sum((p.float() * (i + 1)).sum() for i, (_, params) in enumerate(order) for p in params)
            scaler.scale(loss).backward()
            for i, (opt, params) in enumerate(order):
                before = [p.detach().clone() for p in params]
                scaler.step(opt)
                if any(not torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True)):
                    applied.append((it, i))
                opt.zero_grad(set_to_none=True)
            scaler.update()

    out = _outcome(train)
    out["applied"] = applied
    return out


def misaligned(rank: int, size: int) -> dict:
    """Each case on its own group (a mismatch retires the group's reducer)."""
    import torch
    import torch.distributed as dist

    def fresh(**kwargs):
        return make_scalers(dict(init_scale=2.0**10, growth_interval=3, **kwargs),
                            group=dist.new_group(list(range(size))))["polyamp"]

    out = {}
    params = uneven_params(torch, rank)
    sgd = torch.optim.SGD(params, lr=0.1)
    # another scale on rank 1 (it loaded another checkpoint)
    scaler = fresh()
    if rank == 1:
        scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0**9})
    out["scale"] = train_misaligned(torch, rank, scaler, lambda it: [(sgd, params)])
    # rank 1 steps a second optimizer the others do not
    extra = [torch.nn.Parameter(torch.ones(2))]
    second = torch.optim.SGD(extra, lr=0.1)
    out["extra_optimizer"] = train_misaligned(
        torch, rank, fresh(), lambda it: [(sgd, params), (second, extra)] if rank == 1 else [(sgd, params)])
    # two SGDs in one order, then rank 1 swaps them from iteration 1 on
    plain = [(sgd, params), (second, extra)]
    out["order_changes"] = train_misaligned(
        torch, rank, fresh(), lambda it: plain[::-1] if (rank, it >= 1) == (1, True) else plain)
    # an SGD and an Adam, swapped on rank 1 from the first step
    adam = torch.optim.Adam(extra, lr=0.1)
    mixed = [(sgd, params), (adam, extra)]
    out["classes_swapped"] = train_misaligned(
        torch, rank, fresh(), lambda it: mixed[::-1] if rank == 1 else mixed)
    out["dtensors_swapped"] = dtensors_swapped(torch, rank, size, fresh)
    return out


def dtensors_swapped(torch, rank, size, fresh) -> dict:
    """Two SGDs over FSDP2 layers of other global shapes, swapped on rank 1 from the first step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (size,))
    torch.manual_seed(0)
    layers = [fully_shard(torch.nn.Linear(4, 6), mesh=mesh), fully_shard(torch.nn.Linear(6, 5), mesh=mesh)]
    pairs = [(torch.optim.SGD(layer.parameters(), lr=0.1), layer) for layer in layers]
    scaler = fresh()
    applied: list[int] = []

    def train() -> None:
        x = torch.randn(3, 4)
        scaler.scale(layers[1](layers[0](x)).sum()).backward()
        for i, (opt, layer) in enumerate(pairs[::-1] if rank == 1 else pairs):
            before = [p.to_local().detach().clone() for p in layer.parameters()]
            scaler.step(opt)
            if any(not torch.equal(b, p.to_local().detach()) for b, p in zip(before, layer.parameters())):
                applied.append(i)
        scaler.update()

    out = _outcome(train)
    out["applied"] = applied
    return out


@pytest.fixture
def mismatches(run_gloo, jobs):
    if "misaligned" not in jobs:
        jobs["misaligned"] = run_gloo(misaligned, SIZE, pg_timeout=30.0)
    return jobs["misaligned"].results()


def check_raised(results, name, applied, says):
    for rank, out in enumerate(results):
        case = out[name]
        assert case["type"] == "RankMismatchError", (name, rank, case)
        assert says in case["message"], (name, rank, case["message"])
        assert case["applied"] == applied, (name, rank, case["applied"])


def test_another_scale_on_one_rank_raises_everywhere(mismatches):
    check_raised(mismatches, "scale", [], "scale")


def test_a_second_optimizer_on_one_rank_raises_everywhere(mismatches):
    # iteration 0's first optimizer agreed everywhere; nothing after it was applied on any rank
    check_raised(mismatches, "extra_optimizer", [(0, 0)], "collectives are not aligned")


def test_optimizers_swapped_from_a_later_iteration_raise_everywhere(mismatches):
    check_raised(mismatches, "order_changes", [(0, 0), (0, 1)], "the flag of scaler/optimizer")


def test_optimizers_of_other_classes_swapped_raise_everywhere(mismatches):
    check_raised(mismatches, "classes_swapped", [], "the flag of scaler/optimizer")


def test_dtensor_optimizers_swapped_raise_everywhere(mismatches):
    pytest.importorskip("torch.distributed.fsdp")
    check_raised(mismatches, "dtensors_swapped", [], "the flag of scaler/optimizer")
