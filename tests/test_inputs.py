"""What may enter the engine (polyamp/_inputs.py), issue 15 part 2: each bad argument raises one
clear error naming it, the value and the fix, and leaves the scaler and the gradients as they were.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyamp import ConfigError, ForeignArrayError, LossScaleConfig, LossScaler

torch = pytest.importorskip("torch")


def _snapshot(scaler):
    return scaler.host_state(), scaler.steps, scaler.skipped_steps, scaler.has_pending_check


def _stepped(grads):
    """A scaler (scale 8) that has finished one whole iteration on ``grads``."""
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    scaler.step(grads, lambda: None)
    scaler.update()
    return scaler


# -- a second library after the first ----------------------------------------------------
def test_numpy_gradients_after_torch_ones_are_named_not_an_attribute_error():
    scaler = _stepped([torch.ones(2)])
    before = _snapshot(scaler)
    grad = np.full(2, 8.0, np.float32)
    with pytest.raises(ForeignArrayError, match=r"numpy\.ndarray.*'torch'.*Fix: pass torch"):
        scaler.step([grad], lambda: None)
    assert _snapshot(scaler) == before and grad.tolist() == [8.0, 8.0]
    scaler.step([torch.full((2,), 8.0)], lambda: None)  # the iteration is still open: it goes on
    scaler.update()
    assert scaler.steps == 2


def test_torch_gradients_after_numpy_ones_are_named():
    scaler = _stepped([np.ones(2, np.float32)])
    with pytest.raises(ForeignArrayError, match=r"torch\.Tensor.*'numpy'"):
        scaler.unscale_([np.ones(2, np.float32), torch.ones(2)])
    assert not scaler.has_pending_check


# -- dtypes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["int32", "int64", "complex64", "bool"])
def test_non_floating_torch_gradients_are_refused_before_the_kernel(dtype):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    bad = torch.ones(2, dtype=getattr(torch, dtype))
    good = torch.full((2,), 8.0)
    message = rf"not floating-point \(torch\.Tensor, shape \(2,\), dtype torch\.{dtype}\)"
    with pytest.raises(ForeignArrayError, match=message):
        scaler.step([good, bad], lambda: None)
    assert good.tolist() == [8.0, 8.0] and bad.tolist() == torch.ones(2, dtype=bad.dtype).tolist()
    assert scaler.steps == 0 and not scaler.has_pending_check and scaler.state is None


@pytest.mark.parametrize("dtype", ["int32", "complex128", "bool", "object"])
def test_non_floating_numpy_gradients_are_refused_naming_the_dtype(dtype):
    scaler = LossScaler()
    with pytest.raises(ForeignArrayError, match=rf"dtype {dtype}\).*real floating gradients only"):
        scaler.unscale_([np.ones(3, dtype)])
    assert scaler.state is None and not scaler.has_pending_check


def test_floating_gradients_of_every_width_still_pass():
    scaler = LossScaler(LossScaleConfig(init_scale=4.0))
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    grads = [torch.full((2,), 4.0, dtype=d) for d in dtypes]
    assert scaler.step(grads, lambda: None)
    assert all(g.tolist() == [1.0, 1.0] for g in grads)


# -- torch's meta device -----------------------------------------------------------------
def test_meta_tensors_are_refused_before_any_state_is_created():
    scaler = LossScaler()
    with pytest.raises(ConfigError, match=r"'meta' device.*Fix: materialize the model"):
        scaler.unscale_([torch.ones(2, device="meta")])
    assert scaler.state is None and scaler.backend is None
    assert scaler.get_scale() == 2.0**16 and scaler.state_dict()["scale"] == 2.0**16
    scaler.step([torch.full((2,), 2.0**16)], lambda: None)  # a real step afterwards works
    scaler.update()
    assert scaler.steps == 1


def test_meta_tensors_after_real_ones_are_refused_too():
    scaler = _stepped([torch.ones(2)])
    with pytest.raises(ConfigError, match="'meta' device"):
        scaler.unscale_([torch.ones(2), torch.ones(2, device="meta")])
    assert scaler.get_scale() == 8.0 and not scaler.has_pending_check


def test_meta_loss_is_refused_by_scale():
    scaler = LossScaler()
    with pytest.raises(ConfigError, match="'meta' device"):
        scaler.scale(torch.ones((), device="meta"))
    assert scaler.state is None


# -- None and other non-lists ------------------------------------------------------------
@pytest.mark.parametrize("call", ["unscale_", "step"])
def test_none_gradients_are_named(call):
    scaler = LossScaler()
    args = (None,) if call == "unscale_" else (None, lambda: None)
    message = rf"{call}\(\) needs grads to be a list of gradient arrays, got grads=None\. Fix"
    with pytest.raises(TypeError, match=message):
        getattr(scaler, call)(*args)
    assert _snapshot(scaler) == (scaler.host_state(), 0, 0, False)


def test_step_refuses_a_missing_step_fn_before_dividing():
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    grads = [np.full(2, 8.0, np.float32)]
    with pytest.raises(TypeError, match=r"step_fn to be a callable.*got step_fn=None.*optimizer\.step"):
        scaler.step(grads, None)
    assert grads[0].tolist() == [8.0, 8.0]  # not divided
    assert scaler.steps == 0 and not scaler.has_pending_check
    assert scaler.step(grads, lambda: None) and grads[0].tolist() == [1.0, 1.0]  # nothing left pending


def test_update_refuses_a_flag_array_of_several_elements():
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    scaler.unscale_([np.ones(2, np.float32)])
    message = r"found_inf .* one-element flag array, got an array of shape \(2,\)"
    with pytest.raises(ConfigError, match=message):
        scaler.update(found_inf=np.array([0.0, 1.0], np.float32))
    assert scaler.get_scale() == 8.0 and scaler.has_pending_check  # the iteration is still open
    scaler.update(found_inf=np.array([1.0], np.float32))  # one element is fine
    assert scaler.get_scale() == 4.0
