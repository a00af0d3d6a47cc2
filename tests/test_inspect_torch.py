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
from polyamp import _inspect
from polyamp.cli import main


def inspect(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyamp", "inspect", *args], capture_output=True,
                          text=True, timeout=timeout)


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


def one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("polyamp inspect: error: ")
    return line


def test_a_torch_state_says_which_fields_it_does_not_hold(tmp_path):
    path = tmp_path / "scaler.pt"
    torch.save(torch_state(65536.0), path)  # torch's state holds no init_scale and no backoff tracker
    out = inspect(str(path))
    assert out.returncode == 0, out.stderr
    assert "init_scale=" not in out.stdout and "backoff not saved in this format" in out.stdout
    (unsaved,) = [line for line in out.stdout.splitlines() if "not saved in this format:" in line]
    assert "init_scale" in unsaved and "dynamic" in unsaved and "growth_factor" not in unsaved
    (entry,) = json.loads(inspect("--json", str(path)).stdout)
    assert entry["config"] == {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 7}
    assert entry["backoff_tracker"] is None and "init_scale" in entry["not_saved"]


def test_a_paddle_state_holds_its_trackers_and_not_init_scale(tmp_path):
    path = tmp_path / "paddle.pt"
    torch.save(PaddleScaler(init_loss_scaling=4.0, backend="numpy").state_dict(), path)
    (entry,) = json.loads(inspect("--json", str(path)).stdout)
    assert entry["backoff_tracker"] == 0 and entry["config"]["dynamic"] is True
    assert "init_scale" in entry["not_saved"] and "backoff_interval" in entry["config"]


def test_a_self_referencing_checkpoint_is_walked_once(tmp_path):
    loop: list = [1]
    loop.append(loop)
    torch.save(loop, tmp_path / "loop.pt")
    line = one_error_line(inspect(str(tmp_path / "loop.pt"), timeout=20))
    assert "no scaler state in it" in line and "Recursion" not in line
    ckpt: dict = {"scaler": torch_state(8.0)}
    ckpt["again"] = ckpt  # a dict that holds itself, and a scaler state reached twice
    ckpt["same"] = ckpt["scaler"]
    torch.save(ckpt, tmp_path / "self.pt")
    out = inspect("--json", str(tmp_path / "self.pt"), timeout=20)
    assert out.returncode == 0, out.stderr
    assert [(e["where"], e["scale"]) for e in json.loads(out.stdout)] == [('checkpoint["scaler"]', 8.0)]


def test_lists_doubled_40_times_finish_at_once(tmp_path):
    doubled: list = [0]
    for _ in range(40):
        doubled = [doubled, doubled]  # 2**40 paths, 41 lists
    torch.save(doubled, tmp_path / "doubled.pt")
    assert (tmp_path / "doubled.pt").stat().st_size < 4096
    assert "no scaler state in it" in one_error_line(inspect(str(tmp_path / "doubled.pt"), timeout=20))


def test_past_the_depth_budget_one_line_names_the_file_and_the_budget(tmp_path):
    deep: list = [torch_state(8.0)]
    for _ in range(_inspect.MAX_DEPTH + 5):
        deep = [deep]
    torch.save(deep, tmp_path / "deep.pt")
    line = one_error_line(inspect(str(tmp_path / "deep.pt"), timeout=20))
    assert repr(str(tmp_path / "deep.pt")) in line and f"{_inspect.MAX_DEPTH} levels" in line


def test_past_the_size_budget_one_line_names_the_file_and_the_budget(tmp_path, monkeypatch, capsys):
    path = tmp_path / "wide.pt"
    torch.save({"data": list(range(2000)), "scaler": torch_state(8.0)}, path)
    monkeypatch.setattr(_inspect, "MAX_ITEMS", 1000)  # the default budget takes a file of millions
    assert main(["inspect", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert repr(str(path)) in line and "1,000 items" in line and "Fix:" in line
    monkeypatch.setattr(_inspect, "MAX_ITEMS", 2002)
    assert main(["inspect", str(path)]) == 0 and "scale:    8" in capsys.readouterr().out
