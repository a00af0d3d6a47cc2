"""``ShardedGradScaler(meter=)`` across real gloo ranks (issue 33, item 4): each optimizer's collective
carries the counts of this iteration's gradients so far, so the last optimizer's one carries the
step's totals and every rank gets the same global report, equal to one process counting every shard,
with no collective beyond the one per optimizer that the scaler makes without a meter (plus the
meter's one announcement at its first sample). Ranks whose meters differ, or where one rank meters
and another does not, raise RankMismatchError on every rank before any rank applies."""

from __future__ import annotations

import numpy as np
import pytest

N, STEPS, EVERY = 30, 5, 4  # two optimizer steps per iteration: iterations 0, 2 and 4 sample
NAMES = ("fc1.weight", "fc2.bias")


def shard_of(rank: int, size: int) -> slice:
    return [slice(0, N // 2), slice(N // 2, N), slice(0, 0)][rank] if size == 3 else \
        [slice(0, N // 2), slice(N // 2, N)][rank]


def full_grads(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    grads = {NAMES[0]: rng.standard_normal(N) * 1e-7, NAMES[1]: rng.standard_normal(N) * 1e-2}
    if step == 2:
        grads[NAMES[1]][N - 1] = np.inf  # a skipped sample step
    return grads


def _build(rank: int, size: int, meter, guard=None) -> tuple:
    import torch
    from polyamp.compat.torch import ShardedGradScaler

    params = {k: torch.nn.Parameter(torch.zeros(len(range(N)[shard_of(rank, size)]))) for k in NAMES}
    opts = [torch.optim.SGD([params[k]], lr=1.0) for k in NAMES]  # one optimizer per tensor
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8, meter=meter, guard=guard)
    scaler.scale(torch.ones(()))  # creates the scale state, as a backward pass would
    return params, opts, scaler


def _step(scaler, params, opts, grads: dict[str, np.ndarray], rank: int, size: int) -> None:
    import torch

    scale = np.float32(scaler.get_scale())
    scaler.scale(torch.ones(()))  # the loss a guard judges (the same on every step)
    for k, p in params.items():
        p.grad = torch.from_numpy((grads[k][shard_of(rank, size)] * scale).astype(np.float32))
    for opt in opts:
        scaler.step(opt)
    scaler.update()


def sharded_meter_run(rank: int, size: int, guarded: bool = False) -> dict:
    import polyamp

    out: dict = {}
    for name, meter in (("plain", None), ("metered", polyamp.PrecisionMeter(every=EVERY))):
        guard = polyamp.StepGuard(loss_zscore=6.0, grad_norm_zscore=6.0) if guarded else None
        params, opts, scaler = _build(rank, size, meter, guard)
        counts, reports, weights = [], [], []
        for step in range(STEPS):
            before = scaler.reducer.collectives if step else 0
            _step(scaler, params, opts, full_grads(step), rank, size)
            counts.append(scaler.reducer.collectives - before)
            reports.append(scaler.last_precision if meter is not None else None)
            weights.append([p.detach().numpy().copy() for p in params.values()])
        out[name] = {"counts": counts, "reports": reports, "weights": weights}
    return out


def mismatch_run(rank: int, size: int, kind: str) -> dict:
    import polyamp

    meter = polyamp.PrecisionMeter(every=EVERY + rank % 2) if kind == "settings" else (
        polyamp.PrecisionMeter(every=EVERY) if rank == 0 else None)
    params, opts, scaler = _build(rank, size, meter)
    try:
        _step(scaler, params, opts, full_grads(0), rank, size)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported per rank
        error = type(exc).__name__
    return {"error": error, "weights": [float(p.detach().abs().sum()) for p in params.values()]}


@pytest.mark.parametrize(("size", "guarded"), [(2, False), (3, False), (2, True)])
def test_every_rank_gets_the_global_report_in_each_optimizers_collective(run_gloo, size, guarded):
    import polyamp

    results = run_gloo(sharded_meter_run, size, guarded).results()
    meter = polyamp.PrecisionMeter(every=EVERY)
    numpy = polyamp.get_backend("numpy")
    for step in range(STEPS):
        got = [r["metered"]["reports"][step] for r in results]
        assert all(g == got[0] for g in got), step  # every rank the same global report
        taken = 2 * step  # steps counts optimizer steps taken (skipped ones too), as metrics() does
        if taken % EVERY:
            assert got[0].step == taken - taken % EVERY
            continue
        scale = np.float32(got[0].scale)
        whole = [(v * scale).astype(np.float32) / scale for v in full_grads(step).values()]
        counts, extremes = meter.count(numpy, whole, got[0].scale)
        want = meter.report(taken, got[0].scale, [t.name for t in got[0].tensors], counts, extremes)
        assert got[0] == want, step
    assert results[0]["metered"]["reports"][2].tensors[1].nonfinite == 1  # counted though skipped
    for r in results:
        first = 2 + guarded  # one collective per optimizer (+ the guard's announcement of its values)
        assert r["plain"]["counts"] == [first] + [2] * (STEPS - 1)
        # + one announcement of the metered message's length (the guard's values named in the same one)
        assert r["metered"]["counts"] == [3] + [2] * (STEPS - 1)
        for a, b in zip(r["plain"]["weights"], r["metered"]["weights"]):  # the meter changes no step
            assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["settings", "one rank only"])
def test_ranks_whose_meters_differ_raise_on_every_rank_before_any_applies(run_gloo, kind):
    for r in run_gloo(mismatch_run, 2, kind).results():
        assert r["error"] == "RankMismatchError", r
        assert r["weights"] == [0.0, 0.0]


def phase_run(rank: int, size: int, group: str) -> dict:
    """Each rank resumes from a checkpoint taken at another step (1 and 2 steps taken, every=3): the
    first step samples on neither rank, but their sampling phases differ."""
    import polyamp
    from polyamp.distributed import reducer

    meter = polyamp.PrecisionMeter(every=3)
    scaler = polyamp.LossScaler(init_scale=2.0**8, reducer=reducer(group), meter=meter)
    scaler.load_state_dict({**scaler.state_dict(), "steps": 1 + rank})
    applied: list[int] = []
    try:
        scaler.step({k: np.ones(2, np.float32) for k in NAMES}, lambda: applied.append(1))
        error = None
    except Exception as exc:  # noqa: BLE001 - reported per rank
        error = type(exc).__name__
    return {"error": error, "applied": applied}


def test_ranks_whose_sampling_phase_differs_raise_at_once_on_every_rank(run_gloo):
    for r in run_gloo(phase_run, 2, "torch").results():
        assert r == {"error": "RankMismatchError", "applied": []}, r
