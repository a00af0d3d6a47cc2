"""``ScalerMetricsCallback``: a ``transformers.TrainerCallback`` that adds the scaler's ``metrics()``
to the Trainer's logs (every reporter and ``state.log_history`` get them): one host read per log.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback


class ScalerMetricsCallback(TrainerCallback):
    """Add ``scaler.metrics(diagnose=...)`` as ``<prefix><key>`` to each of the Trainer's logs."""

    def __init__(self, scaler: Any = None, *, prefix: str = "scaler/", diagnose: bool = False,
                 trainer: Any = None) -> None:
        if scaler is None and trainer is None:
            raise TypeError("ScalerMetricsCallback needs scaler= (a polyamp GradScaler) or trainer= (a "
                            "transformers.Trainer whose accelerator.scaler is one). Fix: pass one of them.")
        self.scaler, self.trainer, self.prefix, self.diagnose = scaler, trainer, prefix, diagnose

    def find_scaler(self) -> Any:
        """The scaler given, else the trainer's accelerator's; None when it has none (fp32, bf16)."""
        scaler = self.scaler
        if scaler is None:
            scaler = getattr(getattr(self.trainer, "accelerator", None), "scaler", None)
        return scaler if callable(getattr(scaler, "metrics", None)) else None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        scaler = self.find_scaler()
        if scaler is None or logs is None:
            return
        values = {self.prefix + key: value for key, value in scaler.metrics(diagnose=self.diagnose).items()}
        logs.update(values)
        history = state.log_history  # the Trainer appended this log's copy before calling on_log
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(values)

    @classmethod
    def attach(cls, trainer: Any, **options: Any) -> ScalerMetricsCallback:
        """A callback reading ``trainer``'s scaler, put FIRST among its callbacks so that the reporters
        (``report_to``: TensorBoard, wandb, ...), called after it, see the keys. Returns it."""
        if not hasattr(getattr(trainer, "callback_handler", None), "callbacks"):
            raise TypeError(
                f"ScalerMetricsCallback.attach(trainer=...) takes a transformers Trainer (with "
                f"callback_handler), got a {type(trainer).__name__}. Fix: pass the Trainer, e.g. "
                "ScalerMetricsCallback.attach(trainer)."
            )
        callback = cls(trainer=trainer, **options)
        trainer.callback_handler.callbacks.insert(0, callback)
        return callback
