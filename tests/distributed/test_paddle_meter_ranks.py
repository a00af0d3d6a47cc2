"""The paddle facade's meter= with reducer= on 2 real gloo ranks: a sample step's counts and extremes
ride in the step's one agreement, every rank gets the same global report (each gradient of both ranks
counted as one tensor), named by ``param.name``; a skipped sample step counts the values."""

from __future__ import annotations

import numpy as np

STEPS, EVERY, BAD_STEP = 4, 2, 2


def paddle_meter_run(rank: int, size: int, group: str) -> dict:
    import warnings

    warnings.simplefilter("ignore")  # paddle's "no ccache" and similar notices
    import paddle
    from polyamp.compat.paddle import GradScaler

    import polyamp
    from polyamp.distributed import reducer

    red = reducer(group)
    paddle.seed(rank)
    model = paddle.nn.Linear(4, 2)
    optimizer = paddle.optimizer.SGD(learning_rate=0.125, parameters=model.parameters())
    scaler = GradScaler(init_loss_scaling=2.0**4, reducer=red, meter=polyamp.PrecisionMeter(every=EVERY))
    out: dict = {"counts": [], "skipped": [], "grads": [], "reports": [], "names": []}
    for step in range(STEPS):
        x = np.full((2, 4), (rank + 1) * 1e-6, np.float32)
        if step == BAD_STEP and rank == 1:
            x[0, 0] = np.inf
        loss = model(paddle.to_tensor(x)).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        out["grads"].append([p.grad.numpy().copy() for p in model.parameters()])
        before = red.collectives
        scaler.step(optimizer)
        scaler.update()
        optimizer.clear_grad()
        out["counts"].append(red.collectives - before)
        out["skipped"].append(scaler.last_step_skipped)
        out["reports"].append(scaler.last_precision)
    out["names"] = [p.name for p in model.parameters()]
    return out


def test_every_rank_gets_the_global_report_in_the_steps_one_collective(run_gloo):
    import polyamp

    results = run_gloo(paddle_meter_run, 2, "torch").results()
    meter = polyamp.PrecisionMeter(every=EVERY)
    for out in results:
        assert out["skipped"] == [step == BAD_STEP for step in range(STEPS)]
        assert out["counts"] == [2, 1, 1, 1]  # one collective per step; the meter's length announced once
    for step in range(STEPS):
        reports = [out["reports"][step] for out in results]
        assert reports[0] == reports[1]
        if step % EVERY:
            continue
        # the two ranks' gradients of each parameter counted as one tensor (paddle names them alike)
        whole = [np.concatenate([out["grads"][step][i].reshape(-1) for out in results]) for i in range(2)]
        counts, extremes = meter.count(polyamp.get_backend("numpy"), whole, 16.0)
        assert reports[0] == meter.report(step, 16.0, results[0]["names"], counts, extremes)  # no growth yet
    assert sum(t.nonfinite for t in results[0]["reports"][BAD_STEP].tensors) > 0  # rank 1's inf, on both
