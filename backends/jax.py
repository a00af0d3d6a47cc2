"""JAX backend: JAX's immutable arrays, for :mod:`polyamp.functional` (and ``polyamp info``).

The stateful ``LossScaler`` refuses it (``backend_info`` says ``in_place: False``); loading this
plugin never imports jax (docs/backends/jax.md).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from polyamp import functional
from polyamp._errors import ConfigError, ForeignArrayError, install_hint
from polyamp._hookspecs import hookimpl
from polyamp.policy import LossScaleState


@hookimpl
def backend_info() -> dict[str, Any]:
    try:
        import jax
    except ImportError as exc:
        return {"available": False, "reason": f"jax is not installed ({exc}). Fix: {install_hint('jax')}",
                "version": None, "in_place": False}
    return {"available": True, "reason": "", "version": jax.__version__, "in_place": False}


@hookimpl
def owns_array(array: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(array, jax.Array)


@hookimpl
def full(value: Any, dtype: str, like: Any) -> Any:
    import jax.numpy as jnp

    return jnp.full((), value, dtype=getattr(jnp, dtype), device=_other_device(like))


def _other_device(like: Any) -> Any:
    """``like``'s device when it is one device other than the default, else None: an array put on the
    default device explicitly would be committed there, which ``pmap`` and sharded ``jit`` refuse to move."""
    import jax

    if not isinstance(like, jax.Array) or isinstance(like, jax.core.Tracer) or len(like.devices()) != 1:
        return None
    (device,) = like.devices()
    return None if device == jax.devices()[0] else device


@hookimpl
def scale_array(array: Any, scale: Any) -> Any:
    return functional.scale(LossScaleState(scale, None, None), array)


@hookimpl
def unscale_and_check(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    raise ForeignArrayError(
        "JAX arrays are immutable, and polyamp.LossScaler unscales gradients in place. Fix: use "
        "polyamp.functional (init, scale, unscale, update, where_finite: pure functions that trace "
        "under jax.jit), or polyamp.optax.loss_scaled(optimizer) with optax")


@hookimpl
def cast(array: Any, dtype: str) -> Any:
    import jax.numpy as jnp

    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got dtype={dtype!r}")
    return array.astype(getattr(jnp, dtype))


@hookimpl
def update_scale(state: Any, found_inf: Any, config: Any) -> Any:
    return functional.update(LossScaleState(*state), found_inf, config)


@hookimpl
def read_flag(found_inf: Any) -> bool:
    return bool(found_inf != 0)


@hookimpl
def to_host(array: Any) -> float | int:
    return array.item()


@hookimpl
def axis_max(array: Any, axis_name: Any) -> Any:
    from jax import lax

    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not all(isinstance(n, str) for n in names):  # lax.pmax reads an int as a positional axis
        raise ConfigError(
            f"unscale(..., axis_name={axis_name!r}) must name mapped axes: a str, or a tuple of str "
            "for several. Fix: pass the axis_name given to jax.pmap (or a shard_map mesh axis), e.g. "
            "axis_name='batch'"
        )
    try:
        return lax.pmax(array, axis_name)
    except NameError:  # jax: "unbound axis name" outside pmap / shard_map of that axis
        raise ConfigError(
            f"unscale(..., axis_name={axis_name!r}) names no axis mapped here (no pmap or "
            f"shard_map binds it). Fix: call unscale inside jax.pmap / shard_map with axis_name="
            f"{axis_name!r} (the name given to pmap, or a mesh axis of shard_map), or leave "
            "axis_name out outside them"
        ) from None


@hookimpl
def map_tree(fn: Any, tree: Any, rest: Any) -> Any:
    jax = sys.modules.get("jax")  # not loaded: no object can be a JAX pytree node
    if jax is None or jax.tree_util.all_leaves([tree]):
        return None
    return (jax.tree_util.tree_map(fn, tree, *rest),)
