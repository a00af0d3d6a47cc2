"""Overflow forensics across 2 gloo ranks, the overflow on rank 0 only: rank 0's report names its
tensor, rank 1's says another rank overflowed (engine with reducer=, ShardedGradScaler, and the
paddle facade with reducer=)."""

from __future__ import annotations

import math


def diagnose_on_two_ranks(rank: int, size: int) -> dict:
    """Rank 0's ``head.bias`` gradient holds an inf; rank 1's gradients are finite."""
    import numpy as np
    import torch
    from polyamp.compat.torch import ShardedGradScaler

    from polyamp import LossScaler

    out: dict = {}
    grads = {"embed.weight": np.ones(3, np.float32), "head.bias": np.ones(2, np.float32)}
    if rank == 0:
        grads["head.bias"][0] = math.inf
    scaler = LossScaler(reducer="torch", diagnose=True)
    result = scaler.step(grads, lambda: None)
    scaler.update()
    report = scaler.last_overflow
    out["engine"] = (result.skipped, report.found, [t.name for t in report.tensors], report.diagnosis)
    scaler.step({"embed.weight": np.ones(3, np.float32)}, lambda: None)  # clean on both: applied
    out["engine_applied"] = scaler.last_overflow

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded = ShardedGradScaler("cpu", diagnose=True)
    sharded.name_parameters(model)
    sharded.scale(model(torch.ones(1, 3)).sum()).backward()
    if rank == 0:
        model.bias.grad[1] = math.nan
    sharded.step(opt)
    sharded.update()
    report = sharded.last_overflow
    out["sharded"] = (report.found, [t.name for t in report.tensors], report.diagnosis)

    from polyamp.compat.paddle import GradScaler as PaddleScaler

    from polyamp.optim import SGD
    from polyamp.parameter import Parameter

    param = Parameter(np.zeros(2, np.float32), grad=np.full(2, 4.0, np.float32))
    if rank == 0:
        param.grad[1] = math.inf
    paddle_facade = PaddleScaler(reducer="torch", diagnose=True, backend="numpy")
    paddle_facade.step(SGD([param], lr=0.1))
    paddle_facade.update()
    report = paddle_facade.last_overflow
    out["paddle"] = (report.found, [t.name for t in report.tensors], report.diagnosis)
    return out


def test_only_the_rank_that_overflowed_names_tensors(run_gloo):
    rank0, rank1 = run_gloo(diagnose_on_two_ranks, 2).results()
    skipped, found, names, diagnosis = rank0["engine"]
    assert skipped and found and names == ["head.bias"] and "1 of 2 gradient tensors" in diagnosis
    skipped, found, names, diagnosis = rank1["engine"]
    assert skipped and not found and names == [] and "another rank overflowed" in diagnosis
    assert rank0["engine_applied"] is None and rank1["engine_applied"] is None
    assert rank0["sharded"][:2] == (True, ["bias"])
    found, names, diagnosis = rank1["sharded"]
    assert not found and names == [] and "another rank overflowed" in diagnosis
    assert rank0["paddle"][:2] == (True, ["params[0]"])  # polyamp.Parameter has no .name
    found, names, diagnosis = rank1["paddle"]
    assert not found and names == [] and "another rank overflowed" in diagnosis
