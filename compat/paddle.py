"""``paddle.amp.GradScaler`` and ``AmpScaler`` (paddle 3.x, dygraph) over any polyamp backend.

Signatures, defaults, the INIT/UNSCALED/STEPPED state machine, exceptions, return values, the update
rule and the ``state_dict`` keys follow paddle 3.3's ``grad_scaler.py``; ``reducer=`` agrees each
step over the ranks in one collective. docs/coming-from-paddle.md has the key table and the
differences from paddle. Importing this module imports no framework.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import Any

from polyamp import _guard_values as guard_values
from polyamp import metrics, schedule
from polyamp._metering import check_meter
from polyamp.config import FIXED_ONE
from polyamp.engine import LossScaler, make_iteration
from polyamp.guard import StepGuard
from polyamp.overflow import OverflowReport, build_report, check_diagnose, explain_overflow
from polyamp.policy import HostState

from ._explain import paddle_named_grads, writes_zeros, zeroed_note
from ._paddle_copy import facade_state, restore, restore_facade
from ._paddle_state import (
    PaddleConfigError,
    PaddleStateDictError,
    build_config,
    check_ratio,
    from_torch_state_dict,
    load_paddle_state,
    make_config,
    plain,
    to_paddle_state,
    to_torch_state_dict,
)
from ._paddle_steps import OptimizerState, apply_optimizer, describe_change, named_by_param, param_grad_pairs
from ._stages import check_step, check_unscale
from ._torch_state import is_array, refuse_empty

__all__ = [
    "AmpScaler", "GradScaler", "OptimizerState", "PaddleConfigError", "PaddleStateDictError",
    "from_torch_state_dict", "to_torch_state_dict",
]


class AmpScaler:
    """Drop-in ``paddle.amp.AmpScaler``: ``scale`` and ``minimize``, on any backend and on CPU."""

    _enable = True
    _diagnose = False
    _guard_only = False  # enable=False with a guard: steps judged and skipped, the scale fixed at 1

    def __new__(cls, enable: bool = True, *args: Any, **kwargs: Any) -> AmpScaler:
        if not enable and kwargs.get("guard") is not None:  # guard-only: the scale fixed at 1
            scaler = object.__new__(cls)
            scaler._guard_only = True
            return scaler
        return object.__new__(cls if enable else disabled_type(cls))

    def __init__(
        self,
        enable: bool = True,
        init_loss_scaling: float = 2.0**15,
        incr_ratio: float = 2.0,
        decr_ratio: float = 0.5,
        incr_every_n_steps: int = 1000,
        decr_every_n_nan_or_inf: int = 1,
        use_dynamic_loss_scaling: bool = True,
        *,
        backend: str | None = None,
        min_scale: float | None = None,
        max_scale: float | None = None,
        reducer: Any = None,
        diagnose: bool = False,
        guard: StepGuard | None = None,
        meter: Any = None,
    ) -> None:
        self._diagnose = check_diagnose(diagnose)
        meter = check_meter(meter)  # also when disabled: a disabled scaler counts nothing
        config = FIXED_ONE if self._guard_only else make_config(
            init_loss_scaling, incr_ratio, decr_ratio, incr_every_n_steps, decr_every_n_nan_or_inf,
            use_dynamic_loss_scaling, min_scale=min_scale, max_scale=max_scale,
        )
        self._init_loss_scaling = init_loss_scaling if self._enable and not self._guard_only else 1.0
        enabled = self._enable  # a disabled scaler steps on every rank: nothing to agree
        self._iteration = make_iteration(
            config, backend if enabled else None, reducer=reducer if enabled else None,
            diagnose=self._diagnose and enabled, guard=guard if enabled else None,
            meter=meter if enabled else None)
        self._engine = LossScaler.over(self._iteration)
        self._stages: dict[int, OptimizerState] = {}
        self._decided: dict[int, tuple[bool, Any]] = {}  # this iteration's decisions, by id(optimizer)
        self._found_inf: Any = None  # the last unscale's device flag, whichever optimizer
        self._zeroing: set[int] = set()  # ids of the parameters this iteration's kernel may have zeroed
        self._cache_found_inf: bool | None = None  # the last step's decision
        self.skipped_steps = 0
        self.last_step_skipped: bool | None = None
        self.last_skip_reason: str | None = None  # None when applied; else why (see polyamp.StepGuard)

    # -- scaling and stepping ---------------------------------------------------------
    def scale(self, var: Any) -> Any:
        """``var * scale`` in ``var``'s dtype, on its device; the first array picks the backend."""
        if not is_array(var):
            raise TypeError(
                f"The type of 'var' in AmpScaler.scale() must be a Tensor or array (paddle, "
                f"numpy, torch, cupy), but received {type(var)}. Fix: scale the loss tensor."
            )
        backend = self._engine.bind(var)
        scaled = backend.scale_array(var, self._engine.state.scale)
        if self._engine.guard is not None and guard_values.one_value(var):  # the losses since update()
            self._iteration.take_loss(var, "scale()")
        return scaled

    def minimize(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless unscale_ ran), ``optimizer.minimize(...)`` unless inf/nan, update the scale.

        Optimizers without ``minimize`` get ``step()`` (``args`` are not passed). Returns what
        ``optimizer.minimize`` returned (paddle's ``(optimize_ops, params_grads)``), as it is;
        ``(None, None)`` when skipped. Reads one flag on the host.
        """
        if self._stage(optimizer) is OptimizerState.INIT:
            self._unscale(optimizer)
        ran, result = self._run(optimizer, lambda: apply_optimizer(optimizer, args, kwargs))
        self._update()
        return result if ran else (None, None)

    def _stage(self, optimizer: Any) -> OptimizerState:
        return self._stages.get(id(optimizer), OptimizerState.INIT)

    def _unscale(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s gradients by the scale in place; keep this call's flag (no sync)."""
        check_unscale(self._stage(optimizer))
        self._iteration.require_loss(None, f"{type(self).__name__} step/minimize",
                                     "scale the loss (one value) with scaler.scale(loss) first")
        pairs = param_grad_pairs(optimizer)
        grads: Any = [grad for _, grad in pairs]
        iteration, engine = self._iteration, self._engine
        metering, checks = iteration.metering, iteration.checks
        if metering.active and metering.due(checks.unscaled, iteration.steps, checks.metered):
            grads = named_by_param(pairs, grads)  # a sample step: its report names param.name
        # no arrays seen yet and none here: let nothing choose the backend
        self._found_inf = iteration.unscale(grads) if grads or engine.state is not None else None
        self._stages[id(optimizer)] = OptimizerState.UNSCALED
        if grads and writes_zeros(self._iteration.scaling.backend, self._diagnose):
            self._zeroing.update(id(param) for param, _ in pairs)

    def _run(self, optimizer: Any, call: Callable[[], Any]) -> tuple[bool, Any]:
        """``(ran, call())``, not calling it after an inf/nan (a paddle optimizer gets the flag)."""
        decided = self._decided.get(id(optimizer))  # a retry after the optimizer raised: decided once
        found, flag = decided if decided is not None else self._decide(optimizer)
        if callable(getattr(optimizer, "_set_auxiliary_var", None)):
            optimizer._set_auxiliary_var("found_inf", False if flag is None else flag)
            return True, call()  # paddle's optimizers take the flag and skip themselves
        return (False, None) if found else (True, call())

    def _decide(self, optimizer: Any) -> tuple[bool, Any]:
        """(skipped, the flag for a paddle optimizer): the step's one host read, counted once."""
        flag = local = self._found_inf  # a device flag, None (no gradients), or a copy's host bool
        iteration = self._iteration
        named = lambda: paddle_named_grads(optimizer)  # noqa: E731  # only for a report
        metered = iteration.agreement is not None and iteration.checks.metered is not None
        if iteration.guarding is not None or metered:  # the flag, the guard's values and a sample
            found, flag = self._guarded(named, local)  # step's counts: one collective, one read
        else:
            if iteration.agreement is not None:  # one collective; with no device flag, a host bool
                agreed = self._engine.agree_flag(flag)
                host = flag is None or isinstance(flag, bool)
                flag = iteration.scaling.read_flag(agreed) if host else agreed
            # the one host read, before the optimizer runs: ranks that differ raise (nothing applied),
            # and a report sees the gradients before paddle's kernel of a skipped step writes grad * 0
            found = iteration.decide(flag, named=named, local=local).skipped
            self.last_skip_reason = "overflow" if found else None
        self._decided[id(optimizer)] = found, flag
        self._cache_found_inf = self.last_step_skipped = found
        self.skipped_steps += found
        iteration.count(found)  # steps and the window of metrics()
        return found, flag

    def _guarded(self, named: Callable[[], Any], local: Any) -> tuple[bool, Any]:
        """The guard's (or a sample step's) decision: one collective, one read; (skipped, the flag)."""
        iteration = self._iteration
        if iteration.checks.found is None:  # no gradients on this rank (or a copy's host flag): it takes part
            iteration.record(iteration.scaling.flag_array(bool(local)))
        decision = iteration.decide(named=named, local=local)
        self.last_skip_reason = decision.reason
        return decision.skipped, (True if decision.skipped else decision.flag)

    def metrics(self, *, diagnose: bool = False) -> dict[str, float | int]:
        """``scale``, ``steps``, ``skipped_steps``, ``skipped_last_1000`` and, with ``diagnose=`` or
        ``meter=``, the last report's numbers, as plain numbers (:mod:`polyamp.metrics`). One host read."""
        iteration = self._iteration
        return metrics.measure(iteration, iteration.steps, self.skipped_steps, diagnose=diagnose)

    # -- overflow forensics -----------------------------------------------------------
    @property
    def last_overflow(self) -> OverflowReport | None:
        """With ``diagnose=True``, the report on the last skipped step's gradients; None after an
        applied step (and always with ``diagnose=False``)."""
        return self._engine.last_overflow

    @property
    def last_precision(self) -> Any:
        """With ``meter=``, the :class:`polyamp.PrecisionReport` of the last sample step (gradients
        named by ``param.name``), else None."""
        return self._iteration.metering.last

    def explain(self, obj: Any, *, names: Any = None, loss: Any = None) -> OverflowReport:
        """:func:`polyamp.explain_overflow` on a Layer's, an optimizer's (names from
        ``param.name``) or the given gradients, with this scaler's scale. Read-only."""
        scale = self._engine.get_scale() if self._enable else 1.0
        if names is not None:
            return explain_overflow(obj, names=names, loss=loss, scale=scale)
        report = build_report(paddle_named_grads(obj), loss=loss, scale=scale)
        return zeroed_note(report, obj, self._zeroing)

    def _update(self) -> None:
        """One step of paddle's rule with the last step's flag; reads the scale only to log it."""
        iteration = self._iteration
        try:  # the scale moved: the iteration ends even if a log handler raises
            if self.is_use_dynamic_loss_scaling():
                decision = iteration.concluded(bool(self._cache_found_inf))
                iteration.finish(decision, describe=partial(describe_change, config=self._engine.config))
            else:  # a fixed scale: only the checks end (and the guard's histories move on)
                iteration.finish(iteration.decided(), rule=False)
        finally:
            self._stages.clear()
            self._decided.clear()
            self._zeroing.clear()

    def step_scheduler(self, scheduler: Any, *args: Any, **kwargs: Any) -> bool:
        """Step ``scheduler`` only if the last optimizer step was applied; True if it stepped."""
        return schedule.step_if_applied(scheduler, self.last_step_skipped, *args, **kwargs)

    @property
    def engine(self) -> LossScaler:
        """The neutral :class:`polyamp.LossScaler` underneath."""
        return self._engine

    # -- getters and setters ----------------------------------------------------------
    def is_enable(self) -> bool:
        """Whether loss scaling is on."""
        return self._enable

    def is_use_dynamic_loss_scaling(self) -> bool:
        """Whether the scale moves (False: fixed, overflowing steps still skipped)."""
        return self._engine.config.dynamic

    def get_init_loss_scaling(self) -> float:
        """The initial scale (the last one set or loaded), not the current one."""
        return self._init_loss_scaling

    def set_init_loss_scaling(self, new_init_loss_scaling: float) -> None:
        """Set the initial scale and restart the current scale from it; counters are kept."""
        build_config(self._engine.config.replace, {"init_scale": "new_init_loss_scaling"},
                     init_scale=new_init_loss_scaling)
        if self._guard_only:  # its scale stays fixed at 1 (a disabled scaler ignores this too)
            return
        self._init_loss_scaling = new_init_loss_scaling
        self._engine.set_scale(float(plain(new_init_loss_scaling)))

    def get_incr_ratio(self) -> float:
        """The factor the scale grows by."""
        return self._engine.config.growth_factor

    def set_incr_ratio(self, new_incr_ratio: float) -> None:
        """Set the growth factor (> 1)."""
        check_ratio("new_incr_ratio", new_incr_ratio, above_one=True)
        self._reconfigure("new_incr_ratio", growth_factor=new_incr_ratio)

    def get_decr_ratio(self) -> float:
        """The factor the scale backs off by."""
        return self._engine.config.backoff_factor

    def set_decr_ratio(self, new_decr_ratio: float) -> None:
        """Set the backoff factor (in (0, 1))."""
        check_ratio("new_decr_ratio", new_decr_ratio, above_one=False)
        self._reconfigure("new_decr_ratio", backoff_factor=new_decr_ratio)

    def get_incr_every_n_steps(self) -> int:
        """How many finite steps in a row grow the scale."""
        return self._engine.config.growth_interval

    def set_incr_every_n_steps(self, new_incr_every_n_steps: int) -> None:
        """Set how many finite steps in a row grow the scale (an int >= 1)."""
        self._reconfigure("new_incr_every_n_steps", growth_interval=new_incr_every_n_steps)

    def get_decr_every_n_nan_or_inf(self) -> int:
        """How many overflowing steps (counted since the last finite one) back the scale off."""
        return self._engine.config.backoff_interval

    def set_decr_every_n_nan_or_inf(self, new_decr_every_n_nan_or_inf: int) -> None:
        """Set how many overflowing steps back the scale off (an int >= 1)."""
        self._reconfigure("new_decr_every_n_nan_or_inf", backoff_interval=new_decr_every_n_nan_or_inf)

    def _reconfigure(self, paddle_name: str, **change: Any) -> None:
        (field,) = change
        build_config(self._engine.reconfigure, {field: paddle_name}, **change)

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """paddle's eight keys (``scale`` a 1-element float32 array); a device sync."""
        return to_paddle_state(self._engine)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load paddle's (or torch's) GradScaler state dict; validated before anything changes."""
        refuse_empty(state_dict, "input")
        init = load_paddle_state(self._engine, state_dict)
        if self._guard_only:  # the counters and the guard's history load; the scale stays fixed at 1
            self._iteration.load(FIXED_ONE, HostState(1.0, 0, 0))
            return
        self._init_loss_scaling = init

    # -- copies -----------------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuilt through ``restore``, so disabled scalers (types made per class) copy too."""
        return (restore, (getattr(self, "_public_class", type(self)), self._enable, self.__getstate__()))

    __getstate__ = facade_state  # plain data: the engine as its backend name and state dict (a sync)
    __setstate__ = restore_facade

    def __repr__(self) -> str:
        return f"{type(self).__name__}(enable={self._enable}, engine={self._engine!r})"


class GradScaler(AmpScaler):
    """Drop-in ``paddle.amp.GradScaler``: adds ``step``, ``update`` and ``unscale_`` to AmpScaler."""

    def __init__(
        self,
        enable: bool = True,
        init_loss_scaling: float = 2.0**16,
        incr_ratio: float = 2.0,
        decr_ratio: float = 0.5,
        incr_every_n_steps: int = 2000,
        decr_every_n_nan_or_inf: int = 1,
        use_dynamic_loss_scaling: bool = True,
        *,
        backend: str | None = None,
        min_scale: float | None = None,
        max_scale: float | None = None,
        reducer: Any = None,
        diagnose: bool = False,
        guard: StepGuard | None = None,
        meter: Any = None,
    ) -> None:
        super().__init__(
            enable, init_loss_scaling, incr_ratio, decr_ratio, incr_every_n_steps,
            decr_every_n_nan_or_inf, use_dynamic_loss_scaling,
            backend=backend, min_scale=min_scale, max_scale=max_scale, reducer=reducer,
            diagnose=diagnose, guard=guard, meter=meter,
        )

    def step(self, optimizer: Any) -> None:
        """Unscale (unless unscale_ ran), then ``optimizer.step()`` unless inf/nan; one host read."""
        stage = self._stage(optimizer)
        check_step(stage)
        if stage is OptimizerState.INIT:
            self._unscale(optimizer)
        self._run(optimizer, optimizer.step)
        self._stages[id(optimizer)] = OptimizerState.STEPPED
        if not self.is_use_dynamic_loss_scaling():
            self._update()  # paddle's step ends the iteration when the scale is fixed

    def update(self) -> None:
        """Move the scale with the last step's flag (a no-op with use_dynamic_loss_scaling=False)."""
        if self.is_use_dynamic_loss_scaling():
            self._update()

    def unscale_(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s gradients by the scale in place (e.g. before clipping); no sync."""
        return self._unscale(optimizer)


class DisabledAmpScaler(AmpScaler):
    """What ``AmpScaler(enable=False)`` builds, as paddle's disabled scaler: scale() returns its input,
    minimize() just minimizes; no method asks "am I enabled?"."""

    _enable = False
    _public_class: type = AmpScaler

    def scale(self, var: Any) -> Any:
        """``var`` unchanged."""
        return var

    def minimize(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.minimize(*args, **kwargs)`` (``step()`` where there is none); never skipped."""
        return apply_optimizer(optimizer, args, kwargs)

    def _unscale(self, optimizer: Any) -> None:
        """Nothing to undo."""

    def is_use_dynamic_loss_scaling(self) -> bool:
        """Always False, as paddle's disabled scaler."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """Empty: a disabled scaler has no state (paddle's returns {} too)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Ignored, as paddle's disabled scaler does."""


class DisabledGradScaler(DisabledAmpScaler, GradScaler):
    """What ``GradScaler(enable=False)`` builds: step() steps, update() and unscale_() do nothing."""

    _public_class: type = GradScaler

    def step(self, optimizer: Any) -> None:
        """``optimizer.step()``; never skipped."""
        optimizer.step()

    def update(self) -> None:
        """Nothing to update."""

    def unscale_(self, optimizer: Any) -> None:
        """Nothing to undo."""


@cache
def disabled_type(cls: type) -> type:
    """The no-op type for ``cls(enable=False)``: DisabledAmpScaler or DisabledGradScaler, or for a
    user's subclass one made once, with the no-op methods first and still an instance of ``cls``."""
    if not getattr(cls, "_enable", True):
        return cls
    base = DisabledGradScaler if issubclass(cls, GradScaler) else DisabledAmpScaler
    if cls is base._public_class:
        return base
    return type(f"Disabled{cls.__name__}", (base, cls), {"__module__": cls.__module__, "_public_class": cls})
