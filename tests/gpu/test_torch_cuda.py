"""The differential scenarios on device="cuda": polyamp's GradScaler against torch's, bitwise.

Skipped, with the reason, where CUDA is absent (CI has no GPU); run them on a GPU machine with
``python -m pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import math
import pickle

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none found)"),
]

DEVICE = "cuda"


def _plain(pair, overflow_at=(), poison_at=(), clip=None, unscale=False):
    """The usual iteration: scale, backward, (unscale_, clip,) step, update, record."""

    def iteration(side, step, data):
        side.optimizer.zero_grad()
        side.scaler.scale(pair.loss_of(side.model, data, step in overflow_at)).backward()
        if step in poison_at:
            pair.poison(side.model, math.nan)
        if unscale or clip:
            side.scaler.unscale_(side.optimizer)
        if clip:
            torch.nn.utils.clip_grad_norm_(side.model.parameters(), clip)
        pair.record(side, side.scaler.step(side.optimizer))
        side.scaler.update()
        pair.record(side)

    return iteration


SCENARIOS = {
    "overflow-and-growth": ({"init_scale": 2.0**10, "growth_interval": 3},
                            {"overflow_at": (0, 3, 4, 9)}),
    "poisoned-element": ({"init_scale": 4.0, "growth_interval": 2}, {"poison_at": (1, 5)}),
    "unscale-then-clip": ({"init_scale": 2.0**12, "growth_interval": 2},
                          {"overflow_at": (2,), "clip": 0.05}),
    "non-power-of-two": ({"init_scale": 1000.0, "growth_factor": 3.0, "backoff_factor": 0.3,
                          "growth_interval": 2}, {"overflow_at": (0, 1, 5)}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenarios_match_torch_bitwise(pair, name):
    scaler_kwargs, iteration_kwargs = SCENARIOS[name]
    sides = pair.make_sides(DEVICE, **scaler_kwargs)
    pair.run(sides, 10, _plain(pair, **iteration_kwargs))
    pair.assert_same(sides)


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_adam_matches_torch_bitwise(pair, fused):
    sides = pair.make_sides(
        DEVICE, opt_fn=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, fused=fused),
        init_scale=2.0**8, growth_interval=2,
    )
    pair.run(sides, 8, _plain(pair, overflow_at=(1, 4)))
    pair.assert_same(sides)
    assert sides[1].scaler.skipped_steps == 2


def test_gradient_accumulation_and_two_optimizers(pair):
    sides = pair.make_sides(DEVICE, n_models=2, init_scale=2.0**10, growth_interval=2)

    def iteration(side, step, data):
        out0, out1 = (m(data[0]) for m in side.models)
        side.scaler.scale(((out0 + out1 - data[1]) ** 2).mean() / 2).backward(retain_graph=True)
        side.scaler.scale(((out0 - out1) ** 2).mean() / 2).backward()
        if step == 3:
            pair.poison(side.models[1])
        if step % 2 == 1:
            returned = tuple(side.scaler.step(opt) for opt in side.optimizers)
            side.scaler.update()
            for opt in side.optimizers:
                opt.zero_grad()
            pair.record(side, returned)

    pair.run(sides, 10, iteration)
    pair.assert_same(sides)


def test_state_moves_between_the_scalers_and_through_pickle(pair):
    sides = pair.make_sides(DEVICE, init_scale=2.0**10, growth_interval=2)
    iteration = _plain(pair, overflow_at=(2, 7))
    pair.run(sides, 5, iteration)
    states = [s.scaler.state_dict() for s in sides]
    assert states[0] == states[1]
    sides[0].scaler = type(sides[1].scaler)(DEVICE)
    sides[0].scaler.load_state_dict(states[0])
    sides[1].scaler = pickle.loads(pickle.dumps(torch.amp.GradScaler(DEVICE)))
    sides[1].scaler.load_state_dict(states[1])
    pair.run(sides, 5, iteration, start=5)
    pair.assert_same(sides)


def test_unscale_and_update_never_synchronise(pair):
    sides = pair.make_sides(DEVICE)
    side = sides[1]
    side.scaler.scale(pair.loss_of(side.model, pair.batch(0, DEVICE))).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        side.scaler.unscale_(side.optimizer)
        flag = side.scaler._found_inf_per_device(side.optimizer)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side.scaler.step(side.optimizer)  # the one sync: the skip decision
    torch.cuda.set_sync_debug_mode("error")
    try:
        side.scaler.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [t.device.type for t in flag.values()] == ["cuda"]
    assert side.scaler._scale.device.type == "cuda"


def test_fused_adam_step_never_synchronises(pair):
    sides = pair.make_sides(
        DEVICE, opt_fn=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, fused=True)
    )
    side = sides[1]
    side.scaler.scale(pair.loss_of(side.model, pair.batch(0, DEVICE))).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        side.scaler.step(side.optimizer)
        side.scaler.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert side.scaler.skipped_steps == 0
