"""torch's two overridable steps of ``GradScaler``, called where torch calls them, with torch's arguments.

Subclasses of ``torch.amp.GradScaler`` override ``_unscale_grads_(optimizer, inv_scale, found_inf,
allow_fp16)`` (NeMo routes it to an optimizer's own unscale) and ``_maybe_opt_step(optimizer,
optimizer_state, *args, **kwargs)`` (NeMo agrees ``found_inf`` over the model-parallel group
there). A subclass of polyamp's scaler (also one defined on ``torch.amp.GradScaler`` while
installed) has them called as torch does:

- ``step`` calls ``_maybe_opt_step`` with ``optimizer_state = {"stage": UNSCALED,
  "found_inf_per_device": {device: flag}}``; the default makes polyamp's skip decision on those
  flags. A flag the override changes in place, or replaces in the dict, is the one ``update()`` uses.
- ``unscale_`` / ``_check_inf_per_device`` call ``_unscale_grads_`` only where a class overrides it
  (the default path builds no ``inv_scale``): ``inv_scale`` is ``float32(1 / float64(scale))`` (1
  for the check-only call), ``found_inf`` a zero float32 array beside the scale. The default
  unscales through the iteration by the scaler's own scale, so an override that hands it another
  ``inv_scale`` is refused (ValueError). An override that unscales by itself returns torch's
  ``{device: found_inf}``, which is recorded (and agreed, on a sharded scaler).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polyamp.engine import LossScaler

from ._torch_grads import collect_grads

_UNDECIDED = object()  # _last_skipped while _maybe_opt_step runs: did the default decide?


@dataclass
class UnscaleCall:
    """One ``_unscale_grads_`` call in flight: what the default must honour, and whether it ran."""

    inv_scale: Any
    check_only: bool
    ran: bool = False


def combined(per_device: dict[Any, Any]) -> Any:
    """torch's ``found_inf_per_device`` summed into one flag; None when empty (no gradients)."""
    flags = list(per_device.values())
    return None if not flags else flags[0] if len(flags) == 1 else sum(flags[1:], flags[0])


@functools.cache
def overrides_unscale(cls: type) -> bool:
    """Whether ``cls`` overrides ``_unscale_grads_`` (then unscale_ goes through it)."""
    return cls._unscale_grads_ is not TorchHooks._unscale_grads_  # type: ignore[attr-defined]


class TorchHooks:
    """Mixin of :class:`polyamp.compat.torch.GradScaler`: the defaults of torch's two hooks."""

    _engine: LossScaler
    _found: dict[int, Any]
    _last_skipped: Any
    _unread: list[Any]
    _check_grads: Callable[..., Any]  # the facade's: one optimizer's flag, agreed if sharded
    _found_inf_per_device: Callable[[Any], dict[Any, Any]]
    _maybe_opt_step: Callable[..., Any]
    _unscale_call: UnscaleCall | None = None  # set only while a hooked unscale is in flight

    def _agree_own_flag(self, flag: Any, optimizer: Any) -> Any:
        """A flag an ``_unscale_grads_`` override computed itself: as it is (sharded: agreed)."""
        return flag

    def _unscale_optimizer(self, optimizer: Any, check_only: bool, allow_fp16: bool) -> Any:
        """One optimizer's device flag (None without gradients): unscaled (or checked) directly,
        or through a subclass's ``_unscale_grads_`` with torch's arguments. No sync."""
        if not overrides_unscale(type(self)):
            grads = collect_grads(optimizer, allow_fp16=allow_fp16, backend=self._engine.backend)
            return self._check_grads(grads, check_only, optimizer)
        backend, scale = self._engine.backend, self._engine.state.scale
        one = backend.full(1.0, "float32", scale)
        inv_scale = one if check_only else one / scale  # == float32(1/float64(scale)): 53 >= 2*24+2 bits
        call = self._unscale_call = UnscaleCall(inv_scale, check_only)
        try:
            per_device = self._unscale_grads_(optimizer, inv_scale, backend.full(0.0, "float32", scale),
                                              allow_fp16)
        finally:
            del self._unscale_call
        flag = combined(per_device)
        return flag if call.ran else self._agree_own_flag(flag, optimizer)

    def _opt_step_through_hook(self, optimizer: Any, stage: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """step()'s ``self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)``, as torch's.

        An override that decides without the default leaves its flags, read lazily, as the step's."""
        optimizer_state = {"stage": stage, "found_inf_per_device": self._found_inf_per_device(optimizer)}
        before, self._last_skipped = self._last_skipped, _UNDECIDED
        try:
            retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        except BaseException:
            if self._last_skipped is _UNDECIDED:
                self._last_skipped = before
            raise
        if self._last_skipped is _UNDECIDED:
            flag = self._found[id(optimizer)] = combined(optimizer_state["found_inf_per_device"])
            self._last_skipped = flag
            if flag is not None:
                self._unread.append(flag)
        return retval

    def _unscale_grads_(
        self, optimizer: Any, inv_scale: Any, found_inf: Any, allow_fp16: bool
    ) -> dict[Any, Any]:
        """torch's hook: unscale ``optimizer``'s gradients (check only, for ``_check_inf_per_device``)
        and return their overflow flag as ``{device: flag}`` ({} without gradients); like torch's, the
        flag is a new array and ``found_inf`` is left as it is. Unscales by the scaler's own scale:
        ``inv_scale`` must be the one passed in."""
        call = self._unscale_call
        if call is None or inv_scale is not call.inv_scale:
            raise ValueError(
                f"{type(self).__name__}._unscale_grads_: polyamp's GradScaler._unscale_grads_ unscales by "
                "the scaler's own scale, so it takes only the inv_scale that unscale_() passed (and is "
                "called only from unscale_() or _check_inf_per_device()); got another "
                f"inv_scale={inv_scale!r}. Fix: pass the inv_scale your override received on to "
                "super()._unscale_grads_, or unscale the gradients in your override yourself and "
                "return {device: found_inf}."
            )
        call.ran = True
        grads = collect_grads(optimizer, allow_fp16=allow_fp16, backend=self._engine.backend)
        flag = self._check_grads(grads, call.check_only, optimizer)
        return {} if flag is None else {getattr(flag, "device", "cpu"): flag}
