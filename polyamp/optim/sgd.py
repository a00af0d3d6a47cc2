"""Stochastic gradient descent with momentum, as torch.optim.SGD, for any array-API library."""

from __future__ import annotations

from typing import Any

import array_api_compat

from .._errors import ConfigError
from ..parameter import Parameter
from .optimizer import Optimizer, ParamsT, check_nonnegative, fma, write_param

__all__ = ["SGD"]


class SGD(Optimizer):
    """Stochastic gradient descent, optionally with (Nesterov) momentum and weight decay, as torch's
    ``_single_tensor_sgd`` op by op (float32: bit-equal on CPU); one buffer per param."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize})

    def _check_hyperparameters(self, group: dict[str, Any]) -> None:
        """Raise ValueError for a negative lr, momentum or weight decay, or a bad Nesterov setup."""
        check_nonnegative("lr", group["lr"], "learning rate")
        check_nonnegative("momentum", group["momentum"], "momentum value")
        check_nonnegative("weight_decay", group["weight_decay"], "weight_decay value")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ConfigError("Nesterov momentum requires a momentum and zero dampening: "
                              f"momentum={group['momentum']!r}, dampening={group['dampening']!r}; "
                              "expected momentum > 0 and dampening == 0")

    def _update(self, param: Parameter, state: dict[str, Any], group: dict[str, Any]) -> None:
        """One SGD step on ``param``, in the operation order of torch's ``_single_tensor_sgd``."""
        xp = array_api_compat.array_namespace(param.data)
        grad = -param.grad if group["maximize"] else param.grad
        weight_decay, momentum = group["weight_decay"], group["momentum"]
        if weight_decay != 0:
            grad = fma(grad, param.data, weight_decay)  # grad.add(param, alpha=weight_decay)
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = xp.asarray(grad, copy=True)
            else:  # buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                buf = fma(buf * momentum, grad, 1 - group["dampening"])
            state["momentum_buffer"] = buf
            grad = fma(grad, buf, momentum) if group["nesterov"] else buf
        write_param(param, fma(param.data, grad, -group["lr"]))  # param.add_(grad, alpha=-lr)
