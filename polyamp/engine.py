"""The stateful loss scaler every facade maps onto: ``scale / unscale_ / step / update``.

Device work goes through the bound backend; the only host read of a step is the skip
decision in :meth:`LossScaler.step`. State lives in three 0-d arrays on the gradients'
device, created on first use (as torch does), plus host counters. With ``reducer=`` the
flag is summed over the ranks before that decision: one collective per step (``_agreement``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import IO, Any

from . import _inputs, _registry, checkpoint, overflow
from ._agreement import LOOP as _LOOP
from ._agreement import Agreeing, Agreement
from ._errors import ScalerStateError
from ._skip_log import SkipLog
from .backend import Backend
from .config import SCALE_FLOOR, LossScaleConfig, config_from
from .policy import HostState, LossScaleState, next_host_state

logger = logging.getLogger("polyamp")

__all__ = ["LossScaler", "ScalerStateError", "StepResult"]


@dataclass(frozen=True)
class StepResult:
    """What one :meth:`LossScaler.step` did; truthy exactly when the optimizer step ran.

    ``skipped`` was read on the host (the one sync); ``scale_before`` is the scale the step
    unscaled with (a 0-d device array). The next scale exists only after ``update()``.
    """

    skipped: bool
    scale_before: Any

    def __bool__(self) -> bool:
        return not self.skipped

    @property
    def applied(self) -> bool:
        """True when the optimizer step ran."""
        return not self.skipped

    @property
    def scale_after(self) -> Any:
        """Gone: step() no longer updates the scale, so it cannot know the next one."""
        raise AttributeError(
            "StepResult.scale_after no longer exists: step() does not update the scale. "
            "Fix: call scaler.update() after step(), then read scaler.get_scale()."
        )


class LossScaler(Agreeing):
    """Dynamic loss scaling over any backend: torch's and paddle's rule in one engine.

    The loop is ``stepped = scaler.step(grads, step_fn); scaler.update()``: step unscales
    (unless ``unscale_`` ran), skips on inf/nan and counts; update moves the scale.
    ``backend`` (or ``POLYAMP_BACKEND``) picks the kernels now; otherwise the first arrays
    seen pick them. Errors about the backend are raised here, before any state changes.

    A scaler belongs to one thread: its iteration state is not locked (torch's GradScaler
    cannot be shared between threads either). Give each thread its own scaler.
    Copies (``copy.deepcopy``, ``pickle``, taken between ``update()`` and the next step) are
    independent and keep the state; the copy recreates its device arrays on first use.

    ``config`` or its fields as keywords: ``LossScaler(init_scale=1024, growth_interval=100,
    backend="numpy")`` (not both).

    ``reducer`` (a torch process group, ``"torch"``, an mpi4py communicator, ``"mpi"``, ...: see
    ``polyamp.distributed.reducer``) makes every rank agree on each step's overflow before the
    skip decision: ONE SUM all-reduce per step of a fixed-size message (the non-finite count, and
    a fingerprint of the config, the iteration, the collective's place and the scale state),
    issued by every rank in the same order (a rank without gradients sends 0). A rank that
    differs makes every rank raise ``polyamp.distributed.RankMismatchError`` before anything is
    applied. Every rank must call ``step`` (or ``update``) each iteration. A deep copy shares the
    reducer and counts its own iterations; pickling refuses a reducer (pickle ``state_dict()``).

    ``diagnose=True``: after a skipped step, :attr:`last_overflow` is the
    :class:`polyamp.OverflowReport` on that iteration's gradients (computed then, so applied
    steps cost nothing more; an ``update()`` without ``step()`` reads the flag once to know).
    Gradients may be a mapping name -> array (names in reports).
    """

    enabled = True
    _floor_warned = False  # set per instance by warn_if_at_floor; a class default survives copies
    _diagnose = False  # class defaults: copies pickled before diagnose= existed load as off
    _last_overflow: overflow.OverflowReport | None = None
    _checked: list[tuple[str, Any]] | None = None
    _local_found: Any = None

    def __init__(
        self, config: LossScaleConfig | None = None, backend: str | None = None, *, reducer: Any = None,
        diagnose: bool = False,
        **fields: Any,
    ) -> None:
        config = config_from(config, fields, type(self).__name__)
        if not isinstance(config, LossScaleConfig):
            raise TypeError(
                f"config must be a polyamp.LossScaleConfig, got config={config!r}; "
                "build one with polyamp.LossScaleConfig(init_scale=..., ...)"
            )
        self._config = config
        name, source = _registry.requested_backend(backend)
        self._backend: Backend | None = _registry.get_backend(name, source) if name else None
        self._diagnose = overflow.check_diagnose(diagnose)
        self._agreement = None if reducer is None else Agreement(reducer)
        self._skip_log = SkipLog()  # the first skips one INFO line each, then a summary per window
        self._state: LossScaleState | None = None
        self._host = HostState(float(config.init_scale), 0, 0)
        self._end_iteration()
        self.steps = 0
        self.skipped_steps = 0

    def _end_iteration(self) -> None:
        """Forget this iteration's checks: what update() (or set_scale) does last."""
        self._pending: Any = None  # the summed device overflow flags of this iteration
        self._unscaled = False  # unscale_ (or step) divided this iteration's gradients
        self._skipped: bool | None = None  # step()'s host decision, until update()
        self._agreed = False  # _pending is already summed over the ranks (agree_ ran)
        self._local_found = None  # this rank's own _pending, kept when an agreement replaces it
        self._checked = [] if self._diagnose else None  # (name, gradient) unscaled this iteration

    # -- properties -------------------------------------------------------------------
    @property
    def config(self) -> LossScaleConfig:
        """The immutable config in force; change it with :meth:`reconfigure`."""
        return self._config

    @property
    def backend(self) -> Backend | None:
        """The bound backend, or None until the first arrays decide it."""
        return self._backend

    @property
    def state(self) -> LossScaleState | None:
        """The device state arrays, or None before the first array is seen."""
        return self._state

    @property
    def last_overflow(self) -> overflow.OverflowReport | None:
        """The report on the last skipped step's gradients (``diagnose=True``); None after an
        applied step, and always None with ``diagnose=False``."""
        return self._last_overflow

    def explain(self, grads: Any, *, names: Any = None, loss: Any = None) -> overflow.OverflowReport:
        """:func:`polyamp.explain_overflow` with this scaler's scale (one read of it).

        Read-only: no pending check, no state change; allowed at any point of the iteration.
        """
        return overflow.explain_overflow(grads, names=names, loss=loss, scale=self.get_scale())

    @property
    def has_pending_check(self) -> bool:
        """Whether an inf check was recorded since the last update()."""
        return self._pending is not None

    def reconfigure(self, **changes: Any) -> LossScaleConfig:
        """Replace some config fields (validated first: a bad value changes nothing)."""
        self._config = self._config.replace(**changes)
        return self._config

    # -- state set-up -----------------------------------------------------------------
    def bind(self, array: Any) -> Backend:
        """Pick the backend from ``array`` if none is chosen, and create the state on its device."""
        if self._state is None:
            _inputs.check_array_device(array, "the scaler")  # before a backend or state is chosen by it
        backend = self._backend
        if backend is None:
            backend = self._backend = _registry.backend_for_array(array)
        elif self._state is None:
            _registry.check_owned(backend, array, "the array given to the scaler")
        if self._state is None:
            self._make_state(backend, array)
        return backend

    def _ready_backend(self) -> Backend:
        """The backend and state, defaulting to numpy when no array has been seen yet."""
        if self._backend is None:
            self._backend = _registry.get_backend(_registry.DEFAULT_BACKEND, "default")
        if self._state is None:
            self._make_state(self._backend, None)
        return self._backend

    def _make_state(self, backend: Backend, like: Any) -> None:
        scale, growth, backoff = self._host
        self._state = LossScaleState(
            backend.full(scale, "float32", like),
            backend.full(growth, "int32", like),
            backend.full(backoff, "int32", like),
        )

    # -- the four verbs ---------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """``outputs * scale`` for an array or a nested list/tuple of arrays."""
        _inputs.check_outputs(outputs)
        first = _registry.first_array(outputs)
        if first is None:
            return outputs
        backend = self.bind(first)
        scale = self._state.scale  # type: ignore[union-attr]
        return _map_tree(outputs, lambda a: _scale_leaf(backend, a, scale))

    def unscale_(self, grads: Iterable[Any], *, check_only: bool = False) -> Any:
        """Divide ``grads`` in place by the scale; return this call's device overflow flag.

        Once per iteration (a second call would divide twice; torch refuses it too). The flag
        is added to the iteration's check that :meth:`update` uses. ``check_only=True`` checks
        without dividing (for optimizers that unscale themselves). No host synchronisation.
        """
        if self._skipped is not None:
            raise ScalerStateError(
                "unscale_() was called after step() in the same iteration; step() already "
                f"unscaled. Fix: call update() after step() (the loop is `{_LOOP}`)."
            )
        if self._unscaled:
            raise ScalerStateError(
                "unscale_() was already called in this iteration (since the last update()); a "
                "second call would divide the gradients by the scale twice. Fix: remove the second "
                "scaler.unscale_(...) call; step() does not unscale again after unscale_()."
            )
        return self._unscale(grads, check_only, "unscale_()")

    def unscale_group_(self, grads: Iterable[Any], *, check_only: bool = False) -> Any:
        """Unscale one group of this iteration's gradients (one optimizer's); return its flag.

        For facades that keep their own per-optimizer stages: may be called once per group in
        an iteration, and the flags are summed into the pending check. No host synchronisation.
        """
        if self._skipped is not None:
            raise ScalerStateError(
                f"unscale_group_() was called after step(). Fix: call update() after step() (`{_LOOP}`)."
            )
        return self._unscale(grads, check_only, "unscale_group_()")

    def _unscale(self, grads: Iterable[Any], check_only: bool, where: str) -> Any:
        self._refuse_after_agreement("unscale_()")
        given, names = (list(grads.values()), list(map(str, grads))) if isinstance(grads, Mapping) else (
            grads, None)
        if self._diagnose:
            given = list(given)  # read twice: checked here, named for the report below
        grads = _inputs.gradient_list(given, where)  # refuses bad gradients before any state changes
        backend = self.bind(grads[0]) if grads else self._ready_backend()
        if grads:
            _inputs.check_owned(grads, backend, where)
        scale = self._state.scale  # type: ignore[union-attr]
        found = backend.full(0.0, "float32", scale)
        if grads:
            by = backend.full(1.0, "float32", scale) if check_only else scale
            backend.unscale_and_check(grads, by, found)
        self._pending = found if self._pending is None else self._pending + found
        self._unscaled = True
        if self._diagnose:
            self._checked.extend(overflow.name_gradients(given, names, len(self._checked)))  # type: ignore[union-attr]
        return found

    def record_found_inf(self, flag: Any) -> None:
        """Add a device flag (non-zero = bad step, e.g. a non-finite gradient norm) to the
        iteration's pending check, so the coming skip decision counts it. No host synchronisation.
        """
        self._refuse_after_agreement("record_found_inf()")
        self._pending = flag if self._pending is None else self._pending + flag

    def step(self, grads: Iterable[Any], step_fn: Callable[[], Any]) -> StepResult:
        """Unscale ``grads`` (unless unscale_ ran), run ``step_fn`` unless inf/nan; call update() next.

        Reads the overflow flag on the host: the one synchronisation of an iteration. The scale
        is not changed here: ``update()`` after every step does that. With a reducer the flag is
        first summed over the ranks (one collective, unless ``agree_`` did it).
        """
        if self._skipped is not None:
            raise ScalerStateError(
                "step() was already called in this iteration. Fix: call update() after step() "
                f"(the loop is `{_LOOP}`)."
            )
        if not callable(step_fn):
            raise TypeError(
                f"step() needs step_fn to be a callable that applies the optimizer step, got step_fn="
                f"{_inputs.short_repr(step_fn)}. Fix: pass e.g. optimizer.step (not optimizer.step())."
            )
        if not self._unscaled:
            self._unscale(grads, False, "step()")
        self._agree_pending()
        backend = self._backend
        skipped = bool(backend.read_flag(self._pending))  # type: ignore[union-attr]
        if skipped:
            self.verify_agreement()  # ranks that differ: RankMismatchError before anything applies
        before = self._state.scale + 0  # a copy: update() may change the scale in place
        if self._diagnose:  # the report only on a skipped step: an applied one reads nothing more
            self._last_overflow = self._explain_skip() if skipped else None
        if not skipped:
            step_fn()
        self._skipped = skipped
        self.steps += 1
        self.skipped_steps += skipped
        return StepResult(skipped, before)

    def update(self, found_inf: Any = None) -> None:
        """Advance the scale with ``found_inf`` (default: this iteration's checks); no sync.

        ``found_inf`` is a flag array of the bound backend, or a host bool: put on the state's
        device, or applied to the host state when no array has been seen yet (no backend is
        chosen by it). After a skipped step it logs the scale change (the first few at INFO, then a
        summary per 1000 steps: ``_skip_log``), after a growth at DEBUG, reading the scale only
        when a line is due. With a reducer and no ``step`` this iteration, the pending check is
        summed over the ranks first; ``found_inf`` is used as given.
        """
        if found_inf is not None:
            found_inf = _inputs.flag_value(found_inf, self._backend)
            if not isinstance(found_inf, bool):
                self.bind(found_inf)  # picks the backend if none; the state goes to the flag's device
        if found_inf is None:
            self._agree_pending()
        flag = self._pending if found_inf is None else found_inf
        if flag is None:
            raise ScalerStateError(
                "update() found no inf checks recorded this iteration. Fix: call "
                "unscale_(grads) or step(grads, step_fn) first, or pass found_inf=."
            )
        unverified = found_inf is None and self._agreement is not None and self._agreement.unverified
        if self._skipped is None and (self._diagnose or unverified):  # update() without step(): one read
            skips = flag if isinstance(flag, bool) else self._ready_backend().read_flag(flag)
            if skips and unverified:
                self.verify_agreement()  # ranks that differ: RankMismatchError before the scale moves
            if self._diagnose:
                self._last_overflow = self._explain_skip() if skips else None
        skipped = self._skipped
        before = self.get_scale() if skipped is not None and self._skip_log.wants_scale(skipped) else None
        if isinstance(flag, bool) and self._state is None:
            self._host = next_host_state(self._host, flag, self._config)
        else:
            backend = self._ready_backend()
            if isinstance(flag, bool):
                flag = backend.full(float(flag), "float32", self._state.scale)  # type: ignore[union-attr]
            self._state = backend.update_scale(self._state, flag, self._config)
        if skipped is not None:
            self._skip_log.after_update(skipped, before, self.get_scale, self._describe_change,
                                        overflow.log_summary(self._last_overflow))
        self.warn_if_at_floor(bool(self._skipped))
        self._end_iteration()
        if self._agreement is not None:
            self._agreement.end_iteration()

    def set_scale(self, value: Any) -> None:
        """Set the scale (a number, or a 1-element array read once to check it); trackers kept.

        Like torch's ``update(new_scale)`` it ends the iteration. The value must be a
        positive normal float32 (ConfigError otherwise, nothing changed).
        """
        number = _inputs.scale_value(value)
        state = self._state
        if state is not None:
            new = self._backend.full(number, "float32", state.scale)  # type: ignore[union-attr]
            self._state = state._replace(scale=new)
        else:
            self._host = self._host._replace(scale=number)
        self._end_iteration()

    def _explain_skip(self) -> overflow.OverflowReport:
        """The report on this iteration's gradients after a skip (reads the scale, and with a
        reducer this rank's own flag, to tell whether another rank overflowed)."""
        local = None
        if self._agreement is not None and self._local_found is not None:
            local = bool(self._backend.read_flag(self._local_found))  # type: ignore[union-attr]
        return overflow.build_report(self._checked or [], scale=self.get_scale(), skipped=True,
                                     agreed=self._agreement is not None, local_flag=local)

    # -- reading back (host syncs) ----------------------------------------------------
    def host_state(self) -> HostState:
        """The state as Python numbers: a device sync when the state lives on a GPU."""
        if self._state is None:
            return self._host
        to_host = self._backend.to_host  # type: ignore[union-attr]
        scale, growth, backoff = self._state
        return HostState(float(to_host(scale)), int(to_host(growth)), int(to_host(backoff)))

    def get_scale(self) -> float:
        """The current scale as a float (a device sync)."""
        return self.host_state().scale

    def warn_if_at_floor(self, skipped: bool, report: overflow.OverflowReport | None = None) -> None:
        """After a skipped step's update: warn once per scaler if the scale sits at SCALE_FLOOR.

        Reads the scale (a device sync) only on skipped steps and only until the warning is given,
        so the per-step hot path is untouched. Facades call it with their host-read skip flag
        (and their last report: the warning quotes its diagnosis, else :attr:`last_overflow`'s).
        """
        if not skipped or self._floor_warned or not self._config.dynamic:
            return
        if self.get_scale() <= SCALE_FLOOR:
            self._floor_warned = True
            logger.warning(
                "loss scale hit its floor 2**-126 (float32's smallest normal) after repeated "
                "overflows; it stays there instead of decaying to 0. Usual causes: a NaN or inf "
                "loss or forward pass, gradients not zeroed between steps, or a learning rate "
                "that diverged.%s", overflow.floor_note(self._last_overflow if report is None else report),
            )

    def _describe_change(self, skipped: bool, old: float, new: float) -> str | None:
        """The log line of one update's scale change (``_skip_log`` picks its level)."""
        if not skipped:  # or not read on the host: the torch facade with a fused optimizer
            if new < old:
                return f"overflow in gradients: loss scale backed off {old:g} -> {new:g}"
            return f"loss scale grew {old:g} -> {new:g}" if new > old else None
        if new != old:
            return f"overflow in gradients: step skipped, loss scale backed off {old:g} -> {new:g}"
        return (f"overflow in gradients: step skipped, loss scale kept at {old:g} "
                f"(absorbed by backoff_interval={self._config.backoff_interval})")

    # -- checkpoints and copies -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A versioned, JSON-safe dict of config, state and counters (a device sync).

        Refused between ``step()`` and ``update()``: the step is counted there but its scale change
        is not made yet, so the checkpoint would resume with the old scale (copies refuse it too).
        """
        if self._skipped is not None:
            raise ScalerStateError(
                "state_dict()/save() was called between step() and update(): the step is counted but "
                "the scale it leads to is not computed yet, so a checkpoint now would resume with the "
                f"old scale. Fix: call update() first, and save after it (the loop is `{_LOOP}`)."
            )
        host = self.host_state()
        return checkpoint.to_state_dict(self._config, host, self.steps, self.skipped_steps)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output; validated whole before anything changes."""
        self._apply(checkpoint.from_state_dict(state_dict))

    def _apply(self, parts: tuple[LossScaleConfig, HostState, int, int]) -> None:
        config, host, steps, skipped = parts
        new_state = None
        if self._state is not None:
            like, full = self._state.scale, self._backend.full  # type: ignore[union-attr]
            new_state = LossScaleState(
                full(host.scale, "float32", like),
                full(host.growth_tracker, "int32", like),
                full(host.backoff_tracker, "int32", like),
            )
        self._config, self._host, self._state = config, host, new_state
        self.steps, self.skipped_steps = steps, skipped
        self._end_iteration()

    def save(self, f: str | os.PathLike[str] | IO[bytes]) -> None:
        """Write :meth:`state_dict` to a path (atomically; gzip when it ends in .gz) or a binary file."""
        checkpoint.write(f, self.state_dict())

    def load(self, f: str | os.PathLike[str] | IO[bytes]) -> None:
        """Load a checkpoint written by :meth:`save` from a path or a binary file; errors name it."""
        self._apply(checkpoint.load(f))

    def __getstate__(self) -> dict[str, Any]:
        """The backend by name and the state as host values (one sync); device arrays are rebuilt."""
        if self._pending is not None or self._skipped is not None:
            raise ScalerStateError(
                "a LossScaler can be copied or pickled only between update() and the next "
                "unscale_()/step(): this iteration's overflow checks live on the device. "
                "Fix: call update() first."
            )
        state = self.__dict__.copy()
        state.update(_backend=self._backend.name if self._backend else None, _state=None,
                     _host=self.host_state())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        name = state["_backend"]
        backend = _registry.get_backend(name, "a copied or unpickled LossScaler") if name else None
        self.__dict__.update(state, _backend=backend)

    def __repr__(self) -> str:
        name = self._backend.name if self._backend else "undecided"
        return f"LossScaler(backend={name!r}, config={self._config!r})"


def _map_tree(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every array of a nested list/tuple, keeping the structure."""
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tree(t, fn) for t in tree)
    return fn(tree)


def _scale_leaf(backend: Backend, leaf: Any, scale: Any) -> Any:
    """``leaf * scale``; a Python number gives a Python float (not a NumPy scalar), as it came in."""
    if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
        return float(backend.scale_array(float(leaf), scale))
    return backend.scale_array(leaf, scale)
