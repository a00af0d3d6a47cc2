"""Issue 24's closing table: the jitted functional loop beside the NumPy engine, and its trace count.

The loop of tests/functional/test_jax_jit.py (optax adam, 2,000 steps, an overflow injected on
about 4% of them, ``growth_interval=40``, ``backoff_interval=2``): the engine is fed the same scaled
gradients. Prints a row at every scale change and a summary line. Needs jax and optax. Run:

    python tools/jax_trajectory.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import polyamp
from polyamp import functional as F

CONFIG = polyamp.LossScaleConfig(init_scale=2.0**10, growth_interval=40, backoff_interval=2)
STEPS = 2000


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS, 8, 4)).astype(np.float32)
    y = rng.standard_normal((STEPS, 8)).astype(np.float32)
    poison = np.where(rng.random(STEPS) < 0.04, np.float32(np.inf), np.float32(1.0)).astype(np.float32)
    optimizer, traces = optax.adam(1e-2), []

    @jax.jit
    def step(params, opt_state, ls, x, y, poison):
        traces.append(1)  # runs once per trace
        loss = lambda p: F.scale(ls, jnp.mean((x @ p["w"] + p["b"] - y) ** 2) * poison)  # noqa: E731
        scaled = jax.grad(loss)(params)
        grads, found = F.unscale(ls, scaled)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        params = F.where_finite(found, optax.apply_updates(params, updates), params)
        opt_state = F.where_finite(found, new_opt, opt_state)
        return params, opt_state, F.update(ls, found, CONFIG), scaled, grads, found

    params = {"w": jnp.zeros(4, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    opt_state, ls = optimizer.init(params), F.init(CONFIG, like=params["w"])
    engine = polyamp.LossScaler(CONFIG, backend="numpy")
    print(f"{'step':>5} {'overflow':>8} | {'jit scale':>10} {'growth':>6} {'backoff':>7} | "
          f"{'engine scale':>12} {'growth':>6} {'backoff':>7}")
    previous, equal, skipped = None, 0, 0
    for i in range(STEPS):
        params, opt_state, ls, scaled, grads, found = step(params, opt_state, ls, x[i], y[i], poison[i])
        ref = [np.array(scaled["b"]), np.array(scaled["w"])]
        engine.step(ref, lambda: None)
        engine.update()
        ours = (float(ls.scale), int(ls.growth_tracker), int(ls.backoff_tracker))
        state = engine.state
        theirs = (float(state.scale), int(state.growth_tracker), int(state.backoff_tracker))
        same_grads = bool(found) or all(np.array_equal(grads[k], r) for k, r in zip("bw", ref))
        equal += ours == theirs and same_grads
        skipped += int(found)
        if ours[0] != previous:
            print(f"{i:>5} {int(found):>8} | {ours[0]:>10.0f} {ours[1]:>6} {ours[2]:>7} | "
                  f"{theirs[0]:>12.0f} {theirs[1]:>6} {theirs[2]:>7}")
            previous = ours[0]
    print(f"steps {STEPS}, skipped {skipped}, steps with the same state and bitwise-equal unscaled "
          f"gradients: {equal}, traces: {len(traces)}")


if __name__ == "__main__":
    main()
