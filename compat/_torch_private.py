"""The private members of ``torch.amp.GradScaler`` that trainers call, with torch's meaning.

Found by searching Lightning, accelerate, transformers and timm for ``scaler._``: accelerate's
FSDP2 ``load_state`` calls ``scaler._lazy_init_scale_growth_tracker(scaler._device)`` after
``load_state_dict`` (whose ``_scale`` stays None until then, as torch's); trainers and torch's
own optimizers read ``_scale``, ``_growth_tracker``, ``_get_scale_async``,
``_check_inf_per_device``, ``_found_inf_per_device``, ``_enabled`` and ``_device`` (those live in
:mod:`polyamp.compat._torch_accessors`, the facade and its constructor). Imports nothing of the
facade and does not import torch at import.
"""

from __future__ import annotations

import sys
from typing import Any

from polyamp.engine import LossScaler

_NOT_SCALED = (
    "This may indicate your script did not use scaler.scale(loss or outputs) earlier "
    "in the iteration."
)


class TorchPrivateMembers:
    """Mixin of :class:`polyamp.compat.torch.GradScaler`: torch's private members, torch's meaning."""

    _engine: LossScaler
    _enabled: bool
    _device: str

    def _lazy_init_scale_growth_tracker(self, dev: Any) -> None:
        """Create the scale and growth tracker on device ``dev`` now instead of at the first scale().

        As torch: an AssertionError when they exist already; the values are the initial ones or
        the ones ``load_state_dict`` loaded. A disabled scaler has nothing to create.
        """
        if not self._enabled:
            return
        engine = self._engine
        if engine.state is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        backend = engine.backend
        if backend is None or backend.name == "torch":
            torch = sys.modules.get("torch")
            if torch is None:
                import torch
            engine.bind(torch.empty((), device=dev))
        else:  # a NumPy/CuPy/... scaler: its state lives with its own arrays
            engine.bind(backend.full(0, "float32", None))

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[Any, Any]:
        """torch's check that the state exists: ``(scale, growth_tracker)`` or AssertionError."""
        state = self._engine.state
        if state is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + _NOT_SCALED)
        return state.scale, state.growth_tracker

    @property
    def _init_scale(self) -> float:
        """The scale the state is created with: init_scale, or the value last loaded (host number)."""
        state = self._engine.state
        return self._engine.host_state().scale if state is None else self._engine.config.init_scale

    @property
    def _init_growth_tracker(self) -> int:
        """The growth tracker the state is created with: 0, or the value last loaded."""
        return self._engine.host_state().growth_tracker if self._engine.state is None else 0
