"""The precision meter across ranks (issue 33, item 4): on a sample step the counts (summed), the
extremes (max) and the scale ride in the step's ONE agreement, every rank gets the same global report,
equal to one process counting every shard; a non-sample step sends what a meterless scaler sends;
ranks whose meters differ raise RankMismatchError on every rank at step 0, before any applies.
Real gloo process groups of 2 and 3 ranks (rank 2 of 3 holds empty shards)."""

from __future__ import annotations

import numpy as np
import pytest

N, STEPS, EVERY = 30, 5, 2
NAMES = ("fc1.weight", "fc2.bias")


def shard_of(rank: int, size: int) -> slice:
    return [slice(0, N // 2), slice(N // 2, N), slice(0, 0)][rank] if size == 3 else \
        [slice(0, N // 2), slice(N // 2, N)][rank]


def full_grads(step: int) -> dict[str, np.ndarray]:
    """The whole unscaled gradients of a step (every rank holds a slice of each)."""
    rng = np.random.default_rng(step)
    grads = {NAMES[0]: rng.standard_normal(N) * 1e-7, NAMES[1]: rng.standard_normal(N) * 1e-2}
    if step == 2:
        grads[NAMES[1]][N - 1] = np.inf  # a skipped sample step
    return grads


def meter_run(rank: int, size: int, group: str) -> dict:
    import polyamp
    from polyamp.distributed import reducer

    red = reducer(group)
    meter = polyamp.PrecisionMeter(every=EVERY)
    out: dict = {}
    for name, kwargs in (("plain", {}), ("metered", {"meter": meter})):
        scaler = polyamp.LossScaler(init_scale=2.0**8, reducer=red, **kwargs)
        counts, reports = [], []
        for step in range(STEPS):
            scale = np.float32(scaler.get_scale())
            grads = {k: (v[shard_of(rank, size)] * scale).astype(np.float32)
                     for k, v in full_grads(step).items()}
            before = red.collectives
            scaler.step(grads, lambda: None)
            scaler.update()
            counts.append(red.collectives - before)
            reports.append(scaler.last_precision)
        out[name] = {"counts": counts, "reports": reports}
    # ranks whose meters differ: every rank raises at step 0, no rank applies
    other = polyamp.PrecisionMeter(every=EVERY + rank % 2)
    scaler = polyamp.LossScaler(reducer=red, meter=other)
    applied: list[int] = []
    try:
        scaler.step({k: np.ones(2, np.float32) for k in NAMES}, lambda: applied.append(1))
        out["mismatch"] = None
    except Exception as exc:  # noqa: BLE001 - reported per rank
        out["mismatch"] = type(exc).__name__
    out["applied"] = applied
    return out


def check(results: list[dict], size: int) -> None:
    import polyamp

    meter = polyamp.PrecisionMeter(every=EVERY)
    numpy = polyamp.get_backend("numpy")
    metered = [r["metered"] for r in results]
    for step in range(STEPS):
        got = [m["reports"][step] for m in metered]
        assert all(g == got[0] for g in got)  # every rank the same global report
        if step % EVERY:
            assert got[0].step == step - step % EVERY
            continue
        whole = {k: (v * np.float32(got[0].scale)).astype(np.float32) / np.float32(got[0].scale)
                 for k, v in full_grads(step).items()}
        counts, extremes = meter.count(numpy, list(whole.values()), got[0].scale)
        assert got[0] == meter.report(step, got[0].scale, list(NAMES), counts, extremes)
    for r in results:
        assert r["plain"]["counts"] == [1] * STEPS
        # one collective per step, plus the one announcement of the meter's length at step 0
        assert r["metered"]["counts"] == [2] + [1] * (STEPS - 1)
        assert r["mismatch"] == "RankMismatchError" and r["applied"] == []
    assert results[0]["metered"]["reports"][2].tensors[1].nonfinite == 1


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_global_report_in_the_steps_one_collective(run_gloo, size):
    check(run_gloo(meter_run, size, "torch").results(), size)


def test_every_rank_gets_the_global_report_in_the_steps_one_collective_mpi(run_mpi):
    check(run_mpi(meter_run, 3, "mpi").results(), 3)
