"""The paddle facade with reducer=: step and minimize agree across 2 gloo ranks, one collective each.

Each rank trains its own paddle.nn.Linear on its own data with a paddle optimizer (which
takes the agreed flag as its found_inf and decides itself); at one step rank 1 alone has an
inf input, and both ranks must skip that step and back off the scale together.
"""

from __future__ import annotations

import numpy as np

STEPS = 6
BAD_STEP = 2


def paddle_run(rank: int, size: int, group: str) -> dict:
    import warnings

    warnings.simplefilter("ignore")  # paddle's "no ccache" and similar notices
    import paddle
    from polyamp.compat.paddle import GradScaler

    from polyamp.distributed import reducer

    red = reducer(group)
    paddle.seed(rank)
    model = paddle.nn.Linear(4, 1)
    optimizer = paddle.optimizer.SGD(learning_rate=0.125, parameters=model.parameters())
    scaler = GradScaler(init_loss_scaling=2.0**4, incr_every_n_steps=2, reducer=red)
    out: dict = {"counts": [], "skipped": [], "scales": [], "changed": []}
    for step in range(STEPS):
        x = np.full((2, 4), (rank + 1) / 4.0, np.float32)
        if step == BAD_STEP and rank == 1:
            x[0, 0] = np.inf
        before_weights = model.weight.numpy().copy()
        before = red.collectives
        loss = model(paddle.to_tensor(x)).mean()
        scaler.scale(loss).backward()
        if step % 2:
            scaler.minimize(optimizer, scaler.scale(loss))
        else:
            scaler.unscale_(optimizer)  # as before clipping
            scaler.step(optimizer)
            scaler.update()
        optimizer.clear_grad()
        out["counts"].append(red.collectives - before)
        out["skipped"].append(scaler.last_step_skipped)
        out["scales"].append(float(scaler.state_dict()["scale"][0]))
        out["changed"].append(bool((model.weight.numpy() != before_weights).any()))
    return out


def test_paddle_step_and_minimize_agree_across_ranks(run_gloo):
    results = run_gloo(paddle_run, 2, "torch").results()
    for out in results:
        assert out["counts"] == [1] * STEPS  # one collective per step, the first too
        assert out["skipped"] == [step == BAD_STEP for step in range(STEPS)]
        assert out["changed"] == [step != BAD_STEP for step in range(STEPS)]
        assert out["scales"] == results[0]["scales"]
    assert results[0]["scales"][BAD_STEP] == results[0]["scales"][BAD_STEP - 1] / 2  # backed off together
