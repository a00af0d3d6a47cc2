"""Trainers that build torch's scaler themselves get polyamp's under install(), and its private
members they call work. Each test skips, naming the framework, where it is absent."""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")


def test_accelerate_get_grad_scaler_and_fsdp2_scaler(need, installed):
    need("accelerate")
    from accelerate.utils import get_grad_scaler
    from accelerate.utils.fsdp_utils import get_fsdp2_grad_scaler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available. Disabling." on CPU machines
        scaler = get_grad_scaler()
    assert isinstance(scaler, installed.GradScaler)
    fsdp2 = get_fsdp2_grad_scaler(device="cpu", init_scale=8.0)
    assert isinstance(fsdp2, installed.GradScaler) and fsdp2.get_scale() == 8.0


def test_accelerate_checkpointing_name_bound_at_import_is_patched(need):
    need("accelerate")
    import accelerate.checkpointing as checkpointing
    import polyamp.compat.torch as pt

    torch_class = checkpointing.GradScaler
    with pt.install():
        assert issubclass(checkpointing.GradScaler, pt.GradScaler)
    assert checkpointing.GradScaler is torch_class


def test_accelerate_fsdp2_load_state_sequence(need, tmp_path):
    """accelerate's FSDP2 fp16 load_state: torch.load, load_state_dict, _lazy_init(_device)."""
    need("accelerate")
    from accelerate.utils import SCALER_NAME
    from polyamp.compat.torch import GradScaler

    saved = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(3):
        opt.zero_grad()
        saved.scale(w.sum() * (math.inf if step == 1 else 1.0)).backward()
        saved.step(opt)
        saved.update()
    torch.save(saved.state_dict(), tmp_path / SCALER_NAME)
    scaler = GradScaler("cpu")
    scaler.load_state_dict(torch.load(tmp_path / SCALER_NAME))
    assert scaler._scale is None
    scaler._lazy_init_scale_growth_tracker(scaler._device)
    assert scaler._scale.item() == 2.0**9 and scaler._growth_tracker.item() == 1
    assert scaler.state_dict() == saved.state_dict()


def test_lightning_16_mixed_builds_polyamp_scaler(need, installed):
    need("lightning")
    from lightning.fabric.plugins import MixedPrecision as FabricMixedPrecision
    from lightning.pytorch.plugins import MixedPrecision

    for plugin_class in (MixedPrecision, FabricMixedPrecision):
        plugin = plugin_class("16-mixed", "cpu")
        assert isinstance(plugin.scaler, installed.GradScaler), plugin_class


def test_lightning_fsdp_precision_builds_polyamp_sharded_scaler(need, installed):
    need("lightning")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built")
    from lightning.pytorch.plugins import FSDPPrecision

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its scaler is built for "cuda": disabled without CUDA, as torch's
        plugin = FSDPPrecision("16-mixed")
    assert isinstance(plugin.scaler, installed.ShardedGradScaler)


def test_lightning_fsdp_precision_refuses_a_scaler_argument(need):
    """docs/integrations.md says so: FSDPPrecision(scaler=...) refuses torch's and polyamp's alike,
    and the plugin's attribute is the way in (if Lightning fixes this, the page must change)."""
    need("lightning")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built")
    from lightning.fabric.plugins import FSDPPrecision as FabricFSDPPrecision
    from lightning.pytorch.plugins import FSDPPrecision
    from polyamp.compat.torch import ShardedGradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    for plugin_class in (FSDPPrecision, FabricFSDPPrecision):
        for scaler in (TorchSharded("cpu"), ShardedGradScaler("cpu")):
            with pytest.raises(ValueError, match="does not use a scaler"):
                plugin_class("16-mixed", scaler=scaler)


def test_timm_native_scaler_under_install(need, installed):
    need("timm")
    from timm.utils.cuda import NativeScaler

    loss_scaler = NativeScaler(device="cpu")
    assert isinstance(loss_scaler._scaler, installed.GradScaler)
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.5)
    loss_scaler((w * w).sum() * math.inf, opt, clip_grad=1.0, parameters=[w])
    assert loss_scaler._scaler.skipped_steps == 1 and torch.equal(w.detach(), torch.ones(3))
    assert loss_scaler.state_dict()["scale"] == 2.0**15


def test_frameworks_absent_give_a_reason():
    """The skip reason names the missing framework and the install line."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("fw_check", Path(__file__).with_name("frameworks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.MODULES["nonexistent"] = "polyamp_no_such_framework"
    reason = module.require("nonexistent")
    assert "nonexistent not installed" in reason and "integrations" in reason
    assert "fw_check" not in sys.modules
