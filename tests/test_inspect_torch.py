"""``polyamp inspect`` on the checkpoints torch users have: torch.save files, read with torch's
restricted unpickler only (a malicious pickle's payload never runs)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from polyamp.compat.paddle import GradScaler as PaddleScaler
from polyamp.compat.torch import GradScaler

import polyamp


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyamp", "inspect", *args], capture_output=True,
                          text=True, timeout=120)


def torch_state(scale: float) -> dict:
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=7)
    scaler.scale(torch.ones(()))
    return scaler.state_dict()


def test_a_bare_torch_scaler_state(tmp_path):
    path = tmp_path / "scaler.pt"
    torch.save(torch_state(1024.0), path)  # accelerate's and transformers.Trainer's scaler.pt
    out = inspect(str(path))
    assert out.returncode == 0, out.stderr
    assert "in:       checkpoint\n" in out.stdout and "scale:    1024" in out.stdout
    assert "growth_interval=7" in out.stdout and out.stderr == ""


def test_every_scaler_state_in_a_training_checkpoint_with_its_path(tmp_path):
    model = torch.nn.Linear(2, 2)
    engine = polyamp.LossScaler(init_scale=8.0)
    paddle_side = PaddleScaler(init_loss_scaling=4.0, backend="numpy")
    facade = GradScaler("cpu", init_scale=512.0)
    facade.scale(torch.ones(()))
    checkpoint = {"model": model.state_dict(), "scaler": torch_state(2048.0),
                  "extra": [{"polyamp": engine.state_dict()}, paddle_side.state_dict(), facade.state_dict()]}
    path = tmp_path / "train.pt"
    torch.save(checkpoint, path)
    out = inspect("--json", str(path))
    assert out.returncode == 0, out.stderr
    found = {entry["where"]: entry["scale"] for entry in json.loads(out.stdout)}
    assert found == {'checkpoint["scaler"]': 2048.0, 'checkpoint["extra"][0]["polyamp"]': 8.0,
                     'checkpoint["extra"][1]': 4.0, 'checkpoint["extra"][2]': 512.0}


def test_a_checkpoint_without_a_scaler_says_so(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"model": torch.nn.Linear(2, 2).state_dict()}, path)
    out = inspect(str(path))
    assert out.returncode == 2 and "no scaler state in it" in out.stderr and "Fix:" in out.stderr


class Payload:
    """What a malicious checkpoint holds: unpickling it would create a file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_pickle_never_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"scaler": torch_state(8.0), "x": Payload(str(marker))}, f)
    out = inspect(str(path))
    assert out.returncode == 2 and "weights_only=True" in out.stderr and "never unpickles" in out.stderr
    assert not marker.exists()
    torch.save({"x": Payload(str(marker))}, tmp_path / "evil_zip.pt")  # torch's own zip container too
    out = inspect(str(tmp_path / "evil_zip.pt"))
    assert out.returncode == 2 and not marker.exists()


def test_without_torch_a_torch_file_gets_a_clear_message(tmp_path):
    path = tmp_path / "scaler.pt"
    torch.save(torch_state(8.0), path)
    code = ("import sys; sys.modules['torch'] = None; from polyamp.cli import main; "
            f"sys.exit(main(['inspect', {str(path)!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "needs torch" in out.stderr
    assert "pip install 'polyamp[torch]'" in out.stderr


@pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated")  # a warning inside Lightning
def test_a_lightning_checkpoint(tmp_path):
    lightning = pytest.importorskip("lightning", reason="lightning not installed (the integrations extra)")
    import polyamp.compat.torch as facade
    from lightning.pytorch.plugins import MixedPrecision

    class Model(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, index):
            x, y = batch
            return ((self.layer(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen)),
        batch_size=8)
    with facade.install():
        trainer = lightning.Trainer(
            accelerator="cpu", plugins=[MixedPrecision("16-mixed", "cpu")], max_steps=3, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path)
        trainer.fit(Model(), data)
        scale = trainer.precision_plugin.scaler.get_scale()
        trainer.save_checkpoint(tmp_path / "model.ckpt")
    out = inspect("--json", str(tmp_path / "model.ckpt"))
    assert out.returncode == 0, out.stderr
    (entry,) = json.loads(out.stdout)
    assert entry["where"] == 'checkpoint["MixedPrecision"]' and entry["scale"] == scale
