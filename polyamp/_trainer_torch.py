"""The torch half of MixedPrecisionTrainer: an nn.Module under torch.autocast.

Imported only when a torch model is given, so ``import polyamp`` never imports torch.
Autocast runs eligible ops (matmuls, convolutions) in the compute dtype and keeps losses
and reductions in float32; backward runs those ops in the compute dtype too, so float16
gradients underflow without loss scaling. Master weights stay float32 leaves.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _dtypes, _step_inputs
from ._masters import check_masters


class TorchSteps:
    """Forward and backward of an ``nn.Module``; ``loss_fn(output, target)`` returns a tensor."""

    def __init__(self, model: torch.nn.Module, dtype: str) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        check_masters(self.params, torch.Tensor, lambda p: p)
        self.model, self.dtype = model, dtype
        self.device_type = self.params[0].device.type
        self.torch_dtype = getattr(torch, dtype)

    def forward_backward(self, input: Any, target: Any, loss_fn: Any, scaler: Any, ranks: int = 1) -> Any:
        """Forward under autocast, backward of the scaled loss into the float32 grad buffer.

        ``ranks``: the (float32) loss is divided by it before scaling (data parallel).
        """
        for name, value in (("input", input), ("target", target)):
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"train_step() needs {name} to be a torch.Tensor for a torch "
                                f"model, got {type(value).__module__}.{type(value).__name__}. "
                                f"Fix: torch.as_tensor({name}).")
        x = _dtypes.cast(input, self.dtype) if input.is_floating_point() else input
        if target is not None and target.is_floating_point():
            target = _dtypes.cast(target, self.dtype)
        low = self.dtype != "float32"
        with torch.autocast(self.device_type, dtype=self.torch_dtype, enabled=low):
            output = self.model(x)
            loss = loss_fn(output, target)
        _step_inputs.torch_loss(loss)
        if loss.ndim != 0:
            raise ValueError("loss_fn must return a scalar (0-d) loss tensor, got shape "
                             f"{tuple(loss.shape)}; reduce it, e.g. with reduction='mean'")
        scaler.scale(loss / ranks if ranks > 1 else loss).backward()
        return loss.detach()
