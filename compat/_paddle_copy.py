"""Copies of the paddle facade (``pickle``, ``copy.deepcopy``) that never pickle the engine: the
backend's name and the state dict rebuild a fresh one (a deep copy shares the reducer).
"""

from __future__ import annotations

from typing import Any

from polyamp.engine import LossScaler, make_iteration

_REBUILT = ("_engine", "_iteration", "_found_inf")


def facade_state(scaler: Any) -> dict[str, Any]:
    """``scaler.__dict__`` with the engine as (backend name, state dict): plain, picklable data (a
    device sync; mid-iteration one more for the pending flag, kept as a host bool)."""
    state = {k: v for k, v in vars(scaler).items() if k not in _REBUILT}
    engine, flag = scaler._engine, scaler._found_inf
    backend = engine.backend
    state["_engine"] = {"backend": backend.name if backend else None, "state_dict": engine.state_now(),
                        "reducer": engine.reducer, "last_overflow": engine.last_overflow,
                        "guard": engine.guard, "meter": scaler._iteration.metering.meter,
                        "precision": scaler._iteration.metering.last}
    if flag is not None and not isinstance(flag, bool):
        flag = bool(backend.read_flag(flag)) if scaler._stages else None  # stale once stages clear
    state["_found_inf"] = flag
    return state


def restore_facade(scaler: Any, state: dict[str, Any]) -> None:
    """Fill a bare ``scaler`` from :func:`facade_state`'s output, with an engine of its own."""
    state = dict(state)
    saved = state.pop("_engine")
    diagnose = bool(state["_diagnose"]) and state.get("_enable", True)
    iteration = make_iteration(None, saved["backend"], reducer=saved["reducer"], diagnose=diagnose,
                               guard=saved["guard"], meter=saved.get("meter"))
    engine = LossScaler.over(iteration)
    engine.load_state_dict(saved["state_dict"])
    iteration.last_overflow = saved["last_overflow"]
    iteration.metering.last = saved.get("precision")
    scaler.__dict__.update(state, _engine=engine, _iteration=iteration)


def restore(cls: type, enable: bool, state: dict[str, Any]) -> Any:
    """Unpickle: a bare ``cls`` (its disabled type unless ``enable``) filled from ``state``."""
    scaler = cls.__new__(cls, enable)
    scaler.__setstate__(state)
    return scaler
