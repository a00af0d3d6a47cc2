"""Regressions found by an adversarial review of polyamp.optax (current_scale inside wrappers)."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (pip install 'polyamp[jax]')")
optax = pytest.importorskip("optax", reason="optax is not installed (pip install 'polyamp[optax]')")
import jax.numpy as jnp  # noqa: E402

import polyamp  # noqa: E402
from polyamp import optax as poptax  # noqa: E402

CONFIG = polyamp.LossScaleConfig(init_scale=1024.0)


def _wrapped() -> dict[str, optax.GradientTransformation]:
    inner = poptax.loss_scaled(optax.sgd(0.1), CONFIG)
    return {
        "named_chain": optax.named_chain(("scaled", inner)),
        "multi_transform": optax.multi_transform({"x": inner}, {"w": "x"}),
        "MultiSteps": poptax.loss_scaled(optax.MultiSteps(optax.sgd(0.1), 1), CONFIG),  # inside: issue 32
        "inject_hyperparams": optax.inject_hyperparams(
            lambda lr: poptax.loss_scaled(optax.sgd(lr), CONFIG))(lr=0.1),
    }


@pytest.mark.parametrize("wrapper", sorted(_wrapped()))
def test_current_scale_is_found_inside_optax_wrappers_and_follows_the_rule(wrapper):
    """named_chain and multi_transform keep their parts' states in dicts, which current_scale did not
    search (TypeError 'holds none')."""
    tx, params = _wrapped()[wrapper], {"w": jnp.ones(3)}
    state = tx.init(params)
    assert float(poptax.current_scale(state)) == 1024.0
    _, state = jax.jit(tx.update)({"w": jnp.array([jnp.inf, 1.0, 1.0])}, state, params)
    assert float(poptax.current_scale(state)) == 512.0  # the overflow backed the found scale off


def test_extra_arguments_reach_the_inner_optimizer():
    """update(..., value=loss) raised TypeError: loss_scaled dropped optax's extra arguments, so
    reduce_on_plateau (and the line searches) could not be wrapped."""
    def make():
        return optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=1, factor=0.5))

    tx, bare, params = poptax.loss_scaled(make(), CONFIG), make(), {"w": jnp.ones(2)}
    state, bare_state = tx.init(params), bare.init(params)
    for _ in range(4):  # the loss does not improve: the plateau scales the updates down
        updates, state = jax.jit(tx.update)({"w": jnp.full(2, 1024.0)}, state, params, value=jnp.float32(1.0))
        expected, bare_state = bare.update({"w": jnp.ones(2)}, bare_state, params, value=jnp.float32(1.0))
        assert float(updates["w"][0]) == float(expected["w"][0])  # 1024 = the scale: exact
    assert -1.0 < float(updates["w"][0]) < 0.0  # the value reached the plateau
    skipped, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params, value=jnp.float32(1.0))
    assert float(skipped["w"][0]) == 0.0 and float(poptax.current_scale(state)) == 512.0
