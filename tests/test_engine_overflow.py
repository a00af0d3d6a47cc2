"""LossScaler(diagnose=...): last_overflow after skipped steps only, explain() read-only, named
gradients, the log lines, and no extra host read on an applied step (counted on torch)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from polyamp import LossScaleConfig, LossScaler, OverflowReport

INF, NAN = math.inf, math.nan


def grads_with(bad: float | None = None) -> dict[str, np.ndarray]:
    grads = {"embed.weight": np.full((3, 2), 4.0, np.float32), "head.bias": np.full(2, 8.0, np.float32)}
    if bad is not None:
        grads["head.bias"][1] = bad
    return grads


def test_skipped_step_reports_named_gradients_and_applied_step_clears_it():
    scaler = LossScaler(LossScaleConfig(init_scale=4.0), diagnose=True)
    stepped = []
    result = scaler.step(grads_with(INF), lambda: stepped.append(1))
    scaler.update()
    report = scaler.last_overflow
    assert result.skipped and not stepped and isinstance(report, OverflowReport)
    assert report.scale == 4.0 and report.checked == 2
    (tensor,) = report.tensors
    assert (tensor.name, tensor.posinf, tensor.max_abs_finite) == ("head.bias", 1, 2.0)  # unscaled 8/4
    scaler.step(grads_with(), lambda: stepped.append(1))
    assert scaler.last_overflow is None and stepped == [1]  # applied: None at once
    scaler.update()
    assert scaler.last_overflow is None


def test_without_diagnose_there_is_never_a_report():
    scaler = LossScaler()
    assert scaler.step(grads_with(NAN), lambda: None).skipped
    scaler.update()
    assert scaler.last_overflow is None


def test_unscale_then_update_that_skips_reports_too():
    scaler = LossScaler(diagnose=True)
    scaler.unscale_([np.ones(2, np.float32), np.array([NAN], np.float32)])
    scaler.update()
    assert [t.name for t in scaler.last_overflow.tensors] == ["grads[1]"]
    scaler.unscale_([np.ones(2, np.float32)])
    scaler.update()
    assert scaler.last_overflow is None


def test_gradients_are_numbered_in_the_order_checked():
    scaler = LossScaler(diagnose=True)
    scaler.unscale_([np.ones(2, np.float32), np.ones(1, np.float32), np.array([INF], np.float32)])
    scaler.step([], lambda: None)
    assert scaler.last_overflow.tensors[0].name == "grads[2]" and scaler.last_overflow.checked == 3


def test_a_recorded_flag_with_finite_gradients_says_so():
    scaler = LossScaler(diagnose=True)
    scaler.unscale_([np.ones(2, np.float32)])
    scaler.record_found_inf(np.asarray(np.float32(1.0)))
    assert scaler.step([], lambda: None).skipped
    report = scaler.last_overflow
    assert not report.found and "record_found_inf" in report.diagnosis


def test_mapping_gradients_are_unscaled_by_value():
    scaler = LossScaler(LossScaleConfig(init_scale=4.0))
    grads = grads_with()
    scaler.step(grads, lambda: None)
    np.testing.assert_array_equal(grads["head.bias"], [2.0, 2.0])  # the values were divided


def test_explain_is_read_only_and_uses_the_scale():
    scaler = LossScaler(LossScaleConfig(init_scale=8.0), diagnose=True)
    grads = grads_with(NAN)
    report = scaler.explain(grads, loss=NAN)
    assert report.scale == 8.0 and report.loss_finite is False
    assert not scaler.has_pending_check and scaler.steps == 0 and scaler.last_overflow is None
    np.testing.assert_array_equal(grads["embed.weight"], 4.0)  # not unscaled
    scaler.unscale_(grads)
    assert scaler.explain(grads).tensors[0].name == "head.bias"  # mid-iteration is fine
    assert scaler.has_pending_check


def test_diagnose_must_be_a_bool():
    with pytest.raises(TypeError, match="diagnose=1"):
        LossScaler(diagnose=1)  # type: ignore[arg-type]


def test_copies_keep_diagnose_and_the_report():
    import copy
    import pickle

    scaler = LossScaler(diagnose=True)
    scaler.step([np.array([INF], np.float32)], lambda: None)
    scaler.update()
    for twin in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert twin.last_overflow == scaler.last_overflow
        twin.step([np.array([NAN], np.float32)], lambda: None)
        assert twin.last_overflow.tensors[0].nan == 1


def test_info_line_names_tensors_and_floor_warning_quotes_the_diagnosis(caplog):
    scaler, reports = LossScaler(LossScaleConfig(init_scale=2.0**-125), diagnose=True), []
    with caplog.at_level(logging.INFO, logger="polyamp"):
        for _ in range(2):  # tiny gradients: unscaled by a tiny scale, they stay finite
            tiny = {"embed.weight": np.full(3, 2.0**-126, np.float32),
                    "head.bias": np.array([INF, 0], np.float32)}
            scaler.step(tiny, lambda: None)
            scaler.update()
            reports.append(scaler.last_overflow)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos[0].endswith("; inf/nan in head.bias (1 +inf)")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.endswith("Last overflow report: " + reports[0].diagnosis)  # it hit the floor at once
    assert "1 of 2 gradient tensors hold inf/nan" in warning


def test_info_line_unchanged_without_diagnose(caplog):
    scaler = LossScaler()
    with caplog.at_level(logging.INFO, logger="polyamp"):
        scaler.step(grads_with(INF), lambda: None)
        scaler.update()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == "overflow in gradients: step skipped, loss scale backed off 65536 -> 32768"


def _applied_step_reads(counting_host_reads, diagnose: bool) -> dict[str, int]:
    torch = pytest.importorskip("torch")
    scaler = LossScaler(diagnose=diagnose)
    grads = {"w": torch.ones(4), "b": torch.ones(2, dtype=torch.float16)}
    scaler.step(grads, lambda: None)  # first step: state made, backend bound
    scaler.update()
    with counting_host_reads() as counts:
        assert not scaler.step(grads, lambda: None).skipped
        scaler.update()
    return counts


def test_an_applied_step_reads_nothing_more_with_diagnose(counting_host_reads):
    without = _applied_step_reads(counting_host_reads, diagnose=False)
    with_diagnose = _applied_step_reads(counting_host_reads, diagnose=True)
    assert sum(without.values()) == 1  # the skip decision, and only it
    assert with_diagnose == without
