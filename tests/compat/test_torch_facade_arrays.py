"""The torch-style facade over NumPy arrays: the same decisions and bits as over torch tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyamp.compat.torch import GradScaler  # noqa: E402

import polyamp  # noqa: E402


class ArraySGD:
    """Plain SGD over anything with ``.data``/``.grad`` (torch parameters or polyamp.Parameter)."""

    def __init__(self, params, lr=0.125):
        self.param_groups = [{"params": list(params), "lr": lr}]

    def step(self):
        for p in self.param_groups[0]["params"]:
            p.data -= self.param_groups[0]["lr"] * p.grad


def _available(name):
    return any(i.name == name and i.available for i in polyamp.available_backends())


BACKENDS = [
    "array_api",
    pytest.param("numpy", marks=pytest.mark.skipif(
        not _available("numpy"), reason="numpy backend unavailable in this checkout")),
]
GRADS = [np.array([1.5, -2.0, 3.0], np.float32), np.array([0.25, 4.0], np.float32)]
BAD_STEPS = {1: math.inf, 4: math.nan}


def _train(make_param, to_array, backend):
    params = [make_param(np.zeros_like(g)) for g in GRADS]
    opt = ArraySGD(params)
    scaler = GradScaler("cpu", init_scale=2.0**4, growth_interval=2, backend=backend)
    scales = []
    for step in range(7):
        loss = scaler.scale(to_array(np.ones((), np.float32)))
        for p, g in zip(params, GRADS, strict=True):  # the "backward" of loss * <g, p>
            grad = g.copy() * float(loss)
            grad[0] = BAD_STEPS.get(step, grad[0])
            p.grad = to_array(grad)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return [np.asarray(p.data) for p in params], scales, scaler


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_training_matches_torch_training_bitwise(backend):
    def torch_param(a):
        return torch.nn.Parameter(torch.from_numpy(a))

    def numpy_param(a):
        return polyamp.Parameter(a)

    t_params, t_scales, _ = _train(torch_param, torch.from_numpy, None)
    n_params, n_scales, scaler = _train(numpy_param, np.asarray, backend)
    assert n_scales == t_scales and scaler.skipped_steps == 2
    assert n_scales[1] == 8.0 and n_scales[3] == 16.0
    for a, b in zip(t_params, n_params, strict=True):
        np.testing.assert_array_equal(a, b, strict=True)
    assert scaler.engine.backend.name == backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_errors_match_the_torch_facade(backend):
    param = polyamp.Parameter(np.zeros(2, np.float16))
    opt = ArraySGD([param])
    scaler = GradScaler("cpu", backend=backend)
    with pytest.raises(AssertionError, match="_scale is None"):
        scaler.unscale_(opt)
    scaler.scale(np.ones((), np.float32))
    param.grad = np.ones(2, np.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        scaler.unscale_(opt)
    with pytest.raises(ValueError, match="outputs must be a Tensor"):
        scaler.scale([3])


def test_numpy_state_dict_is_torchs_format():
    scaler = _train(polyamp.Parameter, np.asarray, "array_api")[2]
    torch_scaler = _train(lambda a: torch.nn.Parameter(torch.from_numpy(a)), torch.from_numpy,
                          None)[2]
    assert scaler.state_dict() == torch_scaler.state_dict()


def _mixed(order):
    """A NumPy and a torch parameter with unit gradients, in ``order``, and their optimizer."""
    pair = {"numpy": polyamp.Parameter(np.zeros(2, np.float32)),
            "torch": torch.nn.Parameter(torch.zeros(2))}
    pair["numpy"].grad, pair["torch"].grad = np.ones(2, np.float32), torch.ones(2)
    return pair, ArraySGD([pair[name] for name in order])


def _unchanged(pair):
    return (np.array_equal(pair["numpy"].data, np.zeros(2)) and np.array_equal(pair["numpy"].grad, np.ones(2))
            and torch.equal(pair["torch"].detach(), torch.zeros(2))
            and torch.equal(pair["torch"].grad, torch.ones(2)))


@pytest.mark.parametrize("order", [("numpy", "torch"), ("torch", "numpy")], ids="-first".join)
@pytest.mark.parametrize("scaled", ["numpy", "torch"])
@pytest.mark.parametrize("verb", ["unscale_", "step"])
def test_numpy_and_torch_parameters_in_one_optimizer_are_named_before_anything_changes(
        order, scaled, verb):
    pair, opt = _mixed(order)
    scaler = GradScaler("cpu")
    scaler.scale(np.ones((), np.float32) if scaled == "numpy" else torch.ones(()))
    with pytest.raises(polyamp.ForeignArrayError) as info:  # a TypeError
        getattr(scaler, verb)(opt)
    message = str(info.value)
    assert "numpy.ndarray and torch.Tensor" in message and "one optimizer per array library" in message
    assert _unchanged(pair) and scaler.get_scale() == 2.0**16
    with pytest.raises(AssertionError, match="No inf checks"):
        scaler.update()  # nothing was recorded for the refused optimizer


def test_an_optimizer_of_another_library_than_the_scale_is_named():
    pair, _ = _mixed(())
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(polyamp.ForeignArrayError, match=r"gradients are numpy.ndarray.*'torch'"):
        scaler.step(ArraySGD([pair["numpy"]]))
    assert _unchanged(pair)
    scaler.step(ArraySGD([pair["torch"]]))  # its own library's optimizer still steps
    scaler.update()
    assert torch.equal(pair["torch"].detach(), torch.full((2,), -0.125 / 2**16))
