"""polyamp's GradScaler against the real torch.amp.GradScaler on CPU: bitwise-equal training.

Each test trains two identical models side by side (see _torch_pair.py) and requires equal
parameters, gradients and optimizer state (torch.equal) and identical scale trajectories.
"""

from __future__ import annotations

import pickle

import pytest

torch = pytest.importorskip("torch")

DEVICE = "cpu"


def test_overflows_at_chosen_steps_skip_and_back_off(pair):
    sides = pair.make_sides(DEVICE, init_scale=2.0**10, growth_interval=3)
    overflow_at = {0, 3, 4, 9}

    def iteration(side, step, data):
        side.optimizer.zero_grad()
        side.scaler.scale(pair.loss_of(side.model, data, step in overflow_at)).backward()
        pair.record(side, side.scaler.step(side.optimizer))
        side.scaler.update()
        pair.record(side)

    pair.run(sides, 12, iteration)
    pair.assert_same(sides)
    scales = [entry[0] / 2.0**7 for entry in sides[1].trace[1::2]]
    assert scales == [4, 4, 4, 2, 1, 1, 1, 2, 2, 1, 1, 1]  # backed off, grew, backed off
    assert sides[1].scaler.skipped_steps == len(overflow_at)


def test_one_poisoned_element_skips_the_step(pair):
    sides = pair.make_sides(DEVICE, init_scale=4.0, growth_interval=2)

    def iteration(side, step, data):
        side.optimizer.zero_grad()
        side.scaler.scale(pair.loss_of(side.model, data)).backward()
        if step in (1, 5):
            pair.poison(side.model, float("nan") if step == 5 else float("-inf"))
        side.scaler.step(side.optimizer)
        side.scaler.update()
        pair.record(side)

    pair.run(sides, 8, iteration)
    pair.assert_same(sides)
    assert sides[1].scaler.skipped_steps == 2


def test_growth_every_interval_and_no_growth_past_float32_max(pair):
    sides = pair.make_sides(DEVICE, init_scale=2.0**120, growth_factor=4.0, growth_interval=1)

    def iteration(side, step, data):
        side.optimizer.zero_grad()
        side.scaler.scale(pair.loss_of(side.model, data) * 1e-30).backward()
        side.scaler.step(side.optimizer)
        side.scaler.update()
        pair.record(side)

    pair.run(sides, 6, iteration)
    pair.assert_same(sides)
    scales = [entry[0] for entry in sides[1].trace]
    assert scales[:3] == [2.0**122, 2.0**124, 2.0**126]
    assert scales[-1] == 2.0**126  # 2**128 is inf in float32: the scale stays


def test_unscale_then_clip_grad_norm(pair):
    sides = pair.make_sides(DEVICE, init_scale=2.0**12, growth_interval=2)

    def iteration(side, step, data):
        side.optimizer.zero_grad()
        side.scaler.scale(pair.loss_of(side.model, data, step == 2)).backward()
        side.scaler.unscale_(side.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(side.model.parameters(), 0.05)
        side.notes.append(norm)
        side.scaler.step(side.optimizer)
        side.scaler.update()
        pair.record(side)

    pair.run(sides, 6, iteration)
    pair.assert_same(sides)
    for n1, n2 in zip(sides[0].notes, sides[1].notes, strict=True):  # nan at the overflow step
        torch.testing.assert_close(n1, n2, rtol=0, atol=0, equal_nan=True)
    assert sides[1].notes[2].isnan() and sides[1].notes[3].isfinite()


def test_gradient_accumulation(pair):
    sides = pair.make_sides(DEVICE, init_scale=2.0**8, growth_interval=2)
    accumulate = 3

    def iteration(side, step, data):
        loss = pair.loss_of(side.model, data, step == 4) / accumulate
        side.scaler.scale(loss).backward()
        if (step + 1) % accumulate == 0:
            side.scaler.step(side.optimizer)
            side.scaler.update()
            side.optimizer.zero_grad()
            pair.record(side)

    pair.run(sides, 12, iteration)
    pair.assert_same(sides)
    assert len(sides[1].trace) == 4 and sides[1].scaler.skipped_steps == 1


def _two_models_iteration(pair, overflow_model):
    def iteration(side, step, data):
        for opt in side.optimizers:
            opt.zero_grad()
        out0, out1 = (m(data[0]) for m in side.models)
        loss0 = ((out0 + out1 - data[1]) ** 2).mean()
        loss1 = ((out0 - out1) ** 2).mean()
        side.scaler.scale(loss0).backward(retain_graph=True)
        side.scaler.scale(loss1).backward()
        if step in overflow_model:
            pair.poison(side.models[overflow_model[step]])
        side.scaler.unscale_(side.optimizers[0])
        returned = [side.scaler.step(opt) for opt in side.optimizers]
        side.scaler.update()
        pair.record(side, tuple(returned))

    return iteration


def test_two_optimizers_two_losses(pair):
    sides = pair.make_sides(DEVICE, n_models=2, init_scale=2.0**10, growth_interval=2)
    iteration = _two_models_iteration(pair, {2: 0, 5: 1})
    before = [p.detach().clone() for p in sides[1].models[1].parameters()]
    pair.run(sides, 3, iteration)
    after = list(sides[1].models[1].parameters())
    moved = [not torch.equal(a, b) for a, b in zip(before, after, strict=True)]
    assert any(moved)  # model 1 still stepped
    pair.run(sides, 5, iteration, start=3)
    pair.assert_same(sides)
    assert sides[1].scaler.skipped_steps == 2  # one optimizer skipped in each bad step


def test_adam_state_untouched_on_skipped_steps(pair):
    sides = pair.make_sides(
        DEVICE, opt_fn=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), init_scale=2.0**6
    )

    def iteration(side, step, data):
        side.optimizer.zero_grad()
        side.scaler.scale(pair.loss_of(side.model, data, step == 3)).backward()
        before = _snapshot(side.optimizer)
        side.scaler.step(side.optimizer)
        side.scaler.update()
        if step == 3:
            side.notes.append((before, _snapshot(side.optimizer)))
        pair.record(side)

    pair.run(sides, 6, iteration)
    pair.assert_same(sides)
    before, after = sides[1].notes[0]
    assert len(before) == 4 and all(
        torch.equal(a[k], b[k]) for a, b in zip(before, after, strict=True) for k in a
    )
    assert after[0]["step"] == 3  # three applied steps, the skipped one not counted


def _snapshot(optimizer):
    return [{k: v.clone() for k, v in state.items()} for state in optimizer.state.values()]


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_adam_including_the_self_unscaling_fused_path(pair, fused):
    sides = pair.make_sides(
        DEVICE,
        opt_fn=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, fused=fused),
        init_scale=2.0**8, growth_interval=2,
    )
    assert getattr(sides[1].optimizer, "_step_supports_amp_scaling", False) is fused

    def iteration(side, step, data):
        side.optimizer.zero_grad()
        side.scaler.scale(pair.loss_of(side.model, data, step in (1, 4))).backward()
        if step == 5:
            side.scaler.unscale_(side.optimizer)
        side.scaler.step(side.optimizer)
        side.scaler.update()
        pair.record(side)

    pair.run(sides, 7, iteration)
    pair.assert_same(sides)
    assert sides[1].scaler.skipped_steps == 2


def test_state_dict_moves_both_ways_between_the_scalers(pair):
    sides = pair.make_sides(DEVICE, init_scale=2.0**10, growth_interval=2)

    def iteration(side, step, data):
        side.optimizer.zero_grad()
        side.scaler.scale(pair.loss_of(side.model, data, step in (2, 7))).backward()
        side.scaler.step(side.optimizer)
        side.scaler.update()
        pair.record(side)

    pair.run(sides, 5, iteration)
    torch_state, polyamp_state = (s.scaler.state_dict() for s in sides)
    assert torch_state == polyamp_state
    swapped = [type(sides[1].scaler)(DEVICE), torch.amp.GradScaler(DEVICE)]
    swapped[0].load_state_dict(torch_state)  # torch's dict into polyamp
    swapped[1].load_state_dict(polyamp_state)  # polyamp's dict into torch
    sides[0].scaler, sides[1].scaler = swapped[1], swapped[0]
    pair.run(sides, 5, iteration, start=5)
    pair.assert_same(sides)


@pytest.mark.parametrize("how", ["state_dict", "pickle"])
def test_load_mid_training_and_continue(pair, how):
    sides = pair.make_sides(DEVICE, init_scale=2.0**10, growth_interval=3)

    def iteration(side, step, data):
        side.optimizer.zero_grad()
        side.scaler.scale(pair.loss_of(side.model, data, step in (1, 6))).backward()
        side.scaler.step(side.optimizer)
        side.scaler.update()
        pair.record(side)

    pair.run(sides, 4, iteration)
    for side in sides:
        old = side.scaler
        if how == "pickle":
            side.scaler = pickle.loads(pickle.dumps(old))
        else:
            side.scaler = type(old)(DEVICE)
            side.scaler.load_state_dict(old.state_dict())
    pair.run(sides, 6, iteration, start=4)
    pair.assert_same(sides)


def test_mixed_dtypes_and_sparse_gradients(pair):
    def model_fn():
        return torch.nn.ModuleDict({
            "emb": torch.nn.Embedding(10, 8, sparse=True),
            "lin": torch.nn.Linear(8, 4).double(),
        })

    sides = pair.make_sides(DEVICE, model_fn=model_fn, init_scale=2.0**10, growth_interval=2)

    def iteration(side, step, data):
        side.optimizer.zero_grad()
        idx = torch.tensor([step % 10, 3, 3, 7])
        out = side.model["lin"](side.model["emb"](idx).double())
        loss = (out**2).mean() * (float("inf") if step == 2 else 1.0)
        side.scaler.scale(loss).backward()
        side.scaler.step(side.optimizer)
        side.scaler.update()
        pair.record(side)

    pair.run(sides, 6, iteration)
    assert sides[1].model["emb"].weight.grad.is_sparse
    pair.assert_same(sides)


def test_factors_that_are_not_powers_of_two(pair):
    """Scales like 1000 * 0.3**k make float32(1/float64(scale)) and float64 products matter."""
    sides = pair.make_sides(
        DEVICE, init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=2
    )

    def iteration(side, step, data):
        side.optimizer.zero_grad()
        side.scaler.scale(pair.loss_of(side.model, data, step in (0, 1, 5))).backward()
        side.scaler.step(side.optimizer)
        side.scaler.update()
        pair.record(side)

    pair.run(sides, 9, iteration)
    pair.assert_same(sides)
    assert sides[1].trace[1][0] == float(torch.tensor(1000.0 * 0.3 * 0.3))
