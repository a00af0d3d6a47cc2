"""torch's private GradScaler members that trainers call, side by side with torch's own scaler."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from polyamp.compat.torch import GradScaler  # noqa: E402

STATE = {"scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10,
         "_growth_tracker": 3}


@pytest.fixture(params=["torch", "polyamp"])
def make(request):
    return torch.amp.GradScaler if request.param == "torch" else GradScaler


def test_scale_is_none_after_load_state_dict_then_lazy_init_creates_it(make):
    """accelerate's FSDP2 load_state: load_state_dict, then _lazy_init_scale_growth_tracker(_device)."""
    scaler = make("cpu", init_scale=8.0)
    scaler.load_state_dict(STATE)
    assert scaler._scale is None and scaler._growth_tracker is None  # as torch: created lazily
    scaler._lazy_init_scale_growth_tracker(scaler._device)
    assert scaler._scale.dtype == torch.float32 and scaler._scale.device.type == "cpu"
    assert scaler._scale.item() == 4.0 and scaler._growth_tracker.item() == 3
    assert scaler._growth_tracker.dtype == torch.int32
    with pytest.raises(AssertionError, match="_growth_tracker initialized before _scale"):
        scaler._lazy_init_scale_growth_tracker("cpu")


def test_lazy_init_then_training_uses_the_loaded_state(make):
    """After the early init the next scale() multiplies by the loaded scale and update() counts on."""
    scaler = make("cpu", init_scale=8.0, growth_interval=10)
    scaler.load_state_dict(STATE)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale((w * 3).sum()).backward()
    assert w.grad.tolist() == [12.0, 12.0]
    scaler.step(opt)
    scaler.update()
    assert scaler._get_growth_tracker() == 4 and scaler.get_scale() == 4.0


def test_check_scale_growth_tracker(make):
    scaler = make("cpu")
    with pytest.raises(AssertionError, match="Attempted step but _scale is None"):
        scaler._check_scale_growth_tracker("step")
    scaler.scale(torch.ones(()))
    scale, tracker = scaler._check_scale_growth_tracker("step")
    assert scale is scaler._scale and tracker is scaler._growth_tracker


def test_init_scale_and_init_growth_tracker(make):
    scaler = make("cpu", init_scale=8.0)
    assert (scaler._init_scale, scaler._init_growth_tracker) == (8.0, 0)
    scaler.load_state_dict(STATE)
    assert (scaler._init_scale, scaler._init_growth_tracker) == (4.0, 3)


def test_device_and_enabled(make):
    scaler = make("cpu")
    assert scaler._device == "cpu" and scaler._enabled is True
    assert make("cpu", enabled=False)._enabled is False


def test_lazy_init_on_a_disabled_polyamp_scaler_is_a_no_op():
    scaler = GradScaler("cpu", enabled=False)
    scaler._lazy_init_scale_growth_tracker("cpu")
    assert scaler.scale(torch.ones(())).item() == 1.0


def test_lazy_init_of_a_numpy_scaler_puts_the_state_with_numpy():
    np = pytest.importorskip("numpy")
    scaler = GradScaler("cpu", backend="numpy", init_scale=8.0)
    scaler._lazy_init_scale_growth_tracker("cpu")
    assert isinstance(scaler._scale, np.ndarray) and float(scaler._scale) == 8.0
