"""PyTorch backend: torch's own fused kernels, grouped per (device, dtype); torch imported lazily.

``torch._amp_foreach_non_finite_check_and_unscale_`` unscales a whole group in one call and
``torch._amp_update_scale_`` runs torch's rule on the device when ``backoff_interval`` is 1.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from polyamp._hookspecs import hookimpl
from polyamp.policy import LossScaleState, next_state


def _torch() -> Any:
    import torch

    return torch


@hookimpl
def backend_info() -> dict[str, Any]:
    try:
        torch = _torch()
    except ImportError as exc:
        return {
            "available": False,
            "reason": f"torch is not installed ({exc}); pip install torch",
            "version": None,
        }
    return {"available": True, "reason": "", "version": torch.__version__}


@hookimpl
def owns_array(array: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(array, torch.Tensor)


@hookimpl
def full(value: Any, dtype: str, like: Any) -> Any:
    torch = _torch()
    device = like.device if like is not None else "cpu"
    return torch.full((), value, dtype=getattr(torch, dtype), device=device)


@hookimpl
def scale_array(array: Any, scale: Any) -> Any:
    return array * scale.to(device=array.device, non_blocking=True)


@hookimpl
def unscale_and_check(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    torch = _torch()
    inv_scale = scale.double().reciprocal().float()
    groups: dict[tuple[Any, Any], list[Any]] = {}
    for grad in grads:
        if grad.is_sparse:
            grad = grad._values()
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    home = found_inf.device
    with torch.no_grad():
        for (device, _), group in groups.items():
            if device == home:
                torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
            else:
                flag = torch.zeros((), dtype=torch.float32, device=device)
                inv = inv_scale.to(device, non_blocking=True)
                torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
                found_inf.add_(flag.to(home, non_blocking=True)).clamp_(max=1.0)


@hookimpl
def all_finite(arrays: Sequence[Any]) -> Any:
    torch = _torch()
    if not arrays:
        return torch.tensor(True)
    flags = [torch.isfinite(a).all().to(arrays[0].device) for a in arrays]
    return torch.stack(flags).all()


@hookimpl
def cast(array: Any, dtype: str) -> Any:
    torch = _torch()
    if dtype not in ("float32", "float16", "bfloat16", "float64"):
        raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got dtype={dtype!r}")
    return array.to(getattr(torch, dtype))


def _torch_rule(config: Any) -> bool:
    """Whether torch's own fused update implements ``config`` exactly."""
    return (
        config.dynamic
        and config.backoff_interval == 1
        and config.min_scale is None
        and config.max_scale is None
        and config.product_dtype == "float64"
    )


@hookimpl
def update_scale(state: Any, found_inf: Any, config: Any) -> Any:
    torch = _torch()
    scale, growth, backoff = state
    if _torch_rule(config):
        torch._amp_update_scale_(
            scale, growth, found_inf,
            config.growth_factor, config.backoff_factor, config.growth_interval,
        )
        return state
    import array_api_compat.torch as xp

    new = next_state(LossScaleState(scale, growth, backoff), found_inf, config, xp)
    scale.copy_(new.scale)
    growth.copy_(new.growth_tracker)
    backoff.copy_(new.backoff_tracker)
    return state


@hookimpl
def read_flag(found_inf: Any) -> bool:
    return found_inf.item() != 0


@hookimpl
def to_host(array: Any) -> float | int:
    return array.item()
