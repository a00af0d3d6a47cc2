"""Megatron-Core's and DeepSpeed's own loss-scaler state loads into polyamp with their rule (issue
32, item 6): ``LossScaler.load_state_dict``, the torch facade, and a Fix from ``polyamp.checkpoint``.

megatron-core and DeepSpeed are not installed here (they need CUDA to build their scalers), so the
reference scalers below are their update and state code as their sources write it, on CPU tensors:
Megatron-Core ``megatron/core/optimizer/grad_scaler.py`` (``DynamicGradScaler``, commit 00caa53),
DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py`` (``DynamicLossScaler``, commit 18fd4c9; ZeRO
checkpoints hold the object, whose ``vars()`` are its state). Each runs a random overflow
sequence, its state is taken at a random step and loaded into polyamp, and both go on: the scales
must match bit for bit at every later step.
"""

from __future__ import annotations

import numpy as np
import pytest

import polyamp
from polyamp import LossScaleConfig, LossScaler, StateDictError

torch = pytest.importorskip("torch")


class MegatronDynamicGradScaler:
    """Megatron-Core's DynamicGradScaler (its update and state_dict), on CPU."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self._scale = torch.tensor([initial_scale], dtype=torch.float)
        self.min_scale = torch.tensor([min_scale], dtype=torch.float)
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self):
        state_dict = {}
        state_dict['scale'] = self._scale
        state_dict['growth_tracker'] = self._growth_tracker
        state_dict['hysteresis_tracker'] = self._hysteresis_tracker
        return state_dict


class DeepSpeedDynamicLossScaler:
    """DeepSpeed's DynamicLossScaler (its constructor's attributes and update_scale), without logging."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
                 raise_error_at_min_scale=True, dtype=torch.half):
        self.cur_scale = init_scale
        self.dynamic = False
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.dynamic = True
        self.dtype = dtype

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if (self.cur_scale == self.min_scale) and self.raise_error_at_min_scale:
                    raise Exception("Current loss scale already at minimum")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def _overflows(seed: int, n: int) -> list[bool]:
    rng = np.random.default_rng(seed)
    p = rng.choice([0.05, 0.3, 0.6])
    return [bool(x) for x in rng.random(n) < p]


def _step(scaler: LossScaler, found: bool) -> None:
    grad = np.array([np.inf if found else 1.0], np.float32)
    scaler.step([grad], lambda: None)
    scaler.update()


@pytest.mark.parametrize("seed", range(12))
def test_megatron_state_resumes_bit_for_bit(seed):
    rng = np.random.default_rng(100 + seed)
    window, hysteresis = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    ref = MegatronDynamicGradScaler(2.0**16, 1.0, 2.0, 0.5, window, hysteresis)
    sequence = _overflows(seed, 120)
    cut = int(rng.integers(0, 60))
    for found in sequence[:cut]:
        ref.update(found)
    config = LossScaleConfig(init_scale=1.0, min_scale=1.0, growth_interval=window,
                             backoff_interval=hysteresis)
    scaler = LossScaler(config, backend="numpy")  # built with the run's settings, torch's rule
    scaler.load_state_dict(ref.state_dict())
    assert scaler.config.rule == "megatron" and scaler.get_scale() == ref._scale.item()
    for i, found in enumerate(sequence[cut:]):
        ref.update(found)
        _step(scaler, found)
        assert scaler.get_scale() == ref._scale.item(), (cut + i, found)


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_deepspeed_state_resumes_bit_for_bit(seed, consecutive):
    rng = np.random.default_rng(200 + seed)
    window, shift = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    ref = DeepSpeedDynamicLossScaler(2.0**16, window, 1.0, shift, consecutive, raise_error_at_min_scale=False)
    sequence = _overflows(seed, 120)
    cut = int(rng.integers(0, 60))
    for found in sequence[:cut]:
        ref.update_scale(found)
    config = LossScaleConfig(rule="deepspeed", init_scale=1.0, min_scale=1.0, growth_interval=window,
                             backoff_interval=shift, consecutive_hysteresis=consecutive)
    scaler = LossScaler(config, backend="numpy")
    scaler.load_state_dict(dict(vars(ref)))  # every attribute, settings and dtype included
    assert scaler.get_scale() == np.float32(ref.cur_scale)
    for i, found in enumerate(sequence[cut:]):
        ref.update_scale(found)
        _step(scaler, found)
        assert scaler.get_scale() == np.float32(ref.cur_scale), (cut + i, found)


def test_the_layout_implies_the_rule_from_a_torch_rule_scaler():
    ref = DeepSpeedDynamicLossScaler(2.0**10, 4, 1.0, 2, False, raise_error_at_min_scale=False)
    for found in (False, True, False, False):
        ref.update_scale(found)
    config = LossScaleConfig(growth_interval=4, backoff_interval=2, min_scale=1.0)
    scaler = LossScaler(config, backend="numpy")
    scaler.load_state_dict({k: vars(ref)[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter",
                                                        "cur_hysteresis")})
    assert scaler.config.rule == "deepspeed"
    assert scaler.host_state() == (1024.0, 2, 1)  # 2 finite steps since the overflow, hysteresis 1 spent


def test_the_torch_facade_loads_them_and_reloads_its_own_state():
    from polyamp.compat.torch import GradScaler

    ref = MegatronDynamicGradScaler(2.0**7, 1.0, 2.0, 0.5, 3, 2)
    for found in (False, True, False):
        ref.update(found)
    facade = GradScaler("cpu", growth_interval=3)
    facade._engine.reconfigure(backoff_interval=2)
    facade.load_state_dict(ref.state_dict())
    saved = facade.state_dict()
    assert saved["rule"] == "megatron" and saved["scale"] == 128.0 and saved["_growth_tracker"] == 1
    again = GradScaler("cpu")
    again.load_state_dict(saved)  # its own state_dict loads back, the rule with it
    assert again.state_dict() == saved and again._engine.config.rule == "megatron"


def test_a_setting_that_differs_is_refused_and_nothing_changes():
    ref = DeepSpeedDynamicLossScaler(2.0**10, 4, 1.0, 2, False)
    config = LossScaleConfig(rule="deepspeed", growth_interval=5, backoff_interval=2, min_scale=1.0,
                             raise_error_at_min_scale=True)
    scaler = LossScaler(config, backend="numpy")
    before = scaler.state_dict()
    with pytest.raises(StateDictError, match=r"\['scale_window'\] is 4, but this scaler's config has 5.*Fix"):
        scaler.load_state_dict(dict(vars(ref)))
    assert scaler.state_dict() == before


def test_fp16_optimizer_state_without_hysteresis_needs_backoff_interval_1():
    fused = {"dynamic_loss_scale": True, "cur_scale": 256.0, "cur_iter": 9, "last_overflow_iter": 6,
             "scale_factor": 2.0, "scale_window": 1000}  # DeepSpeed FP16_Optimizer.state_dict()'s keys
    config = LossScaleConfig(rule="deepspeed", growth_interval=1000, backoff_interval=2)
    scaler = LossScaler(config, backend="numpy")
    with pytest.raises(StateDictError, match="no 'cur_hysteresis'.*Fix: build the scaler with backoff_int"):
        scaler.load_state_dict(fused)
    scaler = LossScaler(LossScaleConfig(rule="deepspeed", growth_interval=1000), backend="numpy")
    scaler.load_state_dict(fused)
    assert scaler.host_state() == (256.0, 2, 0)


def test_megatron_with_deepspeed_options_is_refused_with_a_fix():
    ref = MegatronDynamicGradScaler(2.0**7, 1.0, 2.0, 0.5, 3, 2)
    scaler = LossScaler(LossScaleConfig(rule="deepspeed", consecutive_hysteresis=True, growth_interval=3,
                                        backoff_interval=2), backend="numpy")
    with pytest.raises(StateDictError, match=r"rule='megatron'.*Fix: build the scaler with "
                                             r"LossScaleConfig\(rule='megatron'"):
        scaler.load_state_dict(ref.state_dict())
    assert scaler.config.rule == "deepspeed"


def test_checkpoint_names_the_layout_and_the_fix():
    ref = MegatronDynamicGradScaler(2.0**7, 1.0, 2.0, 0.5, 3, 2)
    with pytest.raises(StateDictError, match="It is megatron's own scaler state: load it with "
                                             r"LossScaler.load_state_dict\(sd\)"):
        polyamp.checkpoint.from_state_dict({**ref.state_dict(), "scale": 128.0})
