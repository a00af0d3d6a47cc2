"""Reducer discovery: pluggy plugins from the ``polyamp.reducers`` entry-point group.

``reducer(x)`` asks every plugin's ``make_reducer`` in turn; the first non-None wins. The
built-ins (torch, mpi, cupy_nccl) register through the same group as third-party plugins.
Loading a plugin imports no engine: plugins look objects up in ``sys.modules``.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from .. import _hookspecs
from .._errors import ConfigError
from .._plugins import PluginSet
from ..config import short_repr
from ._reducer import OnFault, Reducer, check_on_fault, check_timeout

_lock = threading.Lock()


@functools.cache
def _plugins() -> PluginSet:
    """The reducer plugin manager plus the entry points that failed to load (and why)."""
    return PluginSet(_hookspecs.ReducerSpec, _hookspecs.REDUCER_GROUP, _hookspecs.REDUCER_HOOKS, "reducer")


def _accepted(plugins: PluginSet) -> str:
    """What the plugins accept, one clause each, for error messages."""
    kinds = [str(k) for k in plugins.manager.hook.reducer_accepts() if k]
    kinds.append("a polyamp.distributed.Reducer")
    names = sorted(n for n, _ in plugins.manager.list_name_plugin())
    text = "; ".join(kinds) + f" (reducer plugins: {', '.join(names) or 'none'}"
    if plugins.broken:
        text += "; failed to load: " + ", ".join(f"{n} ({why})" for n, why in sorted(plugins.broken.items()))
    return text + ")"


def register_reducer(module: Any, name: str) -> None:
    """Register a reducer plugin module at run time (the entry-point group is the usual way)."""
    with _lock:
        _plugins().register(module, name)


def reducer(group: Any, *, timeout: float | None = None, on_fault: OnFault = "abort") -> Reducer:
    """A Reducer over ``group``: a torch ProcessGroup or "torch", an mpi4py communicator or "mpi",
    a CuPy NCCL communicator, or anything a plugin accepts. A Reducer is returned as it is.

    ``timeout``: seconds a collective may take before ``ReducerTimeoutError`` (None: the
    engine's default; torch's is the process group's own ``init_process_group(timeout=...)``).
    ``on_fault``: after a timeout or a dead peer, "abort" (default) reports the error and ends
    the job the way the engine does (MPI ``Abort``; torch aborts the process group, then raises),
    so that no late rank can complete the abandoned step alone; "raise" only raises the error
    on the ranks that saw it, accepting that risk.
    """
    if isinstance(group, Reducer):
        if timeout is not None or on_fault != "abort":
            raise ConfigError(
                f"timeout={short_repr(timeout)}, on_fault={short_repr(on_fault)} cannot change the "
                f"existing reducer {group!r}. Fix: pass them when that reducer is built (or set its "
                "on_fault attribute), or pass the group itself."
            )
        return group
    seconds = check_timeout(timeout)
    fault = check_on_fault(on_fault)
    plugins = _plugins()
    made = plugins.manager.hook.make_reducer(group=group, timeout=seconds)
    if made is None:
        what = f"{type(group).__module__}.{type(group).__qualname__}"
        error = ConfigError if isinstance(group, str) else TypeError
        raise error(
            f"polyamp.distributed.reducer() cannot build a reducer from {short_repr(group)} "
            f"(type {what}). It accepts: {_accepted(plugins)}. Fix: pass one of these, or install "
            f"the plugin for yours (entry-point group {_hookspecs.REDUCER_GROUP!r})."
        )
    if not isinstance(made, Reducer):
        raise TypeError(
            f"a reducer plugin returned {type(made).__name__} for {short_repr(group)}, not a "
            "polyamp.distributed.Reducer. Fix: the plugin's make_reducer must return a Reducer subclass."
        )
    made.on_fault = fault
    return made
