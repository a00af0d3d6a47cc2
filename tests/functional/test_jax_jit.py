"""Item 4 of issue 24: a whole training step under ``jax.jit`` (loss, ``jax.grad`` of the scaled
loss, unscale, an optax update, where_finite, update) compiles once and follows the NumPy engine
over 2,000 steps with injected overflows; under ``pmap`` on 4 CPU devices an overflow on one
device is skipped by all four (and under ``shard_map``), with one collective per step in the
compiled program."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import polyamp
from polyamp import functional as F

jax = pytest.importorskip("jax", reason="jax is not installed (pip install 'polyamp[jax]')")
optax = pytest.importorskip("optax", reason="optax is not installed (pip install 'polyamp[optax]')")
import jax.numpy as jnp  # noqa: E402

STEPS = 2000
CONFIG = polyamp.LossScaleConfig(init_scale=2.0**10, growth_interval=40, backoff_interval=2)


def _data(steps: int, seed: int = 0):
    """Per step a batch and a poison factor: inf on about 4% of the steps (an overflow), else 1."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps, 8, 4)).astype(np.float32)
    y = rng.standard_normal((steps, 8)).astype(np.float32)
    poison = np.where(rng.random(steps) < 0.04, np.float32(np.inf), np.float32(1.0)).astype(np.float32)
    return x, y, poison


def _params():
    return {"w": jnp.zeros(4, jnp.float32), "b": jnp.zeros((), jnp.float32)}


def test_jitted_step_compiles_once_and_follows_the_numpy_engine(make_step):
    optimizer = optax.adam(1e-2)
    traces: list = []
    step = jax.jit(make_step(optimizer, CONFIG, traces))
    params = _params()
    opt_state, ls = optimizer.init(params), F.init(CONFIG, like=params["w"])
    engine = polyamp.LossScaler(CONFIG, backend="numpy")
    x, y, poison = _data(STEPS)
    skipped, scales = 0, set()
    for i in range(STEPS):
        before = params
        params, opt_state, ls, scaled, grads, found_inf = step(params, opt_state, ls, x[i], y[i], poison[i])
        ref = [np.array(scaled["b"]), np.array(scaled["w"])]  # the same scaled gradients, to the engine
        stepped = engine.step(ref, lambda: None)
        engine.update()
        assert bool(found_inf) == (not stepped) == (poison[i] == np.inf)
        state = engine.state
        assert (float(ls.scale), int(ls.growth_tracker), int(ls.backoff_tracker)) == (
            float(state.scale), int(state.growth_tracker), int(state.backoff_tracker)), i
        scales.add(float(ls.scale))
        if stepped:
            assert np.array_equal(grads["b"], ref[0]) and np.array_equal(grads["w"], ref[1])
        else:
            skipped += 1
            assert all(np.array_equal(params[k], before[k]) for k in params)
    assert len(traces) == 1
    assert skipped == int(np.sum(poison == np.inf)) > 40
    assert len(scales) >= 4 and min(scales) < CONFIG.init_scale < max(scales)  # grown and backed off


PMAP_SCRIPT = textwrap.dedent('''
    import json
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    import polyamp
    from polyamp import functional as F

    config = polyamp.LossScaleConfig(init_scale=2.0**10, growth_interval=3)
    traces = []

    def step(params, ls, x, poison):
        traces.append(1)
        scaled = jax.grad(lambda p: F.scale(ls, jnp.sum((x * p) ** 2) * poison))(params)
        grads, found_inf = F.unscale(ls, scaled, axis_name="devices")
        params = F.where_finite(found_inf, params - 0.01 * grads, params)
        return params, F.update(ls, found_inf, config), found_inf

    assert jax.device_count() == 4, jax.devices()
    pstep = jax.pmap(step, axis_name="devices")
    params = jnp.ones((4, 3), jnp.float32)
    x = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 12
    ls = jax.tree_util.tree_map(lambda a: jnp.stack([a] * 4), F.init(config))
    hlo = pstep.lower(params, ls, x, jnp.ones(4, jnp.float32)).compile().as_text()
    print("all-reduce", sum(line.count(" all-reduce(") for line in hlo.splitlines()))
    traces.clear()  # lowering traced once; count the traces of the 12 calls
    for i in range(12):
        poison = jnp.ones(4, jnp.float32).at[2].set(jnp.inf if i % 4 == 1 else 1.0)
        before = params
        params, ls, found = pstep(params, ls, x, poison)
        same = bool(jnp.all(params == before))
        print("step", json.dumps([np.asarray(found).tolist(), same, np.asarray(ls.scale).tolist()]))
    print("traces", len(traces))

    # shard_map over a 4-device mesh: the state replicated, parameters and data split by rows
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4,), ("devices",))
    rows, replicated = NamedSharding(mesh, P("devices")), NamedSharding(mesh, P())

    def row_step(params, ls, x, poison):
        scaled = jax.grad(lambda p: F.scale(ls, jnp.sum((x * p) ** 2) * poison[0]))(params)
        grads, found_inf = F.unscale(ls, scaled, axis_name="devices")
        params = F.where_finite(found_inf, params - 0.01 * grads, params)
        return params, F.update(ls, found_inf, config), found_inf[None]

    split = P("devices")
    sstep = jax.jit(jax.shard_map(row_step, mesh=mesh, in_specs=(split, P(), split, split),
                                  out_specs=(split, P(), split)))
    params = jax.device_put(jnp.ones((4, 3), jnp.float32), rows)
    x = jax.device_put(jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 12, rows)
    ls = jax.device_put(F.init(config), replicated)
    for bad in (False, True):
        poison = jax.device_put(jnp.ones(4, jnp.float32).at[1].set(jnp.inf if bad else 1.0), rows)
        hlo = sstep.lower(params, ls, x, poison).compile().as_text()
        before = params
        params, ls, found = sstep(params, ls, x, poison)
        print("shard_map", json.dumps([sum(line.count(" all-reduce(") for line in hlo.splitlines()),
                                       np.asarray(found).tolist(), bool(jnp.all(params == before)),
                                       float(ls.scale)]))
''')


def test_pmap_and_shard_map_over_four_devices_skip_an_overflow_of_one_with_one_collective(tmp_path: Path):
    """In a subprocess: XLA_FLAGS must be set before jax is imported (the suite's jax has 1 device)."""
    script = tmp_path / "pmap_step.py"
    script.write_text(PMAP_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "all-reduce 1", out.stdout
    assert "traces 1" in lines, out.stdout
    steps = [json.loads(line.removeprefix("step ")) for line in lines if line.startswith("step ")]
    assert len(steps) == 12, out.stdout
    for i, (found, unchanged, scales) in enumerate(steps):
        overflow = i % 4 == 1
        assert found == [1.0 if overflow else 0.0] * 4, (i, found)
        assert unchanged == overflow, i  # all four devices skipped, or all four stepped
        assert len(set(scales)) == 1, scales  # one scale everywhere
    sharded = [json.loads(line.removeprefix("shard_map ")) for line in lines if line.startswith("shard_map ")]
    assert sharded == [[1, [0.0] * 4, False, 1024.0], [1, [1.0] * 4, True, 512.0]], out.stdout
