"""polyamp.loggers in real frameworks on CPU: what Lightning's loggers wrote, the Trainer's log
history and a TensorBoard event file, read back; no host read between logging intervals."""

from __future__ import annotations

import csv
import io
import math
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

OVERFLOW_AT = 2  # the third step is skipped
SCALE_AFTER_6 = 2.0**9  # 2**10 backed off once; growth_interval=100 grows nothing


def _batches(n=6):
    g = torch.Generator().manual_seed(0)
    return [(x, x.sum(1, keepdim=True)) for x in (torch.randn(4, 8, generator=g) for _ in range(n))]


def _lightning_fit(scaler, logger, tmp_path, *, max_steps=6, every=3, precision_plugin=True, callback=None,
                   accumulate=1, logged=None):
    """``logged``: a list that gets (global_step, name, value) of every ``log`` call."""
    import lightning as L
    from lightning.pytorch.plugins import MixedPrecision

    from polyamp.loggers.lightning import ScalerMetrics

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            return loss * math.inf if batch_idx == OVERFLOW_AT else loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def log(self, name, value, *args, **kwargs):
            if logged is not None:
                logged.append((self.trainer.global_step, name, value))
            super().log(name, value, *args, **kwargs)

    plugins = dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]) if precision_plugin else \
        dict(precision="16-mixed")  # on CPU Lightning turns this into bf16: no scaler
    every = {} if every is None else dict(log_every_n_steps=every)  # None: Lightning's default, 50
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=logger, **every,
                            accumulate_grad_batches=accumulate,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path,
                            callbacks=[callback or ScalerMetrics()],  # finds the precision plugin's scaler
                            **plugins)
        trainer.fit(Net(), torch.utils.data.DataLoader(_batches(max_steps * accumulate), batch_size=None))
    return trainer


def _csv_rows(logger):
    """The rows of the CSV logger's file that hold the scaler's metrics ([] when it wrote no file)."""
    path = Path(logger.log_dir) / "metrics.csv"
    with path.open() if path.exists() else io.StringIO() as f:
        return [r for r in csv.DictReader(f) if r.get("scaler/scale")]


def test_lightning_csv_logger_gets_the_metrics_every_log_interval(need, tmp_path):
    need("lightning")
    from lightning.pytorch.loggers import CSVLogger
    from polyamp.compat.torch import GradScaler

    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
    logger = CSVLogger(tmp_path, name="run")
    _lightning_fit(scaler, logger, tmp_path)
    rows = _csv_rows(logger)
    # the first step, then every 3 (the last, step 6, is an interval's); step column: global_step - 1
    assert [int(r["step"]) for r in rows] == [0, 2, 5]
    assert [float(r["scaler/steps"]) for r in rows] == [1.0, 3.0, 6.0]
    assert [float(r["scaler/skipped_steps"]) for r in rows] == [0.0, 1.0, 1.0]
    assert [float(r["scaler/skipped_last_1000"]) for r in rows] == [0.0, 1.0, 1.0]
    assert float(rows[-1]["scaler/scale"]) == SCALE_AFTER_6 == scaler.get_scale()


def test_lightning_logs_at_optimizer_steps_under_gradient_accumulation(need, tmp_path):
    """accumulate_grad_batches=2: 12 batches, 6 optimizer steps; the metrics are logged at optimizer
    steps 3 and 6 (global_step), not at batches 3, 6, 9 and 12, and count optimizer steps."""
    need("lightning")
    from lightning.pytorch.loggers import CSVLogger
    from polyamp.compat.torch import GradScaler

    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
    logger, logged = CSVLogger(tmp_path, name="run"), []
    trainer = _lightning_fit(scaler, logger, tmp_path, accumulate=2, logged=logged)
    assert trainer.global_step == 6 and scaler.metrics()["steps"] == 6
    steps = [(step, value) for step, name, value in logged if name == "scaler/steps"]
    assert {step for step, _ in steps} == {3, 6}, steps  # optimizer steps, not batches
    assert all(value == step for step, value in steps), steps
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("scaler/scale")]
    # the first optimizer step's row (written to the loggers directly), then steps 3 and 6; Lightning's
    # step column: global_step - 1
    assert [int(r["step"]) for r in rows] == [0, 2, 5]
    assert [float(r["scaler/steps"]) for r in rows] == [1.0, 3.0, 6.0]
    assert [float(r["scaler/skipped_steps"]) for r in rows] == [0.0, 1.0, 1.0]  # batch 2: optimizer step 2
    assert float(rows[-1]["scaler/scale"]) == SCALE_AFTER_6 == scaler.get_scale()


def test_lightning_tensorboard_logger(need, tmp_path):
    need("lightning")
    pytest.importorskip("tensorboard", reason="tensorboard not installed: pip install 'polyamp[tensorboard]'")
    from lightning.pytorch.loggers import TensorBoardLogger
    from polyamp.compat.torch import GradScaler
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="run")
    _lightning_fit(GradScaler("cpu", init_scale=2.0**10, growth_interval=100), logger, tmp_path)
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    skipped = [(e.step, e.value) for e in events.Scalars("scaler/skipped_steps")]
    assert skipped == [(0, 0.0), (2, 1.0), (5, 1.0)]
    assert events.Scalars("scaler/scale")[-1].value == SCALE_AFTER_6


def test_lightning_short_run_logs_its_first_and_last_steps(need, tmp_path):
    """Issue 34 item 4: 5 steps under Lightning's default interval (50) used to write nothing; now
    the first and the last step are written (the last after the skip at step 3)."""
    need("lightning")
    from lightning.pytorch.loggers import CSVLogger
    from polyamp.compat.torch import GradScaler

    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
    logger = CSVLogger(tmp_path, name="run")
    trainer = _lightning_fit(scaler, logger, tmp_path, max_steps=5, every=None)
    assert trainer.log_every_n_steps == 50
    rows = _csv_rows(logger)
    assert [int(r["step"]) for r in rows] == [0, 4]
    assert [float(r["scaler/steps"]) for r in rows] == [1.0, 5.0]
    assert [float(r["scaler/skipped_steps"]) for r in rows] == [0.0, 1.0]
    assert float(rows[-1]["scaler/scale"]) == scaler.get_scale() == 2.0**9


def test_lightning_without_a_polyamp_scaler_warns_once(need, tmp_path):
    """Lightning's "16-mixed" on CPU is bf16 (no scaler): the callback says so once, naming the fix,
    and logs nothing; with log_every_n_steps=0 (logging off) nothing is written either."""
    need("lightning")
    from lightning.pytorch.loggers import CSVLogger

    from polyamp.loggers.lightning import ScalerMetrics

    callback = ScalerMetrics()
    logger = CSVLogger(tmp_path, name="run")
    says = r"ScalerMetrics will log nothing.*bf16-mixed.*Fix: pass plugins="
    with pytest.warns(UserWarning, match=says) as got:
        _lightning_fit(None, logger, tmp_path, max_steps=2, precision_plugin=False, callback=callback)
        _lightning_fit(None, logger, tmp_path, max_steps=2, precision_plugin=False, callback=callback)
    assert sum("ScalerMetrics" in str(w.message) for w in got) == 1  # once, over two fits
    assert _csv_rows(logger) == []

    from polyamp.compat.torch import GradScaler

    off = CSVLogger(tmp_path, name="off")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a polyamp scaler: no warning
        warnings.filterwarnings("ignore", module="lightning")
        _lightning_fit(GradScaler("cpu"), off, tmp_path, max_steps=2, every=0)
    assert _csv_rows(off) == []


def test_lightning_warns_about_torchs_own_scaler(need, tmp_path):
    need("lightning")
    from polyamp.loggers.lightning import ScalerMetrics

    with pytest.warns(UserWarning, match=r"has a GradScaler, which is not polyamp's \(no metrics\(\)\)"):
        _lightning_fit(torch.amp.GradScaler("cpu"), False, tmp_path, max_steps=1, callback=ScalerMetrics())


def test_transformers_trainer_log_history_holds_the_metrics(need, tmp_path):
    need("transformers")
    from polyamp.compat.torch import GradScaler
    from transformers import Trainer, TrainingArguments

    from polyamp.loggers.transformers import ScalerMetricsCallback

    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)
            self.calls = 0

        def forward(self, x, labels):
            self.calls += 1
            loss = torch.nn.functional.mse_loss(self.layer(x), labels)
            return {"loss": loss * math.inf if self.calls == OVERFLOW_AT + 1 else loss}

    rows = [{"x": x, "labels": y} for xb, yb in _batches() for x, y in zip(xb, yb)]
    args = TrainingArguments(str(tmp_path), max_steps=6, per_device_train_batch_size=4, learning_rate=0.01,
                             use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                             logging_steps=3, optim="sgd")
    trainer = Trainer(model=Regressor(), args=args, train_dataset=rows)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
    trainer.accelerator.scaler, trainer.accelerator.native_amp = scaler, True
    ScalerMetricsCallback.attach(trainer)  # first: the reporters after it see the keys
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    logged = [h for h in trainer.state.log_history if "scaler/scale" in h]
    assert [h["step"] for h in logged][:2] == [3, 6]
    assert [h["scaler/steps"] for h in logged][:2] == [3, 6]
    assert [h["scaler/skipped_steps"] for h in logged][:2] == [1, 1]
    assert logged[1]["scaler/scale"] == SCALE_AFTER_6


def test_tensorboard_writer_event_file_and_no_read_between_writes(counting_host_reads, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed: pip install 'polyamp[tensorboard]'")
    from polyamp.compat.torch import GradScaler
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from polyamp.loggers.tensorboard import ScalerMetricsWriter

    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([w], lr=0.01)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
    reads_per_step = []
    with ScalerMetricsWriter(scaler, str(tmp_path), every=3) as writer:
        for i in range(6):
            optimizer.zero_grad()
            scaler.scale((w * w).sum() * (math.inf if i == OVERFLOW_AT else 1.0)).backward()
            with counting_host_reads() as reads:
                scaler.step(optimizer)
                scaler.update()
                writer.step()
            reads_per_step.append(sum(reads.values()))
    # the skip decision each step (and the log lines of the skip at step 2); the write adds one read
    assert reads_per_step[0] == reads_per_step[1] == reads_per_step[3] == reads_per_step[4] == 1
    assert reads_per_step[5] == 2
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("scaler/skipped_steps")] == [(3, 1.0), (6, 1.0)]
    assert [e.value for e in events.Scalars("scaler/steps")] == [3.0, 6.0]
    assert events.Scalars("scaler/scale")[-1].value == SCALE_AFTER_6


def test_writer_refuses_bad_arguments():
    from polyamp.loggers.tensorboard import ScalerMetricsWriter

    with pytest.raises(TypeError, match="metrics"):
        ScalerMetricsWriter(object(), writer=object())
    with pytest.raises(ValueError, match="every=0"):
        ScalerMetricsWriter(__import__("polyamp").LossScaler(), every=0)


def test_writer_takes_numpy_ints_and_refuses_bad_arguments_early():
    """Issue 32 item 16: every=np.int64(3) is taken as configs take NumPy ints; prefix=None, a writer
    without add_scalar and write(global_step='x') are refused at the call, naming the argument; the
    no-op scaler has metrics() (empty) as the disabled GradScaler has."""
    import numpy as np

    import polyamp
    from polyamp.loggers.tensorboard import ScalerMetricsWriter

    written = []

    class Writer:
        def add_scalar(self, tag, value, step):
            written.append((tag, step))

        def flush(self):
            pass

    scaler = polyamp.LossScaler(backend="numpy")
    writer = ScalerMetricsWriter(scaler, writer=Writer(), every=np.int64(3))
    assert writer.every == 3 and not writer.step() and not writer.step() and writer.step()
    assert written and {step for _, step in written} == {3}
    with pytest.raises(TypeError, match="prefix=None"):
        ScalerMetricsWriter(scaler, writer=Writer(), prefix=None)
    with pytest.raises(TypeError, match="writer=.*add_scalar"):
        ScalerMetricsWriter(scaler, writer=object())
    with pytest.raises(TypeError, match="global_step='x'"):
        writer.write("x")
    assert polyamp.make_scaler(enabled=False).metrics() == {}


def test_writer_names_an_unusable_log_dir_and_the_fix(tmp_path):
    """Issue 32 item 16: a log_dir where no event file can be made raises a polyamp ConfigError naming
    log_dir and the fix, not the OS error (FileNotFoundError, NotADirectoryError, ValueError)."""
    pytest.importorskip("tensorboard", reason="tensorboard not installed: pip install 'polyamp[tensorboard]'")
    import polyamp
    from polyamp.loggers.tensorboard import ScalerMetricsWriter

    scaler = polyamp.LossScaler(backend="numpy")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for bad in (str(a_file / "runs"), "a\0b", 3.5):
        with pytest.raises(polyamp.ConfigError, match=r"ScalerMetricsWriter\(log_dir=\.\.\.\).*Fix: pass a"):
            ScalerMetricsWriter(scaler, log_dir=bad)
    good = ScalerMetricsWriter(scaler, log_dir=str(tmp_path / "runs"))
    good.close()


def test_callback_attach_refuses_what_is_not_a_trainer():
    pytest.importorskip("transformers")
    from polyamp.loggers.transformers import ScalerMetricsCallback

    with pytest.raises(TypeError, match=r"attach\(trainer=...\) takes a transformers Trainer"):
        ScalerMetricsCallback.attach(object())
