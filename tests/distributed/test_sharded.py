"""polyamp's ShardedGradScaler against torch's own on gloo, 2 and 3 processes (CPU).

Every rank trains its own shard of parameters (its own model and data, as with FSDP/ZeRO) twice
side by side, once under torch's ``ShardedGradScaler``, once under polyamp's, with identical
losses. Per step and rank both must agree on the skip decisions (torch's flag is the SUM over
ranks, polyamp's 1 when some rank overflowed; either way an overflow on one rank makes every
rank skip), and bitwise on the scale and the growth tracker;
at the end the parameters and optimizer states must be bitwise equal. ``dist.all_reduce`` is
wrapped on every rank to count each side's collectives per step. One job per size runs every
scenario (each job starts the processes and imports torch once).
"""

from __future__ import annotations

import copy
import math
import pickle
from dataclasses import dataclass, field

import pytest

SIZES = [2, 3]
LAST = -1  # in an overflow list: the last rank


@dataclass(frozen=True)
class Scenario:
    steps: int
    scaler: dict = field(default_factory=dict)
    overflow: dict = field(default_factory=dict)  # step -> [(rank, model index)]
    dtype: str = "float32"
    n_models: int = 1
    clip: float | None = None  # unscale_, then clip_grad_norm_ to this norm, then step
    no_grads_rank: int | None = None  # this rank's optimizer never gets a gradient
    reload_at: int | None = None  # state_dict round trip (crosswise) before this step


SCENARIOS = {
    "one_rank_overflows": Scenario(
        9, dict(init_scale=2.0**12, growth_interval=3), {2: [(LAST, 0)], 5: [(0, 0)], 7: [(0, 0), (1, 0)]}
    ),
    "growth": Scenario(
        8, dict(init_scale=4.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=1), {5: [(1, 0)]}
    ),
    # FP16 model: the scaled FP16 loss overflows by itself at 2**24, backs off until it fits, regrows.
    "fp16_gradients": Scenario(12, dict(init_scale=2.0**24, growth_interval=2), dtype="float16"),
    "unscale_and_clip": Scenario(
        7, dict(init_scale=2.0**10, growth_interval=2), {1: [(LAST, 0)], 4: [(0, 0)]}, clip=0.5
    ),
    "two_optimizers": Scenario(
        6, dict(init_scale=2.0**8, growth_interval=2), {1: [(0, 1)], 3: [(LAST, 0)]}, n_models=2
    ),
    "no_grads_on_last_rank": Scenario(
        6, dict(init_scale=2.0**8, growth_interval=2), {2: [(0, 0)]}, no_grads_rank=LAST
    ),
    "state_dict_round_trip": Scenario(
        8, dict(init_scale=2.0**10, growth_interval=3), {2: [(1, 0)], 6: [(0, 0)]}, reload_at=4
    ),
}


# -- what runs on every rank ---------------------------------------------------------------
class CountAllReduce:
    """Wraps ``torch.distributed.all_reduce`` (what torch's scaler and polyamp's reducer call)."""

    def __init__(self, dist):
        self.count, self._call = 0, dist.all_reduce

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self._call(*args, **kwargs)


def counted(dist) -> CountAllReduce:
    counter = CountAllReduce(dist)
    dist.all_reduce = counter
    return counter


def mlp(torch, dtype):
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(dtype)


class Side:
    """One run: a scaler, models, an SGD optimizer with momentum per model, a per-step trace."""

    def __init__(self, name, scaler, models, torch):
        self.name, self.scaler, self.models = name, scaler, models
        self.optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
        self.trace = []


def make_scalers(kwargs):
    from polyamp.compat.torch import ShardedGradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    return TorchSharded("cpu", **kwargs), ShardedGradScaler("cpu", **kwargs)


def iteration(torch, side, rank, size, step, sc):
    """One training iteration; returns each optimizer's agreed flag as the scaler holds it."""
    dtype = getattr(torch, sc.dtype)
    scaler = side.scaler
    for opt in side.optimizers:
        opt.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(5, 8, generator=gen).to(dtype), torch.randn(5, 4, generator=gen).to(dtype)
    bad = {i for r, i in sc.overflow.get(step, []) if r % size == rank}
    if sc.no_grads_rank is not None and rank == sc.no_grads_rank % size:
        loss = torch.ones((), dtype=dtype, requires_grad=True) * (math.inf if bad else 1.0)
    else:
        losses = [((m(x) - y) ** 2).mean() * (math.inf if i in bad else 1.0)
                  for i, m in enumerate(side.models)]
        loss = sum(losses[1:], losses[0])
    scaler.scale(loss).backward()
    for opt, model in zip(side.optimizers, side.models, strict=True):
        if sc.clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), sc.clip)
        scaler.step(opt)
    flags = [sum(float(v.item()) for v in scaler._found_inf_per_device(opt).values())
             for opt in side.optimizers]
    scaler.update()
    return flags


def reload(side, kwargs, state):
    """A fresh scaler of the same kind loaded from ``state`` (the other side's state dict)."""
    torch_scaler, polyamp_scaler = make_scalers(kwargs)
    fresh = torch_scaler if side.name == "torch" else polyamp_scaler
    fresh.load_state_dict(state)
    if side.name == "polyamp":  # and a pickle round trip (the default group pickles)
        fresh = pickle.loads(pickle.dumps(fresh))
    side.scaler = fresh


def side_by_side(rank, size, sc, counter):
    import torch

    torch.manual_seed(rank)  # every rank its own shard of parameters
    base = [mlp(torch, getattr(torch, sc.dtype)) for _ in range(sc.n_models)]
    scalers = make_scalers(sc.scaler)
    sides = [Side(name, scaler, copy.deepcopy(base), torch)
             for name, scaler in zip(("torch", "polyamp"), scalers, strict=True)]
    out = {}
    for step in range(sc.steps):
        if step == sc.reload_at:
            states = [side.scaler.state_dict() for side in sides]
            out["state_dicts"] = states
            reload(sides[0], sc.scaler, states[1])
            reload(sides[1], sc.scaler, states[0])
        for side in sides:
            before = counter.count
            flags = iteration(torch, side, rank, size, step, sc)
            scaler = side.scaler
            calls = counter.count - before
            side.trace.append((flags, scaler.get_scale(), scaler._get_growth_tracker(), calls))
    t, p = sides
    out["traces"] = {side.name: side.trace for side in sides}
    params = [(a, b) for mt, mp in zip(t.models, p.models, strict=True)
              for a, b in zip(mt.parameters(), mp.parameters(), strict=True)]
    out["same_params"] = all(torch.equal(a, b) for a, b in params)
    buffers = [(t.optimizers[i].state[a]["momentum_buffer"], p.optimizers[i].state[b].get("momentum_buffer"))
               for i, (mt, mp) in enumerate(zip(t.models, p.models, strict=True))
               for a, b in zip(mt.parameters(), mp.parameters(), strict=True) if a in t.optimizers[i].state]
    out["same_momentum"] = all(b is not None and torch.equal(a, b) for a, b in buffers)
    out["params_moved"] = any(not torch.equal(a, b) for a, b in
                              zip(base[0].parameters(), t.models[0].parameters(), strict=True))
    out["polyamp_collectives"] = p.scaler.reducer.collectives
    out["reducer"] = p.scaler.reducer.name
    return out


def every_scenario(rank: int, size: int) -> dict:
    import torch.distributed as dist

    counter = counted(dist)
    return {name: side_by_side(rank, size, sc, counter) for name, sc in SCENARIOS.items()}


# -- the checks ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jobs():
    return {}


@pytest.fixture(params=SIZES, ids=lambda n: f"{n}ranks")
def ranks(request, run_gloo, jobs):
    """Every rank's results of every scenario, for 2 or 3 ranks (one job per size)."""
    size = request.param
    if size not in jobs:
        jobs[size] = run_gloo(every_scenario, size, pg_timeout=30.0)
    return jobs[size].results()


def check_scenario(ranks, name):
    """torch and polyamp agree per rank and step; all ranks agree; counts are 1 per step(opt)."""
    sc = SCENARIOS[name]
    for rank, results in enumerate(ranks):
        out = results[name]
        t_trace, p_trace = out["traces"]["torch"], out["traces"]["polyamp"]
        for step, (t, p) in enumerate(zip(t_trace, p_trace, strict=True)):
            # the decisions (torch's flag counts the ranks, polyamp's is 0/1), scale, growth tracker
            decided = ([f > 0 for f in t[0]], *t[1:3]), ([f > 0 for f in p[0]], *p[1:3])
            assert decided[0] == decided[1], (name, rank, step, t, p)
            assert set(p[0]) <= {0.0, 1.0}, p
            assert t[3] == sc.n_models, (name, rank, step, t)  # torch: one per optimizer (one device)
            assert p[3] == sc.n_models, (name, rank, step, p)  # polyamp: one per optimizer, the first too
        assert out["same_params"] and out["same_momentum"], (name, rank)
        assert out["reducer"] == "torch:gloo"
        steps = sc.steps - (sc.reload_at or 0)  # the scaler's own reducer (a reload builds a new one)
        assert out["polyamp_collectives"] == sc.n_models * steps
        # every rank skips together: the agreed flags are the same on every rank
        assert [s[0] for s in p_trace] == [s[0] for s in ranks[0][name]["traces"]["polyamp"]]
        assert [s[1:3] for s in p_trace] == [s[1:3] for s in ranks[0][name]["traces"]["polyamp"]]
    flags = [s[0] for s in ranks[0][name]["traces"]["polyamp"]]
    for step, entries in sc.overflow.items():  # an overflow on some ranks is seen on all
        for i in range(sc.n_models):
            assert flags[step][i] == float(any(j == i for _, j in entries)), (name, step, flags)
    return flags


def test_one_rank_overflow_makes_every_rank_skip(ranks):
    flags = check_scenario(ranks, "one_rank_overflows")
    assert [f[0] > 0 for f in flags] == [s in (2, 5, 7) for s in range(9)]
    scales = [s[1] for s in ranks[0]["one_rank_overflows"]["traces"]["polyamp"]]
    assert scales == [2.0**12, 2.0**12, 2.0**11, 2.0**11, 2.0**11, 2.0**10, 2.0**10, 2.0**9, 2.0**9]


def test_growth_with_a_small_interval(ranks):
    check_scenario(ranks, "growth")
    scales = [s[1] for s in ranks[0]["growth"]["traces"]["polyamp"]]
    assert scales == [16.0, 64.0, 256.0, 1024.0, 4096.0, 1024.0, 4096.0, 16384.0]


def test_fp16_gradients_overflow_by_themselves_and_agree(ranks):
    flags = check_scenario(ranks, "fp16_gradients")
    assert any(f[0] > 0 for f in flags) and any(f[0] == 0 for f in flags)
    assert all(r["fp16_gradients"]["params_moved"] for r in ranks)


def test_unscale_then_clip(ranks):
    check_scenario(ranks, "unscale_and_clip")


def test_two_optimizers_skip_each_on_its_own_agreed_flag(ranks):
    flags = check_scenario(ranks, "two_optimizers")
    assert flags[1] == [0.0, 1.0] and flags[3] == [1.0, 0.0]  # one optimizer skips, the other steps


def test_a_rank_without_gradients_still_agrees(ranks):
    check_scenario(ranks, "no_grads_on_last_rank")
    last = ranks[-1]["no_grads_on_last_rank"]
    assert not last["params_moved"]
    assert [s[0] for s in last["traces"]["polyamp"]][2] == [1.0]  # it skipped with rank 0


def test_state_dict_round_trip_crosswise(ranks):
    check_scenario(ranks, "state_dict_round_trip")
    for results in ranks:
        torch_state, polyamp_state = results["state_dict_round_trip"]["state_dicts"]
        assert torch_state == polyamp_state


# -- on a group: errors, pickling, NumPy arrays ------------------------------------------------
def api_on_a_group(rank: int, size: int) -> dict:
    import torch
    import torch.distributed as dist
    from polyamp.compat.torch import ShardedGradScaler

    import polyamp

    out = {}
    # a config that differs on one rank: every rank raises at the first step, nothing applied
    scaler = ShardedGradScaler("cpu", growth_interval=7 if rank == 1 else 2000)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler.scale(param.sum()).backward()
    try:
        scaler.step(opt)
    except polyamp.distributed.RankMismatchError as exc:
        out["mismatch"] = str(exc)
    kept = torch.equal(param.detach(), torch.ones(3))
    try:  # the optimizer is still READY: unscale_ agrees again (not "already been called")
        scaler.unscale_(opt)
    except Exception as exc:  # noqa: BLE001 - any error but the stage's
        kept = kept and "already been called" not in str(exc)
    out["grad_kept"] = kept
    # an explicit group: built at once; a process group does not pickle
    scaler = ShardedGradScaler("cpu", process_group=dist.group.WORLD)
    out["explicit"] = (scaler.reducer.name, scaler.process_group is dist.group.WORLD)
    try:
        pickle.dumps(scaler)
    except TypeError as exc:
        out["pickle"] = str(exc)
    out.update(numpy_training(rank, None))
    return out


def numpy_training(rank: int, group) -> dict:
    """NumPy arrays with polyamp's own optimizer: rank 1 overflows at step 0, every rank skips."""
    import numpy as np
    from polyamp.compat.torch import ShardedGradScaler

    import polyamp
    from polyamp.optim import SGD

    scaler = ShardedGradScaler("cpu", init_scale=4.0, growth_interval=1, backend="numpy", process_group=group)
    weights = polyamp.Parameter(np.ones(4, np.float32))
    opt = SGD([weights], lr=0.5)
    trace = []
    for step in range(3):
        scaled = scaler.scale(np.ones((), np.float32))
        bad = np.inf if (rank, step) == (1, 0) else 1.0
        weights.grad = np.full(4, bad, np.float32) * scaled
        scaler.step(opt)
        scaler.update()
        trace.append((scaler.last_step_skipped, scaler.get_scale(), float(weights.data[0])))
    copy = pickle.loads(pickle.dumps(scaler))
    return {"numpy": trace, "numpy_collectives": scaler.reducer.collectives,
            "numpy_reducer": scaler.reducer.name, "copy_group": copy.process_group}


def numpy_under_mpi(rank: int, size: int) -> dict:
    return numpy_training(rank, "mpi")


def check_numpy(out):
    # skipped together, then two steps of 0.5 * 1.0 each; the scale backs off, then grows
    assert out["numpy"] == [(True, 2.0, 1.0), (False, 4.0, 0.5), (False, 8.0, 0.0)]
    assert out["numpy_collectives"] == 3


def test_numpy_arrays_under_mpirun(run_mpi):
    pytest.importorskip("mpi4py")
    for out in run_mpi(numpy_under_mpi, 3).results():
        check_numpy(out)
        assert out["numpy_reducer"] == "mpi" and out["copy_group"] == "mpi"


def test_errors_pickling_and_numpy_arrays_on_a_group(run_gloo):
    results = run_gloo(api_on_a_group, 2, pg_timeout=30.0).results()
    for out in results:
        assert "config fingerprint" in out["mismatch"] and out["grad_kept"]
        assert out["explicit"] == ("torch:gloo", True)
        assert "process_group=" in out["pickle"] and "state_dict()" in out["pickle"]
        check_numpy(out)
        assert out["numpy_reducer"] == "torch:gloo" and out["copy_group"] is None
