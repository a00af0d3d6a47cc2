"""``torch.amp.GradScaler``'s API and state machine over any polyamp backend: one class.

Behaviour, messages and exception types follow torch 2.13. The engine holds the rule and arrays; this
class holds each optimizer's READY/UNSCALED/STEPPED stage (:class:`OptimizerRecord`). torch's hooks
``_unscale_grads_`` and ``_maybe_opt_step`` are called only where a subclass overrides them
(docs/integrations.md). Importing it does not import torch.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from polyamp import _guard_values as guard_values
from polyamp import metrics, schedule
from polyamp._agreement import Agreement
from polyamp._inputs import scale_value
from polyamp.config import FIXED_ONE, short_repr
from polyamp.distributed import Reducer
from polyamp.engine import LossScaler, make_iteration
from polyamp.guard import StepGuard
from polyamp.overflow import OverflowReport, build_report, check_diagnose, explain_overflow
from polyamp.policy import HostState

from ._explain import named_for_meter, torch_named_grads
from ._stages import check_step, check_unscale
from ._torch_disabled import cuda_missing
from ._torch_forward import ForwardRecord, ForwardWatch, watch_forward
from ._torch_grads import collect_grads
from ._torch_install import Installation, Installer
from ._torch_sharded import PICKLE_REFUSED, Places, build_reducer, mesh_inside
from ._torch_state import (
    TorchConfigError,
    check_new_scale,
    is_array,
    load_torch_state,
    refuse_empty,
    to_torch_state,
    torch_config,
)

__all__ = ["ForwardRecord", "ForwardWatch", "GradScaler", "Installation", "OptState", "OptimizerRecord",
           "ShardedGradScaler", "TorchConfigError", "install", "uninstall", "watch_forward"]


class OptState(Enum):
    """Where one optimizer is in the iteration, as in torch."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


READY, UNSCALED, STEPPED = OptState.READY, OptState.UNSCALED, OptState.STEPPED


@dataclass
class OptimizerRecord:
    """One optimizer's part of an iteration (torch keeps it as a dict per optimizer)."""

    optimizer: Any
    stage: OptState = READY
    found: Any = None  # its device flag; None without gradients
    values: Any = None  # with a guard: its values (agreed over the ranks when sharded)
    skipped: bool = False  # its step was skipped (read on the host)
    decision: Any = None  # the iteration's Decision on it (a retry after optimizer.step raised reuses it)


@dataclass
class UnscaleCall:
    """One ``_unscale_grads_`` call in flight: what the default must honour, and whether it ran."""

    inv_scale: Any
    check_only: bool
    ran: bool = False


_UNDECIDED = object()  # _last_skipped while _maybe_opt_step runs: did the default decide?
_GIVE_LOSS = "scale the loss (a tensor holding one value) with scaler.scale(loss) before backward()"


def combined(per_device: dict[Any, Any]) -> Any:
    """torch's ``found_inf_per_device`` summed into one flag; None when empty (no gradients)."""
    flags = list(per_device.values())
    return sum(flags[1:], flags[0]) if flags else None


@functools.lru_cache(maxsize=64)
def _takes_grad_scaler(step_fn: Callable[..., Any]) -> bool:
    """Whether an optimizer's step accepts ``grad_scaler=`` (torch's deprecated protocol)."""
    return "grad_scaler" in inspect.signature(step_fn).parameters


class GradScaler:
    """Drop-in ``torch.amp.GradScaler`` that also scales NumPy, CuPy and array-API arrays.

    Beyond torch: ``skipped_steps``, ``last_step_skipped``, ``step_scheduler(scheduler)``, and
    overflow forensics: ``explain(obj)``, and with ``diagnose=True`` ``last_overflow``, the report
    on a skipped step's gradients (named after ``name_parameters(module)``). Subclasses may
    override torch's ``_unscale_grads_`` and ``_maybe_opt_step`` (see the Trainers page).
    """

    _param_names: dict[int, str] = {}  # id(parameter) -> name; replaced, never mutated
    _allow_fp16 = False  # torch's GradScaler refuses to unscale FP16 gradients
    _flags_are_sums = False  # an optimizer's flag is this rank's (sharded: agreed over the ranks)
    _unscale_call: UnscaleCall | None = None  # set only while a hooked unscale is in flight
    _guard_only = False  # disabled (or "cuda" without CUDA) with a guard: the scale fixed at 1
    # attributes pickled through the engine's state dict (or not at all) rather than as they are
    _internal = frozenset({"_device", "_enabled", "_backend_name", "_engine", "_iteration", "_records",
                           "_skipped_host", "_unread", "_last_skipped", "_param_names", "_groups"})

    def __new__(cls, device: str = "cuda", *args: Any, **kwargs: Any) -> GradScaler:
        """An enabled scaler, or (enabled=False, or "cuda" without CUDA) the disabled type."""
        enabled = kwargs.get("enabled", args[4] if len(args) > 4 else True)
        if issubclass(cls, DisabledGradScaler):
            return object.__new__(cls)
        enabled = enabled and not cuda_missing(device, kwargs.get("backend"))
        if not enabled and kwargs.get("guard") is not None:  # guard-only: the scale fixed at 1
            scaler = object.__new__(cls)
            scaler._guard_only = True
            return scaler
        return object.__new__(cls if enabled else disabled_class(cls))

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
        diagnose: bool = False,
        guard: StepGuard | None = None,
        meter: Any = None,
    ) -> None:
        self._diagnose = check_diagnose(diagnose)
        config = FIXED_ONE if self._guard_only else torch_config(
            init_scale, growth_factor, backoff_factor, growth_interval, backoff_interval, min_scale,
            max_scale)
        self._device = device
        self._enabled = True
        self._backend_name = backend
        self._iteration = make_iteration(config, backend, diagnose=self._diagnose, guard=guard, meter=meter)
        self._engine = LossScaler.over(self._iteration)
        self._records: dict[int, OptimizerRecord] = {}  # this iteration's, by id(optimizer)
        self._groups: dict[int, int] = {}  # id(optimizer) -> its guard group, kept across iterations
        self._skipped_host = 0
        self._unread: list[Any] = []  # fused optimizers' flags, read lazily
        self._last_skipped: Any = None
        self._last_reason: str | None = None

    def __reduce__(self) -> Any:
        return (_restore, (type(self), self.__getstate__()))

    def _record(self, optimizer: Any) -> OptimizerRecord:
        """``optimizer``'s record of this iteration (READY when new)."""
        record = self._records.get(id(optimizer))
        if record is None:
            record = self._records[id(optimizer)] = OptimizerRecord(optimizer)
        return record

    # -- scaling ----------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor/array, or an iterable of them, by the current scale (no sync)."""
        if is_array(outputs):
            scaling = self._iteration.scaling
            scaled = scaling.bind(outputs).scale_array(outputs, scaling.state.scale)
            if self._iteration.guarding is not None and guard_values.one_value(outputs):  # since update()
                self._iteration.take_loss(outputs, "scale()")
            return scaled
        return self._scale_tree(outputs)

    def _scale_tree(self, val: Any) -> Any:
        """torch's apply_scale: lists/tuples keep their type, other iterables become a map."""
        if is_array(val):
            return self.scale(val)
        if isinstance(val, Iterable):
            mapped = map(self._scale_tree, val)
            return type(val)(mapped) if isinstance(val, (list, tuple)) else mapped
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    # -- unscaling --------------------------------------------------------------------
    def unscale_(self, optimizer: Any) -> None:
        """Divide the optimizer's gradients by the scale in place and record overflow (no sync)."""
        if self._iteration.scaling.state is None:  # raises (a call only then)
            self._check_scale_growth_tracker("unscale_")
        record = self._record(optimizer)
        if record.stage is not OptState.READY:
            check_unscale(record.stage)
        record.found = self._unscale_optimizer(optimizer, check_only=False, allow_fp16=self._allow_fp16)
        record.stage = UNSCALED

    def _unscale_optimizer(self, optimizer: Any, check_only: bool, allow_fp16: bool) -> Any:
        """One optimizer's device flag (None without gradients): unscaled (or checked) directly,
        or through a subclass's ``_unscale_grads_`` with torch's arguments. No sync."""
        scaling = self._iteration.scaling
        if type(self)._unscale_grads_ is GradScaler._unscale_grads_:
            grads = collect_grads(optimizer, allow_fp16=allow_fp16, backend=scaling.backend)
            return self._check_grads(grads, check_only, optimizer)
        backend, scale = scaling.backend, scaling.state.scale
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

    def _check_grads(self, grads: list[Any], check_only: bool, optimizer: Any = None) -> Any:
        """One optimizer's device flag (None without gradients), ``grads`` unscaled unless ``check_only``."""
        if not grads:
            return None
        iteration = self._iteration
        metering, checks = iteration.metering, iteration.checks
        if metering.active and metering.due(checks.unscaled, iteration.steps, checks.metered):
            grads = named_for_meter(grads, optimizer, self._param_names)  # a sample step: named
        if iteration.guarding is None:
            return iteration.unscale(grads, check_only=check_only, owned=True)  # checked by collect_grads
        iteration.require_loss(None, "GradScaler.step()", _GIVE_LOSS)
        found = iteration.unscale(grads, check_only=check_only, owned=True)
        agreed = iteration.agree_group(found, iteration.squares(grads), self._group_of(optimizer))
        self._record(optimizer).values = agreed.extra  # this optimizer's values, judged at its step
        return found

    def _agree_own_flag(self, flag: Any, optimizer: Any) -> Any:
        """A flag an ``_unscale_grads_`` override computed itself: as it is (sharded: agreed)."""
        return flag

    def _group_of(self, optimizer: Any) -> int:
        """The optimizer's guard-history key: its place in first-step order (since building or loading)."""
        return self._groups.setdefault(id(optimizer), len(self._groups))

    def _check_inf_per_device(self, optimizer: Any) -> dict[Any, Any]:
        """Record overflow without unscaling, for optimizers that unscale themselves (no sync)."""
        self._check_scale_growth_tracker("_check_inf_per_device")
        found = self._unscale_optimizer(optimizer, check_only=True, allow_fp16=True)
        self._record(optimizer).found = found
        return self._found_inf_per_device(optimizer)

    def _found_inf_per_device(self, optimizer: Any) -> dict[Any, Any]:
        """torch's view of one optimizer's flags: ``{device: found_inf}`` (empty when none)."""
        record = self._records.get(id(optimizer))
        found = None if record is None else record.found
        return {} if found is None else {getattr(found, "device", "cpu"): found}

    def _unscale_grads_(self, optimizer: Any, inv_scale: Any, found_inf: Any,
                        allow_fp16: bool) -> dict[Any, Any]:
        """torch's hook: unscale (or check) ``optimizer``'s gradients by the scaler's own scale (the
        ``inv_scale`` passed in); their new flag as ``{device: flag}``, ``found_inf`` left as it is."""
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

    # -- stepping ---------------------------------------------------------------------
    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then ``optimizer.step(*args, **kwargs)`` unless gradients overflowed.

        Reads the overflow flag on the host (the one sync), except for optimizers that take
        ``grad_scale``/``found_inf`` themselves. Returns what ``optimizer.step`` returned."""
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if self._iteration.scaling.state is None:  # raises (a call only then)
            self._check_scale_growth_tracker("step")
        record = self._record(optimizer)
        if record.stage is OptState.STEPPED:
            check_step(record.stage)
        if getattr(optimizer, "_step_supports_amp_scaling", False) and self._iteration.guarding is None:
            return self._self_scaling_step(optimizer, record, args, kwargs)  # with a guard: decided here
        if record.stage is READY:
            self.unscale_(optimizer)
        if record.found is None:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if type(self)._maybe_opt_step is not GradScaler._maybe_opt_step:  # called as torch calls it
            retval = self._opt_step_through_hook(optimizer, record, args, kwargs)
        else:  # polyamp's own: the same decision without building torch's optimizer_state
            retval = self._decide_and_step(record, args, kwargs)
        record.stage = STEPPED
        return retval

    def _maybe_opt_step(self, optimizer: Any, optimizer_state: dict[str, Any], *args: Any,
                        **kwargs: Any) -> Any:
        """torch's hook: ``optimizer.step(*args, **kwargs)`` unless ``optimizer_state``'s flags say
        overflow (the one host read; a report only when skipped). Those flags are what update() uses."""
        record = self._record(optimizer)
        record.found = combined(optimizer_state["found_inf_per_device"])
        return self._decide_and_step(record, args, kwargs)

    def _opt_step_through_hook(self, optimizer: Any, record: OptimizerRecord, args: Any,
                               kwargs: dict[str, Any]) -> Any:
        """torch's ``_maybe_opt_step`` call; an override that decides without the default leaves its
        flags, read lazily, as the step's."""
        per_device = self._found_inf_per_device(optimizer)
        optimizer_state = {"stage": record.stage, "found_inf_per_device": per_device}
        before, self._last_skipped = self._last_skipped, _UNDECIDED
        try:
            retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        except BaseException:
            if self._last_skipped is _UNDECIDED:
                self._last_skipped = before
            raise
        if self._last_skipped is _UNDECIDED:
            flag = record.found = combined(optimizer_state["found_inf_per_device"])
            self._last_skipped = flag
            if flag is not None:
                self._unread.append(flag)
        return retval

    def _decide_and_step(self, record: OptimizerRecord, args: Any, kwargs: dict[str, Any]) -> Any:
        """The skip decision on the record's flag (the one host read; a report only when skipped),
        then ``optimizer.step(*args, **kwargs)`` unless it says skip."""
        optimizer, iteration = record.optimizer, self._iteration
        earlier = [r.optimizer for r in self._records.values() if r.skipped] if len(self._records) > 1 else []
        names = self._param_names  # the skipped optimizers' named gradients, for one report
        named = lambda: [p for o in (*earlier, optimizer) for p in torch_named_grads(o, names)]  # noqa: E731
        decision = record.decision
        if decision is None:  # else a retry after optimizer.step raised: decided (and counted) once
            group = 0 if iteration.guarding is None else self._group_of(optimizer)
            decision = record.decision = iteration.decide(record.found, values=record.values, group=group,
                                                          named=named, keep_report=bool(earlier))
            record.skipped = decision.skipped
            self._skipped_host += decision.skipped
            iteration.count(decision.skipped)  # steps and the window of metrics()
        skipped = decision.skipped
        self._last_reason, self._last_skipped = decision.reason, skipped
        return None if skipped else optimizer.step(*args, **kwargs)

    def _confirm_aligned(self, found: Any) -> None:
        """Before a fused optimizer's step: nothing here (ShardedGradScaler checks the ranks)."""

    def _self_scaling_step(self, optimizer: Any, record: OptimizerRecord, args: Any, kwargs: dict) -> Any:
        """torch's path for optimizers that take grad_scale/found_inf: no host sync here."""
        if _takes_grad_scaler(getattr(optimizer.step, "__func__", optimizer.step)):
            warnings.warn(  # torch's
                "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. "
                "In the near future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the "
                "passed optimizer and let the optimizer use them directly.", FutureWarning, stacklevel=3)
            kwargs.update({"grad_scaler": self})
            retval = optimizer.step(*args, **kwargs)
            record.stage = STEPPED
            return retval
        stage = record.stage
        if stage is READY:
            self._check_inf_per_device(optimizer)
        found = record.found
        if found is None:
            found = 0  # torch passes sum([]) == 0 when there are no grads
        elif self._flags_are_sums:
            found = found.clip(max=1)  # fused optimizers skip only when found_inf == 1 exactly
        optimizer.grad_scale = (
            getattr(optimizer, "grad_scale", None)
            if stage is UNSCALED
            else self._engine.state.scale * getattr(optimizer, "grad_scale", 1)
        )
        self._confirm_aligned(found)
        self._last_reason = None  # the optimizer decides on the device: only an overflow can skip it
        optimizer.found_inf = found
        retval = optimizer.step(*args, **kwargs)
        record.stage = STEPPED
        del optimizer.grad_scale, optimizer.found_inf
        self._last_skipped = found
        self._unread.append(found)
        if len(self._unread) > 1024:  # bounds the memory held; a rare batch of syncs
            self._resolve_unread()
        return retval

    def update(self, new_scale: float | Any = None) -> None:
        """Back off after an overflow, grow after growth_interval clean steps, or set new_scale (no sync)."""
        if self._iteration.scaling.state is None:  # raises (a call only then)
            self._check_scale_growth_tracker("update")
        iteration = self._iteration
        if new_scale is not None:  # refused before anything ends
            if not isinstance(new_scale, float):
                check_new_scale(new_scale, self._device)
            new_scale = scale_value(new_scale)
        try:
            if new_scale is not None:  # torch's update(new_scale) ends the iteration, across ranks too
                fixed = self._guard_only  # a guard-only scaler's scale stays 1, as a disabled one ignores it
                iteration.finish(iteration.decided(), rule=False, new_scale=None if fixed else new_scale)
                return
            found, skipped = None, False
            for record in self._records.values():
                skipped = skipped or record.skipped  # as step() read it
                if record.found is not None:
                    found = record.found if found is None else found + record.found
            if found is None:
                raise AssertionError("No inf checks were recorded prior to update.")
            iteration.finish(iteration.concluded(found, skipped=skipped))
        finally:
            self._records = {}

    # -- reporting beyond torch -------------------------------------------------------
    def _resolve_unread(self) -> None:
        if not self._unread:
            return
        read = self._engine.backend.read_flag
        self._count_unread([not isinstance(f, int) and bool(read(f)) for f in self._unread])

    def _count_unread(self, skipped: list[bool]) -> None:
        """Count the fused optimizers' steps whose flags were just read, in the order they ran."""
        for one in skipped:
            self._iteration.count(one)
        self._skipped_host += sum(skipped)
        self._unread.clear()

    def metrics(self, *, diagnose: bool = False) -> dict[str, float | int]:
        """``scale``, ``steps``, ``skipped_steps``, ``skipped_last_1000`` (with ``diagnose=True`` also the
        last overflow's top tensors) as plain numbers (:mod:`polyamp.metrics`), in ONE host read."""
        metrics.check_diagnose_flag(diagnose)
        iteration = self._iteration
        pending = [f for f in self._unread if not isinstance(f, int)]
        scale, read = metrics.read_scale(iteration, pending)
        flags = iter(read)
        self._count_unread([not isinstance(f, int) and next(flags) for f in self._unread])
        return metrics.scaler_metrics(scale, iteration.steps, self._skipped_host, iteration.window,
                                      iteration.last_overflow, diagnose=diagnose,
                                      precision=iteration.metering.last)

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
        return self._last_reason or "overflow"

    def step_scheduler(self, scheduler: Any, *args: Any, **kwargs: Any) -> bool:
        """Step ``scheduler`` only if the last optimizer step was applied; True if it stepped. A skipped step
        leaves the schedule as it was (and no "lr_scheduler.step() before optimizer.step()" warning)."""
        return schedule.step_if_applied(scheduler, self.last_step_skipped, *args, **kwargs)

    @property
    def last_precision(self) -> Any:
        """The :class:`polyamp.PrecisionReport` of the last sample step (``meter=``), else None."""
        return self._iteration.metering.last

    @property
    def last_overflow(self) -> OverflowReport | None:
        """With ``diagnose=True``, the report on the last skipped step's gradients; None after an
        applied step (and always with ``diagnose=False``, or for optimizers that skip themselves)."""
        return self._engine.last_overflow

    def name_parameters(self, module: Any) -> None:
        """Name an optimizer's gradients in reports after ``module.named_parameters()``."""
        named = getattr(module, "named_parameters", None)
        if not callable(named):
            raise TypeError(
                f"name_parameters(module=...) takes a module with named_parameters() (an nn.Module), got "
                f"{' '.join(short_repr(module).split())} ({type(module).__name__}). Fix: pass the model "
                "itself, e.g. scaler.name_parameters(model); a list of parameters carries no names"
            )
        self._param_names = {id(p): name for name, p in named()}

    def explain(self, obj: Any, *, names: Any = None, loss: Any = None) -> OverflowReport:
        """:func:`polyamp.explain_overflow` on an ``nn.Module``'s, an optimizer's or the given
        gradients, with this scaler's scale (one read). Read-only, at any point of the iteration."""
        if names is not None:
            return explain_overflow(obj, names=names, loss=loss, scale=self.get_scale())
        named = torch_named_grads(obj, self._param_names)
        return build_report(named, loss=loss, scale=self.get_scale())

    # -- torch's private members that trainers call (Lightning, accelerate, timm) ------------
    def _lazy_init_scale_growth_tracker(self, dev: Any) -> None:
        """Create the scale and growth tracker (initial or loaded values) on ``dev`` now; as torch, an
        AssertionError when they exist already (accelerate's FSDP2 ``load_state`` calls it)."""
        engine = self._engine
        if engine.state is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        backend = engine.backend
        if backend is None or backend.name == "torch":
            import torch

            engine.bind(torch.empty((), device=dev))
        else:  # a NumPy/CuPy/... scaler: its state lives with its own arrays
            engine.bind(backend.full(0, "float32", None))

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[Any, Any]:
        """torch's check that the state exists: ``(scale, growth_tracker)`` or AssertionError."""
        state = self._engine.state
        if state is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  This may indicate your script "
                                 "did not use scaler.scale(loss or outputs) earlier in the iteration.")
        return state.scale, state.growth_tracker

    @property
    def _init_scale(self) -> float:
        """The scale the state is created with: init_scale, or the value last loaded (host number)."""
        engine = self._engine
        return engine.host_state().scale if engine.state is None else engine.config.init_scale

    @property
    def _init_growth_tracker(self) -> int:
        """The growth tracker the state is created with: 0, or the value last loaded."""
        return self._engine.host_state().growth_tracker if self._engine.state is None else 0

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

    def _get_growth_tracker(self) -> int:
        """torch's private getter: consecutive clean steps so far (a device sync)."""
        return self._engine.host_state().growth_tracker

    # -- getters and setters ----------------------------------------------------------
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
        self._engine.reconfigure(growth_interval=new_interval)

    def is_enabled(self) -> bool:
        """False for a disabled scaler; True for a guard-only one, which takes part in every step (code
        that asks before calling ``step`` must not bypass it)."""
        return self._enabled

    @property
    def engine(self) -> LossScaler:
        """The neutral :class:`polyamp.LossScaler` underneath."""
        return self._engine

    # -- checkpoints and copies ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's five keys; polyamp's extra keys only where the config goes beyond torch."""
        return to_torch_state(self._engine, self._iteration.histories, self._iteration.metering.active)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's (or polyamp's) GradScaler state dict; validated before anything changes."""
        refuse_empty(state_dict, "source")
        histories = load_torch_state(self._engine, state_dict)
        if histories is not None:
            self._iteration.histories = histories
        if self._guard_only:  # the counters and the guard's histories load; the scale stays fixed at 1
            self._iteration.load(FIXED_ONE, HostState(1.0, 0, 0))
        self._groups = {}  # the loaded histories are keyed by the order of first step: it restarts

    def __getstate__(self) -> dict[str, Any]:
        if self._records:
            raise AssertionError(
                "A GradScaler instance may only be pickled at the beginning "
                "of an iteration, or at the end after scaler.update()."
            )
        extra = {k: v for k, v in self.__dict__.items() if k not in self._internal}
        iteration = self._iteration
        return {"device": self._device, "backend": self._backend_name, "extra": extra,
                "engine": self._engine.state_dict(), "skipped": self.skipped_steps,
                "guard": self._engine.guard, "last_overflow": iteration.last_overflow,
                "window": iteration.window, "histories": iteration.histories,
                "meter": iteration.metering.meter, "precision": iteration.metering.last}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state["extra"])  # a subclass's own attributes
        self._device, self._backend_name = state["device"], state["backend"]
        self._enabled = True
        iteration = self._iteration = make_iteration(None, self._backend_name, diagnose=self._diagnose,
                                                     guard=state["guard"], meter=state.get("meter"))
        iteration.metering.last = state.get("precision")
        self._engine = LossScaler.over(iteration)
        self._engine.load_state_dict(state["engine"])
        iteration.histories, iteration.last_overflow = state["histories"], state["last_overflow"]
        iteration.window = state["window"]
        self._records, self._groups = {}, {}  # groups: by id, which a copy does not keep
        self._unread, self._skipped_host, self._last_skipped = [], state["skipped"], None

    def __repr__(self) -> str:
        return f"GradScaler(device={self._device!r}, engine={self._engine!r})"


class ShardedGradScaler(GradScaler):
    """Drop-in ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` (torch's signature).

    Each optimizer's flag is agreed with one all-reduce over ``process_group`` (None: the default
    group; or anything :func:`polyamp.distributed.reducer` accepts), which also finds misaligned
    ranks (docs/distributed.md). FSDP2's DTensor gradients are unscaled as their local shards where
    the group spans their mesh (DTensor's own unscale would all-reduce the flag once more).
    """

    _allow_fp16 = True  # FSDP's mixed precision hands FP16 gradients to the scaler
    _flags_are_sums = True  # the flags are agreed over the ranks (0 or 1: some rank overflowed)
    _internal = GradScaler._internal | {"_group", "_meshes", "_places"}

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = None,
        *,
        backend: str | None = None,
        backoff_interval: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        diagnose: bool = False,
        guard: Any = None,
        meter: Any = None,
    ) -> None:
        super().__init__(  # GradScaler's order: growth_factor first
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled,
            backend=backend, backoff_interval=backoff_interval, min_scale=min_scale,
            max_scale=max_scale, diagnose=diagnose, guard=guard, meter=meter,
        )
        self.process_group = process_group

    @property
    def process_group(self) -> Any:
        """The group as given (None: torch.distributed's default group, resolved at first use)."""
        return self._group

    @process_group.setter
    def process_group(self, group: Any) -> None:
        """An explicit group is checked now; the next step checks the config across it again."""
        self._iteration.agreement = None if group is None else Agreement(build_reducer(group))
        self._group = group
        self._meshes: dict[Any, bool] = {}  # DeviceMesh -> do the group's ranks cover it
        self._places = Places()  # whose flag each optimizer's agreement is: restarts with the group

    @property
    def reducer(self) -> Reducer:
        """The polyamp reducer that agrees the flags (``reducer.collectives`` counts them)."""
        return self._agreed().reducer

    def _agreed(self) -> Agreement:
        """The agreement over the reducer (the default group is resolved at first use)."""
        iteration = self._iteration
        if iteration.agreement is None:
            iteration.agreement = Agreement(build_reducer(self._group))
        return iteration.agreement

    def _check_grads(self, grads: list[Any], check_only: bool, optimizer: Any = None) -> Any:
        """Unscale (or check) ``grads``; the flag agreed over the group (1: some rank overflowed). Every
        rank issues the collective, also one with no gradients; misaligned ranks raise RankMismatchError."""
        agreement, iteration = self._agreed(), self._iteration  # resolved before anything changes
        grads = self._local_shards(grads, agreement.reducer)
        if iteration.guarding is not None:
            iteration.require_loss(None, "ShardedGradScaler.step()", _GIVE_LOSS)
        found = iteration.unscale(grads, check_only=check_only, owned=True)  # 0 without gradients
        whose = self._places.identity(optimizer, agreement.reducer)
        if iteration.guarding is None and iteration.checks.metered is None:
            return iteration.agree_flag(found, whose=whose)
        # the guard's values (the loss, these shards' squares) and a sample step's counts (all of this
        # iteration's so far: the last optimizer's collective carries the step's totals) ride in it
        agreed = iteration.agree_group(found, iteration.squares(grads), self._group_of(optimizer),
                                       whose=whose)
        self._record(optimizer).values = agreed.extra
        return agreed.found_inf

    def _agree_own_flag(self, flag: Any, optimizer: Any) -> Any:
        """A flag an ``_unscale_grads_`` override computed itself, agreed over the group (one collective)."""
        whose = self._places.identity(optimizer, self._agreed().reducer)
        return self._iteration.agree_flag(flag, whose=whose)

    def _confirm_aligned(self, found: Any) -> None:
        """Before a fused optimizer's step: read an unverified agreement's flag (one sync), so that
        misaligned ranks raise here."""
        agreement = self._iteration.agreement
        if agreement is not None and agreement.unverified and self._iteration.scaling.read_flag(found):
            self._iteration.verify()

    def _local_shards(self, grads: list[Any], red: Reducer) -> list[Any]:
        """DTensor gradients as their local shards where ``red``'s group covers their mesh (elsewhere
        DTensor's unscale agrees over its mesh, as in torch)."""
        dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        if dtensor is None or not any(issubclass(kind, dtensor) for kind in set(map(type, grads))):
            return grads
        meshes = self._meshes
        for mesh in {g.device_mesh for g in grads if isinstance(g, dtensor)} - meshes.keys():
            meshes[mesh] = mesh_inside(mesh, red)
        return [g.to_local() if isinstance(g, dtensor) and meshes[g.device_mesh] else g for g in grads]

    def __getstate__(self) -> dict[str, Any]:
        group = self._group
        if group is not None and not isinstance(group, str):
            raise TypeError(PICKLE_REFUSED.format(group=short_repr(group)))
        return {**super().__getstate__(), "process_group": group}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.process_group = state["process_group"]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """GradScaler's load; the optimizers' places restart (every rank loads alike)."""
        super().load_state_dict(state_dict)
        self._places = Places()

    def __repr__(self) -> str:
        return (f"ShardedGradScaler(device={self._device!r}, process_group={short_repr(self._group)}, "
                f"engine={self._engine!r})")


class DisabledGradScaler(GradScaler):
    """What ``GradScaler(enabled=False)`` (or device="cuda" without CUDA) builds: torch's no-op scaler,
    nothing validated, except that the getters return the values given instead of raising AttributeError."""

    _public_class: type = GradScaler
    # never steps: GradScaler's skipped_steps reads 0, last_step_skipped None (a scheduler always steps)
    _skipped_host, _unread, _last_skipped = 0, (), None

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, **extra: Any) -> None:
        self._device = device
        self._enabled = False
        self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
        self._growth_interval = growth_interval

    def __reduce__(self) -> Any:
        return (_restore, (self._public_class, {"disabled": dict(self.__dict__)}))

    def scale(self, outputs: Any) -> Any:
        """``outputs`` unchanged."""
        return outputs

    def unscale_(self, optimizer: Any) -> None:
        """Nothing to undo."""

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)``, closures included, as torch's disabled scaler."""
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        """Nothing to update."""

    def _lazy_init_scale_growth_tracker(self, dev: Any) -> None:
        """Nothing to create."""

    def get_scale(self) -> float:
        """1.0, as torch's disabled scaler."""
        return 1.0

    def get_growth_factor(self) -> float:
        """The value given (torch's disabled scaler raises AttributeError instead)."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = new_interval

    def _get_growth_tracker(self) -> int:
        return 0

    def metrics(self, *, diagnose: bool = False) -> dict[str, float | int]:
        """Empty: a disabled scaler scales nothing and skips nothing, so it has no numbers to log."""
        return {}

    @property
    def last_overflow(self) -> None:
        """None: a disabled scaler skips nothing, so it has nothing to report."""
        return None

    @property
    def engine(self) -> Any:
        """None: there is no engine behind a disabled scaler."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Empty, as torch's disabled scaler."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Ignored, as torch's disabled scaler."""

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"GradScaler(device={self._device!r}, enabled=False)"


class DisabledShardedGradScaler(DisabledGradScaler, ShardedGradScaler):
    """What ``ShardedGradScaler(enabled=False)`` (or device="cuda" without CUDA) builds: a no-op
    with torch's ShardedGradScaler signature; no group is ever used."""

    _public_class: type = ShardedGradScaler

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, backoff_factor: float = 0.5,
                 growth_factor: float = 2.0, growth_interval: int = 2000, enabled: bool = True,
                 process_group: Any = None, **extra: Any) -> None:  # DisabledGradScaler's, in torch's order
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled, **extra)
        self._group = process_group

    @ShardedGradScaler.process_group.setter
    def process_group(self, group: Any) -> None:
        """Kept as given: a disabled scaler issues no collective."""
        self._group = group

    @property
    def reducer(self) -> None:
        """None: a disabled scaler steps on every rank, so there is nothing to agree."""
        return None

    def __repr__(self) -> str:
        return f"ShardedGradScaler(device={self._device!r}, enabled=False)"


@functools.cache
def disabled_class(cls: type) -> type:
    """The disabled type for ``cls``: DisabledGradScaler (DisabledShardedGradScaler), or for a
    user subclass a subclass of both, so the user's overrides run on top of the no-op methods."""
    base = DisabledShardedGradScaler if issubclass(cls, ShardedGradScaler) else DisabledGradScaler
    if cls is base._public_class:
        return base
    namespace = {"_public_class": cls, "__module__": cls.__module__}
    return type(f"Disabled{cls.__name__}", (cls, base), namespace)


def _restore(cls: type, state: dict[str, Any]) -> Any:
    """Unpickle without ``__new__``'s CUDA check: a scaler stays enabled or disabled as it was."""
    if "disabled" in state:
        cls, state = disabled_class(cls), state["disabled"]
    obj = object.__new__(cls)
    obj.__setstate__(state)
    return obj


_INSTALLER = Installer(GradScaler, ShardedGradScaler)


def install() -> Installation:
    """Make ``torch.amp.GradScaler``, ``torch.cuda.amp.GradScaler`` and FSDP's ``ShardedGradScaler``
    build polyamp's scalers, until :func:`uninstall` (opt-in; imports torch).

    Also usable as ``with polyamp.compat.torch.install(): ...``. Names bound by modules imported
    earlier (``from torch.amp import GradScaler``) are patched too.
    """
    return _INSTALLER.install()


def uninstall() -> None:
    """Put torch's scaler classes back everywhere :func:`install` put polyamp's (no-op if not installed)."""
    _INSTALLER.uninstall()
