"""What ``MixedPrecisionTrainer.train_step`` is given and what its ``loss_fn`` returns, checked
before the scaler sees anything: a bad call ends with a message naming the argument, the value
and the fix, and leaves the scaler, the masters and the counters as they were.
"""

from __future__ import annotations

import math
from typing import Any

from .config import short_repr


def _kind(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__name__}"


def check_batch(input: Any, target: Any) -> None:
    """``input`` must be an array (``target`` may be None: loss_fn then gets None)."""
    if input is None or not hasattr(input, "dtype"):
        raise TypeError("train_step() needs input to be an array of the batch, got "
                        f"input={short_repr(input)} ({_kind(input)}). Fix: pass the batch's inputs as an "
                        "array of the model's library.")
    if target is not None and not hasattr(target, "dtype"):
        raise TypeError("train_step() needs target to be an array (or None), got "
                        f"target={short_repr(target)} ({_kind(target)}). Fix: pass the batch's targets as an "
                        "array, e.g. np.asarray(labels).")


def array_loss(result: Any, output: Any) -> tuple[Any, Any]:
    """``(loss, grad_output)`` from an ArrayModel's loss_fn, refused unless the loss is one value
    and the gradient an array of the output's shape."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError("loss_fn must return (loss, d loss / d output) for an ArrayModel, got "
                        f"{short_repr(result)} ({_kind(result)}). Fix: return both, e.g. "
                        "`return loss, 2 * err / n`.")
    loss, grad = result
    check_scalar_loss(loss)
    if grad is None or not hasattr(grad, "shape"):
        raise TypeError("loss_fn's second value must be the gradient of the loss with respect to the "
                        f"output, an array, got {short_repr(grad)} ({_kind(grad)}). Fix: return "
                        "(loss, grad_output).")
    if tuple(grad.shape) != tuple(output.shape):
        raise ValueError(f"loss_fn's gradient has shape {tuple(grad.shape)}, but the model's output has "
                         f"shape {tuple(output.shape)}: it must be d loss / d output, one value per output "
                         "value. Fix: return the gradient with respect to the output itself.")
    return loss, grad


def check_scalar_loss(loss: Any) -> None:
    """The loss must be one number (a 0-d or one-element array): metrics read it after the step."""
    shape = tuple(getattr(loss, "shape", ()))
    if isinstance(loss, (str, bytes)) or not hasattr(loss, "__float__") and not shape:
        raise TypeError(f"loss_fn must return the loss as a number or a 0-d array, got {short_repr(loss)} "
                        f"({_kind(loss)}). Fix: return the reduced loss, e.g. its mean.")
    if math.prod(shape) != 1:
        raise ValueError(f"loss_fn must return a scalar (0-d) loss, got shape {shape}. Fix: reduce it, e.g. "
                         "with a mean over the batch (reduction='mean' in torch).")


def torch_loss(loss: Any) -> None:
    """A torch model's loss_fn returns the loss tensor alone: torch computes its gradient."""
    if not hasattr(loss, "backward"):
        raise TypeError(f"loss_fn must return the loss tensor for a torch model, got {short_repr(loss)} "
                        f"({_kind(loss)}). Fix: return the loss alone (torch computes its gradient), e.g. "
                        "torch.nn.functional.mse_loss(output, target).")
