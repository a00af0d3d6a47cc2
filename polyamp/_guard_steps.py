"""The step guard inside an iteration: each group's history (one per optimizer for the torch facade,
else group 0), the values it sends, its verdicts and a streak's action; the rule is
:mod:`polyamp.guard`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from . import _guard_values, guard
from ._digest import content_digest, to_bytes
from ._guard_values import GuardValues
from .backend import Backend


class GuardSteps:
    """A :class:`polyamp.StepGuard` and what it has seen: each group's history (immutable values,
    replaced as steps are judged) and the last verdict."""

    def __init__(self, step_guard: guard.StepGuard) -> None:
        self.guard = step_guard
        self.histories: dict[int, guard.GuardHistory] = {}
        self.replicated = False  # the shell's gradients are already summed over the ranks (the norm's)
        self.last_verdict: guard.Verdict | None = None
        self.fields = GuardValues.fields(step_guard)  # the slots it sends, in order
        self.maxed = GuardValues.maxed(step_guard)  # per slot: combined over the ranks by their max
        self._settings = to_bytes(step_guard.digest())
        self._history_bytes: dict[int, tuple[guard.GuardHistory, bytes]] = {}  # group -> its digest

    def history_of(self, group: int) -> guard.GuardHistory:
        """The history of ``group`` (empty before its first applied step)."""
        return self.histories.get(group, guard.GuardHistory())

    def require_loss(self, given: bool, where: str, give: str) -> None:
        """Refuse a step of a loss guard that was given no loss (before anything changes)."""
        step_guard = self.guard
        if step_guard.watches_loss and not given:
            raise TypeError(
                f"{where} got no loss, but the scaler's StepGuard(loss_zscore={step_guard.loss_zscore}) "
                f"judges the loss of every step. Fix: {give}, or build the guard without loss_zscore."
            )

    def judge(self, backend: Backend, flag: Any, sent: Any, *, group: int, ranks: int, given_loss: bool
              ) -> guard.Verdict:
        """The flag and the values (combined over ``ranks`` ranks) in the ONE host read, then the rule."""
        overflowed, host = _guard_values.read(backend, flag, sent)
        loss, norm = GuardValues.unpack(self.fields, host).measured(given_loss, ranks, self.replicated)
        verdict = guard.judge(self.guard, self.history_of(group), overflow=overflowed, loss=loss,
                              grad_norm=norm)
        self.last_verdict = verdict
        return verdict

    def whose(self, whose: int, group: int, given_loss: bool) -> int:
        """``whose`` with the guard's settings, whether this rank gave a loss and the group's history
        folded in (a rank where one differs is a misaligned rank)."""
        history = self.history_of(group)
        known = self._history_bytes.get(group)
        if known is None or known[0] is not history:  # a history is immutable: its digest read once
            known = self._history_bytes[group] = (history, to_bytes(history.digest()))
        return content_digest(to_bytes(whose), self._settings, bytes([given_loss]), known[1])

    def advance(self, verdicts: Iterable[tuple[int, guard.Verdict]]) -> list[guard.GuardReport]:
        """Each group's history and streak after its verdict; the streaks' reports that are due."""
        reports, histories = [], dict(self.histories)
        for group, verdict in verdicts:
            histories[group], report = guard.advance(self.guard, histories.get(group, guard.GuardHistory()),
                                                     verdict)
            if report is not None:
                reports.append(report)
        self.histories = histories
        return reports

    def act(self, reports: list[guard.GuardReport]) -> None:
        """``on_streak``'s action on each due report (after the iteration ended: a hook may load)."""
        for report in reports:
            guard.act(self.guard, report)

    def describer(self, group: int, verdict: guard.Verdict) -> Callable[[bool, Any, Any], str]:
        """The log line of a guard-skipped step (worded now: the history moves on first)."""
        why = self.diagnosis(group, verdict)
        return lambda skipped, before, after: f"{why}: step skipped, loss scale kept at {before.scale:g}"

    def diagnosis(self, group: int, verdict: guard.Verdict) -> str:
        """Why the guard skipped, in one line (for a report), with the size of the history that judged it."""
        history = self.history_of(group)
        held = len(history.loss if verdict.reason == "loss_spike" else history.grad_norm)
        return guard.diagnosis(verdict, self.guard, held)
