"""The loss scale a scaler keeps across iterations: config, backend, state, one step of the rule,
the floor's refusal and warning. An :class:`polyamp._iteration.Iteration` holds one.
"""

from __future__ import annotations

import logging
from typing import Any

from . import _inputs, _registry, overflow
from ._errors import MinScaleError
from .backend import Backend
from .config import SCALE_FLOOR, LossScaleConfig
from .policy import (
    HostState,
    LossScaleState,
    backs_off_at_floor,
    fit_to_config,
    next_host_state,
    scale_floor,
    tracker_limits,
)

logger = logging.getLogger("polyamp")


class Scaling:
    """The config in force, the backend (None until arrays choose one) and the scale state (None
    until bound, and never without a backend)."""

    def __init__(self, config: LossScaleConfig, backend: Backend | None) -> None:
        if backend is not None:
            _registry.check_in_place(backend)
        self.config = config
        self.backend = backend
        self.state: LossScaleState | None = None  # device arrays, made on the first array seen
        self.host = HostState(float(config.init_scale), 0, 0)  # the state until then
        self.floor_warned = False

    def bind(self, array: Any) -> Backend:
        """Pick the backend from ``array`` if none is chosen, and create the state on its device."""
        backend = self.backend
        if self.state is not None:  # bound already (per step: nothing to do)
            return backend
        _inputs.refuse_meta([array], "the scaler")  # before a backend or state is chosen by it
        if backend is None:
            backend = _registry.backend_for_array(array)
            _registry.check_in_place(backend, array)  # before the scaler keeps it
            self.backend = backend
        else:
            _registry.check_owned(backend, array, "the array given to the scaler")
        self.state = _make_state(backend, self.host, array)
        return backend

    @property
    def fingerprinted(self) -> Any:
        """The state a rank fingerprint carries: the device arrays, or the host state before any."""
        return self.host if self.state is None else self.state

    def gradients(self, given: Any, where: str, owned: bool = False) -> list[Any]:
        """``given`` as a list of the bound backend's arrays (``owned``: already checked)."""
        if owned and self.state is not None:
            return given
        arrays = _inputs.gradient_list(given, where)
        if arrays:
            _inputs.check_owned(arrays, self.bind(arrays[0]), where)
        return arrays

    def ready(self) -> tuple[Backend, LossScaleState]:
        """The backend and state, defaulting to numpy when no array has been seen yet."""
        if self.backend is None:
            self.backend = _registry.get_backend(_registry.DEFAULT_BACKEND, "default")
        if self.state is None:
            self.state = _make_state(self.backend, self.host, None)
        return self.backend, self.state

    def host_state(self) -> HostState:
        """The state as Python numbers: a device sync when the state lives on a GPU."""
        if self.state is None:
            return self.host
        to_host = self.backend.to_host
        scale, growth, backoff = self.state
        return HostState(float(to_host(scale)), int(to_host(growth)), int(to_host(backoff)))

    def unscale(self, arrays: list[Any], *, check_only: bool, keep: bool, squares: bool) -> tuple[Any, Any]:
        """Divide ``arrays`` by the scale in place (``check_only``: only check): (their device flag,
        their sum of squares or None). ``keep``: an overflowing step's values stay. No sync."""
        if self.state is not None:  # bound: the arrays are the backend's (checked by the caller)
            backend, state = self.backend, self.state
        else:
            backend, state = self.ready() if not arrays else (self.bind(arrays[0]), self.state)
        found = backend.full(0.0, "float32", state.scale)
        if not arrays:
            return found, None
        by = backend.full(1.0, "float32", state.scale) if check_only else state.scale
        fused = backend.unscale_and_squares
        if squares and fused is not None and not (keep or check_only):  # the squares in the same pass
            return found, fused(arrays, by, found)
        (backend.unscale_and_check_keep if keep else backend.unscale_and_check)(arrays, by, found)
        return found, backend.sum_of_squares(arrays) if squares else None

    def unscale_counted(self, arrays: list[Any], bounds: Any) -> tuple[Any, Any]:
        """Divide ``arrays`` (non-empty, bound) by the scale in place and count them for a meter's
        ``bounds`` in the same pass: (their device flag, ``(counts, extremes)``). No sync."""
        backend, state = self.backend, self.state
        found = backend.full(0.0, "float32", state.scale)
        return found, backend.unscale_and_count(arrays, state.scale, found, bounds)

    def flag_array(self, flag: Any) -> Any:
        """``flag`` (a host bool, None: 0, or a device flag) as a float32 flag array. No sync."""
        if flag is not None and not isinstance(flag, bool):
            return flag
        backend, state = self.ready()
        return backend.full(float(bool(flag)), "float32", state.scale)

    def read_flag(self, flag: Any) -> bool:
        """A flag (a device array or a host bool) on the host: one read of an array."""
        return flag if isinstance(flag, bool) else bool(self.ready()[0].read_flag(flag))

    def load(self, host: HostState) -> None:
        """Replace the state (arrays on their device where they exist)."""
        if self.state is not None:
            self.state = _make_state(self.backend, host, self.state.scale)
        self.host = host

    def reconfigure(self, config: LossScaleConfig) -> LossScaleConfig:
        """Put ``config`` in force, trackers fitted to shrunk limits (a sync only then)."""
        old, self.config = self.config, config
        if all(n >= o for n, o in zip(tracker_limits(config), tracker_limits(old))):
            return config
        host = self.host_state()
        fitted = fit_to_config(host, config)
        if fitted == host:
            return config
        if self.state is None:
            self.host = fitted
        else:
            full, like = self.backend.full, self.state.scale
            self.state = self.state._replace(growth_tracker=full(fitted.growth_tracker, "int32", like),
                                             backoff_tracker=full(fitted.backoff_tracker, "int32", like))
        return config

    def set_scale(self, scale: float) -> None:
        """Replace the scale (trackers kept)."""
        if self.state is not None:
            self.state = self.state._replace(scale=self.backend.full(scale, "float32", self.state.scale))
        else:
            self.host = self.host._replace(scale=scale)

    def advance(self, flag: Any) -> None:
        """One step of the rule: on the device (no sync), or on the host before any array exists."""
        if isinstance(flag, bool) and self.state is None:
            self.host = next_host_state(self.host, flag, self.config)
            return
        backend, state = (self.backend, self.state) if self.state is not None else self.ready()
        flag = self.flag_array(flag) if isinstance(flag, bool) else flag  # per step: no call for an array
        self.state = backend.update_scale(state, flag, self.config)

    def refuse_backoff_at_floor(self, flag: Any, state: HostState | None) -> None:
        """DeepSpeed's ``raise_error_at_min_scale``: MinScaleError, before the rule runs, when this
        overflow would back off a scale at its floor. Reads the flag (and the state unless given)."""
        if not self.read_flag(flag):
            return
        state = state or self.host_state()
        if backs_off_at_floor(state, self.config):
            raise MinScaleError("gradients overflowed with the loss scale already at its minimum "
                                f"{state.scale:g} (min_scale={self.config.min_scale!r}, floor "
                                f"{scale_floor(self.config):g}) and hysteresis spent: it cannot back off "
                                "further, and raise_error_at_min_scale=True (DeepSpeed's behaviour). The "
                                "step was skipped; the scale and trackers are unchanged. Fix: find what "
                                "overflows (diagnose=True, polyamp.explain_overflow), lower min_scale, or "
                                "pass raise_error_at_min_scale=False to keep skipping such steps.")

    def warn_if_at_floor(self, skipped: bool, last_overflow: overflow.OverflowReport | None) -> None:
        """After a skipped step's update: warn once if the scale sits at SCALE_FLOOR."""
        if not skipped or self.floor_warned or not self.config.dynamic:
            return
        if self.host_state().scale <= SCALE_FLOOR:
            self.floor_warned = True
            logger.warning(
                "loss scale hit its floor 2**-126 (float32's smallest normal) after repeated "
                "overflows; it stays there instead of decaying to 0. Usual causes: a NaN or inf "
                "loss or forward pass, gradients not zeroed between steps, or a learning rate "
                "that diverged.%s", overflow.floor_note(last_overflow),
            )

    def describe_change(self, skipped: bool, before: HostState, after: HostState) -> str | None:
        """The log line of one update's scale change (``_skip_log`` picks its level)."""
        old, new = before.scale, after.scale
        if not skipped:  # or not read on the host: the torch facade with a fused optimizer
            if new < old:
                return f"overflow in gradients: loss scale backed off {old:g} -> {new:g}"
            return f"loss scale grew {old:g} -> {new:g}" if new > old else None
        if new != old:
            return f"overflow in gradients: step skipped, loss scale backed off {old:g} -> {new:g}"
        return (f"overflow in gradients: step skipped, loss scale kept at {old:g} "
                f"(absorbed by backoff_interval={self.config.backoff_interval})")

    def __getstate__(self) -> dict[str, Any]:
        """The backend by name and the state as host values (one sync); device arrays are rebuilt."""
        return {**self.__dict__, "backend": self.backend.name if self.backend else None, "state": None,
                "host": self.host_state()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        name = state["backend"]
        backend = _registry.get_backend(name, "a copied or unpickled LossScaler") if name else None
        self.__dict__.update(state, backend=backend)


def _make_state(backend: Backend, host: HostState, like: Any) -> LossScaleState:
    return LossScaleState(
        backend.full(host.scale, "float32", like),
        backend.full(host.growth_tracker, "int32", like),
        backend.full(host.backoff_tracker, "int32", like),
    )
