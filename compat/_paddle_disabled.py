"""What ``GradScaler(enable=False)`` and ``AmpScaler(enable=False)`` do: no-ops, as paddle's disabled scalers.

Mixins placed before an enabled class by :func:`disabled_type`, so each verb passes straight
to the optimizer and no method asks "am I enabled?". This module imports nothing of
``compat/paddle.py``: the enabled classes come in as arguments.
"""

from __future__ import annotations

from typing import Any

from ._paddle_steps import apply_optimizer


class DisabledAmp:
    """``AmpScaler(enable=False)``: scale() returns its input, minimize() just minimizes."""

    _enable = False

    def scale(self, var: Any) -> Any:
        """``var`` unchanged."""
        return var

    def minimize(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.minimize(*args, **kwargs)`` (``step()`` where there is none); never skipped."""
        return apply_optimizer(optimizer, args, kwargs)

    def _unscale(self, optimizer: Any) -> None:
        return None

    def is_use_dynamic_loss_scaling(self) -> bool:
        """Always False, as paddle's disabled scaler."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """Empty: a disabled scaler has no state (paddle's returns {} too)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Ignored, as paddle's disabled scaler does."""
        return None


class DisabledGrad(DisabledAmp):
    """``GradScaler(enable=False)``: step() steps, update() and unscale_() do nothing."""

    def step(self, optimizer: Any) -> None:
        """``optimizer.step()``; never skipped."""
        optimizer.step()

    def update(self) -> None:
        """Nothing to update."""
        return None

    def unscale_(self, optimizer: Any) -> None:
        """Nothing to undo."""
        return None


_MADE: dict[type, type] = {}


def disabled_type(cls: type, with_step: bool) -> type:
    """The no-op type for ``cls(enable=False)``: a mixin before ``cls``, made once per class.

    ``with_step``: ``cls`` is a GradScaler (step, update, unscale_). A user's subclass gets
    its own disabled type, still an instance of the subclass.
    """
    if not getattr(cls, "_enable", True):
        return cls
    if cls not in _MADE:
        mixin = DisabledGrad if with_step else DisabledAmp
        _MADE[cls] = type(f"Disabled{cls.__name__}", (mixin, cls),
                          {"__module__": cls.__module__, "_public_class": cls})
    return _MADE[cls]
