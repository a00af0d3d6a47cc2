"""A group of one sends its flag alone (no fingerprint): every way an iteration ends gives what the same
run over two aligned ranks gives, on real gloo groups.

Each rank of a 2-rank job runs the same iterations twice, on its own group of one
(``new_group([rank])``) and on both ranks with the same inputs: skips, scales, agreed flags, errors and
collective counts must be equal, each extra value summed over two ranks twice the one rank's (dyadic
values: exact), and the one rank's run that of a scaler without a reducer. Host and device paths (the
latter forced on CPU arrays, as test_fingerprint does).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

LENGTHS = [2, 2, 1, None, 0, 2, 1, None, 2]  # the extra values agreed per iteration (None: a clip)


def _events(group, library: str) -> list:
    """One run of iterations on ``group`` with ``library``'s arrays: what each returned or raised."""
    import torch

    from polyamp import LossScaleConfig, LossScaler, StepGuard, clip_grad_norm_
    from polyamp.distributed import reducer
    from polyamp.precision import PrecisionMeter

    red = None if group is None else reducer(group)
    config = LossScaleConfig(init_scale=2.0**6, growth_interval=2)
    guard = StepGuard(loss_zscore=3.0, grad_norm_zscore=3.0, min_history=2, window=8, max_grad_norm=50.0)
    scaler = LossScaler(config, reducer=red, guard=guard, meter=PrecisionMeter(every=3))
    array = torch.from_numpy if library == "torch" else np.asarray
    events: list = []

    def note(what, call, *args, **kwargs):
        before = 0 if red is None else red.collectives
        try:
            value = call(*args, **kwargs)
        except Exception as exc:
            value = f"{type(exc).__name__}: {exc}"
        events.append([what, value, 0 if red is None else red.collectives - before])

    def agree(grads, loss, extra):
        scaler.unscale_(grads, loss=loss)
        return [None if a is None else a.tolist() for a in scaler.agree_(extra=extra)]

    def clip(grads, loss):
        scaler.unscale_(grads, loss=loss)
        return float(clip_grad_norm_(grads, 1.0, scaler=scaler)) ** 2

    def update():
        scaler.update()
        return float(scaler.get_scale())

    for step, length in enumerate(LENGTHS):
        values = np.full(4, 2.0 ** (step % 3), np.float32)
        if step in (2, 6):
            values[1] = np.inf if step == 2 else np.nan
        grads, loss = [array(values)], 1e6 if step == 7 else 1.0 + step / 64
        if step == 3:
            note("set_scale", scaler.set_scale, 2.0**3)
        if step == 4:
            note("bad extra", scaler.agree_, extra=np.ones(3))  # refused: nothing sent
            note("bad grad", scaler.unscale_, [array(np.ones(2, np.int32))])
        if step == 5:  # a fresh scaler resumed from the state, its guard another
            state = scaler.state_dict()
            scaler = LossScaler(config, reducer=red, guard=StepGuard(loss_zscore=3.0, min_history=2))
            note("load", scaler.load_state_dict, state)
        if length is None:
            note("clip", clip, grads, loss)
        else:
            extra = array(np.arange(1.0, length + 1.0) * (step + 1)) if length else None
            note("agree", agree, grads, loss, extra)
        note("step", lambda: bool(scaler.step([], lambda: None).skipped))  # noqa: B023 - called at once
        note("update", update)
    return events


def _sharded(group) -> list:
    """ShardedGradScaler, two optimizers (the one-value format): scales and weights after each step."""
    import torch
    from polyamp.compat.torch import ShardedGradScaler

    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 2) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    scaler = ShardedGradScaler("cpu", init_scale=2.0**6, growth_interval=2, process_group=group)
    out = []
    for step in range(5):
        loss = sum(m(torch.ones(1, 3)).sum() for m in models) * (float("inf") if step == 2 else 1.0)
        for optimizer in optimizers:
            optimizer.zero_grad()
        scaler.scale(loss).backward()
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update(new_scale=2.0**4 if step == 3 else None)
        out.append([float(scaler.get_scale()), [p.tolist() for m in models for p in m.parameters()]])
    return out


def _trainer(group) -> list:
    """The data-parallel trainer (the payload's format): its collectives, metrics and weights."""
    from polyamp import MixedPrecisionTrainer, StepGuard
    from polyamp.demo import MLP, softmax_cross_entropy, spirals
    from polyamp.distributed import reducer
    from polyamp.optim import Adam

    x, y = spirals(64, seed=0)  # the same batch on every rank: the mean over two is this rank's
    model, red = MLP([2, 8, 3], seed=1), reducer(group)
    trainer = MixedPrecisionTrainer(model, Adam(model.parameters(), lr=1e-2), "float16", max_grad_norm=1.0,
                                    reducer=red, guard=StepGuard(loss_zscore=3.0, min_history=2))
    metrics = [repr(trainer.train_step(x, y, softmax_cross_entropy)) for _ in range(4)]
    return [red.collectives, metrics, [p.data.tolist() for p in model.parameters()]]


def alone_and_together(rank: int, size: int, device: bool) -> dict:
    import gc

    import torch.distributed as dist

    if device:  # the device path (GPU arrays), on CPU arrays
        import polyamp._agreement as agreement

        agreement._on_host = lambda *args: False
    from polyamp import LossScaler
    from polyamp.distributed import ReducerUnavailableError, reducer

    own = [dist.new_group([r]) for r in range(size)][rank]
    out = {f"{how} {library}": _events(group, library) for library in ("numpy", "torch")
           for how, group in (("alone", own), ("together", dist.group.WORLD), ("local", None))}
    for how, group in (("alone", own), ("together", dist.group.WORLD)):
        out.update({f"sharded {how}": _sharded(group), f"trainer {how}": _trainer(group)})
    red = reducer(own)
    scaler = LossScaler(reducer=red)
    scaler.step([np.ones(2, np.float32)], lambda: None)
    scaler.update()
    before, scale = red.collectives, scaler.get_scale()
    dist.destroy_process_group(own)
    del own
    gc.collect()
    with pytest.raises(ReducerUnavailableError) as raised:
        scaler.step([np.ones(2, np.float32)], lambda: None)
    out["destroyed"] = [str(raised.value), red.collectives - before, scaler.get_scale() == scale]
    return out


def _doubled(alone):
    """What two ranks with this rank's values sum to: every value twice (inf stays inf)."""
    return [_doubled(a) for a in alone] if isinstance(alone, list) else alone * 2


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_a_group_of_one_ends_each_iteration_as_two_aligned_ranks_do(run_gloo, device):
    results = run_gloo(alone_and_together, 2, device).results()
    for out, library in itertools.product(results, ("numpy", "torch")):
        alone, together = out[f"alone {library}"], out[f"together {library}"]
        assert [(e[0], e[2]) for e in alone] == [(e[0], e[2]) for e in together]  # the same collectives
        for (what, a, _), (_, t, _) in zip(alone, together, strict=True):
            if what == "clip":  # the global norm's square: summed over two ranks
                assert t == pytest.approx(2 * a, rel=1e-12), (a, t)  # through a square root
            elif what == "agree":  # the flag agreed as one rank's, the extras summed over two
                assert t == [a[0], None if a[1] is None else _doubled(a[1])], (a, t)
            else:
                assert a == t
        # one rank alone is the arithmetic of a scaler without a reducer
        assert [e[:2] for e in alone] == [e[:2] for e in out[f"local {library}"]]
        skips = [e[1] for e in alone if e[0] == "step"]
        assert True in skips and False in skips
        errors = [e for e in alone if isinstance(e[1], str)]
        assert [e[0] for e in errors] == ["bad extra", "bad grad"] and all(e[2] == 0 for e in errors)
        assert out["sharded alone"] == out["sharded together"]
        assert out["trainer alone"] == out["trainer together"]
        message, issued, same_scale = out["destroyed"]
        assert "polyamp reducer 'torch:gloo' (rank 0 of 1)" in message and "destroyed" in message
        assert issued == 0 and same_scale
