"""polyamp.explain_overflow / OverflowReport / TensorOverflow on real NumPy, torch, array-api-strict,
paddle (and CuPy, gpu mark) arrays: counts, names, order, diagnosis, read-only, errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import polyamp
from polyamp import OverflowReport, TensorOverflow, explain_overflow
from polyamp.overflow import build_report, log_summary

NAN, INF = math.nan, math.inf


def _torch(a):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(a.copy())


def _strict(a):
    xs = pytest.importorskip("array_api_strict")
    return xs.asarray(a.astype(np.float32))  # array-api-strict has no float16


def _paddle(a):
    paddle = pytest.importorskip("paddle")
    return paddle.to_tensor(a.copy())


def _cupy(a):
    info = {i.name: i for i in polyamp.available_backends()}.get("cupy")
    if info is None or not info.available:
        pytest.skip(f"cupy unavailable: {info.reason if info else 'not installed'}")
    import cupy

    return cupy.asarray(a)


LIBRARIES = [
    pytest.param(lambda a: a.copy(), id="numpy"),
    pytest.param(_torch, id="torch"),
    pytest.param(_strict, id="array-api-strict"),
    pytest.param(_paddle, id="paddle"),
    pytest.param(_cupy, id="cupy", marks=pytest.mark.gpu),
]


def _host(array) -> np.ndarray:
    for name in ("numpy", "get"):
        if callable(getattr(array, name, None)) and not isinstance(array, np.ndarray):
            return np.asarray(getattr(array, name)())
    return np.asarray(np.from_dlpack(array)) if not isinstance(array, np.ndarray) else array


def model_grads() -> dict[str, np.ndarray]:
    """Five layers; fc3.weight holds 2 nan, 3 +inf, 1 -inf; fc1.bias 1 +inf; the rest finite."""
    rng = np.random.default_rng(0)
    grads = {f"fc{i}.{part}": rng.standard_normal((4, 6) if part == "weight" else (6,)).astype(np.float16)
             for i in range(1, 6) for part in ("weight", "bias")}
    grads["fc3.weight"].reshape(-1)[:6] = [NAN, NAN, INF, INF, INF, -INF]
    grads["fc3.weight"][3, 5] = -300.0  # its largest finite magnitude
    grads["fc1.bias"][2] = INF
    return grads


@pytest.mark.parametrize("convert", LIBRARIES)
def test_one_overflowing_layer_among_many_counts_and_orders(convert):
    grads = {k: convert(v) for k, v in model_grads().items()}
    before = {k: _host(v).copy() for k, v in grads.items()}
    report = explain_overflow(grads, loss=1.5, scale=1024.0)
    assert report.found and bool(report) and report.checked == 10 and report.loss_finite is True
    assert [t.name for t in report.tensors] == ["fc3.weight", "fc1.bias"]  # most non-finite first
    fc3, fc1 = report.tensors
    assert (fc3.nan, fc3.posinf, fc3.neginf, fc3.max_abs_finite) == (2, 3, 1, 300.0)
    assert (fc1.nan, fc1.posinf, fc1.neginf) == (0, 1, 0)
    assert fc3.shape == (4, 6) and fc3.size == 24 and fc1.dtype == ("float32" if "strict" in str(
        type(grads["fc1.bias"])) else "float16")
    assert "2 of 10 gradient tensors" in report.diagnosis and "fc3.weight" in report.diagnosis
    for k, v in grads.items():  # read-only: every array as it was, nan where nan was
        np.testing.assert_array_equal(_host(v), before[k])


def test_ties_keep_the_order_given_and_unnamed_are_grads_i():
    grads = [np.ones(3, np.float32), np.array([INF, 1], np.float32), np.array([NAN, 2], np.float32)]
    report = explain_overflow(grads)
    assert [t.name for t in report.tensors] == ["grads[1]", "grads[2]"]
    named = explain_overflow(grads, names=["a", "b", "c"])
    assert [t.name for t in named.tensors] == ["b", "c"]
    assert explain_overflow([None, grads[1]]).tensors[0].name == "grads[1]"  # None skipped, index kept


def test_nan_loss_is_the_diagnosis_even_with_finite_gradients():
    report = explain_overflow([np.ones(4, np.float32)], loss=np.array([NAN], np.float32), scale=8.0)
    assert report.found and report.loss_finite is False and report.tensors == ()
    assert report.diagnosis.startswith("the loss itself is not finite")


@pytest.mark.parametrize("convert", LIBRARIES)
def test_all_nan_model_says_every_gradient(convert):
    grads = [convert(np.full(s, NAN, np.float32)) for s in ((3, 3), (3,), (2, 3))]
    report = explain_overflow(grads, loss=2.0)
    assert [t.nan for t in report.tensors] == [9, 6, 3]  # most first: 9, 6, 3
    assert all(t.max_abs_finite == 0.0 for t in report.tensors)
    assert report.diagnosis.startswith("every gradient tensor holds inf/nan (3 of 3)")


@pytest.mark.parametrize("convert", LIBRARIES)
def test_nan_loss_array_of_each_library(convert):
    report = explain_overflow([convert(np.ones(2, np.float32))], loss=convert(np.array([INF], np.float32)))
    assert report.loss_finite is False and report.found


def test_no_overflow_is_falsy_and_says_so():
    report = explain_overflow({"w": np.ones(3, np.float16)}, loss=0.25)
    assert not report and not report.found and report.tensors == ()
    assert report.diagnosis == "no overflow: every gradient and the loss is finite."
    assert explain_overflow([]).checked == 0


def test_skipped_without_local_overflow_names_another_rank_or_a_recorded_flag():
    named = [("w", np.ones(3, np.float32))]
    elsewhere = build_report(named, skipped=True, agreed=True, local_flag=False)
    assert not elsewhere.found and "another rank overflowed" in elsewhere.diagnosis
    recorded = build_report(named, skipped=True, agreed=False)
    assert "record_found_inf" in recorded.diagnosis
    local_norm = build_report(named, skipped=True, agreed=True, local_flag=True)
    assert "another rank" not in local_norm.diagnosis


def test_to_dict_is_json_and_str_is_a_table():
    report = explain_overflow(model_grads(), scale=65536.0, loss=1.0)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["found"] is True and data["scale"] == 65536.0 and data["checked"] == 10
    assert data["tensors"][0] == {"name": "fc3.weight", "shape": [4, 6], "dtype": "float16", "size": 24,
                                  "nan": 2, "posinf": 3, "neginf": 1, "max_abs_finite": 300.0}
    text = str(report)
    lines = text.splitlines()
    assert lines[0] == "overflow report: 2 of 10 gradient tensors hold inf/nan; loss finite; scale 65536"
    assert lines[1].split() == ["name", "shape", "dtype", "size", "nan", "+inf", "-inf", "max|finite|"]
    assert lines[2].split()[0] == "fc3.weight" and lines[-1].startswith("diagnosis: ")
    assert isinstance(report.tensors[0], TensorOverflow) and isinstance(report, OverflowReport)


def test_report_is_frozen():
    report = explain_overflow([np.ones(1, np.float32)])
    with pytest.raises(AttributeError):
        report.found = True  # type: ignore[misc]


def test_log_summary_names_up_to_three_tensors():
    grads = [np.array([INF] * (5 - i), np.float32) for i in range(5)]
    summary = log_summary(explain_overflow(grads))
    assert summary == ("; inf/nan in grads[0] (5 +inf), grads[1] (4 +inf), grads[2] (3 +inf) "
                       "and 2 more tensors")
    assert log_summary(None) == ""


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"grads": np.ones(3)}, TypeError, "pass [grad]"),
    ({"grads": [np.ones(2)], "names": ["a", "b"]}, ValueError, "names must be a sequence of 1 str"),
    ({"grads": [np.ones(2)], "names": "a"}, ValueError, "names="),
    ({"grads": {"a": np.ones(2)}, "names": ["a"]}, TypeError, "mapping's keys are its names"),
    ({"grads": [1.0]}, TypeError, "gradient 'grads[0]' is not an array"),
    ({"grads": [np.ones(2)], "loss": np.ones(2)}, ValueError, "loss must be a number or a 1-element"),
    ({"grads": [np.ones(2)], "loss": "x"}, TypeError, "loss='x'"),
])
def test_bad_input_names_the_argument(kwargs, error, words):
    grads = kwargs.pop("grads")
    with pytest.raises(error, match=None) as info:
        explain_overflow(grads, **kwargs)
    assert words in str(info.value)


def test_public_names():
    assert polyamp.explain_overflow is explain_overflow
    assert {"OverflowReport", "TensorOverflow", "explain_overflow"} <= set(polyamp.__all__)


def test_a_gradient_made_with_create_graph_is_read_as_itself():
    """Issue 32 item 8: a non-leaf gradient (torch.autograd.grad(..., create_graph=True)) requires
    grad; it is the gradient, not a parameter whose .grad to read."""
    torch = pytest.importorskip("torch")
    from polyamp import explain_overflow

    w = torch.tensor([1.0, 2.0], requires_grad=True)
    (g,) = torch.autograd.grad((w * torch.tensor([float("inf"), 1.0])).sum() * w.sum(), w, create_graph=True)
    assert g.requires_grad and not g.is_leaf
    report = explain_overflow([g])
    assert report.found and report.tensors[0].name == "grads[0]"
