"""Ranks whose precision meters differ raise RankMismatchError on EVERY rank before any rank applies
(issue 33, item 4), on real gloo ranks (2 and 3) and MPI ranks (3): meters of other settings (``every``,
targets) and meters at another sampling phase (a scaler resumed from a checkpoint at another step
count: the first step samples on no rank, on some ranks only, or on every rank at another step),
for ``LossScaler(reducer=)`` and ``ShardedGradScaler``; also scalers that load a checkpoint in the
middle of a run. Only the last rank differs (on 3 ranks the first two agree); the checkpoints differ
in their step count only, so nothing but the meter's phase tells the ranks apart. A control case
(every rank at the same step) steps and reports alike everywhere, so the checks can fail."""

from __future__ import annotations

import numpy as np
import pytest

EVERY = 3
NAMES = ("fc1.weight", "fc2.bias")
# case -> (the steps each rank resumes at: others, last); None: a meter of other settings on the last
RESUMED = {
    "control": (3, 3),
    "phase, no rank samples": (1, 2),
    "phase, the others sample": (3, 4),
    "phase, the last samples": (2, 3),
    "same phase, another step": (3, 6),
    "other every": None,
    "other targets": None,
}


def meter_of(case: str, last: bool):
    import polyamp

    if last and case == "other every":
        return polyamp.PrecisionMeter(every=EVERY + 1)
    if last and case == "other targets":
        return polyamp.PrecisionMeter(every=EVERY, targets=(("float16", "loss"), ("bfloat16", 2.0)))
    return polyamp.PrecisionMeter(every=EVERY)


def steps_of(case: str, last: bool) -> int:
    resumed = RESUMED[case]
    return 0 if resumed is None else resumed[last]


def _outcome(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported per rank
        return type(exc).__name__
    return None


# -- LossScaler(reducer=) ---------------------------------------------------------------------
def engine_cases(rank: int, size: int, group: str) -> dict:
    """Every case in turn on one group, each with fresh scalers resumed from a checkpoint of the same
    run, and one case that loads into scalers already stepping in sync."""
    import polyamp
    from polyamp.distributed import reducer

    last = rank == size - 1  # a reducer per case: one that found the ranks misaligned is retired
    grads = {k: np.full(2, 1e-3, np.float32) for k in NAMES}
    out: dict = {}
    checkpoint = polyamp.LossScaler(init_scale=2.0**8).state_dict()
    for case in RESUMED:
        red = reducer(group)
        scaler = polyamp.LossScaler(init_scale=2.0**8, reducer=red, meter=meter_of(case, last))
        scaler.load_state_dict({**checkpoint, "steps": steps_of(case, last)})
        applied: list[int] = []
        before = (scaler.steps, scaler.get_scale())
        error = _outcome(lambda: scaler.step(grads, lambda: applied.append(1)))  # noqa: B023
        if error is None:
            scaler.update()
        out[case] = {"error": error, "applied": applied, "report": scaler.last_precision,
                     "unchanged": error is None or (scaler.steps, scaler.get_scale()) == before}
    # scalers in step (the meter's first sample announced) that each load another rank's checkpoint
    scaler = polyamp.LossScaler(init_scale=2.0**8, reducer=reducer(group), meter=meter_of("control", last))
    for _ in range(2):
        scaler.step(grads, lambda: None)
        scaler.update()
    scaler.load_state_dict({**checkpoint, "steps": 4 if last else 3})
    applied = []
    error = _outcome(lambda: scaler.step(grads, lambda: applied.append(1)))
    out["reloaded in a run"] = {"error": error, "applied": applied, "report": None,
                                "unchanged": scaler.steps == (4 if last else 3)}
    return out


def check(results: list[dict]) -> None:
    for case in (*RESUMED, "reloaded in a run"):
        got = [r[case] for r in results]
        if case == "control":
            assert all(g["error"] is None and g["applied"] == [1] for g in got), got
            assert got[0]["report"] is not None and got[0]["report"].step == 3  # 4 taken: sampled at 3
            assert all(g["report"] == got[0]["report"] for g in got)
            continue
        for g in got:  # every rank raises, none applies, no rank's scaler moves
            assert g["error"] == "RankMismatchError" and g["applied"] == [] and g["unchanged"], (case, got)


@pytest.mark.parametrize("size", [2, 3])
def test_loss_scalers_whose_meters_differ_raise_on_every_rank_gloo(run_gloo, size):
    check(run_gloo(engine_cases, size, "torch").results())


def test_loss_scalers_whose_meters_differ_raise_on_every_rank_mpi(run_mpi):
    check(run_mpi(engine_cases, 3, "mpi").results())


# -- ShardedGradScaler ------------------------------------------------------------------------
def sharded_cases(rank: int, size: int) -> dict:
    """Every case with fresh ShardedGradScalers (two optimizers, one per tensor) resumed from the
    facade's own state dict at another step count; the parameters start at 0."""
    import torch
    from polyamp.compat.torch import ShardedGradScaler

    last, out = rank == size - 1, {}
    checkpoint = ShardedGradScaler("cpu", init_scale=2.0**8, meter=meter_of("control", False))
    checkpoint.scale(torch.ones(()))
    state = checkpoint.state_dict()
    for case in (*RESUMED, "reloaded in a run"):
        params = {k: torch.nn.Parameter(torch.zeros(2)) for k in NAMES}
        opts = [torch.optim.SGD([params[k]], lr=1.0) for k in NAMES]
        scaler = ShardedGradScaler("cpu", init_scale=2.0**8, meter=meter_of(case, last))

        def iteration(scaler=scaler, params=params, opts=opts):
            scaler.scale(torch.ones(()))
            for p in params.values():
                p.grad = torch.full((2,), 1e-3 * scaler.get_scale())
            for opt in opts:
                scaler.step(opt)
            scaler.update()

        if case == "reloaded in a run":  # in step (the first sample announced), then other checkpoints
            iteration(), iteration()
            scaler.load_state_dict({**state, "steps": 8 if last else 6})
        else:
            scaler.load_state_dict({**state, "steps": 2 * steps_of(case, last)})  # two optimizer steps each
        before = [p.detach().clone() for p in params.values()]
        error = _outcome(iteration)
        out[case] = {"error": error, "report": scaler.last_precision,
                     "applied": [not torch.equal(p, b) for p, b in zip(params.values(), before)]}
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_sharded_scalers_whose_meters_differ_raise_on_every_rank_before_any_applies(run_gloo, size):
    results = run_gloo(sharded_cases, size).results()
    for case in (*RESUMED, "reloaded in a run"):
        got = [r[case] for r in results]
        if case == "control":
            assert all(g["error"] is None and g["applied"] == [True, True] for g in got), got
            assert got[0]["report"].step == 6 and all(g["report"] == got[0]["report"] for g in got)
            continue
        for g in got:
            assert g["error"] == "RankMismatchError" and g["applied"] == [False, False], (case, got)
