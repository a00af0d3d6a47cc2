"""DeepSpeed's two fp16 update paths against docs/rule.md's ``from_deepspeed`` (issue 32, items 18
and 19): ZeRO's ``DynamicLossScaler`` (hysteresis, a raise at the minimum) and, without ZeRO,
``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``'s own ``_update_scale`` (neither). DeepSpeed is not
installed here, so its updates are transcribed, line by line, naming the file and commit read.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

import polyamp
from polyamp.policy import HostState, backs_off_at_floor, next_host_state

ROOT = Path(__file__).resolve().parents[2]


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_polyamp_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RULES = _sibling("test_engine_rules")  # DeepSpeedDynamicLossScaler, reference_run's segments


def _from_deepspeed():
    """``from_deepspeed`` exactly as docs/rule.md shows it."""
    text = (ROOT / "docs" / "rule.md").read_text()
    source = re.search(r"^def from_deepspeed\(.*?(?=^\S)", text, re.S | re.M).group(0)
    namespace = {"polyamp": polyamp}
    exec(source, namespace)  # noqa: S102 (the repository's own documentation)
    return namespace["from_deepspeed"]


from_deepspeed = _from_deepspeed()


class DeepSpeedFP16Optimizer:
    """deepspeedai/DeepSpeed ``deepspeed/runtime/fp16/fused_optimizer.py``, ``FP16_Optimizer._update_scale``
    (``unfused_optimizer.py``'s ``FP16_UnfusedOptimizer._update_scale`` is the same code), and the
    ``LossScaleConfig`` it starts from (``loss_scaler.py``), at commit
    edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (version 0.19.6). The engine passes
    ``dynamic_loss_args`` from the fp16 section: init_scale 2**initial_scale_power, scale_window
    loss_scale_window, min_scale min_loss_scale; hysteresis is passed but never read."""

    def __init__(self, fp16: dict):
        self.cur_scale = 2 ** fp16.get("initial_scale_power", 16)
        self.scale_window = fp16.get("loss_scale_window", 1000)
        self.min_loss_scale = fp16.get("min_loss_scale", 1)
        self.scale_factor = 2.0
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, skip: bool) -> None:
        if skip:
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_loss_scale)
            self.last_overflow_iter = self.cur_iter
        else:
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def polyamp_state(self) -> HostState:
        since = self.cur_iter - self.last_overflow_iter - 1
        growth = 0 if since == 0 else 1 + (since - 1) % self.scale_window
        return HostState(float(np.float32(self.cur_scale)), growth, 0)


FP16_SECTIONS = {
    "default-w50": {"enabled": True, "loss_scale_window": 50},
    "hysteresis-4": {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 7, "hysteresis": 4,
                     "min_loss_scale": 4},
    "consecutive": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 3, "hysteresis": 3,
                    "consecutive_hysteresis": True},
}


def _flags_and_states(engine, steps: int, seed: int, raises: bool = False):
    """Random overflows (test_engine_rules' rising segments, and above its cap), the engine's
    states after each update; where the engine raises at the minimum, ``None`` for that step."""
    rng = np.random.default_rng(seed)
    draws = rng.random(steps)
    flags, states = [], []
    for i in range(steps):
        p = RULES.PROBABILITIES[i * len(RULES.PROBABILITIES) // steps]
        found = bool(draws[i] < p) or engine.polyamp_state().scale > RULES.CAP
        flags.append(found)
        try:
            engine.update(found) if hasattr(engine, "update") else engine.update_scale(found)
        except Exception as exc:  # DynamicLossScaler's bare Exception at the minimum
            assert raises and "minimum" in str(exc)
            # the caller goes on: DeepSpeed raised before changing anything, as MinScaleError does
            states.append(None)
            continue
        states.append(engine.polyamp_state())
    return flags, states


def _polyamp_run(flags, config):
    """next_host_state over ``flags``; ``None`` where raise_error_at_min_scale raises (state kept)."""
    state, got = HostState(float(np.float32(config.init_scale))), []
    for found in flags:
        if found and config.raise_error_at_min_scale and backs_off_at_floor(state, config):
            got.append(None)
            continue
        state = next_host_state(state, found, config)
        got.append(state)
    return got


def test_first_overflow_without_zero_backs_off():
    """The issue's case: ``{"enabled": true}`` without ZeRO backs off at once, as DeepSpeed does."""
    fp16 = {"enabled": True}
    engine = DeepSpeedFP16Optimizer(fp16)
    engine.update(True)
    no_zero = next_host_state(HostState(65536.0), True, from_deepspeed(fp16, zero_stage=0))
    zero = next_host_state(HostState(65536.0), True, from_deepspeed(fp16, zero_stage=2))
    assert engine.cur_scale == no_zero.scale == 32768.0
    assert zero == HostState(65536.0, 0, 1)
    assert not from_deepspeed(fp16, zero_stage=0).raise_error_at_min_scale


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(FP16_SECTIONS))
def test_no_zero_is_fp16_optimizers_update(name, seed):
    """10k steps: stage 0's config follows FP16_Optimizer's update bitwise, hysteresis ignored."""
    fp16 = FP16_SECTIONS[name]
    flags, want = _flags_and_states(DeepSpeedFP16Optimizer(fp16), RULES.STEPS, seed)
    assert sum(flags) > 50 and min(s.scale for s in want) <= fp16.get("min_loss_scale", 1)
    RULES.assert_same_run(_polyamp_run(flags, from_deepspeed(fp16, zero_stage=0)), want, name)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(FP16_SECTIONS))
def test_zero_is_dynamic_loss_scalers_update(name, seed):
    """10k steps: stages 1-3's config follows DynamicLossScaler (built as ZeRO builds it, raising at
    the minimum) bitwise, and raises where it raises."""
    fp16 = FP16_SECTIONS[name]
    engine = RULES.DeepSpeedDynamicLossScaler(
        2 ** fp16.get("initial_scale_power", 16), fp16.get("loss_scale_window", 1000),
        fp16.get("min_loss_scale", 1), fp16.get("hysteresis", 2), fp16.get("consecutive_hysteresis", False))
    flags, want = _flags_and_states(engine, RULES.STEPS, seed, raises=True)
    got = _polyamp_run(flags, from_deepspeed(fp16, zero_stage=3))
    assert any(w is None for w in want), "the run reaches the minimum and raises"
    assert [g is None for g in got] == [w is None for w in want]
    RULES.assert_same_run([g for g in got if g], [w for w in want if w], name)


@pytest.mark.parametrize("power", [0, 3])
def test_init_scale_no_float32_value_raises_one_overflow_earlier(power):
    """docs/rule.md's decision (item 19): DeepSpeed's float64 start ``2**power * (1 + 2**-40)`` with
    ``min_scale=1`` backs off once more before raising; polyamp (float32 from the start) raises one
    overflow earlier, with the same float32 scale at every step before."""
    init = 2.0**power * (1 + 2.0**-40)
    engine = RULES.DeepSpeedDynamicLossScaler(init, 1000, 1.0, 1, False, raise_error_at_min_scale=True)
    config = polyamp.LossScaleConfig(rule="deepspeed", init_scale=init, min_scale=1.0, growth_interval=1000,
                                     backoff_interval=1, raise_error_at_min_scale=True)
    scaler = polyamp.LossScaler(config, backend="numpy")
    theirs = ours = None
    for i in range(power + 3):
        if ours is None:
            scaler.step([np.array([np.inf], np.float32)], lambda: None)
            try:
                scaler.update()
            except polyamp.MinScaleError:
                ours = i
        if theirs is None:
            try:
                engine.update_scale(True)
            except Exception:  # noqa: BLE001 (DeepSpeed raises a bare Exception)
                theirs = i
        if ours is None and theirs is None:
            assert scaler.get_scale() == float(np.float32(engine.cur_scale))
    assert (ours, theirs) == (power, power + 1)
