"""set_growth_interval below the clean steps already counted (issue 32), against torch.amp.GradScaler.

torch's ``_amp_update_scale_`` compares ``growth_tracker + 1 == growth_interval``: a tracker
already past the new interval counts on and the scale never grows until the next overflow resets
it. polyamp's rule compares ``>=`` (one rule on every backend): the steps counted meet the new
interval, so the next clean step grows. docs/coming-from-torch.md states the difference.
"""

from __future__ import annotations

import pytest

from polyamp.policy import HostState, next_host_state

torch = pytest.importorskip("torch")

DEVICE = "cpu"


def clean_or_overflow(pair, overflow_at=()):
    def iteration(side, step, data):
        side.optimizer.zero_grad()
        side.scaler.scale(pair.loss_of(side.model, data, step in overflow_at)).backward()
        side.scaler.step(side.optimizer)
        side.scaler.update()
        pair.record(side)

    return iteration


def polyamp_only(pair, **scaler_kwargs):
    """The polyamp side of make_sides alone (it may take polyamp's own keywords)."""
    torch.manual_seed(0)
    model = pair.mlp()
    scaler = pair.PolyampGradScaler(DEVICE, **scaler_kwargs)
    return pair.Side("polyamp", scaler, [model], [torch.optim.SGD(model.parameters(), lr=0.1)])


def test_torch_never_grows_past_a_shortened_interval_until_an_overflow(pair):
    """Real torch 2.x: 7 clean steps under growth_interval=10, set_growth_interval(3): no growth in
    8 more clean steps (the tracker runs on to 15); an overflow resets it, then 3 clean steps grow."""
    sides = pair.make_sides(DEVICE, init_scale=1024.0, growth_interval=10)
    pair.run(sides, 7, clean_or_overflow(pair))
    pair.assert_same(sides)  # before the change: polyamp is torch, bitwise
    real = sides[0]
    real.scaler.set_growth_interval(3)
    pair.run([real], 9, clean_or_overflow(pair, overflow_at={15}), start=7)
    pair.run([real], 3, clean_or_overflow(pair), start=16)
    assert real.trace[7:] == [(1024.0, t, None) for t in range(8, 16)] + [(512.0, 0, None)] + [
        (512.0, 1, None), (512.0, 2, None), (1024.0, 0, None)]


@pytest.mark.parametrize("bounds", [{}, {"min_scale": 1.0}], ids=["torch-fused-op", "tensor-ops"])
def test_the_facade_grows_at_the_next_clean_step_as_the_rule(pair, bounds):
    """The facade follows polyamp's rule on every backend path: 7 clean steps, set_growth_interval(3),
    4 clean steps grow at the first and the fourth; its state_dict loads into torch and the facade."""
    polyamp_side = polyamp_only(pair, init_scale=1024.0, growth_interval=10, **bounds)
    pair.run([polyamp_side], 7, clean_or_overflow(pair))
    polyamp_side.scaler.set_growth_interval(3)
    pair.run([polyamp_side], 4, clean_or_overflow(pair), start=7)
    config = polyamp_side.scaler._engine.config
    state, want = HostState(1024.0, 7, 0), []
    for _ in range(4):
        state = next_host_state(state, False, config)
        want.append((state.scale, state.growth_tracker, None))
    assert want == [(2048.0, 0, None), (2048.0, 1, None), (2048.0, 2, None), (4096.0, 0, None)]
    assert polyamp_side.trace[7:] == want


def test_the_facades_state_dict_right_after_set_growth_interval_loads_in_torch(pair):
    """Saved between set_growth_interval(3) and the next step (tracker 7): the tracker is written
    fitted (2, the same trajectory under polyamp's rule), so both loaders take it."""
    polyamp_side = polyamp_only(pair, init_scale=1024.0, growth_interval=10)
    pair.run([polyamp_side], 7, clean_or_overflow(pair))
    polyamp_side.scaler.set_growth_interval(3)
    sd = polyamp_side.scaler.state_dict()
    assert sd["_growth_tracker"] == 2 and sd["growth_interval"] == 3
    real = torch.amp.GradScaler(DEVICE)
    real.load_state_dict(sd)
    assert real._init_growth_tracker == 2 and real.get_growth_interval() == 3
    again = type(polyamp_side.scaler)(DEVICE)
    again.load_state_dict(sd)
    assert again.state_dict() == sd
