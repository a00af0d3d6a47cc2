"""``torch.amp.GradScaler``'s API and state machine over any polyamp backend.

Behaviour, messages and exception types follow torch 2.13 (user code catches them), with
the state in typed parts: the engine holds the rule and arrays, this module the per-optimizer
READY/UNSCALED/STEPPED stages. Extra keyword-only arguments: ``backend``,
``backoff_interval``, ``min_scale``, ``max_scale``. Importing it does not import torch.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Iterable
from enum import Enum
from typing import Any

from polyamp import schedule
from polyamp._errors import ConfigError
from polyamp.adapters import iter_params
from polyamp.config import LossScaleConfig
from polyamp.engine import LossScaler

from ._torch_state import check_new_scale, is_array, is_fp16, load_torch_state, to_torch_state

__all__ = ["GradScaler", "OptState"]

_NOT_SCALED = (
    "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
)


class OptState(Enum):
    """Where one optimizer is in the iteration, as in torch."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


class TorchConfigError(ConfigError, AssertionError):
    """A bad constructor value; an AssertionError as torch raises, and a polyamp ConfigError."""


def _cuda_missing() -> bool:
    """torch's test for 'device="cuda" cannot work here', done only if torch is already imported."""
    torch = sys.modules.get("torch")
    return torch is not None and not torch.cuda.is_available()


class GradScaler:
    """Drop-in ``torch.amp.GradScaler`` that also scales NumPy, CuPy and array-API arrays."""

    def __new__(cls, device: str = "cuda", *args: Any, **kwargs: Any) -> GradScaler:
        enabled = kwargs.get("enabled", args[4] if len(args) > 4 else True)
        if cls is GradScaler and enabled and device == "cuda" and kwargs.get("backend") in (
            None, "torch"
        ) and _cuda_missing():
            warnings.warn(
                "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                stacklevel=2,
            )
            enabled = False
        if cls is GradScaler and not enabled:
            cls = DisabledGradScaler
        return object.__new__(cls)

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        backend: str | None = None,
        backoff_interval: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
    ) -> None:
        if growth_factor <= 1.0:
            raise TorchConfigError(
                f"The growth factor must be > 1.0. Got growth_factor={growth_factor!r}."
            )
        if backoff_factor >= 1.0:
            raise TorchConfigError(
                f"The backoff factor must be < 1.0. Got backoff_factor={backoff_factor!r}."
            )
        try:
            config = LossScaleConfig(
                init_scale=float(init_scale), growth_factor=float(growth_factor),
                backoff_factor=float(backoff_factor), growth_interval=growth_interval,
                backoff_interval=backoff_interval, min_scale=min_scale, max_scale=max_scale,
            )
        except ConfigError as exc:
            raise TorchConfigError(str(exc)) from None
        self._device = device
        self._enabled = True
        self._backend_name = backend
        self._engine = LossScaler(config, backend)
        self._stages: dict[int, OptState] = {}
        self._flags: dict[int, Any] = {}
        self._skipped_host = 0
        self._unread: list[Any] = []
        self._last_skipped: Any = None

    # -- scaling ----------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor/array, or an iterable of them, by the current scale."""
        engine = self._engine
        if is_array(outputs):
            backend = engine.bind(outputs)
            return backend.scale_array(outputs, engine.state.scale)
        return self._scale_tree(outputs)

    def _scale_tree(self, val: Any) -> Any:
        if is_array(val):
            return self.scale(val)
        if isinstance(val, Iterable) and not isinstance(val, (str, bytes)):
            mapped = map(self._scale_tree, val)
            return type(val)(mapped) if isinstance(val, (list, tuple)) else mapped
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def _check_initialized(self, funcname: str) -> None:
        if self._engine.state is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + _NOT_SCALED)

    def _grads(self, optimizer: Any, allow_fp16: bool) -> list[Any]:
        grads = []
        for param in iter_params(optimizer):
            grad = param.grad
            if grad is None:
                continue
            if not allow_fp16 and is_fp16(grad):
                raise ValueError("Attempting to unscale FP16 gradients.")
            if getattr(grad, "is_sparse", False) and is_fp16(grad):
                param.grad = grad = grad.coalesce()
            grads.append(grad)
        return grads

    def unscale_(self, optimizer: Any) -> None:
        """Divide the optimizer's gradients by the scale in place (no device sync)."""
        self._check_initialized("unscale_")
        stage = self._stages.get(id(optimizer), OptState.READY)
        if stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if stage is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._flags[id(optimizer)] = self._engine.unscale_(self._grads(optimizer, False))
        self._stages[id(optimizer)] = OptState.UNSCALED

    def _check_inf(self, optimizer: Any) -> Any:
        """Record the overflow flag without unscaling (for optimizers that unscale themselves)."""
        engine = self._engine
        backend = engine.backend
        grads = self._grads(optimizer, True)
        found = backend.full(0.0, "float32", engine.state.scale)
        backend.unscale_and_check(grads, backend.full(1.0, "float32", found), found)
        engine.unscale_([])  # registers an (empty) check so update() sees this iteration
        engine._pending = engine._pending + found
        self._flags[id(optimizer)] = found
        return found

    # -- stepping ---------------------------------------------------------------------
    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then ``optimizer.step(*args, **kwargs)`` unless gradients overflowed."""
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_initialized("step")
        key = id(optimizer)
        stage = self._stages.get(key, OptState.READY)
        if stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, stage, args, kwargs)
        if stage is OptState.READY:
            self.unscale_(optimizer)
        skipped = self._engine.backend.read_flag(self._flags[key])
        retval = None if skipped else optimizer.step(*args, **kwargs)
        self._stages[key] = OptState.STEPPED
        self._last_skipped = skipped
        self._skipped_host += skipped
        return retval

    def _fused_step(self, optimizer: Any, stage: OptState, args: Any, kwargs: dict) -> Any:
        """torch's path for optimizers that take grad_scale/found_inf: no host sync here."""
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                FutureWarning,
                stacklevel=3,
            )
            kwargs.update({"grad_scaler": self})
            retval = optimizer.step(*args, **kwargs)
            self._stages[id(optimizer)] = OptState.STEPPED
            return retval
        found = self._flags[id(optimizer)] if stage is OptState.UNSCALED else self._check_inf(optimizer)
        scale = self._engine.state.scale
        optimizer.grad_scale = (
            getattr(optimizer, "grad_scale", None)
            if stage is OptState.UNSCALED
            else scale * getattr(optimizer, "grad_scale", 1)
        )
        optimizer.found_inf = found
        retval = optimizer.step(*args, **kwargs)
        self._stages[id(optimizer)] = OptState.STEPPED
        del optimizer.grad_scale
        del optimizer.found_inf
        self._last_skipped = found
        self._unread.append(found)
        if len(self._unread) > 1024:  # bound the memory; a rare sync
            self._resolve_unread()
        return retval

    def update(self, new_scale: float | Any = None) -> None:
        """Back off after an overflow, grow after growth_interval clean steps, or set new_scale."""
        self._check_initialized("update")
        engine = self._engine
        if new_scale is not None:
            if not isinstance(new_scale, (float, int)) or isinstance(new_scale, bool):
                check_new_scale(new_scale, self._device)
            engine.set_scale(new_scale)
        elif not engine.has_pending_check:
            raise AssertionError("No inf checks were recorded prior to update.")
        else:
            engine.update()
        self._stages.clear()
        self._flags.clear()

    # -- reporting beyond torch -------------------------------------------------------
    def _resolve_unread(self) -> None:
        read = self._engine.backend.read_flag
        self._skipped_host += sum(bool(read(f)) for f in self._unread)
        self._unread.clear()

    @property
    def skipped_steps(self) -> int:
        """How many optimizer steps were skipped for overflow (may read device flags)."""
        self._resolve_unread()
        return self._skipped_host

    @property
    def last_step_skipped(self) -> bool | None:
        """Whether the last step() was skipped; None before the first step."""
        last = self._last_skipped
        if last is None or isinstance(last, bool):
            return last
        return bool(self._engine.backend.read_flag(last))

    def step_scheduler(self, scheduler: Any, *args: Any, **kwargs: Any) -> bool:
        """Step ``scheduler`` only if the last optimizer step was applied; True if it stepped."""
        return schedule.step_if_applied(scheduler, self.last_step_skipped, *args, **kwargs)

    # -- getters and setters ----------------------------------------------------------
    def _get_scale_async(self) -> Any:
        state = self._engine.state
        return None if state is None else state.scale

    def get_scale(self) -> float:
        """The current scale as a Python float (a device sync)."""
        return self._engine.get_scale()

    def get_growth_factor(self) -> float:
        return self._engine.config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._engine.reconfigure(growth_factor=float(new_factor))

    def get_backoff_factor(self) -> float:
        return self._engine.config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._engine.reconfigure(backoff_factor=float(new_factor))

    def get_growth_interval(self) -> int:
        return self._engine.config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._engine.reconfigure(growth_interval=new_interval)

    def _get_growth_tracker(self) -> int:
        return self._engine.host_state().growth_tracker

    def is_enabled(self) -> bool:
        return True

    @property
    def engine(self) -> LossScaler:
        """The neutral :class:`polyamp.LossScaler` underneath."""
        return self._engine

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's five keys; polyamp's extra keys only where the config goes beyond torch."""
        return to_torch_state(self._engine)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's (or polyamp's) GradScaler state dict; validated before anything changes."""
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        load_torch_state(self._engine, state_dict)

    def __reduce__(self) -> Any:
        return (_restore, (type(self), self.__getstate__()))

    def __getstate__(self) -> dict[str, Any]:
        if self._stages or self._flags:
            raise AssertionError(
                "A GradScaler instance may only be pickled at the beginning "
                "of an iteration, or at the end after scaler.update()."
            )
        return {"device": self._device, "backend": self._backend_name,
                "engine": self._engine.state_dict(), "skipped": self.skipped_steps}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._device, self._backend_name = state["device"], state["backend"]
        self._enabled = True
        self._engine = LossScaler(backend=self._backend_name)
        self._engine.load_state_dict(state["engine"])
        self._stages, self._flags, self._unread = {}, {}, []
        self._skipped_host, self._last_skipped = state["skipped"], None


def _restore(cls: type, state: dict[str, Any]) -> GradScaler:
    obj = object.__new__(cls)
    obj.__setstate__(state)
    return obj


class DisabledGradScaler(GradScaler):
    """``GradScaler(enabled=False)``: every method a pass-through, as torch's disabled scaler."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, **extra: Any) -> None:
        self._device = device
        self._enabled = False
        self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
        self._growth_interval = growth_interval

    def scale(self, outputs: Any) -> Any:
        return outputs

    def unscale_(self, optimizer: Any) -> None:
        return None

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        return None

    def get_scale(self) -> float:
        return 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def _get_growth_tracker(self) -> int:
        return 0

    def is_enabled(self) -> bool:
        return False

    @property
    def skipped_steps(self) -> int:
        return 0

    @property
    def last_step_skipped(self) -> bool | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
