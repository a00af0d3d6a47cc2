"""Issue 33, items 1 and 3: the PrecisionMeter config (validated, frozen, NumPy scalars accepted) and
the PrecisionReport built from the counts (totals, fractions, to_dict, str, advice)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest

import polyamp
from polyamp.precision import FloatFormat, PrecisionMeter, PrecisionReport

NUMPY = polyamp.get_backend("numpy")


def test_the_defaults_are_the_issues():
    meter = polyamp.PrecisionMeter()
    assert meter.every == 100
    assert [(t.format.name, t.scale) for t in meter.targets] == [("float16", "loss"), ("bfloat16", 1.0)]
    assert [t.label for t in meter.targets] == ["float16@loss", "bfloat16@1"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        meter.every = 3


def test_numpy_scalars_and_library_dtypes_are_accepted():
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    meter = PrecisionMeter(every=np.int64(7), targets=[
        (np.float16, np.float32(2)), (torch.bfloat16, np.array(1.0)), (ml_dtypes.float8_e4m3fn, "amax"),
        (FloatFormat("float8_e4m3fnuz", 4, 3, "fnuz"), np.int32(4))])
    assert meter.every == 7 and type(meter.every) is int
    assert [t.label for t in meter.targets] == ["float16@2", "bfloat16@1", "float8_e4m3fn@amax",
                                               "float8_e4m3fnuz@4"]
    assert all(type(t.scale) in (str, float) for t in meter.targets)


@pytest.mark.parametrize("kwargs, names", [
    (dict(every=0), "every=0"), (dict(every=2.5), "every=2.5"), (dict(every=True), "every=True"),
    (dict(targets=()), "targets=()"), (dict(targets="float16"), "targets='float16'"),
    (dict(targets=[("float32", "loss")]), "'float32'"), (dict(targets=[("float16",)]), "targets[0]"),
    (dict(targets=[("float16", 0.0)]), "targets[0]'s scale"), (dict(targets=[("float16", math.inf)]), "inf"),
    (dict(targets=[("float16", "los")]), "'los'"), (dict(targets=[("float16", True)]), "True"),
    (dict(targets=[("float16", 10**400)]), "targets[0]'s scale"),
    (dict(targets=[("bfloat16", 1), ("bfloat16", 1.0)]), "targets[1] repeats bfloat16@1"),
    (dict(targets=[(FloatFormat("x", 40, 3), 1.0)]), "FloatFormat"),
])
def test_bad_settings_raise_naming_the_parameter_the_value_and_the_fix(kwargs, names):
    with pytest.raises(polyamp.ConfigError) as info:
        PrecisionMeter(**kwargs)
    assert names in str(info.value) and "Fix:" in str(info.value)


def test_sample_steps_are_the_first_and_every_nth_after_it():
    meter = PrecisionMeter(every=3)
    assert [s for s in range(10) if meter.samples(s)] == [0, 3, 6, 9]
    assert [s for s in range(3) if PrecisionMeter(every=1).samples(s)] == [0, 1, 2]


def test_the_digest_follows_every_setting_that_must_agree():
    base = PrecisionMeter()
    assert base.digest() == PrecisionMeter(every=np.int64(100)).digest()
    others = [PrecisionMeter(every=99), PrecisionMeter(targets=[("float16", "loss")]),
              PrecisionMeter(targets=[("float16", "loss"), ("bfloat16", 2.0)])]
    assert len({base.digest(), *(m.digest() for m in others)}) == 4


def test_a_loss_target_needs_a_scale():
    with pytest.raises(polyamp.ConfigError, match="scale must be the loss scale"):
        PrecisionMeter().count(NUMPY, [np.ones(3, np.float32)], None)
    counts, _ = PrecisionMeter(targets=[("bfloat16", 1.0)]).count(NUMPY, [np.ones(3, np.float32)])
    assert counts.tolist() == [3, 0, 0, 0, 0, 0]


def _report(step=5, scale=2.0**10, **grads) -> PrecisionReport:
    meter = PrecisionMeter(targets=[("float16", "loss"), ("bfloat16", 1.0)])
    counts, extremes = meter.count(NUMPY, list(grads.values()), scale)
    return meter.report(step, scale, list(grads), counts, extremes)


def test_a_report_adds_up_the_gradients():
    small = np.full(100, 2.0**-40, np.float32)  # underflows float16 at 2**10: 2**-30 <= 2**-25
    small[:10] = 0
    big = np.array([1.0, 64.0, -2.0**-20, np.inf], np.float32)  # 64 * 2**10 = 65536 overflows float16
    report = _report(**{"fc2.weight": small, "fc1.bias": big})
    fc2, fc1 = report.tensors
    assert (fc2.name, fc2.numel, fc2.zeros, fc2.nonfinite, fc2.measured) == ("fc2.weight", 100, 10, 0, 90)
    assert (fc2.amax, fc2.amin) == (2.0**-40, 2.0**-40)
    assert (fc1.amax, fc1.amin, fc1.nonfinite) == (64.0, 2.0**-20, 1)
    assert fc2.targets[0].underflow == 90 and fc1.targets[0].overflow == 1
    assert report.totals["float16@loss"].underflow == 90 and report.totals["bfloat16@1"].underflow == 0
    assert report.fractions()["underflow_fraction/float16@loss"] == 90 / 93
    assert report.fractions()["overflow_fraction/float16@loss"] == 1 / 93
    assert report.amax == 64.0 and report.numel == 104


def test_to_dict_is_json_and_holds_every_count():
    report = _report(a=np.array([1e-9, 0.0, 3.0], np.float32))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["step"] == 5 and data["scale"] == 1024.0
    assert data["tensors"][0]["targets"]["float16@loss"] == dataclasses.asdict(report.tensors[0].targets[0])
    assert data["totals"]["bfloat16@1"] == {"underflow": 0, "subnormal": 0, "overflow": 0}
    assert data["advice"] == list(report.advice)


def test_the_suggested_scale_is_the_largest_power_of_two_under_half_the_max():
    for amax in (1.0, 3.0, 65504 / 2, 65504 / 2 + 1, 2.0**-30, 1e-3):
        report = _report(a=np.array([amax], np.float32))
        s = report.suggested_scale(report.targets[0])
        k = int(math.log2(s))
        assert s == 2.0**k and np.float32(amax) * s <= 65504 / 2 < np.float32(amax) * 2 * s


def test_the_suggested_scale_holds_for_formats_as_wide_as_float64():
    meter = PrecisionMeter(targets=[(FloatFormat("wide", 11, 52), 1.0)])
    for amax, expected in ((1.0, 2.0**1022), (2.0**-1000, 2.0**1023), (5e-324, 2.0**1023)):
        counts, extremes = meter.count(NUMPY, [np.array([amax])], 1.0)
        report = meter.report(1, 1.0, ["w"], counts, extremes)
        assert report.suggested_scale(report.targets[0]) == expected  # 2**1023: float64's largest


def test_advice_names_the_gradient_the_loss_and_the_scale_that_keeps_it():
    rng = np.random.default_rng(0)
    lost = (rng.uniform(1, 2, 1000) * 2.0**-40).astype(np.float32)  # all underflow at 2**10
    lost[:620] = 2.0**-8  # 38 % underflow
    report = _report(scale=2.0**10, **{"fc2.weight": lost})
    advice = report.advice
    # amax 2**-8: the largest 2**k with 2**-8 * 2**k <= 32752 is 2**22; amax is then 2**14: 1 binade below
    assert "fc2.weight: 38 % of its non-zero values underflow in float16 at scale 2**10; init_scale=2**22 " \
        "keeps its amax 1 binade below float16's max" in advice
    assert "bfloat16 at scale 1 loses 0.0 % here: loss scaling is not needed for bfloat16" in advice
    assert any(s.startswith("float16 at scale 2**10 loses 38 % here (38 % underflow, 0.0 % overflow)")
               for s in advice)
    text = str(report)
    assert "precision report, step 5, loss scale 2**10" in text and "fc2.weight" in text and "advice:" in text


def test_advice_on_overflow_and_on_nothing_to_measure():
    report = _report(scale=2.0**16, w=np.array([4.0, 0.25, np.nan], np.float32))
    assert any("w: 1 value overflows in float16 at scale 2**16; init_scale=2**12" in s for s in report.advice)
    assert any("1 gradient value is inf/nan" in s for s in report.advice)
    empty = _report(w=np.zeros(3, np.float32))
    assert empty.advice[-1] == "every gradient value is zero or inf/nan: nothing to measure"


def test_a_report_refuses_arrays_of_another_layout():
    meter = PrecisionMeter()
    counts, extremes = meter.count(NUMPY, [np.ones(3, np.float32)], 1.0)
    with pytest.raises(ValueError, match="one name per gradient"):
        meter.report(0, 1.0, ["a", "b"], counts, extremes)


def test_summed_counts_and_max_reduced_extremes_are_the_whole_gradients_report():
    """What the ranks' agreement will do: the shards' counts summed and extremes max-reduced give
    the report of the whole gradients."""
    rng = np.random.default_rng(4)
    whole = [(rng.standard_normal(600) * 10.0 ** rng.uniform(-12, 2, 600)).astype(np.float32)
             for _ in range(3)]
    whole[1][:50] = 0
    meter = PrecisionMeter(targets=[("float16", "loss"), ("float8_e5m2", 1.0)])
    parts = [meter.count(NUMPY, [g[i::3] for g in whole], 512.0) for i in range(3)]
    counts = sum(p.counts for p in parts)
    extremes = np.max([p.extremes for p in parts], axis=0)
    want = meter.count(NUMPY, whole, 512.0)
    assert counts.tolist() == want.counts.tolist() and extremes.tolist() == want.extremes.tolist()


def test_import_polyamp_does_not_load_the_meter():
    code = ("import sys, polyamp; assert 'polyamp.precision' not in sys.modules; "
            "polyamp.PrecisionMeter; assert 'polyamp.precision' in sys.modules; "
            "assert not {'torch', 'jax', 'paddle', 'cupy'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
