"""What docs/integrations.md says the trainers do on CPU, checked against the trainers themselves."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")


def test_lightning_switches_16_mixed_to_bf16_on_cpu_without_a_scaler(need):
    need("lightning")
    import lightning as L
    from lightning.fabric import Fabric

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(accelerator="cpu", precision="16-mixed", logger=False,
                            enable_progress_bar=False, enable_model_summary=False)
        fabric = Fabric(accelerator="cpu", precision="16-mixed")
    for plugin in (trainer.precision_plugin, fabric._precision):
        assert plugin.precision == "bf16-mixed" and plugin.scaler is None
    assert any("fp16 is not supported on CPU" in str(w.message) for w in caught)


def test_accelerate_fp16_on_cpu_builds_no_scaler(need):
    need("accelerate")
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    assert accelerator.mixed_precision == "fp16"  # as asked, yet:
    assert accelerator.scaler is None and accelerator.native_amp is False


def test_transformers_fp16_on_cpu_builds_no_scaler_and_defaults_to_fused_adamw(need, tmp_path):
    need("transformers")
    from transformers import Trainer, TrainingArguments

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}

    args = TrainingArguments(str(tmp_path), fp16=True, use_cpu=True, report_to=[])
    trainer = Trainer(model=Model(), args=args,
                      train_dataset=[{"x": torch.ones(2), "labels": torch.ones(1)}])
    assert trainer.accelerator.scaler is None and trainer.accelerator.native_amp is False
    assert args.optim == "adamw_torch_fused"


def test_accelerate_scaler_set_after_prepare_is_not_seen_by_the_optimizer(need):
    """docs/integrations.md: set after prepare(), the loss is scaled but never unscaled."""
    need("accelerate")
    from accelerate import Accelerator
    from polyamp.compat.torch import GradScaler

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.scaler, accelerator.native_amp = GradScaler("cpu", init_scale=1024.0), True
    accelerator.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()
    assert torch.equal(model.weight.grad, torch.full((1, 2), 1024.0))  # still scaled
    assert accelerator.scaler.skipped_steps == 0 and accelerator.scaler.last_step_skipped is None
