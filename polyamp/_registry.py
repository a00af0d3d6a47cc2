"""Backend discovery and choice: pluggy plugins from the ``polyamp`` entry-point group, loaded on
first need. Choice: ``backend=``, else ``POLYAMP_BACKEND``, else the arrays' library, else ``numpy``.
Nothing here imports an array library: plugins look arrays up in ``sys.modules``.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ._errors import BackendNotFoundError, BackendUnavailableError, ForeignArrayError
from .backend import Backend, BackendInfo

if TYPE_CHECKING:
    from ._plugins import PluginSet

ENV_VAR = "POLYAMP_BACKEND"
DEFAULT_BACKEND = "numpy"
GENERIC_BACKEND = "array_api"
_lock = threading.Lock()


@functools.cache
def _plugins() -> PluginSet:
    """The backend plugin manager plus the entry points that failed to load (and why)."""
    from . import _hookspecs
    from ._plugins import PluginSet

    class _Plugins(PluginSet):
        def names(self) -> list[str]:
            """Registered backend names, the generic array-API backend last."""
            names = [n for n, _ in self.manager.list_name_plugin()]
            return sorted(names, key=lambda n: n == GENERIC_BACKEND)

    return _Plugins(_hookspecs, _hookspecs.PROJECT, _hookspecs.REQUIRED_HOOKS, "backend",
                    broken_prefix="plugin failed to load: ")


def register_backend(module: Any, name: str) -> None:
    """Register a backend module at run time (the entry-point group is the usual way)."""
    with _lock:
        _plugins().register(module, name)
        _bound.cache_clear()
        _owners.clear()


def available_backends() -> list[BackendInfo]:
    """Every installed backend with its availability, the reason if unavailable, and version."""
    plugins = _plugins()
    return ([_info(name) for name in plugins.names()]
            + [BackendInfo(n, False, why, None) for n, why in sorted(plugins.broken.items())])


def _info(name: str) -> BackendInfo:
    module = _plugins().manager.get_plugin(name)
    try:
        raw = module.backend_info()
    except Exception as exc:
        return BackendInfo(name, False, f"backend_info() failed: {type(exc).__name__}: {exc}", None)
    return BackendInfo(name, bool(raw["available"]), str(raw.get("reason", "")), raw.get("version"))


def _summary() -> str:
    """The installed backends by name (no plugin asked whether it runs here: no library imported)."""
    plugins = _plugins()
    names = plugins.names()
    broken = sorted(plugins.broken)
    if not names and not broken:
        return "none (is polyamp installed? run: pip install -e .)"
    listed = ", ".join(names) or "none"
    if broken:
        listed += f" (failed to load: {', '.join(broken)})"
    return f"{listed}; `polyamp info` says which can run here"


def _usable() -> str:
    """The names of the backends a scaler can run here (not those of immutable arrays: JAX's)."""
    manager = _plugins().manager
    return ", ".join(i.name for i in available_backends() if i.available and
                     manager.get_plugin(i.name).backend_info().get("in_place", True)) or "none"


def check_known(name: str, source: str = "backend=") -> None:
    """Raise unless ``name`` is an installed backend that loaded (names only: no library imported)."""
    plugins = _plugins()
    if name in plugins.broken:
        raise BackendUnavailableError(f"backend {name!r} (asked for by {source}) is installed but "
                                      f"{plugins.broken[name]}. Installed backends: {_summary()}.")
    if plugins.manager.get_plugin(name) is None:
        raise BackendNotFoundError(f"unknown polyamp backend {name!r} (asked for by {source}). Installed "
                                   f"backends: {_summary()}. Fix: use one of these names, or install the "
                                   f"plugin that provides {name!r} (it registers under the 'polyamp' "
                                   "entry-point group).")


def get_backend(name: str, source: str = "backend=") -> Backend:
    """The bound backend called ``name``; ``source`` says who asked, for the error message."""
    check_known(name, source)
    return _bound(name, source)


@functools.cache
def _bound(name: str, source: str) -> Backend:
    info = _info(name)
    if not info.available:
        raise BackendUnavailableError(f"backend {name!r} (asked for by {source}) is unavailable: "
                                      f"{info.reason}. {'Or' if 'Fix:' in info.reason else 'Fix:'} choose a "
                                      f"backend available here ({_usable()}) with backend=... or "
                                      f"{ENV_VAR}=...")
    from . import _hookspecs

    module = _plugins().manager.get_plugin(name)
    generic = _plugins().manager.get_plugin(GENERIC_BACKEND)
    hooks = {}
    for hook in _hookspecs.REQUIRED_HOOKS[1:] + _hookspecs.OPTIONAL_HOOKS + _hookspecs.ARRAY_HOOKS:
        impl = getattr(module, hook, None) or getattr(generic, hook, None)
        if impl is None:
            raise BackendUnavailableError(f"backend {name!r} lacks hook {hook!r}")
        hooks[hook] = impl
    for hook, default in _hookspecs.OWN_DEFAULT_HOOKS.items():
        hooks[hook] = getattr(module, hook, None) or hooks[default]
    for hook in _hookspecs.FUSED_HOOKS:
        hooks[hook] = getattr(module, hook, None)
    return Backend(name=name, version=info.version, plugin=module, **hooks)


def requested_backend(backend: str | None) -> tuple[str | None, str]:
    """The backend name asked for by argument or environment, and which of them asked."""
    if backend is not None:
        if not isinstance(backend, str) or not backend:
            raise BackendNotFoundError("backend must be a non-empty backend name such as 'numpy', got "
                                       f"backend={backend!r}")
        return backend, "backend="
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env, f"{ENV_VAR}={env}"
    return None, ""


def backend_for_array(array: Any) -> Backend:
    """The backend that owns ``array`` (plugins in order, generic last); numpy for Python data."""
    plugins = _plugins()
    for name in plugins.names():
        module = plugins.manager.get_plugin(name)
        if module.owns_array(array):
            return get_backend(name, f"an array of type {type(array).__module__}.{type(array).__name__}")
    if isinstance(array, (int, float, list, tuple)):
        return get_backend(DEFAULT_BACKEND, "default")
    raise ForeignArrayError("no installed polyamp backend can hold an array of type "
                            f"{type(array).__module__}.{type(array).__name__}. Installed backends: "
                            f"{_summary()}. Fix: pass arrays of one of these libraries, or install a backend "
                            "plugin for yours.")


#: type(array) -> the backend that owns arrays of that type (owns_array answers by type).
_owners: dict[type, Backend] = {}


def backend_of(array: Any) -> Backend:
    """:func:`backend_for_array`, remembered per array type (for small per-step questions)."""
    found = _owners.get(type(array))
    if found is None:
        found = _owners[type(array)] = backend_for_array(array)
    return found


def model_steps(model: Any, dtype: str) -> Any:
    """The first plugin's ``model_steps(model, dtype)`` that is not None, else None."""
    return _plugins().manager.hook.model_steps(model=model, dtype=dtype)


def map_tree(fn: Any, tree: Any, rest: tuple[Any, ...]) -> tuple[Any] | None:
    """``(mapped,)`` from the first plugin whose pytree registry holds ``tree``, else None (a leaf)."""
    return _plugins().manager.hook.map_tree(fn=fn, tree=tree, rest=rest)


def check_owned(backend: Backend, array: Any, what: str) -> None:
    """Raise ForeignArrayError when the chosen ``backend`` cannot work on ``array``."""
    if not backend.accepts_array(array):
        raise ForeignArrayError(f"{what} is a {type(array).__module__}.{type(array).__name__}, which backend "
                                f"{backend.name!r} cannot hold. Fix: pass backend= for that library "
                                f"(installed: {_summary()}), or unset {ENV_VAR}.")


def check_in_place(backend: Backend, array: Any = None) -> None:
    """Raise ForeignArrayError when ``backend``'s arrays cannot be written in place (JAX's)."""
    if backend.plugin.backend_info().get("in_place", True):
        return
    what = f"a {type(array).__module__}.{type(array).__name__}" if array is not None else "no array yet"
    raise ForeignArrayError(f"polyamp.LossScaler cannot use backend {backend.name!r} (given {what}): its "
                            "arrays cannot be changed in place, and the scaler unscales gradients in place. "
                            "Fix: use polyamp.functional (init, scale, unscale, update, where_finite: pure "
                            "functions that trace under jax.jit), or polyamp.optax.loss_scaled(optimizer) "
                            "with optax.")


def first_array(tree: Iterable[Any] | Any) -> Any:
    """The first array in a nested list/tuple (None when there is none)."""
    if isinstance(tree, (list, tuple)):
        return next((found for found in map(first_array, tree) if found is not None), None)
    return tree
