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
