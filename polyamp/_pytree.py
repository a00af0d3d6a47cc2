"""Pytrees for :mod:`polyamp.functional`: nested dict / list / tuple (NamedTuples too) of arrays.

Plain containers are walked here and arrays are leaves, so torch and NumPy code never reaches
another library's tree code (``torch.compile`` traces this, with jax imported or not). Any other
object is a leaf, unless a backend plugin says it is a container of its library's pytree registry
(the ``map_tree`` hook: the JAX plugin maps flax structs and other registered pytrees).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _registry


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn`` applied leaf by leaf to ``tree`` and the trees of the same structure in ``rest``
    (a different structure is refused: zip would silently drop or broadcast parts)."""
    for other in rest:
        if _node(tree) != _node(other):
            raise ValueError(f"the pytrees mapped together differ in structure: {_describe(tree)} against "
                             f"{_describe(other)}. Fix: pass trees of the same structure (the same dict "
                             "keys, sequence lengths, None and array leaves), e.g. "
                             "where_finite(found_inf, new_params, params)")
    if isinstance(tree, dict):
        return type(tree)((k, tree_map(fn, v, *(r[k] for r in rest))) for k, v in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a NamedTuple (optax states)
        return type(tree)(*(tree_map(fn, *parts) for parts in zip(tree, *rest)))
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(fn, *parts) for parts in zip(tree, *rest))
    if tree is None:
        return None
    if hasattr(tree, "dtype") or isinstance(tree, (int, float)):  # an array or a number: a leaf, never
        return fn(tree, *rest)  # handed to a plugin (torch.compile cannot trace jax's pytree registry)
    mapped = _registry.map_tree(fn, tree, rest)
    return fn(tree, *rest) if mapped is None else mapped[0]


def _node(tree: Any) -> tuple[Any, ...]:
    """What must match between trees mapped together: the container kind and its keys or length."""
    if isinstance(tree, dict):
        return ("dict", set(tree))
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__ if hasattr(tree, "_fields") else "sequence", len(tree))
    return ("None",) if tree is None else ("leaf",)


def _describe(tree: Any) -> str:
    if isinstance(tree, dict):
        return f"a {type(tree).__name__} with keys {sorted(map(repr, tree))}"
    if isinstance(tree, (list, tuple)):
        return f"a {type(tree).__name__} of {len(tree)}"
    return "None" if tree is None else f"a leaf ({type(tree).__name__})"


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in :func:`tree_map`'s order."""
    found: list[Any] = []
    tree_map(found.append, tree)
    return found
