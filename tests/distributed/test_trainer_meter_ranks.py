"""MixedPrecisionTrainer(meter=, reducer=) on 2 gloo ranks: the meter counts the gradients summed over
the ranks, so every rank gets the same report, in the step's one collective; ranks whose meters differ
raise RankMismatchError on every rank at the first step, before any weight moves."""

from __future__ import annotations

import functools

import numpy as np


def trainer_meter_run(rank: int, size: int, group: str) -> dict:
    import polyamp
    from polyamp.demo.data import spirals
    from polyamp.demo.mlp import MLP, softmax_cross_entropy
    from polyamp.distributed import reducer
    from polyamp.optim import Adam

    red = reducer(group)
    x, y = spirals(64, seed=0)
    rows = slice(rank * 32, rank * 32 + 32)
    loss = functools.partial(softmax_cross_entropy, normalizer=2**20)
    out: dict = {}
    for name, every in (("same", 2), ("differ", 2 + rank)):
        model = MLP([2, 8, 3], seed=2)
        trainer = polyamp.MixedPrecisionTrainer(model, Adam(model.parameters(), lr=1e-2), "float16",
                                                reducer=red, meter=polyamp.PrecisionMeter(every=every))
        reports, counts = [], []
        try:
            for _ in range(3):
                before = red.collectives
                trainer.train_step(x[rows], y[rows], loss)
                counts.append(red.collectives - before)
                reports.append(trainer.last_precision)
            out[name] = {"reports": reports, "counts": counts,
                         "grads": {n: np.array(p.grad) for n, p in model.named_parameters()}}
        except Exception as exc:  # noqa: BLE001 - reported per rank
            out[name] = {"error": type(exc).__name__, "steps": trainer.steps}
    return out


def test_every_rank_gets_the_report_of_the_summed_gradients_and_differing_meters_raise(run_gloo):
    import polyamp

    results = run_gloo(trainer_meter_run, 2, "torch").results()
    same = [r["same"] for r in results]
    assert same[0]["reports"] == same[1]["reports"]
    assert same[0]["counts"] == same[1]["counts"] == [2, 1, 1]  # the first step checks the sizes first
    report = same[0]["reports"][2]
    meter = polyamp.PrecisionMeter(every=2)
    grads = same[0]["grads"]
    counts, extremes = meter.count(polyamp.get_backend("numpy"), list(grads.values()), report.scale)
    assert report == meter.report(2, report.scale, list(grads), counts, extremes)
    for r in results:
        assert r["differ"] == {"error": "RankMismatchError", "steps": 0}
