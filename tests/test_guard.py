"""polyamp.StepGuard on one process: the rule of issue 23 item 4 against a plain-Python model of it,
on every backend, with the scale state a guard skip must leave alone; streaks; checkpoints."""

from __future__ import annotations

import json
import logging
import math
import statistics

import numpy as np
import pytest

import polyamp
from polyamp import (
    ConfigError,
    GuardHistory,
    GuardReport,
    LossScaleConfig,
    LossScaler,
    StepGuard,
    StepGuardError,
)

THRESHOLDS = {"loss": 4.0, "grad_norm": 4.0}
MAX_NORM = 40.0
WINDOW, MIN_HISTORY = 50, 20
GROWTH = 30


class Model:
    """Item 4 of the issue, written from its text: histories of applied steps, one-sided z-scores,
    the first reason that applies, and the loss-scale state a guard skip does not touch."""

    def __init__(self, scale: float) -> None:
        self.history = {"loss": [], "grad_norm": []}
        self.scale, self.growth = scale, 0

    def zscores(self, values: dict[str, float]) -> dict[str, float] | None:
        if len(self.history["loss"]) < MIN_HISTORY:
            return None
        found = {}
        for name, value in values.items():
            past = self.history[name]
            sd = statistics.stdev(past)
            if sd > 0:
                found[name] = (value - statistics.mean(past)) / sd
        return found

    def reason(self, overflow: bool, loss: float, norm: float, z: dict[str, float] | None) -> str | None:
        z = z or {}
        if overflow:
            return "overflow"
        if norm > MAX_NORM:
            return "grad_norm_limit"
        if z.get("grad_norm", -math.inf) > THRESHOLDS["grad_norm"]:
            return "grad_norm_spike"
        if z.get("loss", -math.inf) > THRESHOLDS["loss"]:
            return "loss_spike"
        return None

    def after(self, reason: str | None, loss: float, norm: float) -> None:
        if reason is None:
            for name, value in (("loss", loss), ("grad_norm", norm)):
                self.history[name] = (self.history[name] + [value])[-WINDOW:]
            self.growth += 1
            if self.growth == GROWTH:
                self.scale, self.growth = self.scale * 2, 0
        elif reason == "overflow":
            self.scale, self.growth = self.scale / 2, 0


def _guard(**changes) -> StepGuard:
    fields = dict(loss_zscore=THRESHOLDS["loss"], grad_norm_zscore=THRESHOLDS["grad_norm"],
                  max_grad_norm=MAX_NORM, window=WINDOW, min_history=MIN_HISTORY)
    return StepGuard(**{**fields, **changes})


def _step_values(rng: np.random.Generator, step: int) -> tuple[list[np.ndarray], float, bool]:
    """The unscaled gradients (float32), the loss and whether an inf is injected, with spikes."""
    grads = [rng.normal(size=n).astype(np.float32) for n in (60, 30, 10)]
    loss = float(np.float32(2.0 + 0.05 * rng.normal() - step * 1e-4))
    if step % 37 == 36:
        factor = 30.0 if step % 2 else 2.5  # beyond max_grad_norm, or a z-score spike below it
        grads = [g * np.float32(factor) for g in grads]
    if step % 53 == 52:
        loss = float(np.float32(loss + 1.0))  # 20 standard deviations
    return grads, loss, step % 71 == 70


def _reference_norm(grads: list[np.ndarray]) -> float:
    return math.sqrt(math.fsum(float(v) ** 2 for g in grads for v in g.astype(np.float64)))


def _near(z: dict[str, float] | None) -> bool:
    return any(abs(v - THRESHOLDS[k]) < 1e-6 for k, v in (z or {}).items())


def test_the_rule_matches_a_plain_python_model_on_every_backend(backend_name, make_array):
    rng = np.random.default_rng(23)
    config = LossScaleConfig(init_scale=2.0**4, growth_interval=GROWTH)
    scaler = LossScaler(config, guard=_guard())
    model = Model(config.init_scale)
    reasons, ties = [], 0
    for step in range(700):
        grads, loss, inject = _step_values(rng, step)
        scale = scaler.get_scale()
        assert scale == model.scale and scaler.host_state().growth_tracker == model.growth, step
        scaled = [g * np.float32(scale) for g in grads]  # powers of two: unscaling gives g exactly
        if inject:
            scaled[1][3] = np.inf
        result = scaler.step([make_array(g) for g in scaled], lambda: None,
                             loss=make_array(np.asarray(loss, np.float32)))
        scaler.update()
        norm = _reference_norm(grads) if not inject else math.inf
        z = model.zscores({"loss": loss, "grad_norm": norm}) if not inject else result.zscores
        expected = model.reason(inject, loss, norm, z)
        if _near(z):  # a z within 1e-6 of its threshold: follow the scaler, count the tie
            ties, expected = ties + 1, result.reason
        assert result.reason == expected, (step, result, z)
        assert result.skipped is (expected is not None) and bool(result) is (expected is None)
        assert result.loss == pytest.approx(loss, rel=1e-15)
        if not inject:
            # torch squares in float32 before summing in float64: each square within 2**-24, the norm too
            assert result.grad_norm == pytest.approx(norm, rel=2**-24)
            assert (result.zscores is None) is (z is None), step
            if z is not None:
                assert result.zscores.keys() == z.keys()
                for name in z:
                    # torch's float32 squares (2**-24 each) carried through (x - mean) / std
                    assert result.zscores[name] == pytest.approx(z[name], rel=2**-22, abs=1e-6)
        model.after(expected, loss, norm)
        reasons.append(expected)
    assert ties == 0
    counts = {r: reasons.count(r) for r in set(reasons)}
    # every reason happened, and growth happened too (the scale state was compared every step)
    assert {"overflow", "grad_norm_limit", "grad_norm_spike", "loss_spike", None} <= set(counts), counts
    assert model.scale > config.init_scale / 2 ** counts["overflow"]
    assert scaler.steps == 700 and scaler.skipped_steps == 700 - counts[None]
    assert list(scaler.guard_history.loss) == model.history["loss"]


def test_a_guard_skip_leaves_the_scale_state_unchanged():
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=3),
                        guard=StepGuard(max_grad_norm=1.0, window=2, min_history=2))
    small, large = [np.full(4, 0.25, np.float32) * 8], [np.full(4, 4.0, np.float32) * 8]
    scaler.step(small, lambda: None)
    scaler.update()
    before = scaler.host_state()
    assert before.growth_tracker == 1
    applied = []
    result = scaler.step(large, lambda: applied.append(1))
    scaler.update()
    assert result.reason == "grad_norm_limit" and result.grad_norm == 8.0 and applied == []
    assert scaler.host_state() == before  # no growth progress, no backoff


def test_bf16_with_scaling_disabled_the_guard_is_the_only_other_reason():
    torch = pytest.importorskip("torch")
    scaler = LossScaler(LossScaleConfig(init_scale=1.0, dynamic=False),
                        guard=StepGuard(grad_norm_zscore=3.0, window=20, min_history=20))
    rng = np.random.default_rng(1)
    reasons = []
    for step in range(60):
        g = torch.from_numpy(rng.normal(size=64).astype(np.float32)).to(torch.bfloat16)
        if step == 40:
            g = g * 10
        if step == 50:
            g[0] = float("nan")
        result = scaler.step([g], lambda: None)
        scaler.update()
        reasons.append(result.reason)
        assert scaler.get_scale() == 1.0
    assert reasons[40] == "grad_norm_spike" and reasons[50] == "overflow"
    assert [r for i, r in enumerate(reasons) if i not in (40, 50)] == [None] * 58


def test_a_loss_guard_without_a_loss_raises_at_the_first_step_and_changes_nothing():
    scaler = LossScaler(guard=StepGuard(loss_zscore=3.0))
    grads = [np.ones(3, np.float32)]
    with pytest.raises(TypeError, match=r"got no loss.*loss_zscore=3\.0.*Fix: pass loss="):
        scaler.step(grads, lambda: None)
    assert scaler.steps == 0 and not scaler.has_pending_check and grads[0].tolist() == [1.0] * 3
    with pytest.raises(TypeError, match=r"loss=\[1, 2\].*Fix"):
        scaler.step(grads, lambda: None, loss=[1, 2])
    assert scaler.steps == 0 and not scaler.has_pending_check
    scaler.unscale_(grads, loss=1.5)  # given to unscale_: step needs none
    assert scaler.step(grads, lambda: None).loss == 1.5


def test_no_guard_behaviour_is_unchanged_and_loss_is_not_read():
    scaler = LossScaler(init_scale=4.0)
    result = scaler.step([np.ones(2, np.float32)], lambda: None, loss=np.float32(3.0))
    assert result.reason is None and result.loss is None and result.zscores is None
    scaler.update()
    bad = scaler.step([np.array([np.inf], np.float32)], lambda: None)
    assert bad.reason == "overflow" and bad.skipped


@pytest.mark.parametrize(("changes", "field"), [
    (dict(loss_zscore=0), "loss_zscore"), (dict(grad_norm_zscore=-1.0), "grad_norm_zscore"),
    (dict(max_grad_norm=math.inf), "max_grad_norm"), (dict(loss_zscore=True), "loss_zscore"),
    (dict(window=1), "window"), (dict(window=2.0), "window"), (dict(min_history=1), "min_history"),
    (dict(window=10), "min_history"), (dict(window=30, min_history=31), "min_history"),
    (dict(max_consecutive_skips=0), "max_consecutive_skips"), (dict(on_streak="stop"), "on_streak"),
])
def test_bad_values_name_the_field_the_value_and_the_fix(changes, field):
    with pytest.raises(ConfigError, match=rf"{field}.*Fix: "):
        StepGuard(**changes)


def test_numpy_scalars_are_taken_as_python_numbers_like_loss_scale_config():
    """Review: StepGuard refused np.float32 thresholds and np.int64 windows (LossScaleConfig takes
    them), and a value the guard stores must stay a plain number (state_dict and repr are JSON-able)."""
    guard = StepGuard(loss_zscore=np.float32(3.5), grad_norm_zscore=np.int64(4), max_grad_norm=np.array(2.5),
                      window=np.int64(10), min_history=np.int32(4), max_consecutive_skips=np.uint8(3))
    assert guard == StepGuard(loss_zscore=3.5, grad_norm_zscore=4.0, max_grad_norm=2.5, window=10,
                              min_history=4, max_consecutive_skips=3)
    assert [type(getattr(guard, f)) for f in ("loss_zscore", "window", "min_history")] == [float, int, int]
    for bad, field in ((dict(window=np.float64(10)), "window"),
                       (dict(loss_zscore=np.bool_(True)), "loss_zscore"),
                       (dict(grad_norm_zscore=np.float32("nan")), "grad_norm_zscore")):
        with pytest.raises(ConfigError, match=rf"{field}.*Fix: "):
            StepGuard(**bad)


def test_an_inf_norm_of_finite_gradients_is_a_spike_even_before_min_history():
    """Review: a backend may read the sum of squares as inf (squares past float32's range, finite
    gradients). Before min_history (or with a history of std 0) the inf norm was applied and
    entered the history: z-scores went NaN for a window, and the saved history (inf) was refused
    by load_state_dict. Now it is a grad_norm_spike and never enters a history."""
    from polyamp import guard as rules

    step_guard = StepGuard(grad_norm_zscore=4.0, window=10, min_history=5)
    history = rules.GuardHistory(grad_norm=(1.0, 1.0))  # fewer than min_history: nothing is judged
    verdict = rules.judge(step_guard, history, overflow=False, loss=None, grad_norm=math.inf)
    assert verdict.reason == "grad_norm_spike" and verdict.zscores is None  # none judged
    after, _ = rules.advance(step_guard, history, verdict)
    assert after.grad_norm == (1.0, 1.0) and after.streak == 1
    assert rules.GuardHistory.from_dict(json.loads(json.dumps(after.to_dict()))) == after
    assert rules.diagnosis(verdict, step_guard, 2) == "gradient norm spike: the norm is not finite (inf)"
    finite = rules.judge(step_guard, history, overflow=False, loss=None, grad_norm=1e300)
    assert finite.reason is None  # a finite norm is still only judged by its z-score


def test_a_loss_given_to_unscale_and_to_step_is_refused_not_summed():
    """Review: the loss given to unscale_() and again to step() was summed (the judged and reported
    loss doubled). Refused now, naming both calls, before the step and its checks change."""
    from polyamp import ScalerStateError

    scaler = LossScaler(LossScaleConfig(init_scale=1.0, dynamic=False),
                        guard=StepGuard(loss_zscore=3.0, window=10, min_history=3))
    grads = [np.ones(2, np.float32)]
    scaler.unscale_(grads, loss=2.0)
    with pytest.raises(ScalerStateError, match=r"step\(\) got loss=.*unscale_\(\).*Fix: .*not both"):
        scaler.step(grads, lambda: pytest.fail("applied"), loss=2.0)
    result = scaler.step(grads, lambda: None)  # the iteration goes on as if the bad call never was
    scaler.update()
    assert result.loss == 2.0 and result.applied and scaler.steps == 1
    scaler.unscale_(grads)
    assert scaler.step(grads, lambda: None, loss=3.0).loss == 3.0  # given once: taken once


def test_defaults_and_keywords():
    guard = StepGuard(loss_zscore=5)
    assert guard.history_needed == 64 and guard.window == 128 and guard.loss_zscore == 5.0
    assert StepGuard(window=30).history_needed == 20
    with pytest.raises(TypeError):
        StepGuard(5.0)  # keyword-only
    with pytest.raises(TypeError, match="guard must be a polyamp.StepGuard"):
        LossScaler(guard={"loss_zscore": 3})


def _streak_run(guard: StepGuard, steps: int = 9) -> tuple[LossScaler, list]:
    scaler = LossScaler(LossScaleConfig(init_scale=1.0, dynamic=False), guard=guard)
    events = []
    for step in range(steps):
        bad = step >= 3  # every step from the fourth on: a norm beyond the limit, then an overflow
        g = np.full(4, 10.0 if bad else 0.5, np.float32)
        if step == 5:
            g[0] = np.inf
        try:
            scaler.step([g], lambda: None, loss=1.0)
            scaler.update()
            events.append(None)
        except StepGuardError as exc:
            events.append(str(exc))
    return scaler, events


def test_a_streak_raises_from_update_names_its_reasons_and_restarts():
    scaler, events = _streak_run(StepGuard(max_grad_norm=5.0, max_consecutive_skips=3))
    assert events[:5] == [None] * 5 and events[6:8] == [None] * 2
    assert "3 steps skipped in a row (grad_norm_limit x2, overflow x1)" in events[5]
    assert "last loss 1" in events[5] and "Fix: reload the last good checkpoint" in events[5]
    assert events[8] is not None  # the streak restarted after the action: 3 more skips
    assert scaler.guard_history.streak == 0 and not scaler.has_pending_check  # the iteration ended


def test_a_streak_warns_once_per_streak(caplog):
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        scaler, events = _streak_run(StepGuard(max_grad_norm=5.0, max_consecutive_skips=4, on_streak="warn"),
                                     steps=12)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert events == [None] * 12 and len(warnings) == 2  # 9 skips in a row: two streaks of 4
    assert warnings[0].startswith("StepGuard: 4 steps skipped in a row")


def test_a_streak_calls_the_hook_with_a_report():
    reports: list[GuardReport] = []
    scaler, events = _streak_run(StepGuard(max_grad_norm=5.0, grad_norm_zscore=50.0, window=2,
                                           min_history=2, max_consecutive_skips=2,
                                           on_streak=reports.append))
    assert events == [None] * 9 and len(reports) == 3
    first = reports[0]
    assert first.streak == 2 and first.reasons == ("grad_norm_limit", "grad_norm_limit")
    assert first.grad_norm == 20.0 and first.loss == 1.0
    assert first.mean == {"grad_norm": 1.0} and first.std == {"grad_norm": 0.0}
    assert reports[1].reasons == ("overflow", "grad_norm_limit") and reports[1].grad_norm == 20.0


def _resumable_run(scaler: LossScaler, steps: range, rng_seed: int = 5) -> list:
    out = []
    rng = np.random.default_rng(rng_seed)
    values = [_step_values(rng, s) for s in range(steps.stop)]
    for step in steps:
        grads, loss, inject = values[step]
        scale = np.float32(scaler.get_scale())
        scaled = [g * scale for g in grads]
        if inject:
            scaled[0][0] = np.inf
        r = scaler.step(scaled, lambda: None, loss=loss)
        scaler.update()
        out.append((r.reason, r.loss, r.grad_norm, r.zscores, scaler.get_scale()))
    return out


def test_a_run_resumed_mid_window_decides_exactly_as_an_uninterrupted_one(tmp_path):
    config = LossScaleConfig(init_scale=2.0**4, growth_interval=GROWTH)
    whole = _resumable_run(LossScaler(config, guard=_guard()), range(400))
    first = LossScaler(config, guard=_guard())
    head = _resumable_run(first, range(215))
    assert 0 < len(first.guard_history.loss) == WINDOW
    first.save(tmp_path / "ckpt.json.gz")
    second = LossScaler(config, guard=_guard())
    second.load(tmp_path / "ckpt.json.gz")
    assert second.guard_history == first.guard_history
    tail = _resumable_run(second, range(215, 400))
    assert head + tail == whole  # every decision, value and z-score, bitwise
    assert {r[0] for r in whole} >= {None, "loss_spike", "grad_norm_spike", "overflow"}


def test_state_dict_round_trip_and_older_checkpoints():
    scaler = LossScaler(guard=StepGuard(max_grad_norm=1.0, grad_norm_zscore=3.0, window=4, min_history=2,
                                        max_consecutive_skips=5))
    for value in (0.1, 0.2, 5.0, 0.3):
        scaler.step([np.full(1, value * 65536, np.float32)], lambda: None)
        scaler.update()
    sd = json.loads(json.dumps(scaler.state_dict()))
    assert sd["guard"]["streak"] == 0 and len(sd["guard"]["grad_norm"]) == 3
    again = LossScaler(guard=scaler.guard)
    again.load_state_dict(sd)
    assert again.guard_history == scaler.guard_history
    older = {k: v for k, v in sd.items() if k != "guard"}
    fresh = LossScaler(guard=scaler.guard)
    fresh.load_state_dict(older)  # a checkpoint written before guards: empty histories
    assert fresh.guard_history == polyamp.GuardHistory() and fresh.get_scale() == scaler.get_scale()
    smaller = LossScaler(guard=StepGuard(max_grad_norm=1.0, grad_norm_zscore=3.0, window=2, min_history=2))
    smaller.load_state_dict(sd)
    assert smaller.guard_history.grad_norm == scaler.guard_history.grad_norm[-2:]
    for wrong in ("x", 10**400):  # an int float64 cannot hold: the StateDictError too, not an OverflowError
        bad = {**sd, "guard": {**sd["guard"], "grad_norm": [1.0, wrong]}}
        with pytest.raises(polyamp.StateDictError, match=r"state_dict\['guard'\]\['grad_norm'\]"):
            again.load_state_dict(bad)
    assert again.guard_history == scaler.guard_history  # a failed load changes nothing


def test_a_history_with_std_zero_judges_nothing_and_values_below_the_mean_are_no_spike():
    scaler = LossScaler(guard=StepGuard(loss_zscore=1.0, window=3, min_history=3))
    results = []
    for loss in (1.0, 1.0, 1.0, 50.0, 1.0, 2.0, -100.0):
        results.append(scaler.step([np.zeros(1, np.float32)], lambda: None, loss=loss))
        scaler.update()
    assert [r.reason for r in results[:4]] == [None] * 4  # std 0 over (1, 1, 1): 50 is judged by nothing
    assert results[3].zscores == {}
    assert results[6].reason is None and results[6].zscores["loss"] < -1  # one-sided


def test_skip_log_counts_skips_per_reason(caplog):
    from polyamp import _skip_log

    scaler = LossScaler(LossScaleConfig(init_scale=1.0, dynamic=False),
                        guard=StepGuard(max_grad_norm=1.0))
    scaler.iteration.log = _skip_log.SkipLog(first=1, window=6)
    with caplog.at_level(logging.INFO, logger="polyamp"):
        for value in (5.0, 5.0, np.inf, 0.5, 5.0, 0.5, 0.5, 0.5):
            scaler.step([np.full(2, value, np.float32)], lambda: None)
            scaler.update()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert lines[0] == ("gradient norm limit: norm 7.07107 > max_grad_norm=1: step skipped, loss scale kept "
                        "at 1")
    assert "3 skipped steps (2 grad_norm_limit, 1 overflow) in the last 6 steps" in lines[1]


def test_diagnose_reports_the_guards_values_on_a_guard_skip():
    scaler = LossScaler(LossScaleConfig(init_scale=2.0), guard=StepGuard(loss_zscore=4.0, window=20,
                                                                         min_history=20), diagnose=True)
    rng = np.random.default_rng(0)
    for step in range(21):
        loss = 1.0 + 0.01 * rng.normal() + (1.0 if step == 20 else 0.0)
        result = scaler.step({"w": np.full(3, 2.0, np.float32)}, lambda: None, loss=loss)
        scaler.update()
    report = scaler.last_overflow
    assert result.reason == "loss_spike" and report is not None and not report.found
    assert report.reason == "loss_spike" and report.loss == result.loss and report.zscores == result.zscores
    assert report.diagnosis == f"loss spike: z = {result.zscores['loss']:.1f} over the last 20 applied steps"
    assert "another rank" not in str(report)
    bad = scaler.step({"w": np.array([np.inf], np.float32)}, lambda: None, loss=1.0)
    report = scaler.last_overflow  # an overflow under a guard carries the guard's verdict too
    assert bad.reason == "overflow" and report.reason == "overflow" and report.found and report.loss == 1.0


# -- issue 34, item 5: an overflow step still says whether its loss was a spike -------------------
def _overflow_after_warm_up(loss, *, warm=20, guard=None, diagnose=True):
    """A scaler whose loss history holds ``warm`` applied losses near 1, then one step whose
    gradients overflow with ``loss``: (its StepResult, the scaler)."""
    guard = guard or StepGuard(loss_zscore=6.0, window=20)
    scaler = LossScaler(LossScaleConfig(init_scale=2.0**4), guard=guard, diagnose=diagnose)
    rng = np.random.default_rng(0)
    for _ in range(warm):
        scaler.step({"w": np.full(3, 2.0, np.float32)}, lambda: None, loss=1.0 + 0.01 * rng.normal())
        scaler.update()
    before = scaler.state_dict()["guard"]
    result = scaler.step({"w": np.array([1.0, np.inf, 2.0], np.float32)}, lambda: None, loss=loss)
    scaler.update()
    assert scaler.state_dict()["guard"]["loss"] == before["loss"]  # an overflow's loss joins no history
    return result, scaler


def test_an_overflow_step_says_whether_its_loss_was_a_spike():
    spike, scaler = _overflow_after_warm_up(50.0)
    report = scaler.last_overflow
    assert spike.reason == "overflow" and spike.loss_spike is True and spike.zscores["loss"] > 6.0
    assert report.reason == "overflow" and report.loss_spike is True and report.loss == 50.0
    z = spike.zscores["loss"]
    assert f"The loss itself was a spike (z = {z:.1f} > loss_zscore=6)" in report.diagnosis
    assert report.to_dict()["loss_spike"] is True and "param" not in report.diagnosis
    assert scaler.get_scale() == 2.0**3  # an overflow: backed off, whatever the loss

    ordinary, scaler = _overflow_after_warm_up(1.0)
    assert ordinary.reason == "overflow" and ordinary.loss_spike is False
    report = scaler.last_overflow
    assert "The loss was not a spike" in report.diagnosis and report.loss_spike is False

    infinite, scaler = _overflow_after_warm_up(math.inf)
    assert infinite.loss_spike is True
    assert "The loss itself is not finite (inf)" in scaler.last_overflow.diagnosis


def test_loss_spike_is_none_where_the_loss_is_not_judged():
    early, scaler = _overflow_after_warm_up(50.0, warm=5)  # fewer than min_history (20) values
    assert early.reason == "overflow" and early.loss_spike is None and early.zscores is None
    assert "spike" not in scaler.last_overflow.diagnosis and scaler.last_overflow.loss_spike is None
    norm_only, _ = _overflow_after_warm_up(50.0, guard=StepGuard(grad_norm_zscore=6.0, window=20))
    assert norm_only.reason == "overflow" and norm_only.loss_spike is None  # no loss rule
    plain = LossScaler(LossScaleConfig(init_scale=2.0), diagnose=True)
    assert plain.step([np.array([np.inf], np.float32)], lambda: None).loss_spike is None  # no guard
    plain.update()
    assert plain.last_overflow.loss_spike is None and plain.last_overflow.reason is None
    spiked = StepGuard(loss_zscore=6.0, window=20)
    assert polyamp.guard.judge(spiked, GuardHistory(loss=(1.0, 1.1) * 10), overflow=False, loss=9.0,
                               grad_norm=None).loss_spike is True  # the same rule as loss_spike's reason


def test_a_streak_of_overflows_reports_whether_the_last_loss_was_a_spike():
    reports = []
    guard = StepGuard(loss_zscore=6.0, window=20, max_consecutive_skips=2, on_streak=reports.append)
    scaler = LossScaler(LossScaleConfig(init_scale=2.0**4), guard=guard)
    for step in range(22):
        bad = step >= 20
        grad = np.array([np.inf if bad else 2.0], np.float32)
        scaler.step([grad], lambda: None, loss=50.0 if bad else 1.0 + 0.01 * (step % 3))
        scaler.update()
    (report,) = reports
    assert report.reasons == ("overflow", "overflow") and report.loss_spike is True
    assert "last loss 50 (a spike)" in str(report)


# -- issue 32, items 9 and 14: losses and settings taken wrongly -------------------------------------
@pytest.mark.parametrize("loss", [np.complex64(1 + 5j), np.array([1 + 5j]), np.array(True), 10**400],
                         ids=["complex-scalar", "complex-array", "bool-array", "huge-int"])
def test_a_loss_that_is_not_one_real_value_is_refused_before_anything_changes(loss):
    from polyamp import LossScaler

    scaler = LossScaler(guard=StepGuard(loss_zscore=3.0), backend="numpy")
    grad = np.full(2, 4.0, np.float32)
    with pytest.raises(TypeError, match=r"step\(\) needs loss to be a real number.*got loss="):
        scaler.step([grad], lambda: None, loss=loss)
    assert grad.tolist() == [4.0, 4.0] and not scaler.has_pending_check  # nothing moved


def test_a_torch_bool_loss_is_refused_as_a_python_bool_is():
    torch = pytest.importorskip("torch")
    from polyamp import LossScaler

    scaler = LossScaler(guard=StepGuard(loss_zscore=3.0), backend="torch")
    for loss in (True, torch.tensor(True), torch.tensor([1 + 1j])):
        with pytest.raises(TypeError, match="real number"):
            scaler.step([torch.ones(2)], lambda: None, loss=loss)


@pytest.mark.parametrize("build", [lambda v: StepGuard(loss_zscore=v), lambda v: StepGuard(max_grad_norm=v),
                                   lambda v: __import__("polyamp").LossScaleConfig(growth_factor=v),
                                   lambda v: __import__("polyamp").LossScaleConfig(backoff_factor=v)])
def test_an_int_beyond_float64_is_refused_naming_the_field(build):
    from polyamp import ConfigError

    with pytest.raises(ConfigError, match=r"(loss_zscore|max_grad_norm|growth_factor|backoff_factor)=1000"):
        build(10**400)


def test_huge_values_in_a_history_judge_without_overflowing():
    """Issue 32 item 12: histories holding values near float64's largest (from a checkpoint, or
    admitted before min_history) used to make every judged step raise OverflowError from the std."""
    from polyamp.guard import mean_std

    assert mean_std([1.7e308, 1.7e308]) == (1.7e308, 0.0)
    assert mean_std([1.7e308, -1.7e308]) == (0.0, math.inf)
    history = [0.5, 0.25, 1.0, 3.0]
    assert mean_std(history) == (statistics.mean(history), statistics.stdev(history))
    scaler = LossScaler(guard=StepGuard(loss_zscore=3.0, window=4, min_history=2), backend="numpy")
    state = scaler.state_dict()
    state["guard"] = GuardHistory(loss=(1.7e308, -1.7e308)).to_dict()
    scaler.load_state_dict(state)
    result = scaler.step([np.ones(2, np.float32)], lambda: None, loss=1.0)
    scaler.update()
    assert not result.skipped and scaler.steps == 1 and not scaler.has_pending_check
