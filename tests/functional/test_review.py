"""Regressions found by an adversarial review of polyamp.functional and polyamp.optax."""

from __future__ import annotations

import numpy as np
import pytest

from polyamp import functional as F

SKIP = np.ones((), np.float32)  # found_inf: the step overflowed


@pytest.mark.parametrize(
    ("new", "old", "said"),
    [
        ([np.ones(2)] * 3, [np.zeros(2)] * 2, "a list of 3 against a list of 2"),
        ({"a": np.ones(2)}, {"a": np.zeros(2), "b": np.zeros(2)}, "keys"),
        ({"a": np.ones(2), "b": np.ones(2)}, {"a": np.zeros(2)}, "keys"),
        (np.ones(2), [np.zeros(2)], "a leaf (ndarray) against a list of 1"),
        ([np.ones(2)], np.zeros(2), "a list of 1 against a leaf"),
        ([None], [np.zeros(2)], "None against a leaf"),
    ],
)
def test_where_finite_refuses_trees_of_another_structure(new, old, said):
    """zip() dropped the extra parts, a leaf was broadcast over a list's rows, a dict's extra key
    vanished and a missing one raised a bare KeyError: each now says what differs."""
    with pytest.raises(ValueError, match="differ in structure") as caught:
        F.where_finite(SKIP, new, old)
    assert said in str(caught.value) and "Fix:" in str(caught.value)


def test_where_finite_still_maps_non_string_keys_and_none_in_both():
    new = {1: np.ones(2), (2, 3): (np.ones(1), None)}
    old = {1: np.zeros(2), (2, 3): (np.zeros(1), None)}
    kept = F.where_finite(SKIP, new, old)
    assert kept[1].tolist() == [0.0, 0.0] and kept[(2, 3)][0].tolist() == [0.0] and kept[(2, 3)][1] is None


def test_arrays_of_another_library_than_the_state_are_refused_by_name():
    """A NumPy flag with torch parameters came back as NumPy arrays; a NumPy state with torch
    gradients (and the reverse) failed deep inside torch with an unrelated message."""
    torch = pytest.importorskip("torch")
    from polyamp import ForeignArrayError

    numpy_state, torch_state = F.init(), F.init(like=torch.ones(1))
    calls = {
        "unscale torch grads, numpy state": lambda: F.unscale(numpy_state, [torch.ones(2)]),
        "unscale numpy grads, torch state": lambda: F.unscale(torch_state, [np.ones(2, np.float32)]),
        "scale a torch loss, numpy state": lambda: F.scale(numpy_state, torch.ones(())),
        "where_finite numpy flag, torch trees":
            lambda: F.where_finite(SKIP, [torch.ones(2)], [torch.zeros(2)]),
        "update torch state, numpy flag": lambda: F.update(torch_state, SKIP),
    }
    for what, call in calls.items():
        with pytest.raises(ForeignArrayError, match="Fix: build the state on the arrays' library"):
            call()
        assert what
    grads, found = F.unscale(torch_state, [torch.full((2,), 65536.0)])  # one library: unchanged
    assert grads[0].tolist() == [1.0, 1.0] and isinstance(found, torch.Tensor)
    assert F.update(torch_state, 1.0).scale.item() == 32768.0  # a Python flag is still taken


def test_numpy_leaves_are_still_taken_under_jax():
    jnp = pytest.importorskip("jax.numpy")
    state = F.init(like=jnp.ones(1))
    grads, found = F.unscale(state, [np.full(2, 65536.0, np.float32)])
    assert float(grads[0][0]) == 1.0 and float(found) == 0.0


def test_init_like_a_pytree_follows_its_first_array():
    """init(like=params) with a list (or tuple) of torch tensors made a NumPy state, and a dict of
    them raised ForeignArrayError: a pytree now stands for its first leaf."""
    torch = pytest.importorskip("torch")
    for like in ([torch.ones(2)], (None, torch.ones(2)), {"w": torch.ones(2)}):
        state = F.init(like=like)
        assert isinstance(state.scale, torch.Tensor) and state.scale.dtype == torch.float32
    assert isinstance(F.init(like=[]).scale, np.ndarray)  # no leaf: the default library


def test_paddle_arrays_are_refused_at_init_with_the_stateful_alternative():
    """init(like=a paddle tensor) made a state that every other function refused with 'expects
    the state's 0-d arrays, got a paddle.Tensor' (which it was): paddle has no array-API namespace."""
    paddle = pytest.importorskip("paddle")
    from polyamp import ForeignArrayError

    with pytest.raises(ForeignArrayError, match=r"paddle.*no array-API namespace.*Fix: use the stateful"):
        F.init(like=paddle.ones([2]))


def test_where_finite_takes_a_host_flag_as_update_does():
    """where_finite(0.0, ...) raised 'expects the state's 0-d arrays, got a builtins.float'."""
    new, old = {"w": np.ones(2)}, {"w": np.zeros(2)}
    assert F.where_finite(1.0, new, old)["w"] is old["w"] and F.where_finite(True, new, old)["w"] is old["w"]
    assert F.where_finite(0, new, old)["w"] is new["w"]
    with pytest.raises(ValueError, match="differ in structure"):
        F.where_finite(False, [new["w"]], old)
