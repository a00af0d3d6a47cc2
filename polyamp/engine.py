"""The stateful loss scaler every facade maps onto: ``scale / unscale_ / step / update``.

The iteration's work is :mod:`polyamp._iteration`'s; this class keeps the loop's contract (its
order and errors), checkpoints and copies. One host read per step: the skip decision.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

from . import _guard_values, _inputs, _registry, checkpoint, metrics, overflow
from . import guard as _guard
from ._agreement import LOOP as _LOOP
from ._agreement import Agreed, Agreement
from ._errors import ScalerStateError
from ._iteration import Iteration
from ._metering import check_meter
from .backend import Backend
from .config import LossScaleConfig, config_from
from .policy import HostState, LossScaleState

logger = logging.getLogger("polyamp")

__all__ = ["LossScaler", "ScalerStateError", "StepResult"]


@dataclass(frozen=True)
class StepResult(_guard.VerdictFields):
    """What one :meth:`LossScaler.step` did; truthy exactly when the optimizer step ran.

    ``scale_before``: the scale the step unscaled with (a 0-d device array). ``reason``: None when
    applied, else ``"overflow"`` or a :class:`polyamp.StepGuard`'s reason; the guard's ``loss``,
    ``grad_norm`` and ``zscores`` come from its verdict (None without a guard).
    """

    skipped: bool
    scale_before: Any
    verdict: _guard.Verdict | None = None  # the guard's (None without a guard)

    def __bool__(self) -> bool:
        return not self.skipped

    @property
    def reason(self) -> str | None:
        """Why the step was skipped (None when applied): a guard's reason, else ``"overflow"``."""
        return _guard.why(self.verdict, self.skipped)

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


class LossScaler:
    """Dynamic loss scaling over any backend: torch's and paddle's rule in one engine.

    The loop is ``stepped = scaler.step(grads, step_fn); scaler.update()``. ``config`` or its fields
    as keywords (not both); ``backend`` (or ``POLYAMP_BACKEND``) picks the kernels, else the first
    arrays do. ``reducer`` (:func:`polyamp.distributed.reducer`) agrees every step over the ranks in
    ONE all-reduce that also finds misaligned ranks. ``diagnose=True`` fills :attr:`last_overflow`;
    ``guard`` (a :class:`polyamp.StepGuard`) also skips loss and gradient-norm spikes. One thread
    per scaler; copies taken between ``update()`` and the next step are independent.
    """

    enabled = True

    def __init__(
        self, config: LossScaleConfig | None = None, backend: str | None = None, *, reducer: Any = None,
        diagnose: bool = False, guard: _guard.StepGuard | None = None, meter: Any = None, **fields: Any,
    ) -> None:
        config = config_from(config, fields, type(self).__name__)
        self._iteration = make_iteration(config, backend, reducer=reducer, diagnose=diagnose, guard=guard,
                                         meter=meter)

    @classmethod
    def over(cls, iteration: Iteration) -> LossScaler:
        """The engine over an iteration a facade made (:func:`make_iteration`) and drives itself."""
        engine = object.__new__(cls)
        engine._iteration = iteration
        return engine

    @property
    def iteration(self) -> Iteration:
        """The :class:`polyamp._iteration.Iteration` this scaler is a shell over (the facades' too)."""
        return self._iteration

    @property
    def config(self) -> LossScaleConfig:
        """The immutable config in force; change it with :meth:`reconfigure`."""
        return self._iteration.scaling.config

    @property
    def backend(self) -> Backend | None:
        """The bound backend, or None until the first arrays decide it."""
        return self._iteration.scaling.backend

    @property
    def state(self) -> LossScaleState | None:
        """The device state arrays, or None before the first array is seen."""
        return self._iteration.scaling.state

    @property
    def steps(self) -> int:
        """Steps taken (applied or skipped) through :meth:`step`."""
        return self._iteration.steps

    @property
    def skipped_steps(self) -> int:
        """Steps :meth:`step` skipped."""
        return self._iteration.skipped_steps

    @property
    def guard(self) -> _guard.StepGuard | None:
        """The :class:`polyamp.StepGuard` judging each step, or None."""
        return None if self._iteration.guarding is None else self._iteration.guarding.guard

    @property
    def guard_history(self) -> _guard.GuardHistory:
        """The guard's histories of applied steps and its streak of skips (immutable)."""
        return self._iteration.histories.get(0, _guard.GuardHistory())

    @property
    def reducer(self) -> Any:
        """The ``polyamp.distributed.Reducer`` that agrees each step across ranks, or None."""
        return None if self._iteration.agreement is None else self._iteration.agreement.reducer

    @property
    def last_precision(self) -> Any:
        """The :class:`polyamp.PrecisionReport` of the last sample step (``meter=``), else None."""
        return self._iteration.metering.last

    @property
    def last_overflow(self) -> overflow.OverflowReport | None:
        """The report on the last skipped step's gradients (``diagnose=True``), else None."""
        return self._iteration.last_overflow

    def metrics(self, *, diagnose: bool = False) -> dict[str, float | int]:
        """The scaler's numbers for a logger (:mod:`polyamp.metrics`); one host read."""
        iteration = self._iteration
        return metrics.measure(iteration, iteration.steps, iteration.skipped_steps, diagnose=diagnose)

    def explain(self, grads: Any, *, names: Any = None, loss: Any = None) -> overflow.OverflowReport:
        """:func:`polyamp.explain_overflow` with this scaler's scale (one read); read-only, any time."""
        return overflow.explain_overflow(grads, names=names, loss=loss, scale=self.get_scale())

    @property
    def has_pending_check(self) -> bool:
        """Whether an inf check was recorded since the last update()."""
        return self._iteration.checks.found is not None

    def reconfigure(self, **changes: Any) -> LossScaleConfig:
        """Replace some config fields (validated first: a bad value changes nothing)."""
        return self._iteration.scaling.reconfigure(self.config.replace(**changes))

    def bind(self, array: Any) -> Backend:
        """Pick the backend from ``array`` if none is chosen, and create the state on its device."""
        return self._iteration.scaling.bind(array)

    # -- the four verbs ---------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """``outputs * scale`` for an array or a nested list/tuple of arrays."""
        _inputs.check_outputs(outputs)
        first = _registry.first_array(outputs)
        if first is None:
            return outputs
        backend = self.bind(first)
        scale = self._iteration.scaling.ready()[1].scale
        return _scale_tree(backend, outputs, scale)

    def unscale_(self, grads: Iterable[Any], *, check_only: bool = False, loss: Any = None) -> Any:
        """Divide ``grads`` in place by the scale (``check_only``: only check); return this call's
        device overflow flag. Once per iteration; ``loss``: the guard's. No sync."""
        iteration = self._iteration
        _check_order("unscale_()", iteration.checks)
        if loss is not None and iteration.guarding is not None:
            _guard_values.loss_check(loss, "unscale_()")  # refused before the gradients change
        found = iteration.unscale(grads, check_only=check_only, where="unscale_()")
        iteration.take_loss(loss, "unscale_()")
        return found

    def record_found_inf(self, flag: Any) -> None:
        """Add a device flag (non-zero: a bad step, e.g. a non-finite norm) to the pending check. No sync."""
        iteration = self._iteration
        flag = _inputs.flag_value(flag, iteration.scaling.backend, "record_found_inf()", "flag")
        iteration.record(iteration.scaling.flag_array(flag))  # a host bool: on the state's device

    def agree_(self, extra: Any = None) -> Agreed:
        """Agree this iteration's check over the ranks now, with ``extra`` (at most two values, summed)
        in the same ONE all-reduce; ``step`` then issues none. After ``unscale_``, once. No sync."""
        _check_order("agree_()", self._iteration.checks)
        if extra is not None and not hasattr(extra, "shape"):
            raise TypeError(
                "agree_() needs extra to be an array of at most two values (in the gradients' library, "
                f"e.g. a sum of squares pair), got extra={_inputs.short_repr(extra)} "
                f"({type(extra).__name__}). Fix: pass e.g. xp.stack([s, s / h**2]), or leave extra out."
            )
        return self._iteration.agree(extra)

    def agree_flag(self, found_inf: Any) -> Any:
        """``found_inf`` agreed over the ranks (1 when non-zero on some rank): one collective."""
        return self._iteration.agree_flag(found_inf)

    def step(self, grads: Iterable[Any], step_fn: Callable[[], Any], *, loss: Any = None) -> StepResult:
        """Unscale ``grads`` (unless unscale_ ran), run ``step_fn`` unless inf/nan; call update() next.
        Reads the flag on the host (the one sync), agreed first with a reducer. ``loss``: the guard's."""
        iteration = self._iteration
        _check_order("step()", iteration.checks)
        if not callable(step_fn):  # refused before anything changes
            raise TypeError(
                f"step() needs step_fn to be a callable that applies the optimizer step, got step_fn="
                f"{_inputs.short_repr(step_fn)}. Fix: pass e.g. optimizer.step (not optimizer.step())."
            )
        retried = iteration.checks.loss_from == "step()"  # step_fn raised: its loss is taken already
        if iteration.guarding is not None:
            _check_step_loss(iteration, loss, retried)
        if not iteration.checks.unscaled:
            iteration.unscale(grads, where="step()")
        if not retried:
            iteration.take_loss(loss, "step()")
        decision = iteration.decide()
        before = iteration.scaling.ready()[1].scale + 0  # a copy: update() may change the scale in place
        if not decision.skipped:
            try:
                step_fn()
            except BaseException:  # not taken: a retry of step() decides again (the gradients stay unscaled)
                iteration.undecide()
                raise
        iteration.count(decision.skipped)
        return StepResult(decision.skipped, before, decision.verdict)

    def update(self, found_inf: Any = None) -> None:
        """Advance the scale with ``found_inf`` (default: this iteration's agreed checks). No sync."""
        iteration = self._iteration
        if found_inf is not None:
            found_inf = _inputs.flag_value(found_inf, iteration.scaling.backend)
            if not isinstance(found_inf, bool):
                self.bind(found_inf)  # picks the backend if none; the state goes to the flag's device
        iteration.finish(iteration.concluded(found_inf))

    def set_scale(self, value: Any) -> None:
        """Set the scale (a positive normal float32, or a 1-element array read once); trackers kept.
        Like torch's ``update(new_scale)`` it ends the iteration."""
        value = _inputs.scale_value(value)
        iteration = self._iteration
        iteration.finish(iteration.decided(), new_scale=value)  # the guard records this iteration's steps

    # -- reading back (host syncs) ----------------------------------------------------
    def host_state(self) -> HostState:
        """The state as Python numbers: a device sync when the state lives on a GPU."""
        return self._iteration.scaling.host_state()

    def get_scale(self) -> float:
        """The current scale as a float (a device sync)."""
        return self._iteration.scaling.host_state().scale

    # -- checkpoints and copies -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A versioned, JSON-safe dict of config, state and counters (a device sync); refused
        between ``step()`` and ``update()``."""
        _check_order("state_dict()", self._iteration.checks)
        return self.state_now()

    def state_now(self) -> dict[str, Any]:
        """:meth:`state_dict` as the state is now, also between ``step()`` and ``update()``."""
        return checkpoint.of_iteration(self._iteration)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output (or Megatron-Core's or DeepSpeed's), validated whole first."""
        checkpoint.load_into(self._iteration, state_dict)

    def save(self, f: str | os.PathLike[str] | IO[bytes]) -> None:
        """Write :meth:`state_dict` to a path (atomically; gzip when it ends in .gz) or a binary file."""
        checkpoint.write(f, self.state_dict())

    def load(self, f: str | os.PathLike[str] | IO[bytes]) -> None:
        """Load a checkpoint written by :meth:`save` from a path or a binary file; errors name it."""
        checkpoint.apply(self._iteration, checkpoint.load(f, with_guard=True))

    def __getstate__(self) -> dict[str, Any]:
        """The iteration's state as plain data (refused inside an iteration)."""
        return {"iteration": self._iteration.__getstate__()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        iteration = object.__new__(Iteration)
        iteration.__dict__.update(state["iteration"])
        self._iteration = iteration

    def __repr__(self) -> str:
        backend = self._iteration.scaling.backend
        name = backend.name if backend else "undecided"
        return f"LossScaler(backend={name!r}, config={self._iteration.scaling.config!r})"


def make_iteration(config: LossScaleConfig | None, backend: str | None, *, reducer: Any = None,
                   diagnose: bool = False, guard: _guard.StepGuard | None = None, meter: Any = None
                   ) -> Iteration:
    """A checked :class:`Iteration` (the arguments as :class:`LossScaler` takes them)."""
    config = LossScaleConfig() if config is None else config
    if not isinstance(config, LossScaleConfig):
        raise TypeError(
            f"config must be a polyamp.LossScaleConfig, got config={config!r}; "
            "build one with polyamp.LossScaleConfig(init_scale=..., ...)"
        )
    name, source = _registry.requested_backend(backend)
    chosen = _registry.get_backend(name, source) if name else None
    diagnose = overflow.check_diagnose(diagnose)
    step_guard, meter = _guard.check_guard(guard), check_meter(meter)
    agreement = None if reducer is None else Agreement(reducer)
    return Iteration(config, chosen, agreement=agreement, diagnose=diagnose, step_guard=step_guard,
                     meter=meter)


#: verb -> (whether the iteration's checks forbid it now, the error's words)
_ORDER: dict[str, list[tuple[Callable[[Any], bool], str]]] = {
    "unscale_()": [
        (lambda c: c.skipped is not None, "unscale_() was called after step() in the same iteration; step() "
         f"already unscaled. Fix: call update() after step() (the loop is `{_LOOP}`)."),
        (lambda c: c.unscaled, "unscale_() was already called in this iteration (since the last update()); a "
         "second call would divide the gradients by the scale twice. Fix: remove the second "
         "scaler.unscale_(...) call; step() does not unscale again after unscale_()."),
    ],
    "agree_()": [
        (lambda c: c.skipped is not None or c.found is None or c.agreed is not None, "agree_() was called "
         "{when} in this iteration (global_norm and clip_grad_norm_ with a distributed scaler= call it). "
         f"Fix: call it once, after unscale_(grads) and before step() (the loop is `{_LOOP}`)."),
    ],
    "step()": [
        (lambda c: c.skipped is not None, "step() was already called in this iteration. Fix: call update() "
         f"after step() (the loop is `{_LOOP}`)."),
    ],
    "state_dict()": [
        (lambda c: c.skipped is not None, "state_dict()/save() was called between step() and update(): the "
         "step is counted but the scale it leads to is not computed yet, so a checkpoint now would resume "
         f"with the old scale. Fix: call update() first, and save after it (the loop is `{_LOOP}`)."),
    ],
}


def _check_order(verb: str, checks: Any) -> None:
    """Refuse ``verb`` where the loop's order forbids it now (ScalerStateError, nothing changed)."""
    for forbidden, words in _ORDER[verb]:
        if forbidden(checks):
            when = ("after step()" if checks.skipped is not None else
                    "before any unscale_()" if checks.found is None else "twice")
            raise ScalerStateError(words.replace("{when}", when))


def _check_step_loss(iteration: Iteration, loss: Any, retried: bool) -> None:
    """A guarded step's loss: given where judged, one real value, given once (``retried``: taken)."""
    iteration.require_loss(loss, "step()")
    if loss is not None:
        _guard_values.loss_check(loss, "step()")
    if loss is not None and iteration.checks.loss is not None and not retried:  # summed twice
        raise ScalerStateError(
            "step() got loss=, but unscale_() already took this iteration's loss. Fix: give the "
            "loss to unscale_(grads, loss=loss) or to step(grads, step_fn, loss=loss), not both."
        )


def _scale_tree(backend: Backend, tree: Any, scale: Any) -> Any:
    """``leaf * scale`` for every leaf of a nested list/tuple, keeping the structure; a Python number
    gives a Python float (not a NumPy scalar), as it came in."""
    if isinstance(tree, (list, tuple)):
        return type(tree)(_scale_tree(backend, t, scale) for t in tree)
    if isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return float(backend.scale_array(float(tree), scale))
    return backend.scale_array(tree, scale)
