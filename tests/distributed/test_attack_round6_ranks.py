"""Attack round 6 (issue 33, item 4): ranks whose meters differ in ways the first test did not try (one
rank meters and one does not; a different number of gradients on a sample step): every rank raises
RankMismatchError, no rank applies, nobody hangs (short timeouts)."""

from __future__ import annotations

import numpy as np
import pytest

STEPS = 3


def engine_case(rank: int, size: int, group: str, case: str) -> dict:
    import polyamp
    from polyamp.distributed import reducer

    red = reducer(group)
    meter = polyamp.PrecisionMeter(every=2)
    if case == "one_meters":
        meter = meter if rank == 0 else None
    scaler = polyamp.LossScaler(init_scale=4.0, reducer=red, meter=meter)
    applied, counts = [], []
    for step in range(STEPS):
        n = 2 + (rank if case == "tensors" else 0)
        grads = [np.full(3, 4.0, np.float32) for _ in range(n)]
        before = red.collectives
        try:
            scaler.step(grads, lambda step=step: applied.append(step))
            scaler.update()
        except Exception as exc:  # noqa: BLE001 - reported per rank
            return {"error": type(exc).__name__, "msg": str(exc), "applied": applied, "step": step}
        counts.append(red.collectives - before)
    return {"error": None, "applied": applied, "counts": counts,
            "report": None if scaler.last_precision is None else scaler.last_precision.to_dict()}


@pytest.mark.parametrize("case", ["one_meters", "tensors"])
@pytest.mark.parametrize("size", [2, 3])
def test_ranks_whose_meters_or_gradients_differ_raise_on_every_rank(run_gloo, size, case):
    results = run_gloo(engine_case, size, "torch", case, timeout=60).results()
    assert all(r["error"] == "RankMismatchError" and r["step"] == 0 for r in results), results
    assert all(r["applied"] == [] for r in results)
    # the message points at the meter (it said "a global-norm clip's sum of squares" and "Fix: clip")
    assert all("PrecisionMeter" in r["msg"] for r in results), results
    if case == "tensors":
        assert all("as many gradients" in r["msg"] for r in results), results


def ended_without_agreement(rank: int, size: int, group: str, how: str) -> dict:
    import polyamp
    from polyamp.distributed import reducer

    red = reducer(group)
    scaler = polyamp.LossScaler(init_scale=4.0, reducer=red, meter=polyamp.PrecisionMeter(every=1))
    grads = [np.full(3, 4.0 * (rank + 1), np.float32)]  # each rank its own gradients
    scaler.unscale_(grads)
    before = red.collectives
    if how == "found_inf":
        scaler.update(np.zeros((), np.float32))  # the user's own flag: no agreement this iteration
    else:
        scaler.set_scale(8.0)  # ends the iteration without an agreement
    report = scaler.last_precision
    after = red.collectives - before
    scaler.step([np.full(3, 8.0, np.float32)], lambda: None)  # the next step agrees as usual
    scaler.update()
    return {"report": None if report is None else report.amax, "collectives": after,
            "next": scaler.last_precision.amax}


@pytest.mark.parametrize("how", ["found_inf", "set_scale"])
def test_an_iteration_ended_without_agreement_gives_no_rank_a_local_report(run_gloo, how):
    results = run_gloo(ended_without_agreement, 2, "torch", how, timeout=60).results()
    # each rank's own counts dressed as the step's global report differed between the ranks (1.0, 2.0)
    assert [r["report"] for r in results] == [None, None], results
    assert [r["collectives"] for r in results] == [0, 0]
    next_amax = 8.0 / (4.0 if how == "found_inf" else 8.0)  # the same on every rank: agreed
    assert [r["next"] for r in results] == [next_amax, next_amax]
