"""Pytrees for :mod:`polyamp.functional`: nested dict / list / tuple (NamedTuples too) of arrays.

Plain containers are walked here and arrays are leaves, so torch and NumPy code never reaches
another library's tree code (``torch.compile`` traces this, with jax imported or not). Any other
object is a leaf, unless JAX is already imported (looked up in ``sys.modules``, never imported
here) and registers it as a pytree node: then ``jax.tree_util`` maps it, so flax structs and
other registered pytrees work under JAX.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def _registered_node(tree: Any) -> bool:
    """Whether JAX (if loaded) sees ``tree`` as a container rather than a leaf."""
    jax = sys.modules.get("jax")
    return jax is not None and not jax.tree_util.all_leaves([tree])


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn`` applied leaf by leaf to ``tree`` and the trees of the same structure in ``rest``."""
    if isinstance(tree, dict):
        return type(tree)((k, tree_map(fn, v, *(r[k] for r in rest))) for k, v in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a NamedTuple (optax states)
        return type(tree)(*(tree_map(fn, *parts) for parts in zip(tree, *rest)))
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(fn, *parts) for parts in zip(tree, *rest))
    if tree is None:
        return None
    if hasattr(tree, "dtype") or isinstance(tree, (int, float)):  # an array or a number: a leaf, never
        return fn(tree, *rest)  # handed to jax (torch.compile cannot trace jax's C++ pytree registry)
    if _registered_node(tree):
        return sys.modules["jax"].tree_util.tree_map(fn, tree, *rest)
    return fn(tree, *rest)


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in :func:`tree_map`'s order."""
    found: list[Any] = []
    tree_map(found.append, tree)
    return found
