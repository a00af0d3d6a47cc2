"""The step guard's part of an iteration: the loss taken, the values agreed and read with the
flag, each group's verdict and history, and a streak's action. :class:`GuardSteps` is a base of
:class:`polyamp._iteration.Iteration` (it uses the iteration's ``checks``, ``agreement``,
``guard``, ``histories``, ``ready``, ``bind``, ``verify`` and ``end``); the rule is
:mod:`polyamp.guard`'s and the array work :mod:`polyamp._guard_values`'.

One group per step for the engine, the paddle facade and the trainer (group 0); one per optimizer
for the torch facade (:meth:`GuardSteps.agree_group`, :meth:`GuardSteps.decide_group`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

from . import _guard_values, guard
from ._agreement import Agreed
from ._guard_values import plus
from .backend import Backend


class GuardSteps:
    """The guard's methods of an iteration (see the module docstring); no state of its own."""

    # provided by Iteration
    checks: Any
    agreement: Any
    guard: guard.StepGuard | None
    histories: dict[int, guard.GuardHistory]
    last_verdict: guard.Verdict | None
    replicated: bool
    diagnose: bool
    last_overflow: Any
    state: Any
    backend: Any
    bind: Callable[[Any], Backend]
    ready: Callable[[], tuple[Backend, Any]]
    verify: Callable[[], None]
    end: Callable[[], None]
    _refuse_after_agreement: Callable[[str], None]
    _report_or_warn: Callable[..., Any]

    @property
    def history(self) -> guard.GuardHistory:
        """The guard's history of group 0 (the engine's only one)."""
        return self.histories.get(0, guard.GuardHistory())

    @history.setter
    def history(self, value: guard.GuardHistory) -> None:
        self.histories = {**self.histories, 0: value}

    def take_loss(self, loss: Any, where: str) -> None:
        """Add ``loss`` to this iteration's loss for the guard (summed, as the facades' losses since
        the last update); ignored without a guard. No sync (a number goes to the device)."""
        if self.guard is None or loss is None:
            return
        self._refuse_after_agreement(f"{where} with loss=")
        like = self.state.scale if self.state is not None else None
        backend = self.backend
        if like is None:  # no gradients yet: the loss's own library decides the backend
            backend = self.bind(loss) if hasattr(loss, "shape") else self.ready()[0]
            like = self.ready()[1].scale
        value = _guard_values.loss_value(loss, backend, like, where)
        self.checks = self.checks._replace(loss=plus(self.checks.loss, value))

    def require_loss(self, loss: Any, where: str,
                     give: str = "pass loss= (e.g. step(grads, step_fn, loss=loss))") -> None:
        """Refuse a step of a loss guard that was given no loss (before anything changes);
        ``give``: how the shell's user gives one."""
        step_guard = self.guard
        if step_guard is not None and step_guard.watches_loss and loss is None and self.checks.loss is None:
            raise TypeError(
                f"{where} got no loss, but the scaler's StepGuard(loss_zscore={step_guard.loss_zscore}) "
                f"judges the loss of every step. Fix: {give}, or build the guard without loss_zscore."
            )

    def _guard_sent(self) -> Any:
        """This rank's guard values to agree (None without a guard or values)."""
        if self.guard is None:
            return None
        checks = self.checks
        backend, state = self.ready()
        return _guard_values.values(backend, self.guard, checks.loss, checks.sumsq, state.scale)

    def _judge(self, backend: Backend, flag: Any, sent: Any, group: int, agreed: bool) -> bool:
        """The guard's decision: the flag and the values (``agreed``: summed over the ranks) in the
        ONE host read, then the rule."""
        checks = self.checks
        overflowed, host = _guard_values.read(backend, flag, sent)
        ranks = self.agreement.reducer.size if agreed and self.agreement is not None else 1
        loss, norm = _guard_values.unpack(self.guard, checks.loss is not None, host, ranks, self.replicated)
        history = self.histories.get(group, guard.GuardHistory())
        verdict = guard.judge(self.guard, history, overflow=overflowed, loss=loss, grad_norm=norm)
        self.checks = checks._replace(verdicts=(*checks.verdicts, (group, verdict)))
        self.last_verdict = verdict
        return verdict.reason is not None

    def _whose(self, whose: int, group: int) -> int:
        """``whose`` with the guard's settings, whether this rank gave a loss and the group's guard
        history folded in (a rank where one differs is a misaligned rank); ``whose`` itself
        without a guard."""
        if self.guard is None:
            return whose
        history = self.histories.get(group, guard.GuardHistory())
        mine = (whose.to_bytes(8, "little") + self.guard.digest().to_bytes(4, "little")
                + bytes([self.checks.loss is not None]))
        return zlib.crc32(mine, history.digest())

    def squares(self, backend: Backend, arrays: list[Any]) -> Any:
        """One group's sum of squares when a norm rule is set, else None (no sync)."""
        if self.guard is None or not self.guard.watches_norm or not arrays:
            return None
        return _guard_values.squared_norm(backend, arrays)

    def agree_group(self, found: Any, squares: Any, group: int, *, whose: int = 0) -> Agreed:
        """One group's flag and guard values (the iteration's loss, its squares) agreed over the
        ranks in ONE collective (the sharded facade's per-optimizer agreement)."""
        backend, state = self.ready()
        if found is None or isinstance(found, bool):
            found = backend.full(float(bool(found)), "float32", state.scale)
        sent = _guard_values.values(backend, self.guard, self.checks.loss, squares, state.scale)
        if self.agreement is None:
            return Agreed(found, sent)
        return self.agreement.flag_and_extra(found, sent, self.config, state, whose=self._whose(whose, group))

    def decide_group(self, flag: Any, values: Any, group: int, *, named: Any = None,
                     keep_report: bool = False) -> bool:
        """One group's skip decision with the guard: ``flag`` and ``values`` (agreed, or this
        rank's) read in ONE host read, judged against the group's history."""
        backend = self.ready()[0]
        skipped = self._judge(backend, flag, values, group, self.agreement is not None)
        if skipped and self.checks.verdict.reason == "overflow":
            self.verify()
        if self.diagnose and (skipped or not keep_report):
            self.last_overflow = self._report_or_warn(named, None) if skipped else None
        return skipped

    def settle_guard(self) -> None:
        """End the iteration without a scale update (a fixed scale): the guard's histories and
        streaks move on with its verdicts, and a streak's action runs."""
        reports = self._advance_guard(self.checks.verdicts)
        self.end()
        for report in reports:
            guard.act(self.guard, report)

    def _advance_guard(self, verdicts: tuple[tuple[int, guard.Verdict], ...]) -> list[guard.GuardReport]:
        """Each group's history and streak after its verdict; the streaks' reports that are due."""
        reports, histories = [], dict(self.histories)
        for group, verdict in verdicts:
            histories[group], report = guard.advance(self.guard, histories.get(group, guard.GuardHistory()),
                                                     verdict)
            if report is not None:
                reports.append(report)
        self.histories = histories
        return reports

    def _judged(self, group: int, verdict: guard.Verdict) -> int:
        """How many values the history that judged ``verdict`` holds (for its words)."""
        history = self.histories.get(group, guard.GuardHistory())
        return len(history.loss if verdict.reason == "loss_spike" else history.grad_norm)

    def _describe_guarded(self, group: int, verdict: guard.Verdict) -> Callable[[bool, Any, Any], str]:
        held = self._judged(group, verdict)  # read now: the histories move on before the line is written
        return lambda skipped, before, after: guard.describe(verdict, self.guard, before.scale, held)
