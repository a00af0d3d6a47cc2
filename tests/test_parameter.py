"""polyamp.parameter.Parameter: validation, properties and repr over array libraries."""

from __future__ import annotations

import numpy as np
import pytest

from polyamp.parameter import Parameter


def test_numpy_parameter():
    data = np.zeros((2, 3), dtype=np.float32)
    p = Parameter(data)
    assert p.data is data and p.grad is None
    assert p.shape == (2, 3) and type(p.shape) is tuple
    assert p.dtype == np.float32
    assert repr(p) == "Parameter(shape=(2, 3), dtype=float32, library=numpy, grad=None)"
    grad = np.ones((2, 3), dtype=np.float32)
    p.grad = grad
    assert p.grad is grad and repr(p).endswith("grad=set)")
    assert Parameter(data, grad).grad is grad


def test_zero_dim_parameter():
    p = Parameter(np.asarray(1.5, dtype=np.float32), np.asarray(0.5, dtype=np.float32))
    assert p.shape == () and p.grad.shape == ()


def test_torch_parameter():
    torch = pytest.importorskip("torch")
    p = Parameter(torch.zeros(4, dtype=torch.float16), torch.ones(4, dtype=torch.float16))
    assert p.shape == (4,) and type(p.shape) is tuple
    assert p.dtype == torch.float16
    assert "library=torch" in repr(p)


def test_array_api_strict_parameter():
    xps = pytest.importorskip("array_api_strict")
    p = Parameter(xps.zeros((3,), dtype=xps.float32))
    assert p.shape == (3,) and p.dtype == xps.float32
    assert "library=array_api_strict" in repr(p)


def test_identity_semantics():
    a, b = Parameter(np.zeros(2)), Parameter(np.zeros(2))
    assert a != b and len({a: 1, b: 2}) == 2  # usable as optimizer state keys


@pytest.mark.parametrize("value", [[1.0, 2.0], 3.0, None, "x"])
def test_data_must_be_an_array(value):
    with pytest.raises(TypeError, match=r"Parameter data must be an array-API array") as info:
        Parameter(value)
    assert type(value).__qualname__ in str(info.value)
    assert "asarray" in str(info.value)


def test_data_setter_validates():
    p = Parameter(np.zeros(2))
    with pytest.raises(TypeError, match="builtins.list"):
        p.data = [0.0, 1.0]
    p.data = np.ones(2)
    assert p.data[0] == 1.0


def test_grad_must_be_an_array_of_the_data_shape():
    p = Parameter(np.zeros((2, 3)))
    with pytest.raises(TypeError, match="Parameter grad must be None or an array-API array"):
        p.grad = [[0.0] * 3] * 2
    with pytest.raises(ValueError, match=r"data's shape \(2, 3\), got \(3, 2\)"):
        p.grad = np.zeros((3, 2))
    with pytest.raises(ValueError, match="shape"):
        Parameter(np.zeros(2), np.zeros(3))
    p.grad = np.zeros((2, 3))
    p.grad = None
    assert p.grad is None
