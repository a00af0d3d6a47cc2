"""The loggers with a metered scaler (issue 33, item 6): Lightning's CSV logger, the transformers
Trainer's log history and a TensorBoard event file, read back, hold ``underflow_fraction/...`` and
``overflow_fraction/...`` after a sample step, equal to the scaler's last report. Real frameworks on
CPU; each test skips, naming the package, where its framework is absent."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

KEYS = ("underflow_fraction/float16@loss", "overflow_fraction/float16@loss",
        "underflow_fraction/bfloat16@1", "overflow_fraction/bfloat16@1")


def metered_scaler():
    """A torch-facade scaler whose meter samples every step."""
    from polyamp.compat.torch import GradScaler

    import polyamp

    return GradScaler("cpu", init_scale=2.0**10, growth_interval=100, meter=polyamp.PrecisionMeter(every=1))


def batches(n: int = 4):
    g = torch.Generator().manual_seed(0)
    return [(x, x.sum(1, keepdim=True) * 1e-3) for x in (torch.randn(4, 8, generator=g) for _ in range(n))]


def check_logged(values: dict, report) -> None:
    fractions = report.fractions()
    for key in KEYS:
        assert values["scaler/" + key] == pytest.approx(fractions[key], abs=1e-7), key


def test_lightning_logs_the_fractions(need, tmp_path):
    need("lightning")
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.plugins import MixedPrecision

    from polyamp.loggers.lightning import ScalerMetrics

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    scaler = metered_scaler()
    logger = CSVLogger(tmp_path, name="run")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=logger, log_every_n_steps=2,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path, callbacks=[ScalerMetrics()],
                            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        trainer.fit(Net(), torch.utils.data.DataLoader(batches(), batch_size=None))
    with (Path(logger.log_dir) / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("scaler/scale")]
    assert len(rows) >= 2 and all(r.get("scaler/" + KEYS[0]) for r in rows)
    check_logged({k: float(v) for k, v in rows[-1].items() if v}, scaler.last_precision)
    assert scaler.last_precision.step == 3  # the last step sampled: the last row is its report


def test_transformers_log_history_holds_the_fractions(need, tmp_path):
    need("transformers")
    from transformers import Trainer, TrainingArguments

    from polyamp.loggers.transformers import ScalerMetricsCallback

    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}

    rows = [{"x": x, "labels": y} for xb, yb in batches() for x, y in zip(xb, yb)]
    args = TrainingArguments(str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=0.01,
                             use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                             logging_steps=2, optim="sgd")
    trainer = Trainer(model=Regressor(), args=args, train_dataset=rows)
    scaler = metered_scaler()
    trainer.accelerator.scaler, trainer.accelerator.native_amp = scaler, True
    ScalerMetricsCallback.attach(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    logged = [h for h in trainer.state.log_history if "scaler/scale" in h]
    assert [h["step"] for h in logged][:2] == [2, 4]
    check_logged(logged[1], scaler.last_precision)


def test_tensorboard_event_file_holds_the_fractions(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed: pip install 'polyamp[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from polyamp.loggers.tensorboard import ScalerMetricsWriter

    w = torch.nn.Parameter(torch.tensor([1e-12, 1e-3, 1.0, 100.0]))
    optimizer = torch.optim.SGD([w], lr=0.01)
    scaler = metered_scaler()
    written = []
    with ScalerMetricsWriter(scaler, str(tmp_path), every=2) as writer:
        for _ in range(4):
            optimizer.zero_grad()
            scaler.scale((w * w).sum() * 0.5).backward()
            scaler.step(optimizer)
            scaler.update()
            writer.step()
            written.append(scaler.last_precision.fractions())
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    for key in KEYS:
        got = [(e.step, e.value) for e in events.Scalars("scaler/" + key)]
        assert got == [(2, pytest.approx(written[1][key])), (4, pytest.approx(written[3][key]))], key
    assert written[3]["overflow_fraction/float16@loss"] > 0  # 100 * 2**10 overflows float16: seen
    assert written[3]["underflow_fraction/float16@loss"] > 0  # 1e-12 * 2**10 underflows: seen
