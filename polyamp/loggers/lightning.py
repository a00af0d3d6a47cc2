"""``ScalerMetrics``: a Lightning ``Callback`` that logs the scaler's ``metrics()`` through
``pl_module.log`` every ``trainer.log_every_n_steps`` optimizer steps (needs ``lightning``).

The scaler is the one given, else the trainer's precision plugin's (``trainer.precision_plugin.scaler``:
pass ``MixedPrecision("16-mixed", device, scaler=GradScaler(...))``, or use
``polyamp.compat.torch.install()``). Between logging steps nothing is read from the device.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback


class ScalerMetrics(Callback):
    """Log ``scaler.metrics(diagnose=...)`` as ``<prefix><key>`` on the trainer's logging interval."""

    def __init__(self, scaler: Any = None, *, prefix: str = "scaler/", diagnose: bool = False) -> None:
        if scaler is not None and not callable(getattr(scaler, "metrics", None)):
            raise TypeError(f"ScalerMetrics(scaler=...) takes a polyamp scaler (with metrics()), got "
                            f"{type(scaler).__name__}. Fix: pass polyamp.compat.torch.GradScaler(...) or "
                            "leave scaler out to use the trainer's precision plugin's.")
        self.scaler, self.prefix, self.diagnose = scaler, prefix, diagnose

    def find_scaler(self, trainer: Any) -> Any:
        """The scaler given, else the precision plugin's; None when there is none (bf16, fp32)."""
        if self.scaler is not None:
            return self.scaler
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return scaler if callable(getattr(scaler, "metrics", None)) else None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step  # optimizer steps so far, this batch's included
        if step == 0 or step % max(trainer.log_every_n_steps, 1):
            return
        scaler = self.find_scaler(trainer)
        if scaler is None:
            return
        values = scaler.metrics(diagnose=self.diagnose)
        for key, value in values.items():
            pl_module.log(self.prefix + key, float(value), on_step=True, on_epoch=False)
