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
        "MultiSteps": optax.MultiSteps(inner, 1),
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
