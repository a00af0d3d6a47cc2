"""The precision meter inside the step (issue 33, items 1 and 6): LossScaler(meter=) on NumPy and torch,
the torch facade, the sampling phase, skipped steps and metrics(). Every report is held to
``meter.report`` of a direct ``meter.count`` on the same unscaled gradients."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest

import polyamp

EVERY = 3


def grads_at(step: int, scale: float) -> dict[str, np.ndarray]:
    """Scaled gradients whose unscaled values span float16's underflow, subnormal and normal range."""
    rng = np.random.default_rng(step)
    return {"fc1.weight": (rng.standard_normal(300) * 1e-7 * scale).astype(np.float32),
            "fc2.bias": (rng.standard_normal(40) * 1e-2 * scale).astype(np.float32)}


def direct(meter, backend: str, grads, step: int, scale: float):
    """The report of a direct count of the (already unscaled) ``grads``."""
    measured = meter.count(polyamp.get_backend(backend), list(grads.values()), scale)
    counts, extremes = (np.asarray(a.cpu() if hasattr(a, "cpu") else a) for a in measured)
    return meter.report(step, scale, list(grads), counts, extremes)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_sample_steps_report_what_a_direct_count_reports(library):
    wrap = np.asarray
    if library == "torch":
        torch = pytest.importorskip("torch")
        wrap = torch.from_numpy
    meter = polyamp.PrecisionMeter(every=EVERY, targets=(("float16", "loss"), ("bfloat16", 1.0),
                                                          ("float8_e4m3fn", "amax")))
    scaler = polyamp.LossScaler(init_scale=2.0**6, growth_interval=2, meter=meter)
    assert scaler.last_precision is None
    sampled = []
    for step in range(3 * EVERY + 1):
        scale = scaler.get_scale()
        grads = {k: wrap(v) for k, v in grads_at(step, scale).items()}
        if step == EVERY:  # a skipped step is still a step taken, and a sample step
            grads["fc2.bias"][0] = np.inf
        before = scaler.last_precision
        result = scaler.step(grads, lambda: None)
        scaler.update()
        assert result.skipped == (step == EVERY)
        if step % EVERY == 0:
            sampled.append(step)
            assert scaler.last_precision == direct(meter, library, grads, step, scale)
            assert scaler.last_precision.step == step and scaler.last_precision.scale == scale
        else:  # a non-sample step leaves the last report as it was
            assert scaler.last_precision is before
    assert sampled == [0, EVERY, 2 * EVERY, 3 * EVERY]


def test_a_skipped_sample_step_counts_its_nonfinite_values():
    meter = polyamp.PrecisionMeter(every=1)
    scaler = polyamp.LossScaler(init_scale=2.0**4, meter=meter)
    grads = grads_at(0, 16.0)
    grads["fc2.bias"][:3] = [np.inf, -np.inf, np.nan]
    assert scaler.step(grads, lambda: None).skipped
    scaler.update()
    report = scaler.last_precision
    assert report == direct(meter, "numpy", grads, 0, 16.0)
    assert [t.nonfinite for t in report.tensors] == [0, 3]


def test_metrics_gain_the_last_reports_fractions():
    meter = polyamp.PrecisionMeter(every=2)
    scaler = polyamp.LossScaler(init_scale=1.0, meter=meter)
    assert not any("fraction" in k for k in scaler.metrics())
    grads = grads_at(0, 1.0)
    scaler.step(grads, lambda: None)
    scaler.update()
    metrics = scaler.metrics()
    fractions = scaler.last_precision.fractions()
    assert {k: metrics[k] for k in fractions} == fractions
    assert metrics["underflow_fraction/float16@loss"] > 0.1  # 1e-7-sized values at scale 1 underflow
    assert metrics["overflow_fraction/bfloat16@1"] == 0.0


def test_names_follow_the_overflow_report_and_lists_are_named_by_index():
    meter = polyamp.PrecisionMeter(every=1)
    scaler = polyamp.LossScaler(meter=meter)
    grads = list(grads_at(0, 2.0**16).values())
    scaler.step([grads[0], None, grads[1]], lambda: None)
    scaler.update()
    assert [t.name for t in scaler.last_precision.tensors] == ["grads[0]", "grads[2]"]


@pytest.mark.parametrize("bad", [3, "float16", polyamp.StepGuard(), {"every": 2}])
def test_a_meter_that_is_not_a_precision_meter_is_refused_naming_meter(bad):
    with pytest.raises(TypeError, match=r"meter must be a polyamp.PrecisionMeter or None, got meter="):
        polyamp.LossScaler(meter=bad)


def test_a_meterless_scaler_is_unchanged_and_a_metered_one_pickles():
    scaler = polyamp.LossScaler(meter=polyamp.PrecisionMeter(every=1))
    scaler.step(grads_at(0, 2.0**16), lambda: None)
    scaler.update()
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.last_precision == scaler.last_precision
    plain = polyamp.LossScaler()
    plain.step(grads_at(0, 2.0**16), lambda: None)
    plain.update()
    assert plain.last_precision is None and not any("fraction" in k for k in plain.metrics())


def test_the_torch_facade_names_parameters_where_known_else_by_index():
    torch = pytest.importorskip("torch")
    from polyamp.compat.torch import GradScaler, ShardedGradScaler

    meter = polyamp.PrecisionMeter(every=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for named in (True, False):
        scaler = GradScaler("cpu", init_scale=2.0**10, meter=meter)
        if named:
            scaler.name_parameters(model)
        for step in range(3):
            opt.zero_grad()
            scale = scaler.get_scale()
            scaler.scale(model(torch.randn(4, 6)).pow(2).sum() * 1e-6).backward()
            scaler.step(opt)
            scaler.update()
            if step in (0, 2):
                grads = {n: p.grad for n, p in model.named_parameters()}
                want = direct(meter, "torch", grads, step, scale)
                got = scaler.last_precision
                assert [t.name for t in got.tensors] == (
                    list(grads) if named else [f"param_groups[0][{i}]" for i in range(4)])
                renamed = tuple(replace(t, name=g.name) for g, t in zip(got.tensors, want.tensors))
                assert got.tensors == renamed
                assert scaler.metrics()["underflow_fraction/float16@loss"] == got.fractions()[
                    "underflow_fraction/float16@loss"]
    with pytest.raises(TypeError, match="meter must be"):
        GradScaler("cpu", meter="float16")
    with pytest.raises(TypeError, match="meter must be"):
        ShardedGradScaler("cpu", meter="float16")


def _calls(monkeypatch):
    """Every call of the NumPy fused kernel and of the unfused counts, by step (spies: both run)."""
    from polyamp.backends import _numpy_counts

    from polyamp import _precision_counts

    seen = []
    for module, name in ((_numpy_counts, "unscale_and_count"), (_precision_counts, "count")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return seen


def test_a_sample_step_counts_in_the_unscale_pass_and_other_steps_run_no_count(monkeypatch):
    from polyamp.backends import _numpy_counts

    if not _numpy_counts.fused_available():
        pytest.skip("no numba: the unfused passes count")
    seen = _calls(monkeypatch)
    meter = polyamp.PrecisionMeter(every=EVERY)
    scaler = polyamp.LossScaler(init_scale=2.0**6, meter=meter)
    per_step = []
    for step in range(2 * EVERY):
        grads = grads_at(step, scaler.get_scale())
        scaler.step(grads, lambda: None)
        scaler.update()
        per_step.append(seen[:])
        seen.clear()
    assert per_step == [["unscale_and_count"] if s % EVERY == 0 else [] for s in range(2 * EVERY)]


@pytest.mark.parametrize("kind", ["diagnose", "norm guard"])
def test_a_kept_or_norm_fused_unscale_counts_in_its_own_passes_and_reports_alike(monkeypatch, kind):
    seen = _calls(monkeypatch)
    meter = polyamp.PrecisionMeter(every=1)
    extra = {"diagnose": True} if kind == "diagnose" else {
        "guard": polyamp.StepGuard(max_grad_norm=1e6)}
    scaler = polyamp.LossScaler(init_scale=2.0**6, meter=meter, **extra)
    grads = grads_at(0, 2.0**6)
    scaler.step(grads, lambda: None)
    scaler.update()
    assert seen == ["count"]
    assert scaler.last_precision == direct(meter, "numpy", grads, 0, 2.0**6)
