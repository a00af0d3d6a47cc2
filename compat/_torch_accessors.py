"""The enabled GradScaler's getters, setters, checkpoints, pickling and skip reporting.

Split from ``polyamp.compat.torch`` to keep each module small: these methods read or replace
the state and never take part in an iteration's hot path (several of them synchronise).
"""

from __future__ import annotations

from typing import Any

from polyamp import metrics, schedule
from polyamp._errors import ConfigError
from polyamp.engine import LossScaler

from ._torch_state import check_interval, load_torch_state, refuse_empty, to_torch_state

# Attributes pickled through the engine's state dict rather than as they are.
_INTERNAL = frozenset({"_device", "_enabled", "_backend_name", "_engine", "_stages", "_found",
                       "_skipped_host", "_unread", "_last_skipped", "_skipped_here", "_param_names",
                       "_groups"})


class ScalerAccessors:
    """Mixin of :class:`polyamp.compat.torch.GradScaler`: everything outside the four verbs."""

    _engine: LossScaler
    _device: str
    _backend_name: str | None
    _stages: dict[int, Any]
    _unread: list[Any]
    _skipped_host: int
    _last_skipped: Any

    # -- reporting beyond torch -------------------------------------------------------
    def _resolve_unread(self) -> None:
        if not self._unread:
            return
        read = self._engine.backend.read_flag
        self._count_unread([not isinstance(f, int) and bool(read(f)) for f in self._unread])

    def _count_unread(self, skipped: list[bool]) -> None:
        """Count the fused optimizers' steps whose flags were just read, in the order they ran."""
        count = self._engine.iteration.count
        for one in skipped:
            count(one)
        self._skipped_host += sum(skipped)
        self._unread.clear()

    def metrics(self, *, diagnose: bool = False) -> dict[str, float | int]:
        """``scale``, ``steps``, ``skipped_steps``, ``skipped_last_1000`` (and with ``diagnose=True``
        the last overflow's top tensors) as plain numbers (:mod:`polyamp.metrics`). ONE host read:
        the scale, with the pending flags of fused optimizers stacked beside it."""
        metrics.check_diagnose_flag(diagnose)
        iteration = self._engine.iteration
        pending = [f for f in self._unread if not isinstance(f, int)]
        scale, read = metrics.read_scale(iteration, pending)
        flags = iter(read)
        self._count_unread([not isinstance(f, int) and next(flags) for f in self._unread])
        return metrics.scaler_metrics(scale, iteration.steps, self._skipped_host, iteration.window,
                                      iteration.last_overflow, diagnose=diagnose)

    @property
    def skipped_steps(self) -> int:
        """How many optimizer steps were skipped for overflow (reads pending device flags)."""
        self._resolve_unread()
        return self._skipped_host

    @property
    def last_step_skipped(self) -> bool | None:
        """Whether the last step() was skipped; None before the first step (may sync)."""
        last = self._last_skipped
        if last is None or isinstance(last, (bool, int)):
            return None if last is None else bool(last)
        return bool(self._engine.backend.read_flag(last))

    @property
    def last_skip_reason(self) -> str | None:
        """Why the last step() was skipped: None when applied (or before the first step), else
        ``"overflow"``, ``"grad_norm_limit"``, ``"grad_norm_spike"`` or ``"loss_spike"`` (may sync)."""
        if not self.last_step_skipped:
            return None
        return getattr(self, "_last_reason", None) or "overflow"

    def step_scheduler(self, scheduler: Any, *args: Any, **kwargs: Any) -> bool:
        """Step ``scheduler`` only if the last optimizer step was applied; True if it stepped.

        A skipped step leaves the schedule where it was, and torch's "lr_scheduler.step()
        before optimizer.step()" warning is not triggered by a skipped first step.
        """
        return schedule.step_if_applied(scheduler, self.last_step_skipped, *args, **kwargs)

    # -- getters and setters ----------------------------------------------------------
    def _get_scale_async(self) -> Any:
        state = self._engine.state
        return None if state is None else state.scale

    @property
    def _scale(self) -> Any:
        """torch's attribute: the scale tensor, None until the first scale()."""
        return self._get_scale_async()

    @property
    def _growth_tracker(self) -> Any:
        """torch's attribute: the growth tracker tensor, None until the first scale()."""
        state = self._engine.state
        return None if state is None else state.growth_tracker

    def get_scale(self) -> float:
        """The current scale as a Python float (a device sync)."""
        return self._engine.get_scale()

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after growth_interval clean steps."""
        return self._engine.config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor; validated (ValueError naming the value), unlike torch."""
        self._engine.reconfigure(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale is multiplied by after an overflow."""
        return self._engine.config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor; validated (ValueError naming the value), unlike torch."""
        self._engine.reconfigure(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """How many consecutive clean steps grow the scale."""
        return self._engine.config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval; validated (ValueError naming the value), unlike torch."""
        self._engine.reconfigure(growth_interval=check_interval("growth_interval", new_interval,
                                                                 ConfigError))

    def _get_growth_tracker(self) -> int:
        """torch's private getter: consecutive clean steps so far (a device sync)."""
        return self._engine.host_state().growth_tracker

    def is_enabled(self) -> bool:
        """True: a disabled scaler is a DisabledGradScaler."""
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
        refuse_empty(state_dict, "source")
        load_torch_state(self._engine, state_dict)
        self._groups = {}  # the loaded histories are keyed by the order of first step: it restarts

    def __getstate__(self) -> dict[str, Any]:
        if self._stages:
            raise AssertionError(
                "A GradScaler instance may only be pickled at the beginning "
                "of an iteration, or at the end after scaler.update()."
            )
        extra = {k: v for k, v in self.__dict__.items() if k not in _INTERNAL}
        return {"device": self._device, "backend": self._backend_name, "extra": extra,
                "engine": self._engine.state_dict(), "skipped": self.skipped_steps,
                "last_overflow": self._engine.last_overflow, "window": self._engine.iteration.window,
                "guard": self._engine.guard, "histories": self._engine.iteration.histories}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state.get("extra", {}))  # a subclass's own attributes
        self._device, self._backend_name = state["device"], state["backend"]
        self._enabled = True
        self._engine = LossScaler(backend=self._backend_name, diagnose=getattr(self, "_diagnose", False),
                                  guard=state.get("guard"))
        self._engine.load_state_dict(state["engine"])
        self._engine.iteration.histories = state.get("histories", {})
        last = state.get("last_overflow", self.__dict__.pop("_last_overflow", None))  # older copies: extra
        self._engine.iteration.last_overflow = last
        if "window" in state:  # copies made before metrics() existed start a fresh window
            self._engine.iteration.window = state["window"]
        self._stages, self._found, self._skipped_here, self._groups = {}, {}, [], {}  # groups: by id
        self._unread, self._skipped_host, self._last_skipped = [], state["skipped"], None

    def __repr__(self) -> str:
        return f"GradScaler(device={self._device!r}, engine={self._engine!r})"

