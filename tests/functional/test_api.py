"""polyamp.functional's contract beside exactness: purity, dtypes, pytrees, errors, and the JAX
backend plugin (registration, POLYAMP_BACKEND, polyamp info, the LossScaler's refusal)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import polyamp
from polyamp import functional as F

CONFIG = polyamp.LossScaleConfig()


def test_unscale_writes_nothing_in_place_and_keeps_the_structure():
    state = F.init(CONFIG)
    grads = {"a": np.full(3, 65536.0, np.float32), "b": (np.full(2, 2.0**15, np.float16), None)}
    kept = {"a": grads["a"].copy(), "b": grads["b"][0].copy()}
    new, found_inf = F.unscale(state, grads)
    assert np.array_equal(grads["a"], kept["a"]) and np.array_equal(grads["b"][0], kept["b"])
    assert new["a"].tolist() == [1.0] * 3 and new["b"][0].tolist() == [0.5] * 2 and new["b"][1] is None
    assert new["b"][0].dtype == np.float16 and isinstance(new["b"], tuple)
    assert found_inf.dtype == np.float32 and found_inf.shape == () and float(found_inf) == 0.0
    assert float(F.unscale(state, {})[1]) == 0.0  # no gradients: nothing overflowed


def test_found_inf_counts_nan_and_both_infinities():
    state = F.init(CONFIG)
    for bad in (np.nan, np.inf, -np.inf):
        assert float(F.unscale(state, [np.ones(2, np.float32), np.array([1.0, bad])])[1]) == 1.0


def test_scale_multiplies_float16_in_float32_as_the_engine_does():
    """65536 is not a float16 (max 65504): the product is formed in float32 and rounded back."""
    state = F.init(CONFIG)
    loss = np.array(2.0**-10, np.float16)
    scaled = F.scale(state, loss)
    engine = polyamp.LossScaler(CONFIG, backend="numpy")
    assert scaled.dtype == np.float16 and scaled == engine.scale(loss) == np.float16(64.0)
    pair = F.scale(state, [np.float32(1.5) * np.ones(()), np.ones(2)])
    assert pair[0] == 98304.0 and pair[1].dtype == np.float64


def test_where_finite_picks_per_leaf_without_a_branch():
    new, old = {"p": np.ones(2), "step": np.array(3)}, {"p": np.zeros(2), "step": np.array(2)}
    kept = F.where_finite(np.float32(1.0) * np.ones((), np.float32), new, old)
    taken = F.where_finite(np.zeros((), np.float32), new, old)
    assert kept["p"].tolist() == [0.0, 0.0] and int(kept["step"]) == 2
    assert taken["p"].tolist() == [1.0, 1.0] and int(taken["step"]) == 3


def test_init_follows_like_and_update_is_the_policy():
    torch = pytest.importorskip("torch")
    like = torch.zeros(2, dtype=torch.float16)
    state = F.init(CONFIG.replace(init_scale=8.0, growth_interval=1), like=like)
    assert state.scale.dtype == torch.float32 and state.growth_tracker.dtype == torch.int32
    grown = F.update(state, torch.zeros(()), CONFIG.replace(growth_interval=1))
    assert float(grown.scale) == 16.0 and int(grown.growth_tracker) == 0
    backed = F.update(state, torch.ones(()))  # torch's defaults
    assert float(backed.scale) == 4.0


def test_bad_input_names_the_value_and_the_fix():
    with pytest.raises(TypeError, match=r"must be a polyamp.LossScaleConfig or None, got config=3.*Fix:"):
        F.init(3)
    with pytest.raises(TypeError, match=r"floating-point gradients, got an array of dtype=int32.*Fix:"):
        F.unscale(F.init(), [np.ones(2, np.int32)])
    with pytest.raises(TypeError, match=r"needs arrays as losses, got a builtins.float \(2.5\)\. Fix:"):
        F.scale(F.init(), 2.5)
    with pytest.raises(TypeError, match=r"expects the state's 0-d arrays, got a builtins.float.*Fix:"):
        F.unscale(polyamp.LossScaleState(1.0, 0, 0), [np.ones(2)])


jax_test = pytest.mark.skipif(
    not any(i.name == "jax" and i.available for i in polyamp.available_backends()),
    reason="jax is not installed (pip install 'polyamp[jax]')",
)


@jax_test
def test_jax_is_a_registered_backend_that_polyamp_info_lists_with_its_version():
    import jax

    info = {i.name: i for i in polyamp.available_backends()}["jax"]
    assert info.available and info.version == jax.__version__
    out = subprocess.run([sys.executable, "-m", "polyamp", "info"], capture_output=True, text=True,
                         check=True, timeout=120)
    assert any(line.split()[:3] == ["jax", "yes", jax.__version__] for line in out.stdout.splitlines())


@jax_test
def test_polyamp_backend_jax_makes_the_functional_state_on_jax(monkeypatch):
    import jax

    monkeypatch.setenv("POLYAMP_BACKEND", "jax")
    state = F.init(CONFIG)
    assert all(isinstance(a, jax.Array) for a in state)
    assert (state.scale.dtype.name, state.growth_tracker.dtype.name) == ("float32", "int32")


@jax_test
def test_a_loss_scaler_refuses_jax_arrays_and_points_to_polyamp_functional(monkeypatch):
    import jax.numpy as jnp

    scaler = polyamp.LossScaler(CONFIG)
    fix = r"Fix: use polyamp.functional \(init, scale, unscale, update, where_finite"
    refused = rf"given a jaxlib\.\S+ArrayImpl\): its arrays cannot be changed in place.*{fix}"
    with pytest.raises(polyamp.ForeignArrayError, match=refused):
        scaler.scale(jnp.ones((), jnp.float32))
    assert scaler.backend is None and scaler.state is None  # the failed call changed nothing
    assert float(scaler.scale(np.ones((), np.float32))) == 65536.0  # and NumPy still works
    with pytest.raises(polyamp.ForeignArrayError, match=fix):
        polyamp.LossScaler(backend="jax")
    monkeypatch.setenv("POLYAMP_BACKEND", "jax")
    with pytest.raises(polyamp.ForeignArrayError, match=fix):
        polyamp.LossScaler()
    with pytest.raises(polyamp.ForeignArrayError, match=fix):
        polyamp.GradScaler("cpu")


@jax_test
def test_an_interval_beyond_int32_is_refused_where_jax_has_no_int64():
    import jax.numpy as jnp

    state = F.init(CONFIG, like=jnp.ones(()))
    with pytest.raises(polyamp.ConfigError, match=r"growth_interval must be at most 2\*\*31 - 1 .*"
                       r"got growth_interval=4294967296\. Fix:"):
        F.update(state, jnp.zeros(()), CONFIG.replace(growth_interval=2**32))


def test_import_polyamp_never_imports_jax():
    """Not at import, not on NumPy through functional, not when a scaler loads the plugins (the
    JAX plugin looks arrays up in sys.modules); only a backend listing asks jax for its version."""
    code = ("import sys, numpy as np, polyamp\n"
            "from polyamp import functional as F\n"
            "F.update(F.init(), F.unscale(F.init(), [np.ones(2)])[1])\n"
            "s = polyamp.LossScaler(); s.step([np.ones(1, np.float32)], lambda: None); s.update()\n"
            "print(sorted(m for m in ('jax', 'jaxlib', 'optax') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@jax_test
def test_the_jax_plugin_hooks_agree_with_the_core():
    import jax.numpy as jnp

    backend = polyamp.get_backend("jax")
    scale = backend.full(1024.0, "float32", None)
    assert backend.to_host(scale) == 1024.0 and backend.full(0, "int32", scale).dtype == jnp.int32
    assert backend.scale_array(jnp.asarray(2.0**-4, jnp.float16), scale).tolist() == 64.0
    assert backend.cast(jnp.ones(2, jnp.float32), "bfloat16").dtype == jnp.bfloat16
    config = CONFIG.replace(growth_interval=1)
    state = polyamp.LossScaleState(scale, backend.full(0, "int32", scale), backend.full(0, "int32", scale))
    for found in (0.0, 1.0, 1.0, 0.0):
        host = polyamp.next_host_state(polyamp.HostState(*map(backend.to_host, state)), bool(found), config)
        state = backend.update_scale(state, jnp.float32(found), config)
        assert tuple(map(backend.to_host, state)) == tuple(host)
        assert backend.read_flag(jnp.float32(found)) is bool(found)
    with pytest.raises(polyamp.ForeignArrayError, match="immutable.*Fix: use polyamp.functional"):
        backend.unscale_and_check([jnp.ones(2)], scale, jnp.zeros(()))


@jax_test
def test_any_registered_jax_pytree_is_mapped():
    """A pytree node of the user's own (here a registered dataclass), not only dict/list/tuple."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Layer:
        w: jax.Array
        b: jax.Array

    state = F.init(CONFIG, like=jnp.ones(()))
    grads = {"layer": Layer(jnp.full(2, 2.0**17, jnp.float32), jnp.full(1, 2.0**15, jnp.bfloat16))}
    new, found_inf = jax.jit(F.unscale)(state, grads)
    assert isinstance(new["layer"], Layer) and float(found_inf) == 0.0
    assert new["layer"].w.tolist() == [2.0, 2.0] and new["layer"].b.dtype == jnp.bfloat16
    kept = F.where_finite(jnp.float32(1.0), new, grads)
    assert kept["layer"].w.tolist() == [2.0**17] * 2
