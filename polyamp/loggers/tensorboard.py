"""``ScalerMetricsWriter``: the scaler's ``metrics()`` in TensorBoard event files, for plain loops:
one host read every ``every`` steps, none between.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

import numpy as np

from .._errors import ConfigError
from ..config import short_repr


class ScalerMetricsWriter:
    """Add ``scaler.metrics()`` to a TensorBoard event file every ``every`` steps: a new ``SummaryWriter``
    in ``log_dir`` (closed by :meth:`close`), or ``writer=`` yours."""

    def __init__(self, scaler: Any, log_dir: str | None = None, *, every: int = 50, prefix: str = "scaler/",
                 diagnose: bool = False, writer: Any = None) -> None:
        if not callable(getattr(scaler, "metrics", None)):
            raise TypeError(f"ScalerMetricsWriter(scaler=...) takes a polyamp scaler (with metrics()), got "
                            f"{type(scaler).__name__}. Fix: pass a polyamp GradScaler or LossScaler.")
        if isinstance(every, (bool, np.bool_)) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(f"ScalerMetricsWriter(every=...) must be an int >= 1, got every={every!r}. "
                             "Fix: pass how many steps lie between two writes, e.g. every=50.")
        if not isinstance(prefix, str):
            raise TypeError(f"ScalerMetricsWriter(prefix=...) must be a str, got prefix={prefix!r}. "
                            "Fix: pass e.g. prefix='scaler/', or '' for bare metric names.")
        if not isinstance(diagnose, bool):  # checked here, not at the first write
            raise TypeError("ScalerMetricsWriter(diagnose=...) takes True or False, got "
                            f"diagnose={diagnose!r}. "
                            "Fix: pass diagnose=True to write the last overflow's tensors.")
        if writer is not None and not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(f"ScalerMetricsWriter(writer=...) needs add_scalar(tag, value, step), got a "
                            f"{type(writer).__name__}. Fix: pass a torch.utils.tensorboard.SummaryWriter, or "
                            "log_dir= to open one.")
        self.scaler, self.every, self.prefix, self.diagnose = scaler, int(every), prefix, diagnose
        self._owned = writer is None
        self.writer = _open(log_dir) if writer is None else writer
        self.steps = 0

    def step(self) -> bool:
        """Count one iteration; on every ``every``-th write the metrics (True when written)."""
        self.steps += 1
        if self.steps % self.every:
            return False
        self.write(self.steps)
        return True

    def write(self, global_step: int) -> dict[str, float | int]:
        """Write the metrics now at ``global_step`` (one host read) and return them."""
        if isinstance(global_step, (bool, np.bool_)) or not isinstance(global_step, numbers.Integral):
            raise TypeError(f"ScalerMetricsWriter.write(global_step=...) must be an int, got "
                            f"global_step={global_step!r}. Fix: pass the training step, e.g. write(100).")
        values = self.scaler.metrics(diagnose=self.diagnose)
        for key, value in values.items():
            self.writer.add_scalar(self.prefix + key, value, global_step)
        return values

    def close(self) -> None:
        """Flush, and close the writer this object opened."""
        self.writer.flush()
        if self._owned:
            self.writer.close()

    def __enter__(self) -> ScalerMetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _open(log_dir: Any) -> Any:
    """A new ``torch.utils.tensorboard`` (else ``tensorboardX``) SummaryWriter in ``log_dir``;
    ConfigError naming it where it cannot be made there."""
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise ConfigError(f"ScalerMetricsWriter(log_dir=...) must be a path or None, got "
                          f"log_dir={short_repr(log_dir)}. Fix: pass a folder, e.g. log_dir='runs/amp'.")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "ScalerMetricsWriter needs torch.utils.tensorboard (the tensorboard package) or "
                "tensorboardX, and neither imports here. Fix: pip install 'polyamp[tensorboard]' "
                "(or install tensorboardX), or pass writer= an object with add_scalar()."
            ) from exc
    try:
        return SummaryWriter(log_dir)
    except (OSError, ValueError) as exc:  # a folder that cannot be made or written, a NUL in the name
        raise ConfigError(
            f"ScalerMetricsWriter(log_dir=...) cannot open an event file in log_dir={short_repr(log_dir)}: "
            f"{exc}. Fix: pass a folder this process can create and write, e.g. log_dir='runs/amp', or "
            "writer= a SummaryWriter of your own."
        ) from exc
