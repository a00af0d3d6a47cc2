"""Issue 32 on the functional core and polyamp.optax: a subnormal reciprocal (item 17), MultiSteps
around loss_scaled and the skips in the state (item 3), two scales in one state and an unbound
axis name (item 16)."""

from __future__ import annotations

import numpy as np
import pytest

import polyamp
from polyamp import functional as F

GROWN = polyamp.LossScaleConfig(init_scale=2.0**120, growth_interval=1)
BIG_SCALES = [2.0**127, 1.5 * 2.0**127, float(np.float32(2.0**126 * (1 + 2.0**-23))),
              float(np.finfo(np.float32).max)]


def _grown(library):
    """The issue's state: 2**127, reached by growth (10 clean steps from 2**120, interval 1)."""
    state = F.init(GROWN, like=library.make(np.zeros(1, np.float32)))
    zero = F.unscale(state, library.make(np.zeros(1, np.float32)))[1]
    for _ in range(10):
        state = F.update(state, zero, GROWN)
    assert float(library.back(state.scale)) == 2.0**127
    return state


def _engine(scale: float, grads: np.ndarray) -> np.ndarray:
    """The engine's unscale: float32 gradients times float32(1 / float64(scale)), no flush."""
    return grads * np.float32(1.0 / np.float64(np.float32(scale)))


def test_a_subnormal_reciprocal_does_not_zero_the_gradients(library):
    """At 2**127 JAX (XLA flushes the float32 reciprocal 2**-127) returned [0.] with the flag 0."""
    state = _grown(library)
    grads, found_inf = F.unscale(state, {"w": library.make(np.array([2.0**127, 3.0 * 2.0**120], np.float32))})
    assert library.back(grads["w"]).tolist() == [1.0, 3.0 / 128] and float(library.back(found_inf)) == 0.0


@pytest.mark.parametrize("scale", BIG_SCALES)
def test_above_2_126_unscale_is_the_engines_bitwise(library, scale):
    """Every scale whose reciprocal is subnormal, on every library with float64: the engine's bits
    (the reciprocal rounded to the subnormal grid), wherever the result is a normal number."""
    grads = np.array([scale, scale * 0.3, 2.0**-40 * scale, 7.0, -2.0**100], np.float32)
    with library.wide():
        state = F.init(polyamp.LossScaleConfig(init_scale=scale), like=library.make(np.zeros(1, np.float32)))
        got = library.back(F.unscale(state, library.make(grads))[0])
    assert got.tolist() == _engine(scale, grads).astype(np.float64).tolist()


def test_jax_under_jit_with_the_state_as_argument_or_constant():
    """XLA folds two constant factors into one (a subnormal, flushed to 0) and lowers a division
    to a flushed reciprocal: the state closed over under jit must not zero the gradients either."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    for scale in (2.0**127, 1.5 * 2.0**127):
        state = F.init(polyamp.LossScaleConfig(init_scale=scale), like=jnp.zeros(1))
        grads = jnp.asarray(np.array([scale, 2.0**100], np.float32))
        as_argument = jax.jit(lambda s, g: F.unscale(s, g)[0])(state, grads)
        closed_over = jax.jit(lambda g, s=state: F.unscale(s, g)[0])(grads)
        want = np.asarray(F.unscale(state, grads)[0])
        assert want[0] == pytest.approx(1.0, rel=2**-23)
        assert np.asarray(as_argument).tolist() == np.asarray(closed_over).tolist() == want.tolist()


def test_torch_with_flush_denormal_keeps_the_gradients():
    """torch.set_flush_denormal(True) flushes a subnormal factor too (the whole thread, NumPy's
    included): the functional unscale multiplies by none."""
    torch = pytest.importorskip("torch")
    state = F.init(polyamp.LossScaleConfig(init_scale=2.0**127), like=torch.zeros(1))
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals (no SSE3)")
    try:
        grads, found_inf = F.unscale(state, [torch.full((2,), 2.0**127)])
    finally:
        torch.set_flush_denormal(False)
    assert grads[0].tolist() == [1.0, 1.0] and float(found_inf) == 0.0


# -- polyamp.optax -------------------------------------------------------------------------------


def _optax():
    jax = pytest.importorskip("jax", reason="jax is not installed (pip install 'polyamp[jax]')")
    optax = pytest.importorskip("optax", reason="optax is not installed (pip install 'polyamp[optax]')")
    import jax.numpy as jnp

    import polyamp.optax as poptax

    return jax, jnp, optax, poptax


CONFIG = polyamp.LossScaleConfig(init_scale=2.0**10, growth_interval=3)


def _train(tx, batches, overflow_at=()):
    """``tx`` on a quadratic, one update per batch (a target offset), an inf in the gradients of the
    updates at ``overflow_at``: the parameters and (scale, skipped, skips) after each."""
    jax, jnp, optax, poptax = _optax()
    params = {"w": jnp.asarray([1.0, -2.0, 0.5])}
    state = tx.init(params)
    update = jax.jit(tx.update)
    seen = []
    for i, target in enumerate(batches):
        scale = poptax.current_scale(state)
        grads = jax.grad(lambda p, t=target, s=scale: jnp.sum((p["w"] - t) ** 2) * s)(params)
        if i in overflow_at:
            grads = {"w": grads["w"].at[0].set(jnp.inf)}
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        seen.append((np.asarray(params["w"]).tolist(), float(scale), bool(poptax.skipped(state)),
                     int(poptax.skip_count(state))))
    return seen


def test_multisteps_around_loss_scaled_is_refused_with_the_fix():
    """optax.MultiSteps(loss_scaled(adam), every_k_schedule=1), as the docs showed, kept NaN in its
    accumulator after one overflow (0 * inf): 0 later steps applied, the scale decayed to 1e-38."""
    jax, jnp, optax, poptax = _optax()
    tx = optax.MultiSteps(poptax.loss_scaled(optax.adam(1e-2), CONFIG), every_k_schedule=1)
    state = tx.init({"w": jnp.ones(3)})
    for read in (poptax.current_scale, poptax.skipped, poptax.skip_count):
        with pytest.raises(polyamp.ConfigError, match=r"MultiSteps.*loss_scaled\(optax\.MultiSteps"):
            read(state)


@pytest.mark.parametrize("k", [1, 2])
def test_multisteps_inside_loss_scaled_trains_on_after_an_overflow(k):
    """The documented composition: after an overflow the later steps apply, and match a run that
    never saw the overflowing (micro-)batch; the skip is in the state."""
    _, _, optax, poptax = _optax()

    def tx():
        return poptax.loss_scaled(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=k), CONFIG)

    batches = [0.1 * (i % 5) for i in range(12 * k + 1)]
    with_overflow = _train(tx(), batches, overflow_at={3})
    clean = _train(tx(), batches[:3] + batches[4:])  # the overflowing batch never seen
    del with_overflow[3]
    assert len({tuple(s[0]) for s in with_overflow[3:]}) > 3, "the steps after the overflow applied"
    for (params, _, skipped, skips), want in zip(with_overflow[3:], clean[3:], strict=True):
        assert params == want[0] and not skipped and skips == 1  # adam: the same bits at another scale


def test_skipped_and_skip_count_follow_the_flag():
    _, _, optax, poptax = _optax()
    seen = _train(poptax.loss_scaled(optax.sgd(0.1), CONFIG), [0.0] * 6, overflow_at={1, 2, 4})
    assert [(s[2], s[3]) for s in seen] == [(False, 0), (True, 1), (True, 2), (False, 2), (True, 3),
                                            (False, 3)]
    assert [s[1] for s in seen] == [1024.0, 1024.0, 512.0, 256.0, 256.0, 128.0]


def test_two_loss_scaled_in_one_multi_transform_are_named_not_guessed():
    """current_scale returned the first of two scales found, silently."""
    jax, jnp, optax, poptax = _optax()
    eight = polyamp.LossScaleConfig(init_scale=8.0)
    tx = optax.multi_transform({"a": poptax.loss_scaled(optax.sgd(1.0)),
                                "b": poptax.loss_scaled(optax.sgd(1.0), eight)}, {"x": "a", "y": "b"})
    state = tx.init({"x": jnp.ones(1), "y": jnp.ones(1)})
    with pytest.raises(polyamp.ConfigError, match=r"2 polyamp.optax.loss_scaled .*\['a'\].*\['b'\]") as info:
        poptax.current_scale(state)
    # the message's example is a path that works
    path = str(info.value).split("e.g. current_scale(")[1].rsplit(")", 1)[0]
    assert float(poptax.current_scale(eval(path, {"opt_state": state}))) == 65536.0  # noqa: S307
    assert float(poptax.current_scale(state.inner_states["b"].inner_state)) == 8.0


def test_unbound_axis_name_is_a_polyamp_error_naming_it():
    """Outside pmap, unscale(..., axis_name='nope') raised jax's NameError about psum."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    state = F.init(like=jnp.ones(1))
    for call in (lambda: F.unscale(state, jnp.ones(1), axis_name="nope"),
                 lambda: jax.jit(lambda g: F.unscale(state, g, axis_name="nope"))(jnp.ones(1))):
        with pytest.raises(polyamp.ConfigError, match=r"axis_name='nope'.*Fix"):
            call()
