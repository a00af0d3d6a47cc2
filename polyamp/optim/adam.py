"""Adam and AdamW, as torch.optim.Adam / AdamW, for any array-API library."""

from __future__ import annotations

from typing import Any

import array_api_compat

from .._errors import ConfigError
from ..parameter import Parameter
from .optimizer import Optimizer, ParamsT, _round_to_float32, check_nonnegative, fma, write_param

__all__ = ["Adam", "AdamW"]


def _lerp(start: Any, end: Any, weight: float) -> Any:
    """``start + weight * (end - start)`` as torch's two-branch, fused ``lerp`` (exact at 0 and 1)."""
    xp = array_api_compat.array_namespace(start)
    if start.dtype == xp.float32:
        weight = _round_to_float32(weight)  # torch rounds the weight to the data's precision
    if abs(weight) < 0.5:
        return fma(start, end - start, weight)
    return fma(end, end - start, weight - 1)


class Adam(Optimizer):
    """Adam (Kingma & Ba), with optional AMSGrad and L2 or decoupled (AdamW) weight decay, as
    torch's ``_single_tensor_adam`` operation by operation; 2-3 buffers per param."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "amsgrad": amsgrad, "maximize": maximize,
                                  "decoupled_weight_decay": decoupled_weight_decay})

    def _check_hyperparameters(self, group: dict[str, Any]) -> None:
        """Raise ValueError for a negative lr, eps or weight decay, or a beta outside [0, 1)."""
        check_nonnegative("lr", group["lr"], "learning rate")
        check_nonnegative("eps", group["eps"], "epsilon value")
        betas = group["betas"]
        if len(betas) != 2:
            raise ConfigError(f"Invalid betas: betas={betas!r}; expected a pair (beta1, beta2)")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"Invalid beta parameter at index {i}: betas[{i}]={beta!r}; "
                                  f"expected 0 <= betas[{i}] < 1")
        check_nonnegative("weight_decay", group["weight_decay"], "weight_decay value")

    def _init_state(self, xp: Any, param: Parameter, state: dict[str, Any], amsgrad: bool) -> None:
        """Create the step count and moment buffers on first use, as torch's ``_init_group``."""
        if not state:
            if not xp.isdtype(param.dtype, "real floating"):
                raise TypeError(f"{type(self).__name__} needs real floating-point parameters, "
                                f"got dtype={param.dtype}; cast the data, e.g. to float32")
            state["step"] = 0.0
            state["exp_avg"] = xp.zeros_like(param.data)
            state["exp_avg_sq"] = xp.zeros_like(param.data)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = xp.zeros_like(param.data)

    def _update(self, param: Parameter, state: dict[str, Any], group: dict[str, Any]) -> None:
        """One Adam step on ``param``, in the operation order of torch's ``_single_tensor_adam``."""
        xp = array_api_compat.array_namespace(param.data)
        self._init_state(xp, param, state, group["amsgrad"])
        grad = -param.grad if group["maximize"] else param.grad
        lr, weight_decay, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
        state["step"] += 1
        if weight_decay != 0:
            if group["decoupled_weight_decay"]:
                write_param(param, param.data * (1 - lr * weight_decay))
            else:
                grad = fma(grad, param.data, weight_decay)  # grad.add(param, alpha=weight_decay)
        exp_avg = state["exp_avg"] = _lerp(state["exp_avg"], grad, 1 - beta1)
        # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        exp_avg_sq = state["exp_avg_sq"] = fma(state["exp_avg_sq"] * beta2, grad * (1 - beta2), grad)
        if group["amsgrad"]:
            exp_avg_sq = state["max_exp_avg_sq"] = xp.maximum(state["max_exp_avg_sq"], exp_avg_sq)
        step = state["step"]
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = xp.sqrt(exp_avg_sq) / bias_correction2_sqrt + group["eps"]
        write_param(param, param.data + exp_avg * -step_size / denom)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): ``param *= 1 - lr * weight_decay``."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True)
