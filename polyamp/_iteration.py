"""One iteration of a loss scaler, written once: unscale, check, agree, decide, report, update.

Every scaler is a shell over :class:`Iteration`: :class:`polyamp.LossScaler` (one group of
gradients per step), the torch facade (one group per optimizer, torch's stages), the paddle facade
(``minimize``, ``step``/``update``) and the trainer (through the engine). The shells keep their own
order rules and messages; the work is here, once::

    unscale(grads) / record(flag)   -> Checks.found     (device flags, no sync)
    agree() / agree_flag(flag)      -> Checks.agreed    (one collective with a reducer)
    decide(flag)                    -> Decision         (the one host read; a report when skipped)
    finish(concluded())             -> the scale update, its log line, the floor warning, the guard

A step's decision is a value, :class:`Decision`; every way an iteration ends (an update, a new
scale, a fixed scale, a decision without a step) is :meth:`Iteration.finish` of one, so none can
skip the guard's record or leave the iteration open. With a :class:`polyamp.StepGuard` the loss and
the squared gradient norm travel with the flag (one collective, one host read); the guard is a
component, :class:`polyamp._guard_steps.GuardSteps`, called with explicit arguments.

What one iteration has checked so far is one immutable value, :class:`Checks`, replaced as the
iteration moves on and reset by :meth:`Iteration.finish`. The persistent part (config, backend,
the device state, counters, the skip log) lives beside it on the :class:`Iteration`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple

from . import _guard_values, _inputs, _registry, guard, overflow
from ._agreement import Agreed, Agreement, check_extra
from ._errors import ScalerStateError
from ._guard_steps import GuardSteps
from ._guard_values import plus
from ._scaling import Scaling
from ._skip_log import SkipLog
from .backend import Backend
from .config import LossScaleConfig
from .metrics import SkipWindow
from .policy import HostState, next_host_state

logger = logging.getLogger("polyamp")

#: How a shell words one update's scale change: ``describe(skipped, before, after)`` on host states.
Describe = Callable[[bool, HostState, HostState], "str | None"]
#: The named gradients of a report, built only when one is due.
Named = Callable[[], "list[tuple[str, Any]]"]


class Decision(NamedTuple):
    """One step's host decision (immutable), consumed by :meth:`Iteration.finish`.

    ``skipped``: the step was skipped (None: no step was decided, an update without a step).
    ``flag``: what the scale rule advances on (the agreed device flag, or a host bool). ``exact``:
    ``skipped`` was read from this very flag, so the state after the update is the rule's on the
    host state read before it. ``verdicts``: the guard's (group, verdict) pairs.
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
    def held(self) -> bool:
        """The guard skipped with finite gradients: the scale state stays as it is."""
        if not self.verdicts:
            return False
        reasons = {v.reason for _, v in self.verdicts}
        return "overflow" not in reasons and bool(reasons - {None})


class Checks(NamedTuple):
    """What one iteration has checked so far; replaced (never mutated) as it moves on.

    ``found``: this rank's device flags of the iteration, summed (None before the first check).
    ``agreed``: ``found`` agreed over the ranks (None until agreed). ``unscaled``: the shell's
    single unscale ran. ``decisions``: the host decisions of the iteration's steps (one per
    optimizer for the torch facade). ``checked``: (name, gradient) pairs for a report
    (``diagnose=True`` only). ``summed``: the gradients themselves were summed over the ranks
    (:meth:`Iteration.sum_payload`), so every flag checked after it is the same on every rank.
    ``loss``, ``sumsq``: the guard's loss and squared norm (device values); ``values``: what was
    agreed with the flag.
    """

    found: Any = None
    agreed: Any = None
    summed: bool = False
    unscaled: bool = False
    decisions: tuple[Decision, ...] = ()
    checked: tuple[tuple[str, Any], ...] = ()
    loss: Any = None
    sumsq: Any = None
    values: Any = None

    @property
    def skipped(self) -> bool | None:
        """Whether a step of this iteration was skipped (None before any decision)."""
        return any(d.skipped for d in self.decisions) if self.decisions else None

    @property
    def flag(self) -> Any:
        """The flag the decision and the update use: the agreed one once there is one."""
        return self.found if self.agreed is None else self.agreed


#: ``decide()``'s default flag: the iteration's own (agreed first).
OWN: Any = object()


class Iteration:
    """A scaler's state and the steps of its iteration (see the module docstring).

    ``agreement`` (a :class:`polyamp._agreement.Agreement`, or None) agrees flags across ranks;
    a shell may set it later (the sharded facade resolves its default group at first use).
    """

    def __init__(
        self, config: LossScaleConfig, backend: Backend | None, *, agreement: Agreement | None = None,
        diagnose: bool = False, step_guard: guard.StepGuard | None = None,
    ) -> None:
        self.scaling = Scaling(config, backend)  # the config, the backend, the scale state
        self.guarding = None if step_guard is None else GuardSteps(step_guard)  # its histories, per group
        self.agreement = agreement
        self.diagnose = diagnose
        self.log = SkipLog()  # the first skips one INFO line each, then a summary per window
        self.last_overflow: overflow.OverflowReport | None = None
        self.checks = Checks()
        self.steps = 0
        self.skipped_steps = 0
        self.window = SkipWindow()  # the skips of the last steps, for metrics(); host-only

    @property
    def guard(self) -> guard.StepGuard | None:
        """The :class:`polyamp.StepGuard` judging each step, or None."""
        return None if self.guarding is None else self.guarding.guard

    @property
    def watches_norm(self) -> bool:
        """Whether a guard's norm rule needs each group's sum of squares."""
        return self.guarding is not None and self.guarding.guard.watches_norm

    @property
    def histories(self) -> dict[int, guard.GuardHistory]:
        """The guard's history per group (empty without a guard); set to load saved ones."""
        return {} if self.guarding is None else self.guarding.histories

    @histories.setter
    def histories(self, value: dict[int, guard.GuardHistory]) -> None:
        if self.guarding is not None:
            self.guarding.histories = dict(value)

    @property
    def last_verdict(self) -> guard.Verdict | None:
        """The guard's last verdict (None without a guard or before its first)."""
        return None if self.guarding is None else self.guarding.last_verdict

    @property
    def config(self) -> LossScaleConfig:
        """The config in force (the scaling's)."""
        return self.scaling.config

    def load(self, config: LossScaleConfig, host: HostState) -> None:
        """Replace the config and the state; forget the checks. The agreement's count of iterations
        is kept: a rank that loads alone is a rank whose state differs, and the next agreement says so."""
        self.scaling.config = config
        self.scaling.load(host)
        self.checks = Checks()

    # -- checking -------------------------------------------------------------------------
    def unscale(self, grads: Iterable[Any], *, check_only: bool = False, where: str = "unscale_()",
                owned: bool = False) -> Any:
        """Divide one group of gradients by the scale in place (``check_only``: only check them);
        return the group's device flag, added to :attr:`checks`. No host synchronisation.

        ``grads`` may be a mapping name -> gradient (names in reports). ``owned``: a list of arrays
        the caller has already found to be floating arrays of the bound backend (the torch facade's
        ``collect_grads``), so they are not read again here.
        """
        if self.checks.agreed is not None:
            self._refuse_after_agreement("unscale_()")
        given, names = (list(grads.values()), list(map(str, grads))) if isinstance(grads, Mapping) else (
            grads, None)
        if self.diagnose:
            given = list(given)  # read twice: checked here, named for the report below
        scaling = self.scaling
        if owned and scaling.backend is not None and scaling.state is not None:
            arrays = given  # the shell checked their library and dtypes (the torch facade's collect_grads)
        else:
            arrays = _inputs.gradient_list(given, where)  # refuses bad gradients before any state changes
            if arrays:
                _inputs.check_owned(arrays, scaling.bind(arrays[0]), where)
        found, squares = scaling.unscale(arrays, check_only=check_only, keep=self.diagnose,
                                         squares=self.watches_norm)
        checks = self.checks
        checked = checks.checked
        if self.diagnose:
            checked += tuple(overflow.name_gradients(given, names, len(checked)))
        sumsq = checks.sumsq if squares is None else plus(checks.sumsq, squares)
        total = found if checks.found is None else checks.found + found  # plus() inline: per step
        self.checks = checks._replace(found=total, unscaled=True, checked=checked, sumsq=sumsq)
        return found

    def record(self, flag: Any) -> None:
        """Add a device flag (non-zero: a bad step) to the iteration's check. No sync."""
        self._refuse_after_agreement("record_found_inf()")
        self.checks = self.checks._replace(found=plus(self.checks.found, flag))

    def _refuse_after_agreement(self, what: str) -> None:
        if self.checks.agreed is not None:
            raise ScalerStateError(
                f"{what} was called after agree_() in the same iteration: the overflow flag is "
                "already agreed over the ranks, and a flag added now would be this rank's alone. "
                "Fix: unscale and record every flag before agree_() (a non-finite global norm "
                "needs no flag: the agreed count already has its non-finite gradients)."
            )

    # -- agreeing across ranks ------------------------------------------------------------
    def agree(self, extra: Any = None) -> Agreed:
        """The iteration's flag (and ``extra``) agreed over the ranks in ONE collective; without
        an agreement the local values and nothing is sent. Once per iteration, after the checks."""
        found = self.checks.found
        check_extra(extra)
        sent = self._sent(self.checks.sumsq)
        if self.agreement is None:
            self.checks = self.checks._replace(values=sent)
            return Agreed(found, extra)
        both, users = _guard_values.joined(extra, sent)
        whose = self.whose(0)
        agreed = self.agreement.flag_and_extra(found, both, self.config, self._fingerprinted(), whose=whose)
        theirs, values = _guard_values.split(agreed.extra, users, extra, sent)
        self.checks = self.checks._replace(agreed=agreed.found_inf, values=values)
        return Agreed(agreed.found_inf, theirs)

    def agree_found(self) -> None:
        """Agree the iteration's flag unless done, summed with the data, or there is no agreement."""
        checks = self.checks
        pending = checks.found is not None and checks.agreed is None and not checks.summed
        if self.agreement is not None and pending:
            self.agree()

    def check_payload(self, payload: int, like: Any, *, whose: int = 0) -> None:
        """Check, in one fixed-size agreement, that every rank will sum ``payload`` values under
        the same config and state (a rank whose model differs is named instead of breaking the
        transport); one host read of the result on a GPU. ``like``: an array on the state's device."""
        backend = self.scaling.backend or _registry.backend_for_array(like)
        zero = backend.full(0.0, "float32", like)
        agreement = self._needs_agreement("check_payload")
        agreement.flag_and_extra(zero, None, self.config, self._fingerprinted(), payload=payload, whose=whose)
        agreement.verify()

    def sum_payload(self, storage: Any, payload: int, *, whose: int = 0) -> None:
        """Sum ``storage`` (data-parallel gradients: ``payload`` values, the fingerprint after them)
        over the ranks in place: ONE collective for the whole step. Flags checked after it are the
        same on every rank, so the decision issues no other; ranks found to differ on the device
        join the check (the decision names them)."""
        agreement = self._needs_agreement("sum_payload")
        off = agreement.sum_payload_(storage, payload, self.config, self._fingerprinted(), whose=whose)
        checks = self.checks
        found = checks.found if off is None else plus(checks.found, off)
        self.checks = checks._replace(summed=True, found=found)

    def _needs_agreement(self, what: str) -> Agreement:
        if self.agreement is None:
            raise ScalerStateError(f"{what}() needs a scaler built with reducer=. Fix: pass reducer=.")
        return self.agreement

    def _fingerprinted(self) -> Any:
        """The state a fingerprint carries: the device arrays, or the host state before there are any."""
        return self.scaling.host if self.scaling.state is None else self.scaling.state

    def agree_flag(self, found_inf: Any, *, whose: int = 0) -> Any:
        """One group's flag summed over the ranks, as a new device array (one collective);
        None (a rank without gradients) sends 0 and a host bool 0 or 1. Without an agreement:
        ``found_inf`` as it is. The iteration's own checks are not touched."""
        if self.agreement is None:
            return found_inf
        found_inf = self.scaling.flag_array(found_inf)
        return self.agreement.flag(found_inf, self.config, self.scaling.state, whose=whose)

    def verify(self) -> None:
        """After a decision read a non-zero agreed flag: RankMismatchError if the ranks differ."""
        if self.agreement is not None:
            self.agreement.verify()

    # -- the guard's inputs ------------------------------------------------------------------
    def take_loss(self, loss: Any, where: str) -> None:
        """Add ``loss`` to this iteration's loss for the guard (summed, as the facades' losses since
        the last update); ignored without a guard. No sync (a number goes to the device)."""
        if self.guarding is None or loss is None:
            return
        self._refuse_after_agreement(f"{where} with loss=")
        backend = self.scaling.backend
        if self.scaling.state is None:  # no gradients yet: the loss's own library decides the backend
            backend = self.scaling.bind(loss) if hasattr(loss, "shape") else self.scaling.ready()[0]
        like = self.scaling.ready()[1].scale
        try:
            value = _guard_values.loss_value(loss, backend, like, where)
        except BaseException:  # e.g. a tensor that cannot be read: the iteration ends, not half open
            self.end()
            raise
        self.checks = self.checks._replace(loss=plus(self.checks.loss, value))

    def require_loss(self, loss: Any, where: str,
                     give: str = "pass loss= (e.g. step(grads, step_fn, loss=loss))") -> None:
        """Refuse a step of a loss guard that was given no loss (before anything changes)."""
        if self.guarding is not None:
            self.guarding.require_loss(loss is not None or self.checks.loss is not None, where, give)

    def squares(self, arrays: list[Any]) -> Any:
        """One group's sum of squares when a norm rule is set, else None (no sync)."""
        if not self.watches_norm or not arrays:
            return None
        return _guard_values.squared_norm(self.scaling.ready()[0], arrays)

    def whose(self, whose: int, group: int = 0) -> int:
        """The identity a collective names: ``whose``, with the guard's settings, this rank's loss
        and the group's history folded in when there is a guard."""
        if self.guarding is None:
            return whose
        return self.guarding.whose(whose, group, self.checks.loss is not None)

    def _sent(self, squares: Any) -> Any:
        """This rank's guard values to agree (None without a guard)."""
        if self.guarding is None:
            return None
        backend, state = self.scaling.ready()
        return self.guarding.sent(backend, self.checks.loss, squares, state.scale)

    def agree_group(self, found: Any, squares: Any, group: int, *, whose: int = 0) -> Agreed:
        """One group's flag and guard values (the iteration's loss, its squares) agreed over the
        ranks in ONE collective (the torch facades' per-optimizer agreement)."""
        found = self.scaling.flag_array(found)
        sent = self._sent(squares)
        if self.agreement is None:
            return Agreed(found, sent)
        return self.agreement.flag_and_extra(found, sent, self.config, self.scaling.state,
                                             whose=self.whose(whose, group))

    # -- the decision -----------------------------------------------------------------------
    def decide(
        self, flag: Any = OWN, *, values: Any = None, group: int = 0, named: Named | None = None,
        local: Any = None, keep_report: bool = False,
    ) -> Decision:
        """The skip decision, recorded in :attr:`checks`: ``flag`` (default: the iteration's, agreed
        first; None: no gradients) and a guard's ``values`` read on the host in the step's one sync,
        judged against ``group``'s history. A skip raises for misaligned ranks first, then makes
        the report (``diagnose=True``: on ``named()``'s gradients, else the checked ones; ``local``:
        this rank's flag). ``keep_report``: an applied step keeps an earlier report. A failure ends
        the iteration."""
        try:
            decision = self._decision(flag, values, group)
            if decision.skipped and (not decision.verdicts or decision.verdicts[-1][1].reason == "overflow"):
                self.verify()  # ranks that differ: RankMismatchError before anything applies
        except BaseException:
            self.end()
            raise
        self.checks = self.checks._replace(decisions=(*self.checks.decisions, decision))
        if self.diagnose and (decision.skipped or not keep_report):
            self.last_overflow = self._report(named, local) if decision.skipped else None
        return decision

    def _decision(self, flag: Any, values: Any, group: int) -> Decision:
        """The flag (and the guard's values) read on the host, judged: one :class:`Decision`."""
        own = flag is OWN
        if own:
            self.agree_found()
            flag = self.checks.flag
        flag = False if flag is None else flag
        scaling = self.scaling
        bound = scaling.backend is not None or isinstance(flag, bool)
        backend = scaling.backend if bound else scaling.bind(flag)
        if self.guarding is None or not (own or values is not None):
            skipped = flag if isinstance(flag, bool) else bool(backend.read_flag(flag))
            return Decision(skipped, flag, exact=own)
        agreed = self.agreement is not None and (values is not None or self.checks.agreed is not None)
        if values is None:  # the iteration's: agreed with the flag, or this rank's (the trainer's are summed)
            values = self.checks.values if self.checks.agreed is not None else self._sent(self.checks.sumsq)
        ranks = self.agreement.reducer.size if agreed else 1
        verdict = self.guarding.judge(backend, flag, values, group=group, ranks=ranks,
                                      given_loss=self.checks.loss is not None)
        return Decision(verdict.reason is not None, flag, exact=own, verdicts=((group, verdict),))

    def undecide(self) -> None:
        """Forget the last decision (the step it allowed raised, so it was not taken)."""
        self.checks = self.checks._replace(decisions=self.checks.decisions[:-1])

    def count(self, skipped: bool) -> None:
        """Count one optimizer step's host decision: steps, skipped steps, the window of recent skips
        (every shell, for ``metrics()``; the facades keep their own ``skipped_steps`` beside it)."""
        self.steps += 1
        self.skipped_steps += skipped
        self.window.record(skipped)

    def _report(self, named: Named | None = None, local: Any = None) -> overflow.OverflowReport | None:
        """The report on a skipped step's gradients (reads the scale, and with an agreement this
        rank's own flag, to tell whether another rank overflowed); None and a WARNING when it
        cannot be built (e.g. a layout the counts do not support): it never leaves the iteration open."""
        try:
            agreed, checks = self.agreement is not None, self.checks
            local = checks.found if agreed and local is None and checks.agreed is not None else local
            local = None if not agreed or local is None else self.scaling.read_flag(local)
            grads = named() if named is not None else list(checks.checked)
            scale = self.scaling.host_state().scale
            last = checks.decisions[-1] if checks.decisions else None
            if last is None or not last.verdicts or last.reason == "overflow":
                report = overflow.build_report(grads, scale=scale, skipped=True, agreed=agreed,
                                               local_flag=local)
                if last is None or not last.verdicts:
                    return report
                verdict = last.verdicts[-1][1]  # an overflow: the guard's values, and was the loss a spike?
                return replace(report, verdict=verdict,
                               diagnosis=report.diagnosis + guard.overflow_note(verdict, self.guarding.guard))
            group, verdict = last.verdicts[-1]  # the guard's skip
            return replace(overflow.build_report(grads, scale=scale), verdict=verdict,
                           diagnosis=self.guarding.diagnosis(group, verdict))
        except Exception as exc:  # noqa: BLE001 - any failure of the report, reported and survived
            logger.warning("diagnose=True: the overflow report on this skipped step could not be built "
                           "(%s: %s); the step was skipped as decided. Fix: call polyamp.explain_overflow "
                           "on dense gradients to see them.", type(exc).__name__, exc)
            return None

    # -- the end of an iteration ------------------------------------------------------------
    def concluded(self, found_inf: Any = None, *, skipped: bool | None = None) -> Decision:
        """The iteration's decision for its update: its steps' decisions merged, advancing on
        ``found_inf`` (default: the iteration's flag, agreed first). Without a decided step
        (``skipped``: a shell's own answer, e.g. the torch facade's fused steps) an update reads the
        flag once where ``diagnose=True`` or a device-checked agreement needs it."""
        if found_inf is None:
            self.agree_found()
        flag = self.checks.flag if found_inf is None else found_inf
        if flag is None:
            raise ScalerStateError(
                "update() found no inf checks recorded this iteration. Fix: call "
                "unscale_(grads) or step(grads, step_fn) first, or pass found_inf=."
            )
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
                self.last_overflow = self._report() if skips else None
        return Decision(skipped, flag, isinstance(flag, bool) and flag == skipped)

    def decided(self) -> Decision:
        """This iteration's decisions merged, whatever its flag (an end without an update)."""
        checks = self.checks
        verdicts = tuple(gv for d in checks.decisions for gv in d.verdicts)
        return Decision(checks.skipped, checks.flag, False, verdicts)

    def finish(self, decision: Decision, *, describe: Describe | None = None, rule: bool = True,
               new_scale: float | None = None) -> None:
        """End the iteration with ``decision``: the scale rule on its flag (``rule=False``: a fixed
        scale; ``new_scale``: set instead, as torch's ``update(new_scale)``), the log line
        (``describe``, default :meth:`describe_change`; the first skips at INFO, then a summary per
        window: :mod:`polyamp._skip_log`), the floor warning, the guard's histories and a streak's
        action. Reads the scale only when a line is due; not again when ``decision.exact``."""
        reports = self.guarding.advance(decision.verdicts) if self.guarding is not None else ()
        try:
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
        skipped, flag, held = decision.skipped, decision.flag, decision.held
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
            reason = _first_reason({v.reason for _, v in decision.verdicts}) if decision.verdicts else None
            detail = "" if self.last_overflow is None else overflow.log_summary(self.last_overflow)
            log.after_update(skipped, before, read, describe or scaling.describe_change, detail, reason)
        if skipped and not held:
            scaling.warn_if_at_floor(True, self.last_overflow)

    def end(self) -> None:
        """Forget this iteration's checks; the agreement's next collective opens a new iteration."""
        self.checks = Checks()
        if self.agreement is not None:
            self.agreement.end_iteration()

    # -- copies -----------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Plain data (the scaling pickles its backend by name and its state as host values)."""
        if self.checks.found is not None or self.checks.skipped is not None:
            raise ScalerStateError(
                "a LossScaler can be copied or pickled only between update() and the next "
                "unscale_()/step(): this iteration's overflow checks live on the device. "
                "Fix: call update() first."
            )
        parts = {"scaling": copy.copy(self.scaling), "guarding": copy.copy(self.guarding)}  # a copy's own
        return {**self.__dict__, **parts}


def _first_reason(reasons: set[str | None]) -> str | None:
    """The first of :data:`polyamp.guard.REASONS` among ``reasons`` (None: none, or no guard)."""
    return next((r for r in guard.REASONS if r in reasons), None)


