"""Each ``LossScaleConfig.rule`` against its engine's own update, bitwise, on every backend.

The references below are the engines' update functions written out in plain Python, line by line
(logging left out), each naming the upstream file and commit read. Where an engine keeps its scale
in a float32 tensor, a NumPy float32 scalar stands in: torch's and paddle's float32 ``*`` and
``max`` are IEEE float32 operations, as NumPy's are. torch's rule is held against torch's own
``torch._amp_update_scale_``.

Overflow sequences are random, 10k steps, in four segments of rising overflow probability
(0.0005, 0.02, 0.2, 0.6), plus an overflow whenever the reference's scale exceeds 2**40 (as fp16
gradients do when the scale is too high), so that every rule's trajectory stays within float32's
range: polyamp refuses a non-finite scale where Megatron's float32 scale would become inf.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import polyamp
from polyamp import LossScaleConfig, LossScaleState, MinScaleError
from polyamp.config import SCALE_FLOOR
from polyamp.policy import HostState, next_host_state

STEPS = 10_000
PROBABILITIES = (0.0005, 0.02, 0.2, 0.6)
CAP = 2.0**40


# -- the engines' updates, transcribed -------------------------------------------------------------
class MegatronDynamicGradScaler:
    """NVIDIA/Megatron-LM ``megatron/core/optimizer/grad_scaler.py``, ``DynamicGradScaler``, at
    commit 00caa53af30912914981c86f39db123961678bbd (torch.float tensors of shape [1])."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval,
                 hysteresis):
        self._scale = np.float32(initial_scale)
        self.min_scale = np.float32(min_scale)
        self.growth_factor = np.float32(growth_factor)
        self.backoff_factor = np.float32(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)  # torch.max
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def polyamp_state(self) -> HostState:
        """docs/rule.md's mapping: backoff_tracker = hysteresis - hysteresis_tracker, at most
        hysteresis - 1 (a tracker at 1, 0 or below: the next overflow backs off)."""
        spent = min(self.hysteresis - self._hysteresis_tracker, self.hysteresis - 1)
        return HostState(float(self._scale), self._growth_tracker, spent)


class DeepSpeedDynamicLossScaler:
    """deepspeedai/DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py``, ``DynamicLossScaler``
    (``__init__`` and ``update_scale``), at commit 18fd4c973de35381257542d2c99177a82a4b525a."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
                 raise_error_at_min_scale=True):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    def update_scale(self, overflow):
        if overflow:
            # self.cur_scale /= self.scale_factor
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if (self.cur_scale == self.min_scale) and self.raise_error_at_min_scale:
                    raise Exception(
                        "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
                else:
                    next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                    self.cur_scale = next_scale
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

    def polyamp_state(self) -> HostState:
        """docs/rule.md's mapping: polyamp's scale is float32(cur_scale); growth_tracker counts the
        finite steps since the last overflow, 1..window after the first; backoff_tracker is
        delayed_shift - cur_hysteresis."""
        since = self.cur_iter - self.last_overflow_iter - 1
        growth = 0 if since == 0 else 1 + (since - 1) % self.scale_window
        return HostState(float(np.float32(self.cur_scale)), growth,
                         self.delayed_shift - self.cur_hysteresis)


class PaddleGradScaler:
    """PaddlePaddle ``python/paddle/amp/grad_scaler.py``, ``AmpScaler._update``, as installed
    (paddle 3.3.1); ``_scale`` and the ratios are float32 tensors of shape [1]."""

    def __init__(self, init_loss_scaling, incr_ratio, decr_ratio, incr_every_n_steps,
                 decr_every_n_nan_or_inf):
        self._scale = np.float32(init_loss_scaling)
        self._incr_ratio = np.float32(incr_ratio)
        self._decr_ratio = np.float32(decr_ratio)
        self._incr_every_n_steps = incr_every_n_steps
        self._decr_every_n_nan_or_inf = decr_every_n_nan_or_inf
        self._incr_count = 0
        self._decr_count = 0

    def _update(self, found_inf):
        if found_inf:
            self._incr_count = 0
            self._decr_count = self._decr_count + 1
            if self._decr_count == self._decr_every_n_nan_or_inf:
                self._scale = self._scale * self._decr_ratio
                self._decr_count = 0
        else:
            self._decr_count = 0
            self._incr_count = self._incr_count + 1
            if self._incr_count == self._incr_every_n_steps:
                self._scale = self._scale * self._incr_ratio
                self._incr_count = 0
        # polyamp's documented floor (docs/rule.md, "The scale floor"); paddle has none
        self._scale = max(self._scale, np.float32(SCALE_FLOOR))

    def polyamp_state(self) -> HostState:
        return HostState(float(self._scale), self._incr_count, self._decr_count)


class TorchAmpUpdate:
    """torch's own ``torch._amp_update_scale_`` on CPU tensors (no transcription needed)."""

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval):
        torch = pytest.importorskip("torch")
        self._torch = torch
        self.scale = torch.tensor([init_scale], dtype=torch.float32)
        self.growth = torch.tensor([0], dtype=torch.int32)
        self.args = (growth_factor, backoff_factor, growth_interval)

    def update(self, found_inf):
        torch = self._torch
        torch._amp_update_scale_(self.scale, self.growth, torch.tensor([float(found_inf)]), *self.args)
        self.scale.clamp_(min=SCALE_FLOOR)  # polyamp's documented floor; torch has none

    def polyamp_state(self) -> HostState:
        return HostState(self.scale.item(), self.growth.item(), 0)


# -- the engines with their parameters, and the polyamp config that names the same rule -------------
def megatron(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
             growth_interval=1000, hysteresis=2):
    """(Megatron's scaler, polyamp's config) for DynamicGradScaler's arguments."""
    engine = MegatronDynamicGradScaler(initial_scale, min_scale, growth_factor, backoff_factor,
                                       growth_interval, hysteresis)
    config = LossScaleConfig(rule="megatron", init_scale=initial_scale, min_scale=min_scale,
                             growth_factor=growth_factor, backoff_factor=backoff_factor,
                             growth_interval=growth_interval, backoff_interval=hysteresis)
    return engine.update, engine.polyamp_state, config


def deepspeed(init_scale=2.0**16, scale_window=1000, min_scale=1.0, delayed_shift=2,
              consecutive_hysteresis=False, raise_error_at_min_scale=False):
    """(DeepSpeed's scaler, polyamp's config) for DynamicLossScaler's arguments."""
    engine = DeepSpeedDynamicLossScaler(init_scale, scale_window, min_scale, delayed_shift,
                                        consecutive_hysteresis, raise_error_at_min_scale)
    config = LossScaleConfig(rule="deepspeed", init_scale=init_scale, growth_interval=scale_window,
                             min_scale=min_scale, backoff_interval=delayed_shift,
                             consecutive_hysteresis=consecutive_hysteresis,
                             raise_error_at_min_scale=raise_error_at_min_scale)
    return engine.update_scale, engine.polyamp_state, config


def paddle_(init_loss_scaling=2.0**15, incr_ratio=2.0, decr_ratio=0.5, incr_every_n_steps=1000,
            decr_every_n_nan_or_inf=2):
    engine = PaddleGradScaler(init_loss_scaling, incr_ratio, decr_ratio, incr_every_n_steps,
                              decr_every_n_nan_or_inf)
    config = LossScaleConfig(rule="paddle", init_scale=init_loss_scaling, growth_factor=incr_ratio,
                             backoff_factor=decr_ratio, growth_interval=incr_every_n_steps,
                             backoff_interval=decr_every_n_nan_or_inf)
    return engine._update, engine.polyamp_state, config


def torch_(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    engine = TorchAmpUpdate(init_scale, growth_factor, backoff_factor, growth_interval)
    config = LossScaleConfig(rule="torch", init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval)
    return engine.update, engine.polyamp_state, config


# Non-power-of-two factors and min_scale values that are no float32 value test the products'
# precision; windows of 1 and hysteresis of 1 test the edges.
ENGINES = {
    "torch-default": lambda: torch_(growth_interval=50),
    "torch-odd": lambda: torch_(init_scale=3.0, growth_factor=1.5, backoff_factor=0.3, growth_interval=7),
    "paddle-default": lambda: paddle_(incr_every_n_steps=40),
    "paddle-odd": lambda: paddle_(3.0, 1.1, 0.7, 5, 3),
    "megatron-default": lambda: megatron(growth_interval=100, hysteresis=2),
    "megatron-odd": lambda: megatron(3.0, 0.3, 1.5, 0.7, 7, 3),
    "megatron-h1": lambda: megatron(growth_interval=1, hysteresis=1, min_scale=2.0**-10),
    "deepspeed-default": lambda: deepspeed(2.0**32, 100, 1.0, 2),
    "deepspeed-consecutive": lambda: deepspeed(2.0**16, 7, 0.25, 3, True),
    "deepspeed-w1": lambda: deepspeed(2.0**16, 1, 1e-3, 1),
    "deepspeed-min-not-f32": lambda: deepspeed(2.0**16, 5, 1e-3, 4),
}


def reference_run(name: str, seed: int, steps: int = STEPS):
    """(flags, the engine's states mapped to polyamp's after each update, polyamp's config)."""
    update, state_of, config = ENGINES[name]()
    rng = np.random.default_rng(seed)
    draws = rng.random(steps)
    flags, states = [], []
    for i in range(steps):
        p = PROBABILITIES[i * len(PROBABILITIES) // steps]
        found = bool(draws[i] < p) or state_of().scale > CAP
        with np.errstate(over="ignore"):
            update(found)
        flags.append(found)
        states.append(state_of())
    return flags, states, config


def assert_same_run(got, want, where):
    """Scales bitwise (as float32), trackers equal, step by step; names the first difference."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        same = np.float32(g.scale).view(np.uint32) == np.float32(w.scale).view(np.uint32)
        assert same and g[1:] == w[1:], f"{where}: step {i}: polyamp {tuple(g)} != engine {tuple(w)}"


def test_the_runs_cover_what_they_claim():
    """Each rule's run backs off, grows, and (hysteresis > 1) absorbs overflows."""
    for name in ENGINES:
        flags, states, config = reference_run(name, 0)
        scales = [s.scale for s in states]
        assert 50 < sum(flags) < STEPS - 50, name
        assert any(b < a for a, b in zip(scales, scales[1:])), name
        assert any(b > a for a, b in zip(scales, scales[1:])), name
        if config.backoff_interval > 1:
            assert max(s.backoff_tracker for s in states) == config.backoff_interval - 1, name


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(ENGINES))
def test_readable_rule_is_the_engines(name, seed):
    flags, want, config = reference_run(name, seed)
    state, got = HostState(float(np.float32(config.init_scale))), []
    for found in flags:
        state = next_host_state(state, found, config)
        got.append(state)
    assert_same_run(got, want, f"next_host_state {name} seed {seed}")


def _like(name):
    if name == "torch":
        import torch

        return torch.zeros(())
    if name == "array_api":
        import array_api_strict

        return array_api_strict.zeros(())
    if name == "paddle":
        import paddle

        return paddle.zeros([])
    if name == "cupy":
        import cupy

        return cupy.zeros(())
    return np.zeros((), np.float32)


def kernel_run(backend_name: str, config: LossScaleConfig, flags: list[bool]) -> list[HostState]:
    """The backend's update_scale hook over ``flags``, its state read back after every step."""
    backend = polyamp.get_backend(backend_name)
    like = _like(backend_name)
    state = LossScaleState(backend.full(config.init_scale, "float32", like),
                           backend.full(0, "int32", like), backend.full(0, "int32", like))
    yes, no = backend.full(1.0, "float32", like), backend.full(0.0, "float32", like)
    got = []
    for found in flags:
        state = backend.update_scale(state, yes if found else no, config)
        got.append(HostState(*(backend.to_host(a) for a in state)))
    return got


RULE_RUNS = ["torch-odd", "paddle-odd", "megatron-odd", "megatron-h1", "deepspeed-default",
             "deepspeed-consecutive", "deepspeed-min-not-f32"]


@pytest.mark.parametrize("name", RULE_RUNS)
def test_every_backend_kernel_is_the_engine(backend_name, name):
    """10k steps of each backend's update kernel against the engine, bitwise (every backend that
    runs here: tests/conftest.py; cupy's with the gpu mark)."""
    flags, want, config = reference_run(name, 7)
    assert_same_run(kernel_run(backend_name, config, flags), want, f"{backend_name} {name}")


@pytest.mark.parametrize("name", RULE_RUNS)
def test_cupy_kernel_is_the_engine_emulated(cupy_host_update, name):
    """The cupy update kernel's CUDA body (built for the CPU by nvcc), 10k steps."""
    flags, want, config = reference_run(name, 7)
    state, got = HostState(float(np.float32(config.init_scale))), []
    for found in flags:
        state = cupy_host_update(state, 1.0 if found else 0.0, config)
        got.append(state)
    assert_same_run(got, want, f"cupy (emulated) {name}")


# -- through LossScaler: real inf gradients, skip decisions, checkpoints mid-hysteresis -------------
SHORT = 600


def _mid_hysteresis(states, config):
    """A step after which an overflow has been absorbed (trackers mid-run): where to checkpoint."""
    for i, s in enumerate(states[SHORT // 4:], SHORT // 4):
        if 0 < s.backoff_tracker:
            return i
    pytest.fail(f"no absorbed overflow in the run of {config}")


@pytest.mark.parametrize("name", ["paddle-odd", "megatron-odd", "deepspeed-default",
                                  "deepspeed-consecutive", "deepspeed-min-not-f32"])
def test_loss_scaler_follows_the_engine_and_resumes_mid_hysteresis(backend_name, make_array, tmp_path,
                                                                   name):
    """600 steps of LossScaler.step/update with inf gradients where the engine overflowed; at a step
    with an absorbed overflow the scaler is saved, a new one loads the file and goes on."""
    flags, want, config = reference_run(name, 3, SHORT)
    cut = _mid_hysteresis(want, config)
    scaler = polyamp.LossScaler(config, backend=backend_name)
    applied = []
    for i, found in enumerate(flags):
        grads = [make_array(np.array([np.inf if found else 1.0, 2.0], np.float32))]
        result = scaler.step(grads, lambda i=i: applied.append(i))
        assert result.skipped == found and bool(result) == (not found)
        scaler.update()
        assert scaler.host_state() == want[i] or assert_same_run([scaler.host_state()], [want[i]], i)
        if i == cut:
            scaler.save(tmp_path / "scaler.json")
            saved = json.loads((tmp_path / "scaler.json").read_text())
            assert saved["config"]["rule"] == config.rule and saved["backoff_tracker"] > 0
            scaler = polyamp.LossScaler(backend=backend_name)
            scaler.load(tmp_path / "scaler.json")
            assert scaler.config == config and scaler.host_state() == want[i]
    assert applied == [i for i, found in enumerate(flags) if not found]


def test_checkpoint_keeps_deepspeeds_growth_tracker_at_the_window():
    """DeepSpeed's rule leaves growth_tracker == scale_window (the step before a growth): loadable."""
    config = LossScaleConfig(rule="deepspeed", growth_interval=3)
    scaler = polyamp.LossScaler(config, backend="numpy")
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.host_state() == HostState(2.0**16, 3, 0)
    other = polyamp.LossScaler(backend="numpy")
    other.load_state_dict(scaler.state_dict())
    other.update(found_inf=False)
    assert other.host_state() == HostState(2.0**17, 1, 0)
    with pytest.raises(polyamp.StateDictError, match=r"growth_tracker.*<= 2 .*rule='torch'"):
        other.load_state_dict({**scaler.state_dict(), "config": {"growth_interval": 3}})


def test_checkpoints_without_the_new_fields_load_as_before():
    """A checkpoint written before ``rule`` existed: its config has product_dtype and no rule."""
    old = {"format": "polyamp.LossScaler", "version": 1, "scale": 1024.0, "growth_tracker": 5,
           "backoff_tracker": 1, "steps": 9, "skipped_steps": 2,
           "config": {"init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                      "growth_interval": 2000, "backoff_interval": 2, "min_scale": None,
                      "max_scale": None, "dynamic": True, "product_dtype": "float32"}}
    scaler = polyamp.LossScaler(backend="numpy")
    scaler.load_state_dict(old)
    assert scaler.config.rule == "torch" and scaler.config.products == "float32"
    assert not scaler.config.consecutive_hysteresis and not scaler.config.raise_error_at_min_scale
    assert scaler.host_state() == HostState(1024.0, 5, 1)


# -- raise_error_at_min_scale ----------------------------------------------------------------------
def test_min_scale_error_is_deepspeeds_exception_at_the_same_step(backend_name, make_array):
    """The engine raises at the overflow that finds the scale at min_scale with hysteresis spent;
    LossScaler raises MinScaleError from update() at that same step: skipped, weights and state
    unchanged, and the scaler goes on when the caller does."""
    update, _, config = deepspeed(2.0**4, 3, 1.0, 2, raise_error_at_min_scale=True)
    flags = [False, True, False, True, True, True, True, False, True, True, True]
    engine_raised_at = None
    for i, found in enumerate(flags):
        try:
            update(found)
        except Exception as exc:  # DeepSpeed raises a bare Exception
            assert "already at minimum" in str(exc)
            engine_raised_at = i
            break
    assert engine_raised_at is not None
    scaler = polyamp.LossScaler(config, backend=backend_name)
    weights = np.array([1.0, 2.0], np.float32)
    for i, found in enumerate(flags):
        grads = [make_array(np.array([np.inf if found else 0.5, 0.5], np.float32))]
        before = weights.copy()
        result = scaler.step(grads, lambda: weights.__isub__(0.25))
        state = scaler.host_state()
        if i < engine_raised_at:
            scaler.update()
            continue
        assert result.skipped and np.array_equal(weights, before)
        with pytest.raises(MinScaleError, match=r"already at its minimum 1 .*raise_error_at_min_scale=False"):
            scaler.update()
        assert scaler.host_state() == state and state.scale == 1.0
        break
    scaler.step([make_array(np.array([0.5], np.float32))], lambda: weights.__isub__(0.25))
    scaler.update()  # the iteration ended with the error: the loop goes on
    assert scaler.steps == engine_raised_at + 2


def test_min_scale_error_not_raised_while_hysteresis_absorbs():
    config = LossScaleConfig(rule="deepspeed", init_scale=1.0, min_scale=1.0, backoff_interval=3,
                             raise_error_at_min_scale=True)
    scaler = polyamp.LossScaler(config, backend="numpy")
    for _ in range(2):  # absorbed by delayed_shift=3
        scaler.step([np.array([np.inf], np.float32)], lambda: None)
        scaler.update()
    scaler.step([np.array([np.inf], np.float32)], lambda: None)
    with pytest.raises(MinScaleError):
        scaler.update()
    scaler.update(found_inf=False)  # a finite update() without step() reads nothing extra
    assert scaler.host_state() == HostState(1.0, 1, 2)
    with pytest.raises(MinScaleError):  # an update() without step(): the flag is read
        scaler.update(found_inf=True)


# -- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "match"), [
    ({"rule": "apex"}, r"rule must be one of 'torch', 'paddle', 'megatron', 'deepspeed', got rule='apex'"),
    ({"rule": ["torch"]}, r"rule must be one of .* got rule=\['torch'\]\. Fix: pass e\.g\. rule='torch'"),
    ({"rule": "megatron", "product_dtype": "float64"},
     r"rule='megatron' forms scale\*factor in float32, got product_dtype='float64'\. Fix:"),
    ({"rule": "deepspeed", "product_dtype": "float32"}, r"forms scale\*factor in float64"),
    ({"rule": "paddle", "product_dtype": "float64"}, r"Fix: leave product_dtype unset"),
    ({"consecutive_hysteresis": True},
     r"consecutive_hysteresis is DeepSpeed's option, got consecutive_hysteresis=True with rule='torch'"),
    ({"rule": "megatron", "raise_error_at_min_scale": True},
     r"raise_error_at_min_scale is DeepSpeed's option.*Fix: pass rule='deepspeed'"),
    ({"rule": "deepspeed", "consecutive_hysteresis": 1}, r"consecutive_hysteresis must be True or False"),
])
def test_config_refuses_rule_mismatches(fields, match):
    with pytest.raises(polyamp.ConfigError, match=match):
        LossScaleConfig(**fields)


def test_products_default_to_the_rules_own():
    assert [LossScaleConfig(rule=r).products for r in ("torch", "paddle", "megatron", "deepspeed")] == [
        "float64", "float32", "float32", "float64"]
    assert LossScaleConfig(product_dtype="float32").products == "float32"  # the paddle facade's config
    assert LossScaleConfig().replace(rule="megatron").products == "float32"


def test_trainer_raises_min_scale_error_with_the_weights_untouched():
    """MixedPrecisionTrainer runs the same iteration: its skipped step leaves the model as it was."""
    from polyamp import MixedPrecisionTrainer
    from polyamp.demo import MLP, softmax_cross_entropy, spirals
    from polyamp.optim import SGD

    x, y = spirals(32, seed=0)
    model = MLP([2, 8, 3], seed=0)
    config = LossScaleConfig(rule="deepspeed", init_scale=1.0, min_scale=1.0, backoff_interval=1,
                             raise_error_at_min_scale=True)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.1), "float16", config)
    assert not trainer.train_step(x, y, softmax_cross_entropy).skipped
    model.parameters()[0].data[...] = np.nan  # the forward pass turns NaN: gradients overflow
    before = [p.data.copy() for p in model.parameters()]
    with pytest.raises(MinScaleError):
        trainer.train_step(x, y, softmax_cross_entropy)
    for p, b in zip(model.parameters(), before, strict=True):
        np.testing.assert_array_equal(p.data, b)


def _reads_per_step(host_reads, config):
    """(reads in step(), reads in update()) for finite, finite, finite, overflow, finite steps."""
    import torch

    scaler = polyamp.LossScaler(config)
    counts = []
    for found in [False, False, False, True, False]:
        grads = [torch.full((3,), np.inf if found else 2.0)]
        with host_reads() as in_step:
            scaler.step(grads, lambda: None)
        with host_reads() as in_update:
            scaler.update()
        counts.append((in_step.count, in_update.count))
    assert scaler.host_state().scale == 8.0  # grown to 16, backed off by the overflow
    return counts


@pytest.mark.parametrize("rule", ["megatron", "deepspeed"])
def test_applied_steps_read_once_under_every_rule(host_reads, rule):
    """The rules add no host read: one per applied step (the skip decision), none in update(), also
    with raise_error_at_min_scale=True, whose check reads the flag and the state (scale and two
    trackers) after a skipped step only. A skipped step's update otherwise reads what torch's rule
    reads there (the floor check)."""
    pytest.importorskip("torch")
    base = LossScaleConfig(init_scale=8.0, growth_interval=2)
    torch_rule = _reads_per_step(host_reads, base)
    assert torch_rule[:3] + torch_rule[4:] == [(1, 0)] * 4
    assert _reads_per_step(host_reads, base.replace(rule=rule)) == torch_rule
    if rule == "deepspeed":
        raising = _reads_per_step(host_reads, base.replace(rule=rule, raise_error_at_min_scale=True))
        assert raising[:3] + raising[4:] == [(1, 0)] * 4
        assert raising[3] == (1, torch_rule[3][1] + 1 + 3)
