"""Forensics look at the arrays the user meant (issue: reports that looked at the wrong arrays).

Each case was wrong without a word before: an iterator of names checked nothing, parameters were
read as if they were gradients, paddle's report came after its kernel zeroed the gradients, and a
byte-swapped NumPy array was "not floating-point". Two optimizers that both skip share one report.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from polyamp.compat.paddle import GradScaler as PaddleScaler
from polyamp.compat.torch import GradScaler as TorchScaler

import polyamp


def test_names_may_be_any_iterable_read_once():
    grads = [np.array([np.inf], np.float32), np.ones(2, np.float32)]
    for names in ((n for n in ["w", "b"]), map(str.upper, ["w", "b"]), iter(["w", "b"])):
        report = polyamp.explain_overflow(grads, names=names)
        assert report.checked == 2 and report.found and report.tensors[0].name.lower() == "w"


def test_names_of_the_wrong_length_are_refused_also_from_an_iterator():
    with pytest.raises(ValueError, match="names must be a sequence of 2 str"):
        polyamp.explain_overflow([np.ones(1), np.ones(1)], names=(n for n in ["w"]))


def _model_with_inf_grad() -> torch.nn.Module:
    model = torch.nn.Linear(3, 2)
    model(torch.ones(3)).sum().backward()
    model.weight.grad[1, 2] = -math.inf  # the weights themselves stay finite
    return model


@pytest.mark.parametrize("wrap", [list, iter], ids=["list", "generator"])
def test_torch_parameters_stand_for_their_gradients(wrap):
    model = _model_with_inf_grad()
    report = polyamp.explain_overflow(wrap(model.parameters()))
    assert report.found and report.checked == 2
    assert report.tensors[0].neginf == 1 and report.tensors[0].shape == (2, 3)


def test_the_torch_facade_explains_parameters_too():
    model = _model_with_inf_grad()
    scaler = TorchScaler("cpu")
    report = scaler.explain(model.parameters())
    assert report.found and report.tensors[0].neginf == 1


def test_polyamp_parameters_stand_for_their_gradients():
    p, q = polyamp.Parameter(np.zeros(2, np.float32)), polyamp.Parameter(np.zeros(1, np.float32))
    p.grad = np.array([np.nan, 1.0], np.float32)  # q has no gradient: left out
    report = polyamp.explain_overflow([p, q])
    assert report.checked == 1 and report.tensors[0].nan == 1


def test_plain_gradient_tensors_are_still_read_as_they_are():
    grad = torch.tensor([1.0, math.inf])  # requires_grad=False: a gradient, not a parameter
    assert polyamp.explain_overflow([grad]).tensors[0].posinf == 1


@pytest.mark.parametrize("dtype", [">f4", ">f8", "<f4"])
def test_byte_swapped_numpy_gradients_are_floating(dtype):
    bad = np.array([1.0, np.inf, -np.inf, np.nan], dtype=dtype)
    report = polyamp.explain_overflow([bad])
    tensor = report.tensors[0]
    assert (tensor.posinf, tensor.neginf, tensor.nan, tensor.dtype) == (1, 1, 1, np.dtype(dtype).name)
    scaler = polyamp.LossScaler(init_scale=4.0, backend="numpy")
    good = np.array([4.0, 8.0], dtype=dtype)
    assert scaler.step([good], lambda: None)  # unscaled in place, in its byte order
    np.testing.assert_array_equal(good, [1.0, 2.0])
    assert good.dtype == np.dtype(dtype)
    scaler.update()
    assert not scaler.step([bad.copy()], lambda: None)
    scaler.update()


def test_the_paddle_facade_reports_inf_before_paddles_kernel_zeroes_the_gradients():
    paddle = pytest.importorskip("paddle")
    paddle.seed(0)
    layer = paddle.nn.Linear(2, 1)
    optimizer = paddle.optimizer.SGD(learning_rate=0.1, parameters=layer.parameters())
    before = [p.numpy().copy() for p in layer.parameters()]
    scaler = PaddleScaler(init_loss_scaling=8.0, diagnose=True)
    loss = layer(paddle.to_tensor([[1.0, 2.0]])).sum()
    scaler.scale(loss * float("inf")).backward()
    scaler.minimize(optimizer, loss)
    report = scaler.last_overflow
    assert scaler.last_step_skipped and report is not None
    assert sum(t.posinf + t.neginf for t in report.tensors) > 0  # inf is reported as inf, not NaN
    for p, old in zip(layer.parameters(), before):
        np.testing.assert_array_equal(p.numpy(), old)


def test_the_paddle_facades_explain_after_unscale_says_the_kernel_zeroed_the_gradients():
    """Issue 32 item 16: after unscale_ (diagnose off) paddle's kernel left grad * 0 (inf read as NaN):
    explain(optimizer) says so and how to see the values; with diagnose=True it sees the inf itself."""
    paddle = pytest.importorskip("paddle")
    reports = {}
    for diagnose in (False, True):
        layer = paddle.nn.Linear(2, 1)
        optimizer = paddle.optimizer.SGD(learning_rate=0.1, parameters=layer.parameters())
        scaler = PaddleScaler(init_loss_scaling=8.0, diagnose=diagnose)
        loss = layer(paddle.to_tensor([[1.0, 2.0]])).sum()
        scaler.scale(loss * float("inf")).backward()
        before = scaler.explain(optimizer)
        scaler.unscale_(optimizer)
        reports[diagnose] = scaler.explain(optimizer)
        assert "writes grad * 0" not in before.diagnosis  # not unscaled yet: the values as written
        scaler.step(optimizer)
        scaler.update()
        after = scaler.explain(optimizer)  # a new iteration: nothing unscaled in it yet
        assert "writes grad * 0" not in after.diagnosis
    zeroed, kept = reports[False], reports[True]
    assert zeroed.found and sum(t.posinf + t.neginf for t in zeroed.tensors) == 0  # the kernel's NaN
    assert "paddle's kernel, which on an overflow writes grad * 0" in zeroed.diagnosis
    assert "Fix: build the scaler with diagnose=True" in zeroed.diagnosis
    assert sum(t.posinf + t.neginf for t in kept.tensors) > 0 and "grad * 0" not in kept.diagnosis


def test_two_optimizers_that_both_skip_share_one_report():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)
    scaler = TorchScaler("cpu", diagnose=True)
    scaler.scale(torch.ones(()))
    a.grad, b.grad = torch.tensor([math.inf, 0.0]), torch.tensor([0.0, math.nan, 0.0])
    scaler.step(opt_a)
    scaler.step(opt_b)
    shapes = sorted(t.shape for t in scaler.last_overflow.tensors)
    assert shapes == [(2,), (3,)]  # both optimizers' bad gradients, not only the last one's
    scaler.update()


def test_the_report_on_a_large_gradient_allocates_less_than_the_gradient():
    """The counts run in fixed-size chunks (they used to allocate ~3.5x the bad gradient)."""
    import tracemalloc

    grad = np.ones(10_000_000, np.float32)
    grad[[5, 9_999_999]] = [np.inf, -np.inf]
    grad[7] = np.nan
    tracemalloc.start()
    try:
        report = polyamp.explain_overflow([grad])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    tensor = report.tensors[0]
    assert (tensor.nan, tensor.posinf, tensor.neginf, tensor.max_abs_finite) == (1, 1, 1, 1.0)
    assert peak < grad.nbytes, (peak, grad.nbytes)


@pytest.mark.parametrize("scale", ["1024", np.array([8.0]), -1.0, 0.0, math.inf, True])
def test_a_bad_scale_is_refused_naming_it(scale):
    with pytest.raises(ValueError, match="scale must be a positive, finite number"):
        polyamp.explain_overflow([np.ones(2, np.float32)], scale=scale)


def test_a_numpy_scale_is_taken_as_a_number():
    assert polyamp.explain_overflow([np.ones(2, np.float32)], scale=np.float32(8)).scale == 8.0


@pytest.mark.parametrize("loss, error", [("nan", TypeError), (b"1", TypeError), (10**400, ValueError)])
def test_a_bad_loss_is_refused_naming_it(loss, error):
    with pytest.raises(error, match="loss must be a number"):
        polyamp.explain_overflow([np.ones(2, np.float32)], loss=loss)


@pytest.mark.parametrize("grad, words", [
    (lambda: torch.empty(3, device="meta"), "'meta' device"),
    (lambda: torch.sparse_coo_tensor([[0]], torch.tensor([math.inf]), (3,), check_invariants=True),
     "is sparse"),
    (lambda: torch.tensor([1 + 1j, complex(math.inf, 0)]), "complex64"),
    (lambda: torch.ones(2).to(torch.float8_e4m3fn), "float8_e4m3fn"),
    (lambda: np.arange(3), "int64"),
], ids=["meta", "sparse", "complex", "float8", "int"])
def test_gradients_the_counts_cannot_read_are_refused_naming_them(grad, words):
    with pytest.raises(TypeError, match=f"gradient 'w' .*{words}.*Fix:"):
        polyamp.explain_overflow({"w": grad()})


def test_watch_forward_reads_sparse_outputs_and_refuses_meta_ones():
    from polyamp.compat.torch import watch_forward

    class Sparse(torch.nn.Module):
        def forward(self, x):
            coo = torch.sparse_coo_tensor([[0, 1]], torch.tensor([math.inf, 1.0]), (3,),
                                          check_invariants=True)
            return coo, torch.tensor([math.nan])

    model = Sparse()
    with watch_forward(model) as watch:
        model(torch.ones(1))
    assert [(r.nonfinite, r.max_abs_finite) for r in watch.records] == [(1, 1.0)]  # first bad output
    meta = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(TypeError, match="'meta' device.*Fix:"), watch_forward(meta):
        meta(torch.ones(2, device="meta"))


def test_csr_gradients_and_a_meta_loss_are_refused_by_name():
    """Issue 32 item 16: a sparse CSR gradient (not is_sparse in torch) and a meta-device loss got
    raw torch errors from the counts."""
    torch = pytest.importorskip("torch")
    import warnings

    from polyamp import explain_overflow

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: sparse CSR support is in beta
        csr = torch.tensor([[0.0, float("inf")], [1.0, 0.0]]).to_sparse_csr()
    with pytest.raises(TypeError, match=r"gradient 'grads\[0\]' is sparse"):
        explain_overflow([csr])
    with pytest.raises(TypeError, match="loss is on torch's 'meta' device"):
        explain_overflow([torch.ones(2)], loss=torch.empty((), device="meta"))
