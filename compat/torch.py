"""``torch.amp.GradScaler``'s API and state machine over any polyamp backend.

Behaviour, messages and exception types follow torch 2.13 (user code catches them), with
the state in typed parts: the engine holds the rule and arrays, this module the per-optimizer
READY/UNSCALED/STEPPED stages and overflow flags. Extra keyword-only arguments: ``backend``,
``backoff_interval``, ``min_scale``, ``max_scale``. ``ShardedGradScaler`` (torch's FSDP
scaler) adds one collective per step that agrees on overflow across ranks
(:mod:`polyamp.compat._torch_sharded`). Importing it does not import torch.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

from polyamp import _guard_values as guard_values
from polyamp.config import short_repr
from polyamp.engine import LossScaler
from polyamp.guard import StepGuard
from polyamp.overflow import OverflowReport, build_report, check_diagnose, explain_overflow

from ._explain import torch_named_grads
from ._stages import check_step, check_unscale
from ._torch_accessors import ScalerAccessors
from ._torch_disabled import DisabledMethods, cuda_missing
from ._torch_forward import ForwardRecord, ForwardWatch, watch_forward
from ._torch_hooks import TorchHooks, combined
from ._torch_install import Installation, Installer
from ._torch_private import TorchPrivateMembers
from ._torch_sharded import DisabledShardedInit, ShardedMethods
from ._torch_state import TorchConfigError, check_new_scale, is_array, torch_config

__all__ = ["ForwardRecord", "ForwardWatch", "GradScaler", "Installation", "OptState", "ShardedGradScaler",
           "TorchConfigError", "install", "uninstall", "watch_forward"]


_NOT_SCALED = (
    "This may indicate your script did not use scaler.scale(loss or outputs) earlier "
    "in the iteration."
)


class OptState(Enum):
    """Where one optimizer is in the iteration, as in torch."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


READY, UNSCALED, STEPPED = OptState.READY, OptState.UNSCALED, OptState.STEPPED


_GIVE_LOSS = "scale the loss (a tensor holding one value) with scaler.scale(loss) before backward()"


@functools.lru_cache(maxsize=64)
def _takes_grad_scaler(step_fn: Callable[..., Any]) -> bool:
    """Whether an optimizer's step accepts ``grad_scaler=`` (torch's deprecated protocol)."""
    return "grad_scaler" in inspect.signature(step_fn).parameters


class GradScaler(TorchHooks, TorchPrivateMembers, ScalerAccessors):
    """Drop-in ``torch.amp.GradScaler`` that also scales NumPy, CuPy and array-API arrays.

    Beyond torch: ``skipped_steps``, ``last_step_skipped``, ``step_scheduler(scheduler)``, and
    overflow forensics: ``explain(obj)``, and with ``diagnose=True`` ``last_overflow``, the report
    on a skipped step's gradients (named after ``name_parameters(module)``). Subclasses may
    override torch's ``_unscale_grads_`` and ``_maybe_opt_step`` (:mod:`polyamp.compat._torch_hooks`).
    """

    _diagnose = False  # class defaults: scalers pickled before diagnose= existed load as off
    _param_names: dict[int, str] = {}  # id(parameter) -> name; replaced, never mutated
    _allow_fp16 = False  # torch's GradScaler refuses to unscale FP16 gradients
    _flags_are_sums = False  # an optimizer's flag is this rank's (sharded: agreed over the ranks)
    _last_reason: str | None = None  # why the last step was skipped (scalers pickled before guards: None)

    def __new__(cls, device: str = "cuda", *args: Any, **kwargs: Any) -> GradScaler:
        """An enabled scaler, or (enabled=False, or "cuda" without CUDA) the disabled type.

        The CUDA rule is :func:`polyamp.compat._torch_disabled.cuda_missing` (torch's test,
        asked of torch whenever torch is installed).
        """
        enabled = kwargs.get("enabled", args[4] if len(args) > 4 else True)
        if issubclass(cls, DisabledMethods):
            return object.__new__(cls)
        if enabled and cuda_missing(device, kwargs.get("backend")):
            enabled = False
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
    ) -> None:
        self._diagnose = check_diagnose(diagnose)
        config = torch_config(init_scale, growth_factor, backoff_factor, growth_interval,
                               backoff_interval, min_scale, max_scale)
        self._device = device
        self._enabled = True
        self._backend_name = backend
        self._engine = LossScaler(config, backend, diagnose=self._diagnose, guard=guard)
        self._reset_iteration()
        self._groups: dict[int, int] = {}  # with a guard: id(optimizer) -> its group, kept across iterations
        self._skipped_host = 0
        self._unread: list[Any] = []
        self._last_skipped: Any = None
        self._last_reason: str | None = None

    def __reduce__(self) -> Any:
        return (_restore, (type(self), self.__getstate__()))

    def _reset_iteration(self) -> None:
        self._stages: dict[int, OptState] = {}
        self._found: dict[int, Any] = {}  # per optimizer: its device flag, None if no grads
        self._skipped_here: list[Any] = []  # optimizers whose step() this iteration skipped (host read)
        self._values: dict[int, Any] = {}  # with a guard: id(optimizer) -> its values (agreed if sharded)

    # -- scaling ----------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor/array, or an iterable of them, by the current scale (no sync)."""
        if is_array(outputs):
            engine = self._engine
            scaled = engine.bind(outputs).scale_array(outputs, engine.state.scale)
            if engine.guard is not None and guard_values.one_value(outputs):  # the losses since update()
                engine.iteration.take_loss(outputs, "scale()")
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

    def _check_initialized(self, funcname: str) -> None:
        if self._engine.state is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + _NOT_SCALED)

    # -- unscaling --------------------------------------------------------------------
    def unscale_(self, optimizer: Any) -> None:
        """Divide the optimizer's gradients by the scale in place and record overflow (no sync)."""
        self._check_initialized("unscale_")
        key = id(optimizer)
        check_unscale(self._stages.setdefault(key, READY))
        self._found[key] = self._unscale_optimizer(optimizer, check_only=False, allow_fp16=self._allow_fp16)
        self._stages[key] = UNSCALED

    def _check_grads(self, grads: list[Any], check_only: bool, optimizer: Any = None) -> Any:
        """One optimizer's device overflow flag, None without gradients (no sync).

        Unscales ``grads`` in place unless ``check_only``. ShardedGradScaler agrees here.
        """
        if not grads:
            return None
        iteration = self._engine.iteration
        iteration.require_loss(None, "GradScaler.step()", _GIVE_LOSS)
        found = iteration.unscale(grads, check_only=check_only, owned=True)  # by collect_grads
        if iteration.guard is not None:  # this optimizer's values, judged at its step
            self._values[id(optimizer)] = iteration.agree_group(
                found, iteration.squares(grads), self._group_of(optimizer)).extra
        return found

    def _group_of(self, optimizer: Any) -> int:
        """The optimizer's guard history's key: its place in the order optimizers were first stepped
        (since construction, unpickling or load_state_dict), so an optimizer stepped alone in an
        iteration is still judged against its own history."""
        return self._groups.setdefault(id(optimizer), len(self._groups))

    def _check_inf_per_device(self, optimizer: Any) -> dict[Any, Any]:
        """Record overflow without unscaling, for optimizers that unscale themselves (no sync)."""
        self._check_initialized("_check_inf_per_device")
        found = self._unscale_optimizer(optimizer, check_only=True, allow_fp16=True)
        self._stages.setdefault(id(optimizer), READY)
        self._found[id(optimizer)] = found
        return self._found_inf_per_device(optimizer)

    def _found_inf_per_device(self, optimizer: Any) -> dict[Any, Any]:
        """torch's view of one optimizer's flags: ``{device: found_inf}`` (empty when none)."""
        found = self._found.get(id(optimizer))
        return {} if found is None else {getattr(found, "device", "cpu"): found}

    # -- stepping ---------------------------------------------------------------------
    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then ``optimizer.step(*args, **kwargs)`` unless gradients overflowed.

        Reads the overflow flag on the host (the one sync), except for optimizers that take
        ``grad_scale``/``found_inf`` themselves. Returns what ``optimizer.step`` returned.
        """
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_initialized("step")
        key = id(optimizer)
        stage = self._stages.setdefault(key, READY)
        check_step(stage)
        if getattr(optimizer, "_step_supports_amp_scaling", False) and self._engine.guard is None:
            return self._self_scaling_step(optimizer, stage, args, kwargs)  # with a guard: decided here
        if stage is READY:
            self.unscale_(optimizer)
        found = self._found[key]
        if found is None:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if overrides_opt_step(type(self)):  # a subclass's _maybe_opt_step, called as torch calls it
            retval = self._opt_step_through_hook(optimizer, UNSCALED, args, kwargs)
        else:  # polyamp's own: the same decision without building torch's optimizer_state
            retval = self._decide_and_step(optimizer, found, args, kwargs)
        self._stages[key] = STEPPED
        return retval

    def _maybe_opt_step(
        self, optimizer: Any, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """torch's hook: ``optimizer.step(*args, **kwargs)`` unless ``optimizer_state``'s flags say
        overflow (the one host read; a report only when skipped). Those flags are what update() uses."""
        found = self._found[id(optimizer)] = combined(optimizer_state["found_inf_per_device"])
        return self._decide_and_step(optimizer, found, args, kwargs)

    def _decide_and_step(self, optimizer: Any, found: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """The skip decision on ``found`` (the one host read; a report only when skipped), then
        ``optimizer.step(*args, **kwargs)`` unless it says skip."""
        iteration = self._engine.iteration
        named = lambda: self._named_grads([*self._skipped_here, optimizer])  # noqa: E731
        values = self._values.get(id(optimizer))  # with a guard: the flag and its values in one read
        decision = iteration.decide(found, values=values, group=self._group_of(optimizer), named=named,
                                    keep_report=bool(self._skipped_here))
        skipped = decision.skipped
        self._last_reason = decision.reason
        retval = None if skipped else optimizer.step(*args, **kwargs)
        self._last_skipped = skipped
        self._skipped_host += skipped
        iteration.count(skipped)  # steps and the window of metrics()
        if skipped:
            self._skipped_here.append(optimizer)
        return retval

    def _named_grads(self, optimizers: list[Any]) -> list[tuple[str, Any]]:
        """The named gradients of the optimizers whose steps this iteration skipped, for one report."""
        return [pair for optimizer in optimizers for pair in torch_named_grads(optimizer, self._param_names)]

    def _confirm_aligned(self, found: Any) -> None:
        """Before a fused optimizer's step: nothing here (ShardedGradScaler checks the ranks)."""

    def _self_scaling_step(self, optimizer: Any, stage: OptState, args: Any, kwargs: dict) -> Any:
        """torch's path for optimizers that take grad_scale/found_inf: no host sync here."""
        if _takes_grad_scaler(getattr(optimizer.step, "__func__", optimizer.step)):
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                "directly.",
                FutureWarning,
                stacklevel=3,
            )
            kwargs.update({"grad_scaler": self})
            retval = optimizer.step(*args, **kwargs)
            self._stages[id(optimizer)] = STEPPED
            return retval
        if stage is READY:
            self._check_inf_per_device(optimizer)
        found = self._found[id(optimizer)]
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
        self._stages[id(optimizer)] = STEPPED
        del optimizer.grad_scale
        del optimizer.found_inf
        self._last_skipped = found
        self._unread.append(found)
        if len(self._unread) > 1024:  # bounds the memory held; a rare batch of syncs
            self._resolve_unread()
        return retval

    def update(self, new_scale: float | Any = None) -> None:
        """Back off after an overflow, grow after growth_interval clean steps, or set new_scale.

        No host sync: the rule runs on the scale's device.
        """
        self._check_initialized("update")
        iteration = self._engine.iteration
        try:
            if new_scale is not None:  # torch's update(new_scale) ends the iteration, across ranks too
                if not isinstance(new_scale, float):
                    check_new_scale(new_scale, self._device)
                self._engine.set_scale(new_scale)
                return
            flags = [f for f in self._found.values() if f is not None]
            if not flags:
                raise AssertionError("No inf checks were recorded prior to update.")
            found = flags[0] if len(flags) == 1 else sum(flags[1:], flags[0])
            iteration.finish(iteration.concluded(found, skipped=bool(self._skipped_here)))  # as step() read
        finally:
            self._reset_iteration()

    # -- overflow forensics -----------------------------------------------------------
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



@functools.cache
def overrides_opt_step(cls: type) -> bool:
    """Whether ``cls`` overrides ``_maybe_opt_step`` (then step goes through it, as torch's does)."""
    return cls._maybe_opt_step is not GradScaler._maybe_opt_step

class DisabledGradScaler(DisabledMethods, GradScaler):
    """What ``GradScaler(enabled=False)`` (or device="cuda" without CUDA) builds: a no-op."""

    _public_class: type = GradScaler

    def __reduce__(self) -> Any:
        return (_restore, (self._public_class, {"disabled": dict(self.__dict__)}))


class ShardedGradScaler(ShardedMethods, GradScaler):
    """Drop-in ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``.

    torch's signature (``backoff_factor`` before ``growth_factor``, then ``process_group``),
    FP16 and CPU gradients; each optimizer's overflow flag is agreed with one all-reduce
    over ``process_group`` (None: the default group; or anything
    :func:`polyamp.distributed.reducer` accepts), so every rank skips together. With
    ``diagnose=True`` a rank whose own gradients are finite reports that another rank overflowed.
    """


class DisabledShardedGradScaler(DisabledShardedInit, DisabledGradScaler, ShardedGradScaler):
    """What ``ShardedGradScaler(enabled=False)`` (or device="cuda" without CUDA) builds: a no-op."""

    _public_class: type = ShardedGradScaler


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

    Also usable as ``with polyamp.compat.torch.install(): ...``. Names bound by modules
    imported earlier (``from torch.amp import GradScaler``) are patched too; see
    :mod:`polyamp.compat._torch_install`.
    """
    return _INSTALLER.install()


def uninstall() -> None:
    """Put torch's scaler classes back everywhere :func:`install` put polyamp's (no-op if not installed)."""
    _INSTALLER.uninstall()
