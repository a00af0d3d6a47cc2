"""Train the demo MLP three ways: float32, float16 without loss scaling, float16 + polyamp
(or the same with bfloat16), from the same initial weights on the same data.

The loss is a mean over a global batch of ``global_batch`` samples (2**24: a language-model batch
in tokens), so per-sample gradients (~2e-8) sit below float16's smallest subnormal and vanish
without loss scaling; Adam is scale-invariant, so float32 is unaffected. With ``--distributed``
each rank computes an equal shard of the ``batch`` samples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from polyamp import LossScaleConfig, MixedPrecisionTrainer
from polyamp._errors import ConfigError

from . import backends
from .data import spirals
from .threads import single_threaded
from .world import World

__all__ = [
    "DemoSettings", "RunResult", "format_table", "preflight", "run_demo", "summary", "train_once",
    "within_tolerance",
]

#: float16 + polyamp must end within these of float32 (final training loss, test accuracy).
LOSS_TOLERANCE = 0.02
ACCURACY_TOLERANCE = 0.01

Progress = Callable[[str, int], Callable[[float], None]]


@dataclass(frozen=True)
class DemoSettings:
    """Everything a demo run depends on; the defaults are the full demo (``polyamp demo``)."""

    backend: str = "numpy"
    dtype: str = "float16"
    steps: int = 300
    batch: int = 4096
    global_batch: int = 2**24
    hidden: int = 64
    lr: float = 1e-2
    seed: int = 0
    test_size: int = 4000
    init_scale: float = 2.0**16
    growth_interval: int = 10

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "global_batch", "hidden", "test_size", "growth_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {name}={value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be an int >= 0 (NumPy seeds are), got seed={self.seed!r}")
        if self.global_batch < self.batch:
            raise ConfigError(
                f"global_batch must be >= batch, got global_batch={self.global_batch!r} and "
                f"batch={self.batch!r}; the loss is a mean over the global batch"
            )
        if self.dtype not in ("float16", "bfloat16"):
            raise ConfigError(f"dtype must be 'float16' or 'bfloat16', got dtype={self.dtype!r}")

    def replace(self, **changes: Any) -> DemoSettings:
        """A copy with some settings changed (validated again)."""
        return replace(self, **changes)

    @property
    def scale_config(self) -> LossScaleConfig:
        """The loss-scale config of the polyamp run."""
        return LossScaleConfig(init_scale=self.init_scale, growth_interval=self.growth_interval)


@dataclass
class RunResult:
    """One training run: per-step history (loss as the per-sample mean) and final numbers."""

    label: str
    dtype: str
    loss_scaling: bool
    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    zero_grad_fraction: float = float("nan")  # of the float32 master gradient values, step 1
    accuracy: float = float("nan")
    seconds: float = 0.0

    @property
    def final_loss(self) -> float:
        """The per-sample training loss of the last step."""
        return self.losses[-1]

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped for inf/nan gradients."""
        return sum(self.skipped)

    @property
    def final_scale(self) -> float:
        """The loss scale of the last step (1.0 without loss scaling)."""
        return self.scales[-1]


def _label(dtype: str, loss_scaling: bool) -> str:
    if dtype == "float32":
        return "float32"
    return f"{dtype} + polyamp" if loss_scaling else f"{dtype}, no loss scaling"


def train_once(settings: DemoSettings, dtype: str, loss_scaling: bool, data: tuple,
               progress: Progress | None = None, world: World | None = None) -> RunResult:
    """Train one fresh model (the same initial weights every time) and evaluate it on test data;
    with a ``world`` of several ranks, on this rank's shard of the batch."""
    world = world or World()
    rows = world.share(settings.batch, "--batch")
    kit = backends.get(settings.backend)
    x, y, x_test, y_test = (kit.asarray(a) for a in (data[0][rows], data[1][rows], *data[2:]))
    model, optimizer, loss_fn = kit.build(settings, world.size)
    trainer = MixedPrecisionTrainer(model, optimizer, dtype, settings.scale_config, loss_scaling=loss_scaling,
                                    backend=kit.name,  # the scaler works where the arrays are
                                    reducer=world.reducer)
    result = RunResult(_label(dtype, loss_scaling), dtype, loss_scaling)
    per_sample = settings.global_batch / settings.batch  # the loss is a share of a global mean
    tick = progress(result.label, settings.steps) if progress else None
    start = time.perf_counter()
    for step in range(settings.steps):
        metrics = trainer.train_step(x, y, loss_fn)
        if step == 0:
            result.zero_grad_fraction = kit.zero_fraction(trainer.grads.flat)
        result.losses.append(metrics.loss * per_sample)
        result.scales.append(metrics.loss_scale)
        result.skipped.append(metrics.skipped)
        if tick:
            tick(result.losses[-1])
    result.seconds = time.perf_counter() - start
    result.accuracy = kit.accuracy(model, x_test, y_test)
    if world.reducer is not None:  # each rank's loss is its shard's: the mean over ranks, once
        losses = world.reducer.allreduce_sum_(np.asarray(result.losses, dtype=np.float64))
        result.losses = (losses / world.size).tolist()
    return result


def preflight(settings: DemoSettings, world: World | None = None) -> None:
    """Raise now, before any training, when the backend, the dtype or the split cannot run here."""
    backends.check_dtype(backends.get(settings.backend), settings.dtype)
    (world or World()).share(settings.batch, "--batch")


def run_demo(settings: DemoSettings, progress: Progress | None = None,
             world: World | None = None) -> list[RunResult]:
    """The demo's three runs, on the same spirals and from the same initial weights (on every rank)."""
    preflight(settings, world)
    data = (*spirals(settings.batch, seed=settings.seed),  # train, then test
            *spirals(settings.test_size, seed=settings.seed + 1))
    runs = [("float32", False), (settings.dtype, False), (settings.dtype, True)]
    with single_threaded(settings.backend):  # small matmuls: spinning BLAS threads only cost
        return [train_once(settings, dtype, scaling, data, progress, world) for dtype, scaling in runs]


def within_tolerance(run: RunResult, reference: RunResult) -> bool:
    """Whether ``run`` ends within LOSS_TOLERANCE and ACCURACY_TOLERANCE of ``reference``."""
    return (abs(run.final_loss - reference.final_loss) <= LOSS_TOLERANCE
            and abs(run.accuracy - reference.accuracy) <= ACCURACY_TOLERANCE)


def _power_of_two(value: float) -> str:
    """``2^k`` for an exact power of two (loss scales are), else the number."""
    exponent = math.log2(value) if value > 0 else math.nan
    return f"2^{exponent:.0f}" if exponent.is_integer() else f"{value:g}"


def format_table(results: list[RunResult]) -> str:
    """The results as a plain-text table, one row per run."""
    header = ("run", "final loss", "test accuracy", "skipped steps", "final scale",
              "zero grads at step 1", "time")
    rows = [header] + [(
        r.label, f"{r.final_loss:.4f}", f"{100 * r.accuracy:.1f}%", str(r.skipped_steps),
        _power_of_two(r.final_scale) if r.loss_scaling else "-", f"{100 * r.zero_grad_fraction:.0f}%",
        f"{r.seconds:.1f}s") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(results: list[RunResult]) -> str:
    """One line per low-precision run: within tolerance of float32 or not (bfloat16: and why)."""
    reference = results[0]
    lines = [f"{run.label}: {'matches' if within_tolerance(run, reference) else 'does NOT match'} float32 "
             f"(tolerance: loss within {LOSS_TOLERANCE}, test accuracy within {100 * ACCURACY_TOLERANCE:.0f} "
             "point)" for run in results[1:]]
    if reference is not results[-1] and results[-1].dtype == "bfloat16":
        lines.append("bfloat16 has float32's exponent range (8 bits), so these gradients do not underflow "
                     "in it: bfloat16 needs no loss scaling, and the three runs match. The gap that loss "
                     "scaling closes is float16's (the default --dtype).")
    return "\n".join(lines)
