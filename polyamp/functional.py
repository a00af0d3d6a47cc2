"""Loss scaling as pure functions over pytrees: no in-place write, no host read.

For immutable arrays (JAX, under ``jax.jit``, ``pmap`` and ``shard_map``), optax
(:mod:`polyamp.optax`), and a step with no host read on torch and CuPy (``torch.compile``)::

    state = init(config, like=params_leaf)
    grads = grad(lambda p: scale(state, loss_fn(p)))(params)
    grads, found_inf = unscale(state, grads)          # found_inf: 0-d float32, non-zero on inf/nan
    params = where_finite(found_inf, new_params, params)  # the skip, without a branch
    state = update(state, found_inf, config)          # the rule: polyamp.policy.next_state

The arithmetic is the engine's (gradients times ``float32(1 / float64(scale))``); without float64
(JAX without x64) it is float32, within one ulp. No factor is ever subnormal (flushed to 0 by XLA).
"""

from __future__ import annotations

import functools
from typing import Any

import array_api_compat

from . import _pytree, _registry
from ._errors import ConfigError, ForeignArrayError
from .config import LossScaleConfig
from .policy import LossScaleState, next_state

__all__ = ["init", "measure", "scale", "unscale", "update", "where_finite"]

#: The int32 trackers are compared with the intervals; a library without int64 compares in int32.
_INT32_MAX = 2**31 - 1


def init(config: LossScaleConfig | None = None, *, like: Any = None) -> LossScaleState:
    """The first state: scale ``config.init_scale`` (float32), trackers 0 (int32), as 0-d arrays on
    ``like``'s library and device (an array or a pytree), else ``POLYAMP_BACKEND``'s, else NumPy."""
    config = config_or_default(config)
    if isinstance(like, (dict, list, tuple)):  # a pytree (the parameters): its first array
        like = next(iter(_pytree.leaves(like)), None)  # (the NumPy default took a list of tensors)
    if like is not None:
        backend = _registry.backend_for_array(like)
    else:
        name, source = _registry.requested_backend(None)
        backend = _registry.get_backend(name or _registry.DEFAULT_BACKEND, source or "default")
    scale = backend.full(float(config.init_scale), "float32", like)
    _namespace(scale)  # a library the other functions cannot work with is refused here
    return LossScaleState(scale, backend.full(0, "int32", like), backend.full(0, "int32", like))


def scale(state: LossScaleState, loss: Any) -> Any:
    """``loss * scale`` in each loss's own dtype (a pytree of losses too); the scale is unchanged."""
    xp = _namespace(state.scale)
    has_f64 = _wide_kinds(xp)[0]
    return _pytree.tree_map(lambda leaf: _times(xp, has_f64, leaf, state.scale, "losses"), loss)


def unscale(state: LossScaleState, grads: Any, *, axis_name: Any = None) -> tuple[Any, Any]:
    """``(grads / scale, found_inf)``: new gradients and a 0-d float32 flag, 1 when any gradient
    held inf or nan. ``axis_name`` (JAX ``pmap`` / ``shard_map``): the flag is agreed over that
    axis in one collective (``lax.pmax``), so every device skips together."""
    xp = _namespace(state.scale)
    has_f64 = _wide_kinds(xp)[0]
    inv, after = _reciprocal(xp, has_f64, state.scale)
    bad = None
    for leaf in _pytree.leaves(grads):  # one reduction per gradient; XLA fuses them under jit
        _check_library(xp, leaf, "gradients")
        leaf_bad = xp.any(~xp.isfinite(leaf))
        bad = leaf_bad if bad is None else bad | leaf_bad
    found_inf = xp.zeros_like(state.scale) if bad is None else xp.astype(bad, xp.float32)
    if axis_name is not None:  # one collective over the mapped axis (JAX's pmap / shard_map)
        found_inf = _axis_max(found_inf, axis_name)
    return _pytree.tree_map(lambda g: _times(xp, has_f64, g, inv, "gradients", after), grads), found_inf


#: Above this scale the float32 reciprocal is subnormal, which XLA (JAX on CPU, GPU, TPU) and
#: torch under ``set_flush_denormal(True)`` read as 0: every gradient would become 0, no flag set.
_SUBNORMAL_RECIPROCAL = 2.0**126


def _reciprocal(xp: Any, has_f64: bool, scale: Any) -> tuple[Any, Any]:
    """``(inv, after)``: times ``inv`` then ``after`` is times ``float32(1 / float64(scale))`` with no
    subnormal factor: ``(reciprocal, 1)``, above 2**126 ``(4 * reciprocal, 0.25)`` (bit for bit)."""
    if has_f64:
        scale_w = xp.astype(scale, xp.float64)
        inv = xp.astype(1.0 / scale_w, xp.float32)
        big_w = xp.maximum(scale_w, xp.full_like(scale_w, 2.0**126))  # 4 / big_w: within float32
        inv4 = xp.astype(xp.round((4.0 / big_w) * 2.0**147) * 2.0**-147, xp.float32)
    else:  # float32's 2**147 is inf: no grid rounding (docs/functional.md: within one ulp here)
        inv = 1.0 / scale
        inv4 = 4.0 / xp.maximum(scale, xp.full_like(scale, 2.0**126))
    big = scale > _SUBNORMAL_RECIPROCAL
    inv = xp.where(big, inv4, inv)
    after = xp.where(big, xp.full_like(scale, 0.25), xp.ones_like(scale))  # (float32, as the scale)
    if xp.__name__.startswith("jax"):  # XLA folds two constant factors into one (a subnormal: 0)
        import jax  # noqa: PLC0415 (loaded already: the state is a JAX array)

        inv, after = jax.lax.optimization_barrier((inv, after))
    return inv, after


def _axis_max(flag: Any, axis_name: Any) -> Any:
    """``flag``'s maximum over the named axis, through its backend's ``axis_max`` hook."""
    backend = _registry.backend_of(flag)
    if backend.axis_max is None:
        raise ValueError(f"unscale(..., axis_name={axis_name!r}) needs an array library with named mapped "
                         f"axes (JAX under pmap or shard_map), got {backend.name} arrays. Fix: leave "
                         "axis_name out, or agree found_inf over your ranks yourself (e.g. a MAX all-reduce)")
    return backend.axis_max(flag, axis_name)


def update(state: LossScaleState, found_inf: Any, config: LossScaleConfig | None = None) -> LossScaleState:
    """The next state under ``config``'s rule (torch's by default): :func:`polyamp.policy.next_state`,
    branch-free, on the device. ``found_inf`` is :func:`unscale`'s flag."""
    config = config_or_default(config)
    xp = _namespace(state.scale)
    _check_library(xp, found_inf, "found_inf")
    if isinstance(found_inf, (bool, int, float)):  # a host flag: a 0-d array beside the state
        found_inf = xp.zeros_like(state.scale) + float(found_inf)  # (torch's where refuses a bool)
    has_f64, has_i64 = _wide_kinds(xp)
    if not has_i64:  # JAX without x64 (torch, NumPy and CuPy use config as it is)
        _check_intervals(config)
    products = None if has_f64 else "float32"  # JAX without x64: float32 products (docs/functional.md)
    return next_state(LossScaleState(*state), found_inf, config, xp, products=products)


def where_finite(found_inf: Any, new: Any, old: Any) -> Any:
    """Per leaf, ``new`` where ``found_inf`` (:func:`unscale`'s flag, or a host bool) is 0, else
    ``old``: a skipped step without a branch."""
    if isinstance(found_inf, (bool, int, float)):  # a host flag (update takes one too): no array op
        return _pytree.tree_map(lambda n, o: o if found_inf else n, new, old)
    xp = _namespace(found_inf)
    skip = found_inf != 0

    def pick(n: Any, o: Any) -> Any:
        _check_library(xp, n, "new")
        _check_library(xp, o, "old")
        return xp.where(skip, o, n)

    return _pytree.tree_map(pick, new, old)


def measure(grads: Any, scale: Any, targets: Any = None) -> Any:
    """Exact precision counts of the unscaled ``grads`` (a pytree), as :class:`polyamp.PrecisionMeter`
    defines them: ``Measured(counts, extremes)`` on the gradients' device, no host read (JAX needs x64).

    ``scale``: for "loss" targets (the state, its scale, or a number); ``targets``: a PrecisionMeter
    or its ``targets``; ``meter.report(step, scale, names, counts, extremes)`` reads the result.
    """
    from .precision import PrecisionMeter

    meter = targets if isinstance(targets, PrecisionMeter) else (
        PrecisionMeter() if targets is None else PrecisionMeter(targets=targets))
    if isinstance(scale, LossScaleState):
        scale = scale.scale
    leaves = [leaf for leaf in _pytree.leaves(grads) if leaf is not None]
    odd = next((leaf for leaf in leaves if not hasattr(leaf, "shape")), None)
    if odd is not None:
        raise TypeError(f"measure needs arrays as gradients, got a {type(odd).__name__} leaf ({odd!r:.40}). "
                        "Fix: pass the gradients' arrays (a number is no gradient).")
    if not leaves:
        raise ValueError(f"measure needs at least one gradient array, got grads={grads!r:.60}. "
                         "Fix: pass the gradients' pytree (a dict, list or tuple of arrays).")
    return meter.count(_registry.backend_of(leaves[0]), leaves, scale)


# -- helpers ------------------------------------------------------------------------------------
def config_or_default(config: LossScaleConfig | None) -> LossScaleConfig:
    """``config``, torch's defaults for None; anything else is refused naming the value."""
    if config is None:
        return LossScaleConfig()
    if not isinstance(config, LossScaleConfig):
        raise TypeError(f"config must be a polyamp.LossScaleConfig or None, got config={config!r}. "
                        "Fix: build one with polyamp.LossScaleConfig(init_scale=..., ...)")
    return config


def _namespace(array: Any) -> Any:
    """The array-API namespace of ``array`` (a state array or the flag)."""
    try:
        return array_api_compat.array_namespace(array)
    except TypeError:
        if hasattr(array, "dtype"):  # an array of a library with no array-API namespace (paddle)
            raise ForeignArrayError("polyamp.functional needs an array-API library (NumPy, torch, "
                                    "CuPy, JAX, array-api-strict); "
                                    f"{type(array).__module__}.{type(array).__name__} has no "
                                    "array-API namespace. Fix: use the stateful polyamp.LossScaler "
                                    "(or polyamp.compat.paddle's GradScaler) for these arrays") from None
        raise TypeError("polyamp.functional expects the state's 0-d arrays, got a "
                        f"{type(array).__module__}.{type(array).__name__}. Fix: make "
                        "the state with polyamp.functional.init(config, like=...)") from None


def _check_library(xp: Any, array: Any, what: str) -> None:
    """Refuse an array of another library than the state's (Python numbers pass, NumPy under JAX too)."""
    if isinstance(array, (int, float, bool)) or array is None:
        return
    try:
        mine = array_api_compat.array_namespace(array)
    except TypeError:
        return  # not an array: the caller says what it needs
    if mine is xp or (mine.__name__.endswith(".numpy") and xp.__name__.startswith("jax")):
        return
    raise ForeignArrayError(f"polyamp.functional got {what} of {mine.__name__} "
                            f"({type(array).__module__}.{type(array).__name__}) while the state "
                            f"(or found_inf) is of {xp.__name__}. Fix: build the state on the "
                            "arrays' library, polyamp.functional.init(config, like=a_parameter), "
                            "and keep parameters, gradients and optimizer state on it")


def _wide_kinds(xp: Any) -> tuple[bool, bool]:
    """Whether ``xp`` has float64 and int64 now (JAX: ``jax_enable_x64`` may change, so asked each call)."""
    try:
        info = xp.__array_namespace_info__()
        floats = info.dtypes(kind="real floating")
        ints = info.dtypes(kind="signed integer")
    except AttributeError:  # a namespace without the inspection API: assume both
        return True, True
    return "float64" in floats, "int64" in ints


@functools.lru_cache(maxsize=64)
def _check_intervals(config: LossScaleConfig) -> None:
    """Refuse intervals that int32 trackers cannot be compared with (a library without int64)."""
    for name in ("growth_interval", "backoff_interval"):
        value = getattr(config, name)
        if value > _INT32_MAX:
            raise ConfigError(f"{name} must be at most 2**31 - 1 where the array library has "
                              f"no int64 (JAX without jax_enable_x64), got {name}={value}. "
                              f"Fix: pass {name}=2**31 - 1, which the int32 trackers reach "
                              "only after as many steps, or enable jax_enable_x64.")


def _floating(xp: Any, dtype: Any) -> bool:
    try:
        return xp.isdtype(dtype, "real floating")
    except TypeError:  # a dtype the namespace does not know: NumPy's bfloat16 (ml_dtypes)
        return True


def _times(xp: Any, has_f64: bool, array: Any, factor: Any, what: str, after: Any = None) -> Any:
    """``array * factor`` (then ``* after``) in ``array``'s dtype, as the NumPy engine computes it."""
    dtype = getattr(array, "dtype", None)
    if dtype is None:
        raise TypeError(f"polyamp.functional needs arrays as {what}, got a "
                        f"{type(array).__module__}.{type(array).__name__} ({array!r:.40}). Fix: pass "
                        "an array of the state's library, e.g. xp.asarray(value, dtype=xp.float32)")
    _check_library(xp, array, what)
    if dtype == xp.float32:
        return _then(array * factor, after)
    if has_f64 and dtype == xp.float64:
        return _then(array * xp.astype(factor, xp.float64),
                     None if after is None else xp.astype(after, xp.float64))
    if not _floating(xp, dtype):
        raise TypeError(f"polyamp.functional needs floating-point {what}, got an array of dtype={dtype}. "
                        f"Fix: pass floating-point {what} (e.g. cast them with astype(float32))")
    return xp.astype(_then(xp.astype(array, xp.float32) * factor, after), dtype)


def _then(product: Any, after: Any) -> Any:
    return product if after is None else product * after
