"""polyamp: dynamic loss scaling and mixed precision over NumPy, CuPy and PyTorch arrays.

Importing polyamp imports neither torch nor cupy; backends are found when a scaler is built.
The gradient helpers, the trainer, ``Parameter`` and the precision meter load on first use
(``benchmarks/import_time.py``).
"""

from importlib import import_module as _import_module
from typing import TYPE_CHECKING, Any

from ._errors import (
    BackendError,
    BackendNotFoundError,
    BackendUnavailableError,
    ConfigError,
    ForeignArrayError,
    MinScaleError,
    PolyampError,
    StateDictError,
    StepGuardError,
)
from ._registry import available_backends, get_backend, register_backend
from .backend import Backend, BackendInfo
from .config import FIXED_ONE, LossScaleConfig
from .engine import LossScaler, ScalerStateError, StepResult
from .guard import GuardHistory, GuardReport, StepGuard
from .noop import NoOpLossScaler
from .overflow import OverflowReport, TensorOverflow, explain_overflow
from .policy import HostState, LossScaleState, next_host_state, next_state

if TYPE_CHECKING:  # loaded on first use by __getattr__ below; listed here for readers and tools
    from .grads import GradBuffer, ScaledGradientsError, clip_grad_norm_, global_norm
    from .parameter import Parameter
    from .precision import PrecisionMeter, PrecisionReport
    from .trainer import ArrayLossFn, ArrayModel, MixedPrecisionTrainer, StepMetrics

__version__ = "0.1.0"

__all__ = [
    "ArrayLossFn", "ArrayModel", "Backend", "BackendError", "BackendInfo", "BackendNotFoundError",
    "BackendUnavailableError", "ConfigError", "ForeignArrayError", "GradBuffer", "GradScaler",
    "GuardHistory", "GuardReport", "HostState", "LossScaleConfig", "LossScaleState", "LossScaler",
    "MinScaleError", "MixedPrecisionTrainer", "NoOpLossScaler", "OverflowReport", "Parameter",
    "PolyampError", "PrecisionMeter", "PrecisionReport", "ScaledGradientsError", "ScalerStateError",
    "StateDictError", "StepGuard", "StepGuardError", "StepMetrics", "StepResult", "TensorOverflow",
    "available_backends", "clip_grad_norm_", "explain_overflow", "get_backend", "global_norm",
    "make_scaler", "next_host_state", "next_state", "register_backend", "__version__",
]


def make_scaler(
    config: LossScaleConfig | None = None, backend: str | None = None, enabled: bool = True, *,
    guard: StepGuard | None = None, **fields: Any
) -> LossScaler | NoOpLossScaler:
    """A :class:`LossScaler`, or the :class:`NoOpLossScaler` when ``enabled`` is False.

    ``fields`` are LossScaleConfig fields, instead of ``config`` (``make_scaler(init_scale=1024)``).
    ``enabled=False`` with a ``guard`` is a guard-only scaler (bf16, fp32): a LossScaler whose
    scale is fixed at 1 that skips non-finite and spiking steps (``config`` is not used then).
    """
    if not enabled and guard is not None:
        if config is not None or fields:
            given = ", ".join(["config"] * (config is not None) + sorted(fields))
            raise ConfigError("make_scaler(enabled=False, guard=...) is a guard-only scaler, its scale "
                              f"fixed at 1: {given} would not be used. Fix: leave them out, or pass "
                              "enabled=True to scale.")
        return LossScaler(FIXED_ONE, backend, guard=guard)
    if guard is not None:
        return LossScaler(config, backend, guard=guard, **fields)
    return (LossScaler if enabled else NoOpLossScaler)(config, backend, **fields)


_LAZY = {
    "GradBuffer": "grads", "ScaledGradientsError": "grads", "clip_grad_norm_": "grads",
    "global_norm": "grads", "Parameter": "parameter", "ArrayLossFn": "trainer", "ArrayModel": "trainer",
    "MixedPrecisionTrainer": "trainer", "StepMetrics": "trainer", "PrecisionMeter": "precision",
    "PrecisionReport": "precision",
}


def __getattr__(name: str):  # lazy: the facade, polyamp.optim and the helpers stay out of a bare import
    if name in _LAZY:
        value = getattr(_import_module(f"polyamp.{_LAZY[name]}"), name)
        globals()[name] = value  # later reads skip __getattr__
        return value
    if name == "GradScaler":
        from polyamp.compat.torch import GradScaler

        return GradScaler
    if name in ("optim", "functional", "optax"):  # as torch.optim after `import torch`; optax
        return _import_module(f"polyamp.{name}")  # loads optax (and jax) only when asked for
    raise AttributeError(f"module 'polyamp' has no attribute {name!r}")
