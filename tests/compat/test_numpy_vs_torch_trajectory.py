"""polyamp.GradScaler over NumPy follows real torch.amp.GradScaler step for step."""

from __future__ import annotations

import numpy as np
import pytest

import polyamp
from polyamp.optim import SGD

torch = pytest.importorskip("torch")

STEPS = 50
OVERFLOW_AT = {0, 1, 2, 7, 8, 20, 21, 22, 23, 35, 49}


def _gradients(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in ((4, 3), (3,))]


@pytest.mark.parametrize("growth_interval", [1, 3, 2000])
def test_fifty_steps_same_trajectory_and_parameters(growth_interval):
    init = [np.full((4, 3), 0.5, np.float32), np.zeros(3, np.float32)]
    np_params = [polyamp.Parameter(p.copy()) for p in init]
    t_params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in init]
    np_opt, t_opt = SGD(np_params, lr=0.01), torch.optim.SGD(t_params, lr=0.01, foreach=False)
    ours = polyamp.GradScaler("cpu", init_scale=2.0**10, growth_interval=growth_interval)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=growth_interval)

    for step in range(STEPS):
        ours.scale(np.float32(1.0))
        theirs.scale(torch.ones(()))
        for seed, (p_np, p_t) in enumerate(zip(np_params, t_params)):
            grad = _gradients(step)[seed] * np.float32(ours.get_scale())
            if step in OVERFLOW_AT and seed == step % 2:
                grad.flat[step % grad.size] = np.inf if step % 3 else np.nan
            p_np.grad = grad.copy()
            p_t.grad = torch.from_numpy(grad.copy())
        ours.step(np_opt)
        theirs.step(t_opt)
        ours.update()
        theirs.update()
        assert ours.get_scale() == theirs.get_scale(), f"step {step}"
        assert ours._get_growth_tracker() == theirs._get_growth_tracker(), f"step {step}"
        assert ours.last_step_skipped == (step in OVERFLOW_AT)
        for p_np, p_t in zip(np_params, t_params):
            np.testing.assert_array_equal(p_np.data, p_t.detach().numpy())
    assert ours.skipped_steps == len(OVERFLOW_AT)
    assert ours.state_dict() == theirs.state_dict()
