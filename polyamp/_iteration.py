"""One iteration of a loss scaler, written once: unscale, check, agree, decide, report, update.

Every scaler (engine, torch and paddle facades, trainer) is a shell over :class:`Iteration`::

    unscale(grads) / record(flag)   -> Checks.found     (device flags, no sync)
    agree() / agree_flag(flag)      -> Checks.agreed    (one collective with a reducer)
    decide(flag)                    -> Decision         (the one host read; a report when skipped)
    finish(concluded())             -> the scale update, its log line, the floor warning, the guard

Every way an iteration ends is :meth:`Iteration.finish` of a :class:`Decision`, so none can skip the
guard's record or leave the iteration open.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple

from . import _guard_values, _registry, guard, overflow
from ._agreement import Agreed, Agreement, check_extra
from ._errors import ScalerStateError
from ._guard_steps import GuardSteps
from ._guard_values import GuardValues, plus
from ._metering import Metering
from ._scaling import Scaling
from ._skip_log import SkipLog, SkipWindow
from .backend import Backend
from .config import LossScaleConfig
from .policy import HostState, next_host_state

logger = logging.getLogger("polyamp")

#: How a shell words one update's scale change: ``describe(skipped, before, after)`` on host states.
Describe = Callable[[bool, HostState, HostState], "str | None"]
#: The named gradients of a report, built only when one is due.
Named = Callable[[], "list[tuple[str, Any]]"]


class Decision(NamedTuple):
    """One step's host decision (immutable), consumed by :meth:`Iteration.finish`.

    ``skipped``: None when no step was decided. ``flag``: what the scale rule advances on. ``exact``:
    ``skipped`` was read from this very flag (the state after the update needs no read).
    ``verdicts``: the guard's (group, verdict) pairs.
    """

    skipped: bool | None
    flag: Any
    exact: bool = False
    verdicts: tuple[tuple[int, guard.Verdict], ...] = ()

    @property
    def verdict(self) -> guard.Verdict | None:
        """The guard's last verdict, or None without a guard."""
        return self.verdicts[-1][1] if self.verdicts else None

    @property
    def reason(self) -> str | None:
        """Why the step was skipped (None: applied); ``"overflow"`` without a guard."""
        if self.verdicts:
            return self.verdicts[-1][1].reason
        return "overflow" if self.skipped else None

    @property
    def worst(self) -> str | None:
        """The first of ``guard.REASONS`` among the verdicts (None: all applied, or no guard)."""
        if not self.verdicts:
            return None
        reasons = {v.reason for _, v in self.verdicts}
        return next((r for r in guard.REASONS if r in reasons), None)


class Checks(NamedTuple):
    """What one iteration has checked so far; replaced (never mutated) as it moves on.

    ``found``: this rank's device flags, summed; ``agreed``: ``found`` agreed over the ranks;
    ``summed``: the gradients were summed over the ranks (:meth:`Iteration.sum_payload`);
    ``decisions``: one per step; ``checked``: (name, gradient) pairs for a report; ``measured``: the
    guard's device values; ``values``: those agreed with the flag; ``metered``: a sample step's
    precision counts; ``loss_from``: the verb that gave the loss (a retried step() takes none).
    """

    found: Any = None
    agreed: Any = None
    summed: bool = False
    unscaled: bool = False
    decisions: tuple[Decision, ...] = ()
    checked: tuple[tuple[str, Any], ...] = ()
    measured: GuardValues = GuardValues()
    values: Any = None
    metered: Any = None
    loss_from: str | None = None

    @property
    def skipped(self) -> bool | None:
        """Whether a step of this iteration was skipped (None before any decision)."""
        return any(d.skipped for d in self.decisions) if self.decisions else None

    @property
    def flag(self) -> Any:
        """The flag the decision and the update use: the agreed one once there is one."""
        return self.found if self.agreed is None else self.agreed

    @property
    def loss(self) -> Any:
        """The guard's loss of this iteration (a device value), or None."""
        return self.measured.loss


#: ``decide()``'s default flag: the iteration's own (agreed first).
OWN: Any = object()

#: An iteration's checks before its first check (immutable: one for all).
FRESH = Checks()


class Iteration:
    """A scaler's state and its iteration's steps (see the module docstring); ``agreement`` may be
    set later (the sharded facade resolves its group at first use); ``meter``: a PrecisionMeter."""

    def __init__(
        self, config: LossScaleConfig, backend: Backend | None, *, agreement: Agreement | None = None,
        diagnose: bool = False, step_guard: guard.StepGuard | None = None, meter: Any = None,
    ) -> None:
        self.scaling = Scaling(config, backend)
        self.guarding = None if step_guard is None else GuardSteps(step_guard)
        self.metering = Metering(meter)
        self.agreement = agreement
        self.diagnose = diagnose
        self.log = SkipLog()  # the first skips one INFO line each, then a summary per window
        self.last_overflow: overflow.OverflowReport | None = None
        self.checks = FRESH
        self.steps = self.skipped_steps = 0
        self.window = SkipWindow()  # the skips of the last steps, for metrics(); host-only

    @property
    def histories(self) -> dict[int, guard.GuardHistory]:
        """The guard's history per group (empty without a guard); set to load saved ones."""
        return {} if self.guarding is None else self.guarding.histories

    @histories.setter
    def histories(self, value: dict[int, guard.GuardHistory]) -> None:
        if self.guarding is not None:
            self.guarding.histories = dict(value)

    def load(self, config: LossScaleConfig, host: HostState) -> None:
        """Replace the config and the state; forget the checks (not the agreement's count)."""
        self.scaling.config = config
        self.scaling.load(host)
        self.checks = FRESH

    # -- checking -------------------------------------------------------------------------
    def unscale(self, grads: Iterable[Any], *, check_only: bool = False, where: str = "unscale_()",
                owned: bool = False) -> Any:
        """Unscale one group of gradients (``check_only``: check only), no sync; ``owned``: checked."""
        self._refuse_after_agreement("unscale_()")
        given, names = (list(grads.values()), list(map(str, grads))) if isinstance(grads, Mapping) else (
            list(grads) if self.diagnose or self.metering.active else grads, None)  # read twice: named too
        arrays = self.scaling.gradients(given, where, owned)  # refuses bad gradients before any state changes
        squares = self.guarding is not None and self.guarding.guard.watches_norm
        checks, keep = self.checks, self.diagnose  # with a meter: a sample's counts (fused, or kept to count)
        found, sumsq, counted = self.metering.active and self.metering.unscale(
            checks, self.steps, self.scaling, arrays, check_only, keep, squares) or (
            *self.scaling.unscale(arrays, check_only=check_only, keep=keep, squares=squares), None)
        measured = checks.measured if sumsq is None else checks.measured.plus(sumsq=sumsq)
        checked = checks.checked
        metered = self.metering.active and self.metering.count(
            checks, self.steps, self.scaling, given, names, not check_only and arrays, counted) or None
        if self.diagnose:
            checked += tuple(overflow.name_gradients(given, names, len(checked)))
        self.checks = checks._replace(found=found if checks.found is None else checks.found + found,
                                      unscaled=True, checked=checked, measured=measured, metered=metered)
        return found

    def record(self, flag: Any) -> None:
        """Add a device flag (non-zero: a bad step) to the iteration's check. No sync."""
        self._refuse_after_agreement("record_found_inf()")
        self.checks = self.checks._replace(found=plus(self.checks.found, flag))

    def _refuse_after_agreement(self, what: str) -> None:
        if self.checks.agreed is not None:
            raise ScalerStateError(_AFTER_AGREEMENT.format(what=what))

    # -- agreeing across ranks ------------------------------------------------------------
    def agree(self, extra: Any = None) -> Agreed:
        """The iteration's flag (and ``extra``) agreed over the ranks in ONE collective, once."""
        found = self.checks.found
        check_extra(extra)
        sent = self._sent(self.checks.measured)
        if self.agreement is None:
            self.checks = self.checks._replace(values=sent)
            return Agreed(found, extra)
        both, users = _guard_values.joined(extra, sent)  # the user's values are summed, the guard's its way
        maxed = () if self.guarding is None else (False,) * users + self.guarding.maxed
        agreed, metered = self.metering.agree(self.agreement, found, both, maxed, self.checks.metered,
                                              self.scaling, self.whose(0))
        theirs, values = _guard_values.split(agreed.extra, users, extra, sent)
        self.checks = self.checks._replace(agreed=agreed.found_inf, values=values, metered=metered)
        return Agreed(agreed.found_inf, theirs)

    def agree_found(self) -> None:
        """Agree the iteration's flag unless done, summed with the data, or there is no agreement."""
        checks = self.checks
        if self.agreement is not None and checks.found is not None and checks.agreed is None \
                and not checks.summed:
            self.agree()

    def agree_flag(self, found_inf: Any, *, whose: int = 0) -> Any:
        """One group's flag summed over the ranks (one collective; None sends 0); checks untouched."""
        if self.agreement is None:
            return found_inf
        return self.agreement.flag(self.scaling.flag_array(found_inf), self.scaling.config,
                                   self.scaling.state, whose=self.whose(whose))

    def agree_group(self, found: Any, squares: Any, group: int, *, whose: int = 0) -> Agreed:
        """One group's flag and guard values agreed in ONE collective (per optimizer: torch facades)."""
        found = self.scaling.flag_array(found)
        sent = self._sent(self.checks.measured._replace(sumsq=squares))
        if self.agreement is None:
            return Agreed(found, sent)
        maxed = () if self.guarding is None else self.guarding.maxed
        agreed, metered = self.metering.agree(self.agreement, found, sent, maxed, self.checks.metered,
                                              self.scaling, self.whose(whose, group))
        self.checks = self.checks._replace(metered=metered)
        return agreed

    def sum_payload(self, storage: Any, payload: int, *, whose: int = 0, like: Any = None) -> None:
        """Sum ``storage`` (``payload`` values, the fingerprint after them) over the ranks: ONE
        collective. ``like`` (first steps): first check that every rank sums as many values."""
        if self.agreement is None:
            raise ScalerStateError("sum_payload() needs a scaler built with reducer=. Fix: pass reducer=.")
        agreement, config, state = self.agreement, self.scaling.config, self.scaling.fingerprinted
        if like is not None:
            zero = (self.scaling.backend or _registry.backend_for_array(like)).full(0.0, "float32", like)
            agreement.flag_and_extra(zero, None, config, state, payload=payload, whose=whose)
            agreement.verify()
        off = agreement.sum_payload_(storage, payload, config, state, whose=whose)
        found = self.checks.found if off is None else plus(self.checks.found, off)
        self.checks = self.checks._replace(summed=True, found=found)

    def verify(self) -> None:
        """After a decision read a non-zero agreed flag: RankMismatchError if the ranks differ."""
        if self.agreement is not None:
            self.agreement.verify()

    # -- the guard's inputs ------------------------------------------------------------------
    def take_loss(self, loss: Any, where: str) -> None:
        """Add ``loss`` to the guard's loss of this iteration (ignored without a guard). No sync."""
        if self.guarding is None or loss is None:
            return
        self._refuse_after_agreement(f"{where} with loss=")
        try:
            value = _guard_values.loss_on(self.scaling, loss, where)
        except BaseException:  # e.g. a tensor that cannot be read: the iteration ends, not half open
            self.end()
            raise
        self.checks = self.checks._replace(measured=self.checks.measured.plus(loss=value), loss_from=where)

    def require_loss(self, loss: Any, where: str,
                     give: str = "pass loss= (e.g. step(grads, step_fn, loss=loss))") -> None:
        """Refuse a step of a loss guard that was given no loss (before anything changes)."""
        if self.guarding is not None:
            self.guarding.require_loss(loss is not None or self.checks.loss is not None, where, give)

    def squares(self, arrays: list[Any]) -> Any:
        """One group's sum of squares when a norm rule is set, else None (no sync)."""
        watches = self.guarding is not None and self.guarding.guard.watches_norm and bool(arrays)
        return self.scaling.ready()[0].sum_of_squares(arrays) if watches else None

    def whose(self, whose: int, group: int = 0) -> int:
        """The identity a collective names: ``whose``, the guard's settings, loss and history, the meter's."""
        given = self.checks.loss is not None
        whose = whose if self.guarding is None else self.guarding.whose(whose, group, given)
        return self.metering.whose(whose, self.steps)  # and the meter's settings and sampling phase

    def _sent(self, measured: GuardValues) -> Any:
        """This rank's guard values to agree (None without a guard)."""
        if self.guarding is None:
            return None
        backend, state = self.scaling.ready()
        return measured.pack(self.guarding.fields, backend, state.scale)

    # -- the decision -----------------------------------------------------------------------
    def decide(
        self, flag: Any = OWN, *, values: Any = None, group: int = 0, named: Named | None = None,
        local: Any = None, keep_report: bool = False,
    ) -> Decision:
        """The skip decision on ``flag`` (default: the iteration's; None: no gradients) and a guard's
        ``values``, in the step's one host read. A skip checks the ranks, then reports (on
        ``named()``; ``local``: this rank's flag). A failure ends the iteration."""
        try:
            decision = self._decision(flag, values, group)
            if decision.skipped and (not decision.verdicts or decision.verdicts[-1][1].reason == "overflow"):
                self.verify()  # ranks that differ: RankMismatchError before anything applies
        except BaseException:
            self.end()
            raise
        self.checks = self.checks._replace(decisions=(*self.checks.decisions, decision))
        if self.diagnose and (decision.skipped or not keep_report):
            self.last_overflow = _skip_report(self, named, local) if decision.skipped else None
        return decision

    def _decision(self, flag: Any, values: Any, group: int) -> Decision:
        """The flag (and the guard's values) read on the host, judged: one :class:`Decision`."""
        own = flag is OWN
        if own:
            self.agree_found()
            flag = self.checks.flag
        flag = False if flag is None else flag
        backend = self.scaling.backend
        if backend is None and not isinstance(flag, bool):
            backend = self.scaling.bind(flag)
        if self.guarding is None or not (own or values is not None):
            skipped = flag if isinstance(flag, bool) else bool(backend.read_flag(flag))
            return Decision(skipped, flag, own)
        checks = self.checks
        agreed = self.agreement is not None and (values is not None or checks.agreed is not None)
        if values is None:  # the iteration's: agreed with the flag, or this rank's (the trainer's are summed)
            values = checks.values if checks.agreed is not None else self._sent(checks.measured)
        verdict = self.guarding.judge(backend, flag, values, group=group,
                                      ranks=self.agreement.reducer.size if agreed else 1,
                                      given_loss=checks.loss is not None)
        return Decision(verdict.reason is not None, flag, exact=own, verdicts=((group, verdict),))

    def undecide(self) -> None:
        """Forget the last decision (the step it allowed raised, so it was not taken)."""
        self.checks = self.checks._replace(decisions=self.checks.decisions[:-1])

    def count(self, skipped: bool) -> None:
        """Count one optimizer step's host decision (steps, skips, the window of recent skips)."""
        self.steps, self.skipped_steps = self.steps + 1, self.skipped_steps + skipped
        self.window.record(skipped)

    # -- the end of an iteration ------------------------------------------------------------
    def concluded(self, found_inf: Any = None, *, skipped: bool | None = None) -> Decision:
        """The decision for the update, advancing on ``found_inf`` (default: the iteration's flag).
        Without a step, the flag is read once where a report or a device-checked agreement needs it."""
        if found_inf is None:
            self.agree_found()
        flag = self.checks.flag if found_inf is None else found_inf
        if flag is None:
            raise ScalerStateError(_NO_CHECKS)
        decisions = self.checks.decisions
        if len(decisions) == 1:  # one step (the engine's, paddle's, one optimizer's)
            one = decisions[0]
            exact = one.exact and found_inf is None or isinstance(flag, bool) and flag == one.skipped
            return Decision(one.skipped, flag, exact, one.verdicts)
        if decisions:
            return self.decided()._replace(flag=flag)
        unverified = found_inf is None and self.agreement is not None and self.agreement.unverified
        if skipped is None and (self.diagnose or unverified):  # update() without step(): one read
            skips = self.scaling.read_flag(flag)
            if skips and unverified:
                self.verify()  # ranks that differ: RankMismatchError before the scale moves
            if self.diagnose:
                self.last_overflow = _skip_report(self) if skips else None
        return Decision(skipped, flag, isinstance(flag, bool) and flag == skipped)

    def decided(self) -> Decision:
        """This iteration's decisions merged, whatever its flag (an end without an update)."""
        checks = self.checks
        verdicts = tuple(gv for d in checks.decisions for gv in d.verdicts)
        return Decision(checks.skipped, checks.flag, False, verdicts)

    def finish(self, decision: Decision, *, describe: Describe | None = None, rule: bool = True,
               new_scale: float | None = None) -> None:
        """End the iteration with ``decision``: the scale rule (``rule=False``: a fixed scale;
        ``new_scale``: set instead), the log line, the floor warning and the guard's record."""
        reports = self.guarding.advance(decision.verdicts) if self.guarding is not None else ()
        try:
            if self.checks.metered is not None:  # after the decision: one read
                self.metering.commit(self.checks, self.scaling.backend, self.agreement)
            if new_scale is not None:
                self.scaling.set_scale(new_scale)
            elif rule:
                self._update(decision, describe)
        finally:  # the iteration ends even if a log handler raises
            self.end()
        if reports:  # after the iteration ended: the hook may load a checkpoint
            self.guarding.act(reports)

    def _update(self, decision: Decision, describe: Describe | None) -> None:
        """The scale rule on ``decision.flag`` (unless the guard held it), its log line, the floor."""
        skipped, flag, reason = decision.skipped, decision.flag, decision.worst
        held = reason not in (None, "overflow")  # the guard skipped with finite gradients
        log, scaling = self.log, self.scaling
        before = scaling.host_state() if skipped is not None and log.wants_scale(skipped) else None
        if skipped is not False and not held and scaling.config.raise_error_at_min_scale:
            scaling.refuse_backoff_at_floor(flag, before)
        if not held:  # a guard-skipped step leaves the scale state as it is
            scaling.advance(flag)
        read = scaling.host_state
        if decision.exact and before is not None:  # the device ran the rule on the same flag: no read
            after = before if held else next_host_state(before, bool(skipped), scaling.config)
            read = lambda: after  # noqa: E731
        if held:
            describe = self.guarding.describer(*next(gv for gv in decision.verdicts if gv[1].reason))
        if skipped is not None:
            detail = "" if self.last_overflow is None else overflow.log_summary(self.last_overflow)
            log.after_update(skipped, before, read, describe or scaling.describe_change, detail, reason)
        if skipped and not held:
            scaling.warn_if_at_floor(True, self.last_overflow)

    def end(self) -> None:
        """Forget this iteration's checks; the agreement's next collective opens a new iteration."""
        self.checks = FRESH
        if self.agreement is not None:
            self.agreement.end_iteration()

    def __getstate__(self) -> dict[str, Any]:
        """Plain data (the scaling pickles its backend by name and its state as host values)."""
        if self.checks.found is not None or self.checks.skipped is not None:
            raise ScalerStateError(_IN_ITERATION)
        return {**self.__dict__, "scaling": copy.copy(self.scaling), "guarding": copy.copy(self.guarding)}


def _skip_report(iteration: Iteration, named: Named | None = None, local: Any = None
                 ) -> overflow.OverflowReport | None:
    """The report on a skipped step's gradients (reads the scale, and this rank's own flag); None and
    a WARNING when it cannot be built: it never leaves the iteration open."""
    try:
        agreed, checks = iteration.agreement is not None, iteration.checks
        local = checks.found if agreed and local is None and checks.agreed is not None else local
        local = None if not agreed or local is None else iteration.scaling.read_flag(local)
        grads = named() if named is not None else list(checks.checked)
        scale = iteration.scaling.host_state().scale
        verdicts = checks.decisions[-1].verdicts if checks.decisions else ()
        if not verdicts:
            return overflow.build_report(grads, scale=scale, skipped=True, agreed=agreed, local_flag=local)
        group, verdict = verdicts[-1]
        if verdict.reason != "overflow":  # the guard's skip
            return replace(overflow.build_report(grads, scale=scale), verdict=verdict,
                           diagnosis=iteration.guarding.diagnosis(group, verdict))
        report = overflow.build_report(grads, scale=scale, skipped=True, agreed=agreed, local_flag=local)
        note = guard.overflow_note(verdict, iteration.guarding.guard)  # and was the loss a spike?
        return replace(report, verdict=verdict, diagnosis=report.diagnosis + note)
    except Exception as exc:  # noqa: BLE001 - any failure of the report, reported and survived
        logger.warning("diagnose=True: the overflow report on this skipped step could not be built "
                       "(%s: %s); the step was skipped as decided. Fix: call polyamp.explain_overflow "
                       "on dense gradients to see them.", type(exc).__name__, exc)
        return None


#: The error of a flag or loss added after the iteration's flag was agreed.
_AFTER_AGREEMENT = (
    "{what} was called after agree_() in the same iteration: the overflow flag is already agreed over "
    "the ranks, and a flag added now would be this rank's alone. Fix: unscale and record every flag "
    "before agree_() (a non-finite global norm needs no flag: the agreed count already has its "
    "non-finite gradients)."
)

#: The error of an update() with nothing checked.
_NO_CHECKS = ("update() found no inf checks recorded this iteration. Fix: call unscale_(grads) or "
              "step(grads, step_fn) first, or pass found_inf=.")

#: The error of a copy taken inside an iteration.
_IN_ITERATION = ("a LossScaler can be copied or pickled only between update() and the next "
                 "unscale_()/step(): this iteration's overflow checks live on the device. "
                 "Fix: call update() first.")
