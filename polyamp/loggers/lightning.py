"""``ScalerMetrics``: a Lightning ``Callback`` that logs the scaler's ``metrics()`` (docs/integrations.md).

The first and last steps go to ``trainer.loggers`` directly, at Lightning's row (``global_step - 1``),
since Lightning drops values logged between its intervals. Between logging steps nothing is read.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch.callbacks import Callback


class ScalerMetrics(Callback):
    """Log ``scaler.metrics(diagnose=...)`` as ``<prefix><key>``: after the first step, every
    ``trainer.log_every_n_steps`` steps and after the last step."""

    def __init__(self, scaler: Any = None, *, prefix: str = "scaler/", diagnose: bool = False) -> None:
        if scaler is not None and not callable(getattr(scaler, "metrics", None)):
            raise TypeError(f"ScalerMetrics(scaler=...) takes a polyamp scaler (with metrics()), got "
                            f"{type(scaler).__name__}. Fix: pass polyamp.compat.torch.GradScaler(...) or "
                            "leave scaler out to use the trainer's precision plugin's.")
        if not isinstance(prefix, str):  # checked here, not at the first logging step mid-run
            raise TypeError(f"ScalerMetrics(prefix=...) must be a str, got prefix={prefix!r}. "
                            "Fix: pass e.g. prefix='scaler/', or '' for bare metric names.")
        if not isinstance(diagnose, bool):
            raise TypeError(f"ScalerMetrics(diagnose=...) takes True or False, got diagnose={diagnose!r}. "
                            "Fix: pass diagnose=True to log the last overflow's tensors.")
        self.scaler, self.prefix, self.diagnose = scaler, prefix, diagnose
        self.warned = False  # the "logs nothing" warning, given once per callback
        self.logged_step: int | None = None  # the global_step last logged in this fit

    def find_scaler(self, trainer: Any) -> Any:
        """The scaler given, else the precision plugin's; None when there is none (bf16, fp32)."""
        if self.scaler is not None:
            return self.scaler
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return scaler if callable(getattr(scaler, "metrics", None)) else None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.logged_step = None
        if self.find_scaler(trainer) is None and not self.warned:
            self.warned = True
            if trainer.is_global_zero:  # from this module: a filter on Lightning's warnings keeps it
                warnings.warn(no_scaler_message(trainer), UserWarning, stacklevel=1)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step  # optimizer steps so far, this batch's included
        if step == 0 or step == self.logged_step or trainer.log_every_n_steps <= 0:
            return
        scaler = self.find_scaler(trainer)
        if scaler is None:
            return
        if step % trainer.log_every_n_steps == 0:  # Lightning writes what is logged at these steps
            for key, value in scaler.metrics(diagnose=self.diagnose).items():
                pl_module.log(self.prefix + key, float(value), on_step=True, on_epoch=False)
            self.logged_step = step
        elif self.logged_step is None:  # the first step: between intervals, so written here
            self.write(trainer, scaler, step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        step = trainer.global_step
        scaler = self.find_scaler(trainer)
        if scaler is not None and step > 0 and step != self.logged_step and trainer.log_every_n_steps > 0:
            self.write(trainer, scaler, step)  # the last step, when no interval ended on it

    def write(self, trainer: Any, scaler: Any, step: int) -> None:
        """The metrics to every logger of ``trainer`` now, at Lightning's row for ``step``."""
        metrics = scaler.metrics(diagnose=self.diagnose)
        values = {self.prefix + key: float(value) for key, value in metrics.items()}
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step - 1)
            logger.save()
        self.logged_step = step


def no_scaler_message(trainer: Any) -> str:
    """Why a :class:`ScalerMetrics` without ``scaler=`` logs nothing on ``trainer``, and the fix."""
    plugin = trainer.precision_plugin
    found = getattr(plugin, "scaler", None)
    has = "no scaler" if found is None else f"a {type(found).__name__}, which is not polyamp's (no metrics())"
    cpu = (" (on CPU Lightning turns precision='16-mixed' into 'bf16-mixed', which builds no scaler)"
           if found is None and str(getattr(trainer, "precision", "")).startswith("bf16") else "")
    return (f"ScalerMetrics will log nothing: the trainer's precision plugin ({type(plugin).__name__}, "
            f"precision={getattr(trainer, 'precision', None)!r}) has {has}{cpu}. Fix: pass "
            "plugins=[MixedPrecision('16-mixed', device, scaler=polyamp.compat.torch.GradScaler(device))] "
            "(on CPU too), or on a GPU call polyamp.compat.torch.install() before building the Trainer; "
            "or pass ScalerMetrics(scaler).")
