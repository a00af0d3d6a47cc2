"""The step guard: skip a step whose loss or gradient norm is a spike against the applied steps.

The rule (docs/guard.md, "The rule") in plain Python on host floats: the iteration brings the values,
agreed over the ranks, in the step's one collective and its one host read. A skipped step's values
never enter a history, so a run of spikes cannot make itself normal.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ._digest import content_digest
from ._errors import ConfigError, StateDictError, StepGuardError
from .config import _plain, is_real, short_repr

logger = logging.getLogger("polyamp")

__all__ = ["GuardHistory", "GuardReport", "StepGuard", "Verdict", "advance", "judge"]

#: The reasons a step is skipped, in the order the first that applies is named.
REASONS = ("overflow", "grad_norm_limit", "grad_norm_spike", "loss_spike")
#: The quantities a guard keeps histories of (StepResult.zscores' keys).
QUANTITIES = ("loss", "grad_norm")


@dataclass(frozen=True, kw_only=True)
class StepGuard:
    """When a step with finite gradients is still skipped: loss and gradient-norm spikes.

    ``loss_zscore`` / ``grad_norm_zscore``: skip when the value's z-score over the history of the
    last ``window`` applied steps exceeds it (judged once ``min_history`` values are there;
    None: ``max(20, window // 2)``). ``max_grad_norm``: skip when the global gradient norm exceeds
    it. ``max_consecutive_skips=N``: after N skips in a row (any reason), ``on_streak`` acts:
    ``"raise"`` (:class:`polyamp.StepGuardError`), ``"warn"`` (one WARNING) or a callable given a
    :class:`GuardReport` (a rollback hook); then the streak restarts.
    """

    loss_zscore: float | None = None
    grad_norm_zscore: float | None = None
    max_grad_norm: float | None = None
    window: int = 128
    min_history: int | None = None
    max_consecutive_skips: int | None = None
    on_streak: str | Callable[[GuardReport], Any] = "raise"

    def __post_init__(self) -> None:
        for name in ("window", "min_history", "max_consecutive_skips"):  # NumPy scalars: Python ints,
            object.__setattr__(self, name, _plain(getattr(self, name), integral=True))  # as LossScaleConfig
        for name in ("loss_zscore", "grad_norm_zscore", "max_grad_norm"):
            object.__setattr__(self, name, _positive(name, _plain(getattr(self, name), integral=False)))
        _count("window", self.window, 2, "a history needs 2 values for a standard deviation")
        if self.min_history is not None:
            _count("min_history", self.min_history, 2, "a standard deviation needs 2 values")
        if self.history_needed > self.window:
            given = "min_history" if self.min_history is not None else \
                "min_history=None (max(20, window // 2))"
            raise ConfigError(
                f"{given} must be <= window, got min_history={self.history_needed} and window="
                f"{self.window}: the history never holds that many values, so no z-score would be judged. "
                f"Fix: pass min_history={max(2, self.window // 2)} or a window >= {self.history_needed}."
            )
        if self.max_consecutive_skips is not None:
            _count("max_consecutive_skips", self.max_consecutive_skips, 1, "a streak is 1 skip or more")
        if not (self.on_streak in ("raise", "warn") or callable(self.on_streak)):
            raise ConfigError(
                f"on_streak must be 'raise', 'warn' or a callable taking a polyamp.GuardReport, got "
                f"on_streak={short_repr(self.on_streak)}. Fix: pass e.g. on_streak='warn'."
            )

    @property
    def history_needed(self) -> int:
        """``min_history``, or its default ``max(20, window // 2)``."""
        return self.min_history if self.min_history is not None else max(20, self.window // 2)

    @property
    def watches_norm(self) -> bool:
        """Whether a norm rule is set (only then is the gradient norm computed)."""
        return self.grad_norm_zscore is not None or self.max_grad_norm is not None

    @property
    def watches_loss(self) -> bool:
        """Whether the loss is judged (then every step needs a loss)."""
        return self.loss_zscore is not None

    def digest(self) -> int:
        """A 128-bit digest of the settings every rank must hold equal (any callable ``on_streak`` alike)."""
        action = self.on_streak if isinstance(self.on_streak, str) else "callable"
        return content_digest(repr((self.loss_zscore, self.grad_norm_zscore, self.max_grad_norm, self.window,
                                    self.history_needed, self.max_consecutive_skips, action)).encode())

    def thresholds(self) -> dict[str, float]:
        """quantity -> its z threshold, for the quantities with a z rule (those keep a history)."""
        found = {"loss": self.loss_zscore, "grad_norm": self.grad_norm_zscore}
        return {name: z for name, z in found.items() if z is not None}


def _positive(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if not (is_real(value) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be None or a finite number > 0, got {name}={short_repr(value)}. "
                          f"Fix: pass e.g. {name}=6.0, or None to turn this rule off.")
    return float(value)


def _count(name: str, value: Any, least: int, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name} must be an int >= {least} ({why}), got {name}={short_repr(value)}. "
                          f"Fix: pass e.g. {name}={max(least, 20)}.")


class GuardHistory(NamedTuple):
    """A guard's state: the histories of applied steps (oldest first) and the streak of skips."""

    loss: tuple[float, ...] = ()
    grad_norm: tuple[float, ...] = ()
    streak: int = 0
    reasons: tuple[str, ...] = ()  # the reasons of the streak's skips, oldest first

    def digest(self) -> int:
        """A non-zero 128-bit digest of every value (what must be equal on every rank)."""
        packed = struct.pack(f"<{len(self.loss) + len(self.grad_norm)}d", *self.loss, *self.grad_norm)
        head = f"{len(self.loss)},{self.streak},{','.join(self.reasons)}".encode()
        return content_digest(head, packed)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (floats round-trip exactly through JSON)."""
        return {"loss": list(self.loss), "grad_norm": list(self.grad_norm), "streak": self.streak,
                "reasons": list(self.reasons)}

    @classmethod
    def from_dict(cls, data: Any, where: str = "state_dict['guard']") -> GuardHistory:
        """Validated whole; StateDictError naming the key otherwise."""
        if not isinstance(data, dict):
            raise StateDictError(f"{where} must be a dict, got {short_repr(data)}")
        values = {}
        for key in QUANTITIES:
            got = data.get(key, [])
            if not isinstance(got, list) or not all(is_real(v) and math.isfinite(v) for v in got):
                raise StateDictError(f"{where}[{key!r}] must be a list of finite numbers, got "
                                     f"{short_repr(got)}. Fix: load a state_dict written by state_dict().")
            values[key] = tuple(float(v) for v in got)
        streak, reasons = data.get("streak", 0), data.get("reasons", [])
        if isinstance(streak, bool) or not isinstance(streak, int) or streak < 0:
            raise StateDictError(f"{where}['streak'] must be an int >= 0, got {short_repr(streak)}")
        if not isinstance(reasons, list) or any(r not in REASONS for r in reasons) or len(reasons) != streak:
            raise StateDictError(f"{where}['reasons'] must list one of {REASONS} per skip of the streak "
                                 f"({streak}), got {short_repr(reasons)}")
        return cls(values["loss"], values["grad_norm"], streak, tuple(reasons))

    def fitted(self, window: int) -> GuardHistory:
        """The histories cut to the last ``window`` values (a guard with a smaller window loaded them)."""
        return self._replace(loss=self.loss[-window:], grad_norm=self.grad_norm[-window:])


class Verdict(NamedTuple):
    """One step's decision: ``reason`` (None: applied), the agreed values, the z-scores judged."""

    reason: str | None
    loss: float | None
    grad_norm: float | None
    zscores: dict[str, float] | None
    loss_spike: bool | None = None  # loss_zscore's rule on the loss, judged on an overflow step too


def verdict_field(name: str, doc: str) -> Any:
    """A read-only property: the embedded ``verdict``'s field ``name``, None without a verdict."""
    def read(self: Any) -> Any:
        return None if self.verdict is None else getattr(self.verdict, name)

    return property(read, doc=doc)


class VerdictFields:
    """The guard's values of a report, read from the :class:`Verdict` it embeds as ``verdict``."""

    loss = verdict_field("loss", "The agreed loss the guard judged (None when not seen).")
    grad_norm = verdict_field("grad_norm", "The agreed gradient norm the guard judged (None when not seen).")
    zscores = verdict_field("zscores", "Quantity -> z-score judged (None before ``min_history``).")
    loss_spike = verdict_field("loss_spike", "Whether the loss was a spike by ``loss_zscore``'s rule, also "
                               "on an overflow step (True: a bad batch, False: a scale grown too far); None "
                               "when not judged.")


def why(verdict: Verdict | None, skipped: bool | None) -> str | None:
    """A step's reason: the guard's verdict's, else ``"overflow"`` when it was skipped."""
    return verdict.reason if verdict is not None else ("overflow" if skipped else None)


@dataclass(frozen=True)
class GuardReport(VerdictFields):
    """What ``on_streak`` is given after ``max_consecutive_skips`` skips in a row (every rank alike)."""

    streak: int
    reasons: tuple[str, ...]
    mean: dict[str, float]
    std: dict[str, float]
    verdict: Verdict  # the last skip's

    def __str__(self) -> str:
        counts = ", ".join(f"{r} x{self.reasons.count(r)}" for r in dict.fromkeys(self.reasons))
        stats = "; ".join(f"{q} mean {self.mean[q]:.6g} std {self.std[q]:.6g}" for q in self.mean)
        spike = {None: "", True: " (a spike)", False: " (not a spike)"}[self.loss_spike]
        return (f"{self.streak} steps skipped in a row ({counts}); last loss {_text(self.loss)}{spike}, last "
                f"grad norm {_text(self.grad_norm)}" + (f"; history: {stats}" if stats else ""))


def _text(value: float | None) -> str:
    return "not given" if value is None else f"{value:.6g}"


def mean_std(history: Sequence[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (ddof=1) of at least 2 finite values, in float64,
    computed on the values scaled by a power of two (exact) so that no square overflows."""
    n = len(history)
    top = max(map(abs, history))
    shift = math.frexp(top)[1] if top > 0 and math.isfinite(top) else 0
    scaled = [math.ldexp(x, -shift) for x in history]
    mean = math.fsum(scaled) / n
    std = math.sqrt(math.fsum((x - mean) * (x - mean) for x in scaled) / (n - 1))
    return _ldexp(mean, shift), _ldexp(std, shift)


def _ldexp(value: float, shift: int) -> float:
    """``value * 2**shift``, inf past float64's range (a std of values near its largest)."""
    try:
        return math.ldexp(value, shift)
    except OverflowError:
        return math.copysign(math.inf, value)


def judge(guard: StepGuard, history: GuardHistory, *, overflow: bool, loss: float | None,
          grad_norm: float | None) -> Verdict:
    """The decision of the guard's rule on host floats (pure; nothing changes)."""
    zscores: dict[str, float] | None = None
    values = {"loss": loss, "grad_norm": grad_norm}
    for name in guard.thresholds():
        value, past = values[name], getattr(history, name)
        if len(past) >= guard.history_needed and value is not None:
            mean, std = mean_std(past)
            zscores = {} if zscores is None else zscores
            if std > 0 and not math.isnan(value):  # an inf (squares past float32's range) is a spike
                zscores[name] = (value - mean) / std
    z = zscores or {}
    spike = loss_spike(guard, loss, zscores)
    if overflow:
        reason = "overflow"
    elif guard.max_grad_norm is not None and grad_norm is not None and not grad_norm <= guard.max_grad_norm:
        reason = "grad_norm_limit"
    elif guard.grad_norm_zscore is not None and grad_norm is not None and (
            not math.isfinite(grad_norm) or z.get("grad_norm", -math.inf) > guard.grad_norm_zscore):
        reason = "grad_norm_spike"  # an inf norm never enters a history, judged or not
    elif spike:
        reason = "loss_spike"
    else:
        reason = None
    return Verdict(reason, loss, grad_norm, zscores, spike)


def loss_spike(guard: StepGuard, loss: float | None, zscores: dict[str, float] | None) -> bool | None:
    """Whether ``loss`` is a spike by ``loss_zscore``'s rule (z above it, or not finite); None when
    it cannot be judged."""
    if guard.loss_zscore is None or loss is None:
        return None
    if not math.isfinite(loss):
        return True
    z = (zscores or {}).get("loss")
    return None if z is None else z > guard.loss_zscore


def overflow_note(verdict: Verdict, guard: StepGuard) -> str:
    """The sentence an overflow report adds about the step's loss; "" when it was not judged."""
    if verdict.reason != "overflow" or verdict.loss_spike is None:
        return ""
    if not math.isfinite(verdict.loss):  # type: ignore[arg-type]  # judged: a loss was given
        return f" The loss itself is not finite ({verdict.loss}): the forward pass overflowed, not the scale."
    z = verdict.zscores["loss"]  # type: ignore[index]  # judged and finite: its z-score
    if verdict.loss_spike:
        return (f" The loss itself was a spike (z = {z:.1f} > loss_zscore={guard.loss_zscore:g}): a bad "
                "batch, more likely than a scale grown too far.")
    return (f" The loss was not a spike (z = {z:.1f} <= loss_zscore={guard.loss_zscore:g}): the scale grew "
            "too far for these gradients, and backs off.")


def advance(guard: StepGuard, history: GuardHistory, verdict: Verdict
            ) -> tuple[GuardHistory, GuardReport | None]:
    """The history after ``verdict`` (pure), and the report when a streak reached its end."""
    if verdict.reason is None:
        keep = {name: (getattr(history, name) + (float(getattr(verdict, name)),))[-guard.window:]
                for name in guard.thresholds() if getattr(verdict, name) is not None}
        return history._replace(streak=0, reasons=(), **keep), None
    streak, reasons = history.streak + 1, (*history.reasons, verdict.reason)
    limit = guard.max_consecutive_skips
    if limit is None or streak < limit:
        return history._replace(streak=streak, reasons=reasons), None
    stats = {q: mean_std(getattr(history, q)) for q in QUANTITIES if len(getattr(history, q)) >= 2}
    report = GuardReport(streak, reasons, {q: m for q, (m, _) in stats.items()},
                         {q: sd for q, (_, sd) in stats.items()}, verdict)
    return history._replace(streak=0, reasons=()), report


def act(guard: StepGuard, report: GuardReport) -> None:
    """``on_streak``'s action on a streak's report: raise, warn once, or call the hook."""
    if guard.on_streak == "raise":
        raise StepGuardError(
            f"StepGuard(max_consecutive_skips={guard.max_consecutive_skips}): {report}. The run is not "
            "recovering on its own. Fix: reload the last good checkpoint or lower the learning rate, or "
            "pass on_streak='warn' or a callable to handle streaks without stopping."
        )
    if guard.on_streak == "warn":
        logger.warning("StepGuard: %s", report)
        return
    guard.on_streak(report)  # type: ignore[operator]


def diagnosis(verdict: Verdict, guard: StepGuard, held: int) -> str:
    """Why the guard skipped, e.g. "loss spike: z = 9.3 over the last 128 applied steps"."""
    z = verdict.zscores or {}
    if verdict.reason == "grad_norm_limit":
        return f"gradient norm limit: norm {verdict.grad_norm:.6g} > max_grad_norm={guard.max_grad_norm:g}"
    quantity = "grad_norm" if verdict.reason == "grad_norm_spike" else "loss"
    words, what = ("gradient norm spike", "norm") if quantity == "grad_norm" else ("loss spike", "loss")
    if quantity not in z:
        return f"{words}: the {what} is not finite ({getattr(verdict, quantity)})"
    return f"{words}: z = {z[quantity]:.1f} over the last {held} applied steps"


def check_guard(guard: Any) -> StepGuard | None:
    """``guard`` when it is None or a StepGuard; else a TypeError naming it."""
    if guard is not None and not isinstance(guard, StepGuard):
        raise TypeError(f"guard must be a polyamp.StepGuard or None, got guard={short_repr(guard)} "
                        f"({type(guard).__name__}). Fix: pass guard=polyamp.StepGuard(loss_zscore=6.0).")
    return guard
